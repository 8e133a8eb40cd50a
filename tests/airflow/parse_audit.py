"""Parse the DAG files under an audit hook and print, as JSON, every side effect seen.

Run as ``python parse_audit.py DAGS_FOLDER``. Airflow and the provider are imported and the
folder is parsed once with DagBag first (Airflow's own lazy set-up), then each DAG file is
executed again as a fresh module while a ``sys.addaudithook`` hook records file opens other
than Python sources, directory listings, file creation/removal/renames, sockets and
subprocesses; ``Variable.get`` is patched to record calls. Expected output: all lists empty.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

folder = Path(sys.argv[1]).resolve()
sys.dont_write_bytecode = True  # importing must not be what writes files

from airflow.dag_processing.dagbag import BundleDagBag  # noqa: E402
from airflow.sdk import Variable  # noqa: E402

import airflow_provider_vllm.task_groups.batch_job  # noqa: E402,F401

warm = BundleDagBag(dag_folder=str(folder), bundle_path=folder)
files = sorted(p for p in folder.glob("*.py") if p.name != "vllm_dag_defaults.py")
events: dict[str, list] = {"open": [], "fs": [], "net": [], "proc": [], "variable_get": []}


def _variable_get(*args, **kwargs):
    events["variable_get"].append(repr(args))
    raise RuntimeError("Variable.get at parse time")


Variable.get = staticmethod(_variable_get)
try:
    from airflow.models.variable import Variable as ModelVariable

    ModelVariable.get = staticmethod(_variable_get)
except ImportError:
    pass

active = False
SOURCE_SUFFIXES = (".py", ".pyc")


def hook(event: str, args: tuple) -> None:
    if not active:
        return
    if event == "open":
        path, mode = str(args[0]), args[1]
        if mode in (None, "r", "rb") and path.endswith(SOURCE_SUFFIXES) and path.startswith(str(folder)):
            return  # the DAG file itself, read by the import system
        events["open"].append([path, mode])
    elif event in (
        "os.mkdir",
        "os.rename",
        "os.remove",
        "os.rmdir",
        "os.unlink",
        "os.listdir",
        "os.scandir",
        "shutil.rmtree",
        "shutil.copyfile",
        "os.truncate",
        "os.chmod",
        "os.link",
        "os.symlink",
    ):
        events["fs"].append([event, repr(args)[:200]])
    elif event.startswith("socket.") and event in ("socket.connect", "socket.bind", "socket.getaddrinfo"):
        events["net"].append([event, repr(args)[:200]])
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork"):
        events["proc"].append([event, repr(args)[:200]])


sys.addaudithook(hook)
parsed = []
for i, path in enumerate(files):
    spec = importlib.util.spec_from_file_location(f"audited_dag_{i}", path)
    module = importlib.util.module_from_spec(spec)
    active = True
    try:
        spec.loader.exec_module(module)
    finally:
        active = False
    parsed.append(
        [path.name, sorted(getattr(d, "dag_id", "?") for d in vars(module).values() if type(d).__name__ == "DAG")]
    )
print(json.dumps({"warm_import_errors": warm.import_errors, "parsed": parsed, "events": events}))
