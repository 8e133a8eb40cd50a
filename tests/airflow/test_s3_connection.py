"""S3 through an Airflow Connection only: moto on loopback, its keys and endpoint in ``AIRFLOW_CONN_*``.

No ``AWS_*`` variable in this process (nor in the Airflow one of the DAG run): plan, the local
shards (the worker process gets the Connection's identity through its environment), merge,
QA, publish and the report page all reach S3 through the Connection. The credentials must not
show up in the spec XCom, ``_plan.json``, the worker's command line, manifests or logs.

The first test drives the operators with the fake engine (fast); the second is a real
``airflow dags test`` of the re-run DAG with the tiny model (slow, vLLM).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.airflow.test_operators import context, fake_python  # noqa: F401 (fixture)
from tests.support.data import make_spec
from tests.support.loopback import CONN_KEY, CONN_SECRET, RecordingServer, aws_connection, s3_client
from tests.support.s3server import MotoServer

CONN_ID = "vllm_s3"


def put_parquet(s3, key: str, ids: list[str], texts: list[str]) -> None:
    import io

    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ids, "text": texts}), buf, row_group_size=32)
    s3.put_object(Bucket="data", Key=key, Body=buf.getvalue())


@pytest.fixture
def moto_conn(monkeypatch):
    """(moto, boto3 client): bucket ``data``; the Connection ``vllm_s3``; no AWS_* in the environment."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    with MotoServer() as moto:
        s3 = s3_client(moto.endpoint)
        s3.create_bucket(Bucket="data")
        monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", aws_connection(moto.endpoint))
        # branch-independent: the allow-list is set, whether or not an unset one fails closed
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", "s3://data")
        yield moto, s3


def s3_text(s3, key: str) -> str:
    return s3.get_object(Bucket="data", Key=key)["Body"].read().decode()


