"""The local runner's process handling when a worker dies hard (no Airflow needed)."""

from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

from airflow_provider_vllm.utils.worker_process import LocalWorkerProcess

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(120)]

# a stand-in worker: starts a long-lived child (like vLLM's engine core) that inherits its
# stdout/stderr, reports the child's pid, then is SIGKILLed (like the OOM killer would)
SCRIPT = """
import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print('{"child": %d}' % child.pid, flush=True)
print("engine started", file=sys.stderr, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_worker_with_an_orphaned_engine_process_neither_hangs_nor_leaks_it():
    lines: list[str] = []
    result = LocalWorkerProcess([sys.executable, "-c", SCRIPT], dict(os.environ), lines.append).run()
    assert result.returncode == -9 and lines == ["engine started"]
    child = result.manifest["child"]
    # Killed: gone, or a zombie until init reaps it (psutil's wait() on a zombie that is not our
    # child would wait for it to disappear, which depends on init, not on the runner).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _dead(child):
        time.sleep(0.1)
    assert _dead(child), f"the orphaned engine process {child} is still running"


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_worker_starts_in_a_private_empty_directory_so_relative_names_resolve_nowhere(tmp_path, monkeypatch):
    (tmp_path / "outside" / "evil").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    script = "import os, json; print(json.dumps({'cwd': os.getcwd(), 'seen': os.path.exists('outside/evil')}))"
    env = {**os.environ, "PYTHONPATH": "."}
    result = LocalWorkerProcess([sys.executable, "-c", script], env, lambda _: None).run()
    assert result.returncode == 0 and result.manifest is not None
    assert result.manifest["seen"] is False and result.manifest["cwd"] != str(tmp_path)
    assert not os.path.exists(result.manifest["cwd"])  # removed once the worker has exited


TASK = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
from airflow_provider_vllm.utils.worker_process import LocalWorkerProcess

def log_line(line):
    print(line, flush=True)
    sys.stdin.readline()  # the task is busy while its worker runs: killed here

worker = "import os, sys; print(os.getcwd(), file=sys.stderr, flush=True)"
LocalWorkerProcess([sys.executable, "-c", worker], {"PATH": "/usr/bin:/bin"}, log_line).run()
"""


def test_the_working_directory_of_a_task_killed_with_sigkill_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """The worker's private working directory is the task's ``copies_folder("worker")``: a task killed with
    SIGKILL while its worker runs leaves it, and the next task's removes it."""
    import subprocess
    import tempfile
    from pathlib import Path

    from tests.support import ROOT

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    task = subprocess.Popen(
        [sys.executable, "-c", TASK, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    )
    left = Path(task.stdout.readline().strip())
    task.kill()
    task.wait()
    assert left.parent == tmp_path and left.is_dir()
    script = "import os, json; print(json.dumps({'cwd': os.getcwd()}))"
    result = LocalWorkerProcess([sys.executable, "-c", script], dict(os.environ), lambda _: None).run()
    assert result.returncode == 0 and Path(result.manifest["cwd"]).parent == tmp_path
    assert not left.exists() and list(tmp_path.iterdir()) == []
    assert left.name.startswith(f"vllm-batch-worker-{task.pid}-")
