"""Real Airflow in subprocesses: a sandboxed AIRFLOW_HOME and the ``airflow`` CLI of this venv."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import ROOT

DAGS = ROOT / "dags"
PY = sys.executable
AIRFLOW = str(Path(PY).with_name("airflow"))
CLI_MANY = "cli_many: "  # the line tests/airflow/cli_many.py prints its results on
# Every Airflow a test starts: a DAG file parses in ~2 s alone here, but next to the other test processes' vLLM
# engines on 2 cores it has exceeded Airflow's 30 s per-file import timeout (the wheel's venv once; a task
# process of airflow standalone once, which then reports "Dag not found during start up" and is rescheduled
# every 60 s). The tests are about whether and how the DAGs run, not how fast they parse. The dag-processor's
# limit on one file's parse process (50 s) gets the same room.
LOADED_MACHINE = {
    "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "600",
    "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "600",
}


@dataclass
class AirflowSandbox:
    home: Path
    data: Path
    env: dict[str, str] = field(default_factory=dict)
    serialized: bool = False  # `dags reserialize` ran (the DAG files do not change during a session)
    # the process ``dags_test`` runs its DAGs in (tests/airflow/cli_many.py --serve), started on first use;
    # shared_runs=False: a process per run (a sandbox made for one run)
    shared_runs: bool = True
    server: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    _answers: bytes = field(default=b"", repr=False, compare=False)

    def environ(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """The sandbox's environment for one command: ``env`` over it, and the test that runs the command as
        pytest names it now (the sandbox is made once per session: its copy names the test that made it, and
        scripts/suite_cpu.py charges a process to the test its ``PYTEST_CURRENT_TEST`` names)."""
        out = {**self.env, **(env or {})}
        out.pop("PYTEST_CURRENT_TEST", None)
        if "PYTEST_CURRENT_TEST" in os.environ:
            out["PYTEST_CURRENT_TEST"] = os.environ["PYTEST_CURRENT_TEST"]
        return out

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: int = 900, log: Path | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``airflow <args>``; stdout+stderr also go to ``log`` when given."""
        p = subprocess.run(
            [AIRFLOW, *args],
            env=self.environ(env),
            cwd=str(self.home),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if log is not None:
            log.write_text(p.stdout + p.stderr)
        return p

    def reserialize(self) -> None:
        """The DAGs serialized into the metadata DB, as the CLI's ``dags trigger`` needs them; once per sandbox."""
        if not self.serialized:
            p = self.run("dags", "reserialize")
            assert p.returncode == 0, tail(p)
            self.serialized = True

    def cli_many(self, *argvs: list[str] | dict, serialize: bool = False, timeout: int = 900) -> list[dict]:
        """Several ``airflow`` commands in one process (tests/airflow/cli_many.py): how each ended, in order.
        Each is an argument list or ``{"argv": [...], "env": {...}, "log": path}`` (the module says how).
        ``serialize``: the commands need the DAGs in the metadata DB (``dags trigger``); unless ``reserialize``
        ran already, ``dags reserialize`` goes first in the same process."""
        first = [["dags", "reserialize"]] if serialize and not self.serialized else []
        commands = [*first, *argvs]
        p = subprocess.run(
            [PY, str(ROOT / "tests" / "airflow" / "cli_many.py"), json.dumps(commands)],
            env=self.environ(),
            cwd=str(self.home),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert p.returncode == 0, tail(p)
        (line,) = [x for x in p.stdout.splitlines() if x.startswith(CLI_MANY)]
        results = json.loads(line.removeprefix(CLI_MANY))
        assert len(results) == len(commands), results
        if first:
            assert results[0]["ok"], results[0]
            self.serialized = True
        return results[len(first) :]

    def _dags_test_command(self, dag_id: str, date: str, conf: dict | None) -> tuple[list[str], Path]:
        """``dags test`` arguments and a log file of its own for one run (created: the next run's gets another name)."""
        args = ["dags", "test", dag_id, date] + (["-c", json.dumps(conf)] if conf is not None else [])
        log = self.home / f"{dag_id}-{date}-{len(list(self.home.glob('*.log')))}.log"
        log.write_text("")
        return args, log

    @staticmethod
    def _completed(command: dict, result: dict) -> subprocess.CompletedProcess:
        """A ``dags test`` run in a shared process (``command`` as cli_many.py takes it, ``result`` its answer)
        as ``run`` returns one: stdout is everything it wrote, its task logs included."""
        return subprocess.CompletedProcess(
            command["argv"],
            0 if result["ok"] else 1,
            stdout=Path(command["log"]).read_text(),
            stderr=result["error"] or "",
        )

    def dags_test(
        self, dag_id: str, date: str, conf: dict | None = None, env: dict[str, str] | None = None, timeout: int = 900
    ) -> subprocess.CompletedProcess:
        """``airflow dags test DAG DATE [-c CONF]`` with ``env`` over the sandbox's environment. The runs of a
        session share one process (``cli_many.py --serve``): Airflow, its execution API app (~8 s here), the
        provider and the DAG files are loaded once, as ``dags_test_many`` does for the runs of one test. A run
        whose ``env`` sets Airflow's own options (read when Airflow is imported; ``[vllm_batch]``'s are read
        at each use) gets a process of its own. Comes back as ``run`` returns it: stdout is everything the run
        wrote, its task logs included; the return code is the entry point's."""
        args, log = self._dags_test_command(dag_id, date, conf)
        own_options = any(
            k == "AIRFLOW_HOME" or (k.startswith("AIRFLOW__") and not k.startswith("AIRFLOW__VLLM_BATCH__"))
            for k in env or {}
        )
        if own_options or not self.shared_runs:
            return self.run(*args, env=env, timeout=timeout, log=log)
        command = {"argv": args, "env": self.environ(env), "log": str(log)}
        return self._completed(command, self._serve(command, timeout))

    def _serve(self, command: dict, timeout: float) -> dict:
        """``command`` run by the sandbox's ``cli_many.py --serve`` process (started when there is none):
        its answer. A server that ends without answering fails the command, and the next one starts anew."""
        if self.server is None or self.server.poll() is not None:
            with open(self.home / "cli-server.log", "ab") as err:
                self.server = subprocess.Popen(
                    [PY, str(ROOT / "tests" / "airflow" / "cli_many.py"), "--serve"],
                    env=self.environ(),
                    cwd=str(self.home),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                )
            self._answers = b""
        server = self.server
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps(command).encode() + b"\n")
        server.stdin.flush()
        deadline = time.monotonic() + timeout
        mark = CLI_MANY.encode()
        with selectors.DefaultSelector() as sel:
            sel.register(server.stdout, selectors.EVENT_READ)
            while True:
                lines = self._answers.split(b"\n")
                for i, line in enumerate(lines[:-1]):
                    if line.startswith(mark):
                        self._answers = b"\n".join(lines[i + 1 :])
                        return json.loads(line[len(mark) :])
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    self.close()
                    raise subprocess.TimeoutExpired([AIRFLOW, *command["argv"]], timeout)
                chunk = os.read(server.stdout.fileno(), 1 << 16)
                if not chunk:
                    rc = server.wait()
                    self.server = None
                    return {"ok": False, "error": f"the dags test process ended (exit {rc}) before the run did"}
                self._answers += chunk

    def close(self) -> None:
        """End the ``dags_test`` process, if one runs (its stdin closes: it ends after the command it runs)."""
        server, self.server = self.server, None
        if server is None:
            return
        assert server.stdin is not None
        try:
            server.stdin.close()
        except OSError:
            pass
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    def dags_test_many(self, *runs: tuple[str, str, dict | None, dict[str, str] | None], timeout: int = 900):
        """Several ``airflow dags test DAG DATE [-c CONF]`` runs, each ``(dag_id, date, conf, env)``, one after
        the other in one process (tests/airflow/cli_many.py): Airflow, the DAG files and the provider are
        imported once. Each comes back as ``dags_test`` returns it: a ``CompletedProcess`` whose stdout is
        everything the run wrote (its task logs included) and whose return code is the entry point's."""
        commands = []
        for dag_id, date, conf, env in runs:
            args, log = self._dags_test_command(dag_id, date, conf)
            commands.append({"argv": args, "env": env or {}, "log": str(log)})
        results = self.cli_many(*commands, timeout=timeout)
        return [self._completed(c, r) for c, r in zip(commands, results)]

    def inspect(self, dag_id: str) -> dict:
        """Runs, task instances, earlier tries, XComs and asset events of ``dag_id``, from the DB.

        Read in this process through Airflow's models (tests/airflow/inspect_db.py) with an engine
        of its own: a subprocess per read cost ~4 s of Airflow start-up, ~20 times a session."""
        from tests.airflow.inspect_db import read

        url = self.env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN") or f"sqlite:///{self.home / 'airflow.db'}"
        return read(url, dag_id)


def tail(p: subprocess.CompletedProcess, n: int = 6000) -> str:
    return (p.stdout + p.stderr)[-n:]
