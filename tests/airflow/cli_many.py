"""Run several ``airflow`` CLI commands in one process; print, as JSON, how each ended.

Run as ``python cli_many.py COMMANDS_JSON`` where COMMANDS_JSON is a JSON list whose items are either an
argument list, e.g. ``["dags", "trigger", "my_dag", "-c", "{...}"]``, or an object
``{"argv": [...], "env": {"NAME": "value", ...}, "log": "/path/to/file"}``: the command runs with ``env``
laid over this process's environment (restored afterwards), and everything it writes to stdout and stderr,
its task logs included, goes to ``log`` (file descriptors 1 and 2 are redirected). Each command is parsed by
Airflow's own CLI parser and run through the command function the ``airflow`` entry point would call, so a
test pays Airflow's start-up once instead of once per command (``airflow dags test`` runs the DAG's tasks in
its own process: one import of Airflow, of the DAG files and of the provider for several runs). Prints one
line, ``cli_many: `` and a JSON list of ``{"ok": bool, "error": "<exception type>: <message>" | null}`` in
the order given; ``ok`` is false where the entry point would have exited non-zero (an exception, or a
``SystemExit`` with a non-zero code such as ``dags test``'s "DagRun failed"). ``python cli_many.py --serve``
takes the commands one per line on stdin instead and answers each with its own line (``serve``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from airflow.cli.cli_parser import get_parser

MARK = "cli_many: "  # tests/support/airflow_env.py:CLI_MANY


@contextlib.contextmanager
def environment(overlay: dict[str, str]):
    before = {k: os.environ.get(k) for k in overlay}
    os.environ.update(overlay)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def output_to(log: str | None):
    if log is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def run_one(parser, command: list[str] | dict) -> dict:
    """One command, as the ``airflow`` entry point would run it: ``{"ok": ..., "error": ...}``."""
    if isinstance(command, list):
        command = {"argv": command}
    with environment(command.get("env") or {}), output_to(command.get("log")):
        args = parser.parse_args(command["argv"])
        try:
            args.func(args)
        except SystemExit as e:  # what the entry point's exit status would be
            ok = e.code in (None, 0)
            return {"ok": ok, "error": None if ok else f"SystemExit: {e.code}"}
        except Exception as e:  # noqa: BLE001  (the entry point would print it and exit non-zero)
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "error": None}


def main() -> None:
    parser = get_parser()
    print(MARK + json.dumps([run_one(parser, command) for command in json.loads(sys.argv[1])]))


def serve() -> None:
    """``--serve``: one command per line on stdin (as in COMMANDS_JSON), one ``cli_many: {...}`` line per
    command on stdout, until stdin closes. A session's ``airflow dags test`` runs share one process this
    way (tests/support/airflow_env.py, ``AirflowSandbox.dags_test``)."""
    parser = get_parser()
    for line in sys.stdin:
        if line.strip():
            print(MARK + json.dumps(run_one(parser, json.loads(line))), flush=True)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["--serve"] else main()
