"""The worker image does not ship Airflow: the worker package must import without it."""

import subprocess
import sys

BLOCK_AIRFLOW = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "airflow" or name.startswith("airflow."):
            raise ImportError("airflow is not installed in the worker image: " + name)
sys.meta_path.insert(0, Block())
import airflow_provider_vllm.worker.__main__, airflow_provider_vllm.worker.shard
import airflow_provider_vllm.worker.engine, airflow_provider_vllm.steps.merge, airflow_provider_vllm.steps.plan
loaded = sorted(m for m in sys.modules if m == "airflow" or m.startswith("airflow."))
assert not loaded, loaded
print("OK")
"""


def test_worker_imports_without_airflow():
    r = subprocess.run([sys.executable, "-c", BLOCK_AIRFLOW], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"


def test_block_is_effective():
    """The blocker really blocks (so the test above could fail)."""
    r = subprocess.run([sys.executable, "-c", BLOCK_AIRFLOW.replace("print(\"OK\")", "import airflow")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "not installed in the worker image" in r.stderr


def test_worker_cli_rejects_bad_task_with_terminal_exit():
    r = subprocess.run([sys.executable, "-m", "airflow_provider_vllm.worker", '{"spec": {}, "shard_id": "x"}'],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "shard_id" in r.stderr and '"terminal": true' in r.stdout
