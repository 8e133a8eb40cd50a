"""The local runner's process handling: the worker's exact command line as a child process.

No Airflow imports: the shard operator hands in a logging callback. stderr (progress and
engine logs) is streamed line by line as it arrives; stdout carries only the worker's JSON
manifest (its last line starting with ``{``).

Fault injection (tests and drills only): ``VLLM_BATCH_INJECT_EXIT="MAP_INDEX:TRY:EXIT[,...]"``
in the Airflow worker's environment makes the matching try of the matching mapped shard run
a stand-in process that exits with EXIT instead of the worker (``*`` matches any map index).
Unset, nothing changes; the worker package itself has no such hook.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.exit_codes import Outcome, outcome
from airflow_provider_vllm.core.records import FailureManifest
from airflow_provider_vllm.core.storage import copies_folder

FAULT_ENV = envs.INJECT_EXIT.name
MAX_LOG_LINE = 4000
_AIRFLOW_VAR = re.compile(r"^_*AIRFLOW", re.IGNORECASE)


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the worker inherits of the Airflow worker's environment: all of it but Airflow's own variables.

    ``AIRFLOW_CONN_*`` / ``AIRFLOW_VAR_*`` (Connections and Variables, secrets included), ``AIRFLOW__*``
    options (the Fernet key, the API's JWT secret, secrets-backend kwargs, the database URL, the signing
    key) and Airflow's internal ``_AIRFLOW*`` variables: the worker reads none of them (its settings are
    the ``VLLM_BATCH_*`` variables the operator sets), and vLLM's processes and, with remote code, the
    model repo's code run in it.
    """
    return {k: v for k, v in environ.items() if not _AIRFLOW_VAR.match(k)}


@dataclass
class WorkerResult:
    """How a worker process ended: exit status (negative: killed by that signal) and manifest."""

    returncode: int
    manifest: dict | None
    stdout_tail: list[str] = field(default_factory=list)


def parse_manifest(stdout_lines: Sequence[str]) -> dict | None:
    """The last stdout line that starts with ``{`` and parses as a JSON object, else None."""
    for line in reversed(stdout_lines):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def injected_exit(map_index: int | None, try_number: int, env: Mapping[str, str] | None = None) -> int | None:
    """The exit code ``VLLM_BATCH_INJECT_EXIT`` asks for on this map index and try, else None."""
    raw = envs.INJECT_EXIT.get(env)
    if not raw:
        return None
    for item in raw.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"{FAULT_ENV}={raw!r}: expected MAP_INDEX:TRY:EXIT[,...]")
        mi, tn, code = parts
        if (mi == "*" or int(mi) == (map_index if map_index is not None else -1)) and int(tn) == try_number:
            return int(code)
    return None


def fault_command(code: int) -> list[str]:
    """A stand-in for the worker that prints a failure manifest and exits with ``code``."""
    manifest = json.dumps(
        FailureManifest(
            status="failed",
            error="InjectedFault",
            terminal=outcome(code) is Outcome.FAIL,
            message=f"fault injected by {FAULT_ENV}: exit {code}",
        ).dump()
    )
    script = (
        f"import sys; print('fault injected by {FAULT_ENV}: exit {code}', file=sys.stderr); "
        f"print({manifest!r}); sys.exit({code})"
    )
    return [sys.executable, "-c", script]


class LocalWorkerProcess:
    """Runs one worker command (no shell) and streams its stderr to ``log_line``."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log_line: Callable[[str], None]):
        self.argv = list(argv)
        self.env = dict(env)
        self.log_line = log_line
        self.proc: subprocess.Popen | None = None

    def run(self) -> WorkerResult:
        # Own session: on kill, the worker and vLLM's engine process can be stopped together.
        # VLLM_BATCH_PARENT_PID: the worker binds its life to this process (parent-death signal, see
        # worker/lifecycle.py), which is why it is started and waited for in this one thread.
        env = {**self.env, envs.PARENT_PID.name: str(os.getpid())}
        # A private, empty working directory: vLLM loads a model name that exists as a relative path
        # (``org/name``) from the working directory, which must never be the Airflow worker's. What was
        # relative to ours (the interpreter, PYTHONPATH entries) is made absolute first.
        argv = list(self.argv)
        if os.sep in argv[0]:
            argv[0] = os.path.abspath(argv[0])
        if env.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
        with copies_folder("worker") as workdir:  # swept by the next one when a task killed with SIGKILL leaves it
            return self._run(argv, env, workdir)

    def _run(self, argv: list[str], env: dict[str, str], workdir: str) -> WorkerResult:
        self.proc = proc = subprocess.Popen(
            argv,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
        reader.start()
        threading.Thread(target=self._reap_group, daemon=True).start()
        for line in proc.stderr:
            line = line.rstrip("\n")
            if line:
                self.log_line(line if len(line) <= MAX_LOG_LINE else line[:MAX_LOG_LINE] + " ...")
        rc = proc.wait()
        reader.join(timeout=30)
        return WorkerResult(rc, parse_manifest(out), [s.rstrip("\n") for s in out[-5:]])

    def _reap_group(self) -> None:
        """Once the worker has exited, SIGKILL what is left of its process group.

        A worker killed from outside (OOM killer, SIGKILL) leaves vLLM's engine core running
        as an orphan that holds the worker's stdout/stderr open (and its memory): without this
        the log loop would never see EOF and the task would hang.
        """
        proc = self.proc
        proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker leads its own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self, grace_s: float = 30.0) -> None:
        """SIGTERM the worker (it exits 75 keeping committed chunks), then SIGKILL its group."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
