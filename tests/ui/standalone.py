"""A real ``airflow standalone`` on 127.0.0.1 for the UI tests, and its REST client.

Every process it starts carries ``VLLM_BATCH_UI_RUN=<uuid>`` in its environment; ``stop()``
ends the standalone's process group, then any process still carrying that marker (worker
processes and vLLM engines run in their own sessions), by pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.airflow_env import LOADED_MACHINE

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARKER = "VLLM_BATCH_UI_RUN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(leader: subprocess.Popen) -> bool:
    """Whether a process of the group ``leader`` leads still exists (the leader reaped first: not a zombie of ours)."""
    leader.poll()
    try:
        os.killpg(leader.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment holds ``VLLM_BATCH_UI_RUN=<marker>`` (this test's, nothing else)."""
    needle = f"{MARKER}={marker}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


@dataclass
class Standalone:
    home: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    port: int = 0
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    proc: subprocess.Popen | None = None
    _token: str | None = None
    _scheduler: int | None = None  # the pid of the scheduler this standalone runs on (``ensure_scheduler``)
    replacements: list[subprocess.Popen] = field(default_factory=list)  # schedulers started after one exited

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VLLM_BATCH_INJECT"))}
        env.update(
            {
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",  # standalone starts its parts as `airflow`
                "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p),
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "1",
                "AIRFLOW__CORE__PARALLELISM": "4",
                # A loaded 2-core machine (vLLM engines next to SQLite) answers slowly: without these, a
                # task start can time out against the Execution API and fail before it ran (seen here).
                "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
                "AIRFLOW__CORE__DEFAULT_TASK_RETRIES": "2",
                **LOADED_MACHINE,
                # The DAG files do not change while the tests run: parse them when the dag-processor starts and
                # then every 10 minutes, not every 30 s (each parse is a process importing Airflow and the DAGs).
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
                # Only what the test triggers runs: no scheduled nightly run of its own.
                "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
                # Other Airflows on this machine own 8793/8794.
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                MARKER: self.marker,
            }
        )
        env.update(self.env_extra)
        return env

    def start(self, timeout: float = 240, attempts: int = 3) -> None:
        """Start ``airflow standalone`` and wait until its scheduler is healthy.

        ``free_port()`` releases the port before the API server binds it, so another test's server (xdist) may
        take it meanwhile: uvicorn then logs "address already in use" and the rest of the standalone runs on
        without an API (seen in CI: 240 s of waiting, then every UI test errored). On that message everything is
        stopped and started again on other ports, up to ``attempts`` times."""
        self.port = self.port or free_port()
        self.home.mkdir(parents=True, exist_ok=True)
        for attempt in range(attempts):
            log = self.home / "standalone.log"
            start_at = log.stat().st_size if log.exists() else 0
            self.proc = self._airflow("standalone", note=f"start {attempt + 1} on port {self.port}")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"airflow standalone exited {self.proc.returncode}: {self.log_tail()}")
                if "address already in use" in log.read_text(errors="replace")[start_at:]:
                    break  # a port of this start was taken: start again on others
                try:
                    health = self.get("/api/v2/monitor/health", auth=False)
                    if health.get("scheduler", {}).get("status") == "healthy" and self.password_file().exists():
                        self._scheduler = self._find_scheduler()
                        return
                except (OSError, urllib.error.URLError, ValueError):
                    pass
                time.sleep(2)
            else:
                raise TimeoutError(f"airflow standalone not healthy after {timeout}s: {self.log_tail()}")
            self.stop()
            self.proc, self.replacements, self.port = None, [], free_port()
        raise RuntimeError(f"airflow standalone: a port was taken in each of {attempts} starts: {self.log_tail()}")

    def _airflow(self, command: str, note: str = "") -> subprocess.Popen:
        """``airflow <command>`` in a session of its own, appending (O_APPEND) to ``standalone.log``, which the
        standalone and any replacement scheduler share (``note``: a line written there first)."""
        log = open(self.home / "standalone.log", "ab")
        if note:
            log.write(f"\n[tests] {note}\n".encode())
            log.flush()
        return subprocess.Popen(
            [str(BIN / "airflow"), command],
            cwd=self.home,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _find_scheduler(self) -> int | None:
        """The pid of this standalone's ``airflow scheduler`` process (by its marker and command line)."""
        for pid in marked_pids(self.marker):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd[1:3] == [str(BIN / "airflow").encode(), b"scheduler"] and _alive(pid):
                return pid
        return None

    def ensure_scheduler(self) -> bool:
        """Start another ``airflow scheduler`` when the one this standalone runs on has exited (True then).

        Airflow 3.3.2's scheduler can die on SQLite: a backfill that the API server creates and, on a lock
        error, deletes again ("Backfill creation is not supported on SQLite under concurrent access", HTTP 503)
        can delete a run the scheduler has loaded, whose next update then raises ``StaleDataError`` out of the
        scheduler loop. ``airflow standalone`` does not restart its parts: without this, every later run of the
        session waits for a scheduler that is gone. Only a scheduler process that is gone or a zombie is
        replaced (two schedulers on one SQLite database are not supported); the replacement writes to the same
        log and carries the marker, so ``stop()`` ends it."""
        pid = self._scheduler
        if pid is None or _alive(pid):
            return False
        replacement = self._airflow("scheduler", note=f"the scheduler (pid {pid}) exited: starting another")
        self.replacements.append(replacement)
        self._scheduler = replacement.pid
        return True

    def wait_dags(self, dag_ids, timeout: float = 180) -> None:
        """Until the dag-processor has parsed ``dag_ids`` (the UI shows nothing before)."""
        deadline = time.monotonic() + timeout
        missing = set(dag_ids)
        while missing and time.monotonic() < deadline:
            for dag_id in list(missing):
                try:
                    self.get(f"/api/v2/dags/{dag_id}")
                    missing.discard(dag_id)
                except urllib.error.HTTPError:
                    pass
            time.sleep(1)
        if missing:
            raise TimeoutError(f"DAGs not parsed after {timeout}s: {sorted(missing)}: {self.log_tail()}")

    def stop(self) -> list[int]:
        """End everything this standalone started; returns pids that had to be killed by marker.

        Each ``airflow`` command started here leads a process group of its own, which its children join: the
        LocalExecutor's workers among them. Those set their process title, which overwrites the environment that
        ``marked_pids`` reads, so the groups are signalled whether or not their leader still runs (a scheduler
        killed by a test leaves its idle workers behind; they outlived earlier suites)."""
        groups = [p for p in (self.proc, *self.replacements) if p is not None]
        for p in groups:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(_group_alive(p) for p in groups) and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in groups:
            _signal_group(p.pid, signal.SIGKILL)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        leftovers = marked_pids(self.marker)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        while (marked_pids(self.marker) or any(_group_alive(p) for p in groups)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return leftovers

    def log_tail(self, n: int = 4000) -> str:
        p = self.home / "standalone.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def password_file(self) -> Path:
        return self.home / "simple_auth_manager_passwords.json.generated"

    @property
    def password(self) -> str:
        return json.loads(self.password_file().read_text())["admin"]

    # ---- REST --------------------------------------------------------------------------

    def token(self) -> str:
        if self._token is None:
            self._token = self.request(
                "POST", "/auth/token", {"username": "admin", "password": self.password}, auth=False
            )["access_token"]
        return self._token

    def request(
        self, method: str, path: str, body: Any = None, *, auth: bool = True, headers: dict[str, str] | None = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **(headers or {})}
        if auth:
            h["Authorization"] = f"Bearer {self.token()}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def status_of(self, path: str, *, auth: bool = True) -> tuple[int, bytes, dict[str, str]]:
        """GET ``path``; (status, body, headers) also for 4xx answers."""
        h = {"Authorization": f"Bearer {self.token()}"} if auth else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=h), timeout=60) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def get(self, path: str, *, auth: bool = True) -> Any:
        return self.request("GET", path, auth=auth)

    def runs(self, dag_id: str) -> list[dict]:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns?limit=100&order_by=logical_date")["dag_runs"]

    def run(self, dag_id: str, run_id: str) -> dict:
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        q = urllib.parse.quote(run_id, safe="")
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{q}/taskInstances?limit=100")["task_instances"]

    def trigger(self, dag_id: str, conf: dict, run_id: str) -> dict:
        return self.request(
            "POST", f"/api/v2/dags/{dag_id}/dagRuns", {"dag_run_id": run_id, "logical_date": None, "conf": conf}
        )

    def wait_run(self, dag_id: str, run_id: str, states=("success", "failed"), timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ensure_scheduler()
            run = self.run(dag_id, run_id)
            if run["state"] in states:
                return run
            time.sleep(3)
        tis = {t["task_id"]: t["state"] for t in self.task_instances(dag_id, run_id)}
        done = ("success", "failed", "skipped", "upstream_failed")
        logs = self.log_tails(dag_id, run_id, [task for task, state in tis.items() if state not in done])
        raise TimeoutError(f"{dag_id} {run_id} not in {states} after {timeout}s: {run['state']} {tis}{logs}")

    def log_tails(self, dag_id: str, run_id: str, task_ids: list[str], lines: int = 12) -> str:
        """The end of the newest log file of each task, for a failure message (Airflow's default log layout)."""
        out = []
        for task_id in task_ids:
            folder = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
            logs = sorted(folder.rglob("*.log"), key=lambda f: f.stat().st_mtime)
            if logs:
                tail = logs[-1].read_text(errors="replace").splitlines()[-lines:]
                out.append(f"\n--- {logs[-1].relative_to(self.home)}\n" + "\n".join(line[:400] for line in tail))
        return "".join(out)

    def wait_parked(self, dag_id: str, run_id: str, task_id: str, timeout: float = 120) -> None:
        """Until the scheduler has processed the exit of the worker that parked a HITL task.

        Airflow 3.3.2 races here: a response recorded before the scheduler handled that exit
        re-queues the task, and the late "success" event of the parked try then marks the
        re-queued task failed ("state changed externally"). A person needs seconds to answer; a
        test answers at once, so it waits for the scheduler's log line first.
        """
        needle = f"TaskInstance Finished: dag_id={dag_id}, task_id={task_id}, run_id={run_id}, "
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ensure_scheduler()
            for line in (self.home / "standalone.log").read_text(errors="replace").splitlines():
                if needle in line and "state=awaiting_input" in line:
                    return
            time.sleep(1)
        raise TimeoutError(f"the scheduler did not report {task_id} of {run_id} parked in {timeout}s")

    def wait_task(self, dag_id: str, run_id: str, task_id: str, states, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ensure_scheduler()
            ti = next((t for t in self.task_instances(dag_id, run_id) if t["task_id"] == task_id), None)
            if ti is not None and ti["state"] in states:
                return ti
            if self.run(dag_id, run_id)["state"] in ("success", "failed"):
                raise AssertionError(f"{dag_id} {run_id} ended before {task_id} reached {states}: {ti}")
            time.sleep(3)
        raise TimeoutError(f"{task_id} of {run_id} not in {states} after {timeout}s")
