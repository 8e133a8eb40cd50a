"""A local-runner DAG on an Airflow without vLLM: the shard fails on its first attempt, is not retried, and
its log says how to install vLLM and that the Kubernetes runner needs none (a real ``airflow dags test``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.support.airflow_env import tail
from tests.support.data import make_spec, write_parquet

HERE = Path(__file__).resolve()
DAG_ID = "vllm_no_engine"
DAG_FILE = """
import json
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_provider_vllm.task_groups.batch_job import vllm_batch_job

with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:
    vllm_batch_job(
        json.loads({spec!r}), group_id="job", human_review=False, shard_retries=2,
        shard_retry_delay=timedelta(seconds=1),
    )
# the worker runs on a Python that cannot import vLLM, as on an Airflow-only install
dag.task_dict["job.shard"].partial_kwargs["python"] = {python!r}
"""
NO_VLLM_PYTHON = """#!{executable}
import sys
sys.path.insert(0, {root!r})
sys.modules["vllm"] = None  # `import vllm` fails with ModuleNotFoundError: vLLM is not installed
from airflow_provider_vllm.worker.__main__ import entrypoint
assert sys.argv[1:3] == ["-m", "airflow_provider_vllm.worker"], sys.argv
entrypoint(sys.argv[3:])
"""


def test_without_vllm_the_shard_fails_once_terminally_naming_the_fix(airflow_sandbox, tmp_path):
    box = airflow_sandbox
    python = tmp_path / "python-without-vllm"
    python.write_text(NO_VLLM_PYTHON.format(executable=sys.executable, root=str(HERE.parents[2])))
    python.chmod(0o755)
    src, out = box.data / "novllm" / "in", box.data / "novllm" / "out"
    write_parquet(src / "part-0.parquet", [f"n{i:03d}" for i in range(20)], [f"ticket {i}" for i in range(20)])
    dags = tmp_path / "dags"
    dags.mkdir()
    spec = json.dumps(make_spec(src, out).model_dump(mode="json"))
    (dags / "vllm_no_engine.py").write_text(DAG_FILE.format(dag_id=DAG_ID, spec=spec, python=str(python)))

    p = box.dags_test(DAG_ID, "2026-11-28", env={"AIRFLOW__CORE__DAGS_FOLDER": str(dags)})
    logs = p.stdout + p.stderr
    db = box.inspect(DAG_ID)
    shard = [t for t in db["tis"] if t["task_id"] == "job.shard"]
    assert shard and all(t["state"] == "failed" and t["try_number"] == 1 for t in shard), tail(p)
    assert not [h for h in db["history"] if h["task_id"] == "job.shard"]  # no earlier try: never retried
    assert "terminal worker error (exit 2, not retried)" in logs and "vLLM is not installed" in logs, tail(p)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in logs and "runner='kubernetes'" in logs
    assert not (out / "_SUCCESS.json").exists()