def test_plan_shards_merge_qa_publish_and_report_page_through_a_connection_only(
    moto_conn,
    fake_python,  # noqa: F811
    monkeypatch,
    caplog,
):
    from airflow_provider_vllm.operators import (
        VllmLocalShardOperator,
        VllmMergeOperator,
        VllmPlanOperator,
        VllmPublishOperator,
        VllmQAOperator,
    )
    from airflow_provider_vllm.operators import shard as shard_module

    moto, s3 = moto_conn
    n = 150
    texts = [f"ticket {i}: I was charged twice" for i in range(n)]
    texts[9] = ""
    put_parquet(s3, "in/part-0.parquet", [f"s{i:03d}" for i in range(n)], texts)
    doc = make_spec(
        "s3://data/in", "s3://data/runs/r1", sharding={"target_rows": 60, "chunk_rows": 20}, qa={"fail_error_rate": 0.5}
    ).model_dump(mode="json")
    conn = {"aws_conn_id": CONN_ID}

    launched: list[tuple[list[str], dict[str, str]]] = []
    real = shard_module.LocalWorkerProcess

    def recording(argv, env, on_line):
        launched.append((list(argv), dict(env)))
        return real(argv, env, on_line)

    monkeypatch.setattr(shard_module, "LocalWorkerProcess", recording)
    caplog.set_level("DEBUG")

    plan_ctx = context()
    shards = VllmPlanOperator(task_id="plan", spec=doc, **conn).execute(plan_ctx)
    spec = plan_ctx["ti"].xcoms["spec"]
    assert len(shards) == 3
    manifests = [
        VllmLocalShardOperator(
            task_id="shard", spec=spec, shard=s, python=fake_python, progress_interval_s=0.05, **conn
        ).execute(context(map_index=i))
        for i, s in enumerate(shards)
    ]
    assert [m["status"] for m in manifests] == ["committed"] * 3
    merged = VllmMergeOperator(task_id="merge", spec=spec, plan=plan_ctx["ti"].xcoms["plan"], **conn).execute(context())
    assert merged["rows"] == n and merged["ok_rows"] == n - 1 and merged["error_rows"] == 1
    qa_summary = VllmQAOperator(task_id="qa", spec=spec, **conn).execute(context())
    assert qa_summary["report_html"] == "s3://data/runs/r1/qa/report.html"
    event = VllmPublishOperator(task_id="publish", spec=spec, **conn).execute(context())
    marker = json.loads(s3_text(s3, "runs/r1/_SUCCESS.json"))
    assert event["rows"] == marker["rows"] == n and marker["qa"]["status"] == qa_summary["status"]

    # the worker processes got the Connection's identity in their environment, never their arguments
    assert len(launched) == 3
    for argv, env in launched:
        assert env["AWS_ACCESS_KEY_ID"] == CONN_KEY and env["AWS_SECRET_ACCESS_KEY"] == CONN_SECRET
        assert env["AWS_ENDPOINT_URL_S3"] == moto.endpoint and env["AWS_DEFAULT_REGION"] == "us-east-1"
        assert not any(CONN_SECRET in a or CONN_KEY in a or moto.endpoint in a for a in argv)
    assert not [k for k in os.environ if k.startswith("AWS_")]  # nor did this process get them
    # ... and nowhere in what the job keeps or shows
    kept = {
        "spec xcom": json.dumps(spec),
        "_plan.json": s3_text(s3, "runs/r1/_plan.json"),
        "manifests": json.dumps(manifests),
        "merge": json.dumps(merged),
        "qa": json.dumps(qa_summary),
        "_SUCCESS.json": json.dumps(marker),
        "_MERGED.json": s3_text(s3, "runs/r1/_MERGED.json"),
        # what a task log shows (INFO and up); the secret key at no level at all
        "logs": "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO),
    }
    for name, text in kept.items():
        assert CONN_SECRET not in text and CONN_KEY not in text, name
        assert moto.endpoint not in text, name
    assert not [r.name for r in caplog.records if CONN_SECRET in r.getMessage()]

    # the report page: same Connection, named by the deployment's config
    from airflow.api_fastapi.common.db.common import _get_session
    from fastapi.testclient import TestClient

    from airflow_provider_vllm.plugins import report as plugin

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__AWS_CONN_ID", CONN_ID)
    xcoms = {("job.plan", "spec"): spec, ("job.qa", "return_value"): qa_summary}
    from tests.airflow.test_report_page_access import finished_run

    monkeypatch.setattr(plugin, "_records", lambda session, dag_id, run_id, task_id, map_index: finished_run(xcoms))
    plugin.app.dependency_overrides[plugin._can_read_task_instances.dependency] = lambda: None
    plugin.app.dependency_overrides[_get_session] = lambda: None
    plugin._fs_cache.clear()
    try:
        client = TestClient(plugin.app)
        r = client.get("/report", params={"dag_id": "d", "run_id": "r1", "task_id": "job.qa"})
        assert r.status_code == 200 and r.text == s3_text(s3, "runs/r1/qa/report.html")
        r = client.get("/report.json", params={"dag_id": "d", "run_id": "r1", "task_id": "job.qa"})
        assert r.status_code == 200 and r.json()["status"] == qa_summary["status"]
    finally:
        plugin.app.dependency_overrides.clear()


