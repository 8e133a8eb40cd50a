"""Run several ``airflow`` CLI commands in one process; print, as JSON, how each ended.

Run as ``python cli_many.py ARGV_JSON`` where ARGV_JSON is a JSON list of argument lists, e.g.
``[["dags", "trigger", "my_dag", "-c", "{...}"], ...]``. Each is parsed by Airflow's own CLI parser and
run through the command function the ``airflow`` entry point would call, so a test pays Airflow's
import once instead of once per command. Prints one line, ``cli_many: `` and a JSON list of
``{"ok": bool, "error": "<exception type>: <message>" | null}`` in the order given.
"""

from __future__ import annotations

import json
import sys

from airflow.cli.cli_parser import get_parser  # noqa: E402

MARK = "cli_many: "  # tests/support/airflow_env.py:CLI_MANY
results = []
parser = get_parser()
for argv in json.loads(sys.argv[1]):
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except Exception as e:  # noqa: BLE001  (the entry point would print it and exit non-zero)
        results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    else:
        results.append({"ok": True, "error": None})
print(MARK + json.dumps(results))
