"""The worker's exit once its outcome is durable: teardown cannot change the exit code.

vLLM 0.32 (CPU) once aborted a worker (SIGABRT, ``terminate called without an active
exception``) during interpreter teardown after the shard was committed and the manifest
printed; the task then failed and was retried. ``exit_hard`` flushes, kills leftover engine
processes and leaves with ``os._exit``.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

SCRIPT = r"""
import atexit, os, subprocess, sys
from airflow_provider_vllm.worker.__main__ import exit_hard
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
sys.stderr.write(f"child={child.pid}\n")
atexit.register(os.abort)           # stands for a native thread aborting at teardown
print('{"status": "committed"}', end="")  # unflushed on purpose
exit_hard(int(sys.argv[1]))
"""


def _run(code: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(code)], capture_output=True, text=True, timeout=120)


def test_exit_code_survives_an_aborting_teardown_and_output_is_flushed():
    p = _run(0)
    assert p.returncode == 0, p.stderr
    assert p.stdout == '{"status": "committed"}'
    child = int(p.stderr.split("child=")[1].split()[0])
    assert gone(child, within_s=30)  # SIGKILLed before the exit; its end is asynchronous: poll


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_failure_codes_pass_through():
    assert _run(75).returncode == 75
    assert _run(2).returncode == 2