@pytest.mark.reliability
def test_storage_options_that_belong_to_the_connection_are_refused(moto_conn):
    """Endpoint, keys, client kwargs or proxies in the spec: the plan fails, nothing is written or sent."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPlanOperator
    from tests.support.ledger import record_malicious

    moto, s3 = moto_conn
    put_parquet(s3, "in/part-0.parquet", ["a", "b"], ["x", "y"])
    with RecordingServer() as srv:
        hostile = [
            {"endpoint_url": srv.url},
            {"client_kwargs": {"endpoint_url": srv.url}},
            {"client_kwargs": {"headers": {"Metadata-Flavor": "Google"}}},
            {"config_kwargs": {"proxies": {"http": srv.url, "https": srv.url}}},
        ]
        refused = 0
        for i, opts in enumerate(hostile):
            doc = make_spec("s3://data/in", f"s3://data/runs/h{i}").model_dump(mode="json")
            doc["io"]["storage_options"] = opts
            with pytest.raises(AirflowFailException, match="storage_options"):
                VllmPlanOperator(task_id="plan", spec=doc, aws_conn_id=CONN_ID).execute(context())
            refused += 1
            assert "Contents" not in s3.list_objects_v2(Bucket="data", Prefix=f"runs/h{i}/")
        assert srv.requests == []
    record_malicious("s3 storage_options owned by the Connection", len(hostile), refused)
    # what a spec may still tune: botocore timeouts and retries
    doc = make_spec("s3://data/in", "s3://data/runs/ok").model_dump(mode="json")
    doc["io"]["storage_options"] = {"config_kwargs": {"read_timeout": 30, "retries": {"max_attempts": 3}}}
    assert len(VllmPlanOperator(task_id="plan", spec=doc, aws_conn_id=CONN_ID).execute(context())) == 1


# ---- a real DAG run ----------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_rerun_dag_on_s3_through_a_connection_only(airflow_sandbox, tiny_model, tmp_path):
    """`airflow dags test` of the re-run DAG: input and output on moto, credentials only in AIRFLOW_CONN_AWS_DEFAULT."""
    from tests.support.airflow_env import AirflowSandbox, tail

    box = airflow_sandbox
    env = {k: v for k, v in box.env.items() if not k.startswith("AWS_")}
    with MotoServer() as moto:
        s3 = s3_client(moto.endpoint)
        s3.create_bucket(Bucket="data")
        n = 40
        put_parquet(
            s3,
            "adhoc/tickets.parquet",
            [f"c{i:03d}" for i in range(n)],
            [f"Please refund order {i}, I was charged twice." for i in range(n)],
        )
        env.update(
            {
                "AIRFLOW_CONN_AWS_DEFAULT": aws_connection(moto.endpoint),
                "AIRFLOW_VAR_VLLM_BATCH_DATA_ROOT": "s3://data/support",
                "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES": f"s3://data,{Path(tiny_model).parent},{box.data}",
            }
        )
        s3box = AirflowSandbox(home=box.home, data=box.data, env=env, shared_runs=False)  # one run
        conf = {
            "input_uri": "s3://data/adhoc/",
            "model": tiny_model,
            "labels": ["billing", "bug", "other"],
            "shard_rows": n,  # one shard, one engine start; tests/s3 merges many shards on S3
            "max_tokens": 16,
        }
        p = s3box.dags_test("vllm_batch_rerun", "2026-11-24", conf=conf)
        assert p.returncode == 0, tail(p)
        log = p.stdout + p.stderr
        assert CONN_SECRET not in log and CONN_KEY not in log
        db = s3box.inspect("vllm_batch_rerun")
        run_id = db["runs"][-1]["run_id"]
        tis = {(t["task_id"].split(".")[-1], t["map_index"]): t["state"] for t in db["tis"] if t["run_id"] == run_id}
        assert tis[("publish", -1)] == "success" and tis[("qa", -1)] == "success" and tis[("merge", -1)] == "success"
        event = next(x["value"] for x in db["xcoms"] if x["run_id"] == run_id and x["task_id"] == "rerun.publish")
        out = event["output_uri"].rstrip("/")
        assert out.startswith("s3://data/support/reruns/") and event["rows"] == n
        key = out[len("s3://data/") :]
        marker = json.loads(s3_text(s3, f"{key}/_SUCCESS.json"))
        assert marker["rows"] == n and marker["qa"]["status"] in ("pass", "warn")
        for x in db["xcoms"]:
            if x["run_id"] == run_id:
                assert CONN_SECRET not in json.dumps(x["value"]) and moto.endpoint not in json.dumps(x["value"])
        # the report page of that run, through the API server's own app and the run's XComs in the DB
        page = _report_page_in_api_server(s3box, run_id)
        assert page["status"] == 200, page
        assert page["body"] == s3_text(s3, f"{key}/qa/report.html")


PAGE_SCRIPT = r"""
import json, sys
from fastapi.testclient import TestClient
from airflow.api_fastapi.app import create_app
app = create_app("all")
client = TestClient(app)
r = client.get("/vllm-batch/report", params={"dag_id": "vllm_batch_rerun", "run_id": sys.argv[1],
                                              "task_id": "rerun.qa"})
print(json.dumps({"status": r.status_code, "body": r.text}))
"""


def _report_page_in_api_server(box, run_id: str) -> dict:
    """GET the report through Airflow's whole API app (plugins, auth: every user an admin) over the sandbox DB."""
    import subprocess

    env = box.environ(
        {"AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True", "AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS": "False"}
    )
    p = subprocess.run(
        [sys.executable, "-c", PAGE_SCRIPT, run_id],
        env=env,
        cwd=str(box.home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
