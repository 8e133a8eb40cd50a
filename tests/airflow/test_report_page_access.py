"""The QA report page as an attacker would try it: hostile XComs against real servers on loopback.

The plugin's FastAPI app answers through Starlette's TestClient; the XComs it reads are the
attacker's (a forged plan ``spec`` / QA summary, as anyone who can write an XCom or run a task
could leave them). The target of each SSRF attempt is a real HTTP server on 127.0.0.1 that
records every request: each attempt must get a 403 with a reason, and the server must have
seen nothing. The readable case goes to moto's S3 through an Airflow Connection only: no
``AWS_*`` variable in the process, and options planted in the XCom (endpoint, headers) unused.
"""

from __future__ import annotations

import hashlib
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.support.airflow_env import LOADED_MACHINE
from tests.support.ledger import record_malicious
from tests.support.loopback import SECRET_BODY, RecordingServer, aws_connection, s3_client
from tests.support.s3server import MotoServer

REPORT = b"<!doctype html><title>QA report</title><p>the run's own report</p>"
REPORT_JSON = b'{"status": "pass"}'
VOUCHED = {"html": hashlib.sha256(REPORT).hexdigest(), "json": hashlib.sha256(REPORT_JSON).hexdigest()}


@pytest.fixture
def page(monkeypatch):
    """(client, xcoms): the plugin app, logged-in user assumed, XComs from the ``xcoms`` dict."""
    from airflow.api_fastapi.common.db.common import _get_session
    from fastapi.testclient import TestClient

    from airflow_provider_vllm.plugins import report as plugin

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    xcoms: dict[tuple[str, str], object] = {}
    monkeypatch.setattr(plugin, "_records", lambda session, dag_id, run_id, task_id, map_index: finished_run(xcoms))
    plugin.app.dependency_overrides[plugin._can_read_task_instances.dependency] = lambda: None
    plugin.app.dependency_overrides[_get_session] = lambda: None
    plugin._fs_cache.clear()  # each test brings its own Connection
    try:
        yield TestClient(plugin.app), xcoms
    finally:
        plugin.app.dependency_overrides.clear()
        plugin._fs_cache.clear()


def finished_run(xcoms: dict):
    """The DB's records of a finished run whose own plan and QA tasks wrote ``xcoms`` while they ran."""
    from airflow_provider_vllm.plugins.report_access import RunRecords, TaskRecord, XComRecord

    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    plan = TaskRecord("job.plan", "success", t0, t0 + timedelta(minutes=1))
    qa = TaskRecord("job.qa", "success", t0 + timedelta(minutes=5), t0 + timedelta(minutes=6))

    def x(task: str, key: str, ti: TaskRecord):
        v = xcoms.get((task, key))
        return None if v is None else XComRecord(v, ti.end_date - timedelta(seconds=1))

    return RunRecords(True, qa, plan, x("job.qa", "return_value", qa), x("job.plan", "spec", plan))


def plant(xcoms: dict, output_uri: str, report_html: str | None = None, **io) -> None:
    """The attacker's XComs: the plan task's ``spec`` and the QA task's summary of one run."""
    xcoms[("job.plan", "spec")] = {"io": {"input_uri": "s3://data/in", "output_uri": output_uri, **io}}
    xcoms[("job.qa", "return_value")] = {
        "status": "pass",
        "report_html": report_html or f"{output_uri.rstrip('/')}/qa/report.html",
        "report_sha256": VOUCHED,  # what the QA task wrote (REPORT, REPORT_JSON)
    }


def get(client, kind: str = "report"):
    return client.get(f"/{kind}", params={"dag_id": "d", "run_id": "r", "task_id": "job.qa"})


def hostile_cases(srv: RecordingServer, tmp: Path) -> dict[str, tuple[dict, str]]:
    """name -> (planted XComs, expected words in the 403 reason)."""
    u = srv.url
    headers = {
        "client_kwargs": {"endpoint_url": u, "headers": {"Metadata-Flavor": "Google", "X-aws-ec2-metadata-token": "x"}}
    }
    return {
        # the reproduction from the issue: the page fetched this and returned the server's body
        "http output_uri": ({"output_uri": f"{u}/creds#"}, "scheme 'http' is not allowed"),
        "http output, report in it": (
            {"output_uri": f"{u}/latest/meta-data/iam", "report_html": f"{u}/latest/meta-data/iam/qa/report.html"},
            "not allowed",
        ),
        "https output_uri": ({"output_uri": "https://169.254.169.254/latest/"}, "not allowed"),
        "upper-case HTTP": ({"output_uri": f"HTTP://127.0.0.1:{srv.port}/x"}, "not allowed"),
        "chained fsspec url": ({"output_uri": f"simplecache::{u}/x"}, "chained"),
        "chained s3 over http": ({"output_uri": f"s3::{u}/data/x"}, "chained"),
        "allowed bucket, report_html on http": (
            {"output_uri": "s3://data/runs/r1", "report_html": f"{u}/creds#/qa/report.html"},
            "not allowed",
        ),
        # options in the XCom must never reach a file system: refused here as the bucket is not allowed
        "storage_options endpoint+headers, other bucket": (
            {"output_uri": "s3://other-team/runs/r1", "storage_options": {"endpoint_url": u, **headers}},
            "outside [vllm_batch] allowed_uri_prefixes",
        ),
        "other bucket": ({"output_uri": "s3://other-team/runs/r1"}, "outside"),
        "sibling bucket by prefix": ({"output_uri": "s3://data-other/runs/r1"}, "outside"),
        "gs instead of s3": ({"output_uri": "gs://data/runs/r1"}, "outside"),
        "dot-dot out of the allowed prefix": ({"output_uri": "s3://data/runs/../../other-team/x"}, "'..'"),
        "encoded dot-dot": ({"output_uri": "s3://data/runs/%2e%2e/other"}, "percent-encoded"),
        "credentials in the s3 url": (
            {"output_uri": "s3://AKIA:secret@data/runs/r1"},
            "credentials in URIs are not allowed",
        ),
        "credentials and port in an http url": (
            {"output_uri": f"http://user:pw@127.0.0.1:{srv.port}/x"},
            "not allowed",
        ),
        "local path outside": ({"output_uri": "/etc"}, "outside"),
        "file url outside": ({"output_uri": "file:///etc/ssl"}, "outside"),
        "relative local path": ({"output_uri": "etc/passwd"}, "absolute"),
        "report_html elsewhere in the allowed bucket": (
            {"output_uri": "s3://data/runs/r1", "report_html": "s3://data/runs/r2/qa/report.html"},
            "not under this run's output prefix",
        ),
        "report_html dot-dot": (
            {"output_uri": "s3://data/runs/r1", "report_html": "s3://data/runs/r1/../r2/qa/report.html"},
            "'..'",
        ),
        "symlinked report leaves the prefix": (
            {"output_uri": str(tmp / "allowed" / "run")},
            "leads outside the run's output prefix",
        ),
    }


@pytest.mark.reliability
def test_hostile_report_locations_get_403_and_no_request_leaves(page, tmp_path, monkeypatch):
    client, xcoms = page
    (tmp_path / "allowed" / "run" / "qa").mkdir(parents=True)
    (tmp_path / "secret.html").write_text("host secret")
    for name in ("report.html", "report.json"):
        (tmp_path / "allowed" / "run" / "qa" / name).symlink_to(tmp_path / "secret.html")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", f"s3://data,{tmp_path / 'allowed'}")
    with RecordingServer() as srv:
        cases = hostile_cases(srv, tmp_path)
        refused = []
        for name, (planted, reason) in cases.items():
            plant(xcoms, **planted)
            for kind in ("report", "report.json"):
                r = get(client, kind)
                assert r.status_code == 403, (name, kind, r.status_code, r.text[:300])
                assert reason in r.json()["detail"], (name, r.json()["detail"])
                assert "secret@" not in r.json()["detail"] and "pw@" not in r.json()["detail"]  # never echoed
                assert SECRET_BODY not in r.content and b"host secret" not in r.content
            refused.append(name)
        record_malicious("report page location (SSRF)", len(cases), len(refused))
        assert srv.requests == [], srv.requests  # nothing reached the server
    assert len(refused) == len(cases)


@pytest.mark.reliability
def test_no_allow_list_refuses_every_report_naming_the_setting(page, tmp_path, monkeypatch):
    client, xcoms = page
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", raising=False)
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION", raising=False)
    run = tmp_path / "run"
    (run / "qa").mkdir(parents=True)
    (run / "qa" / "report.html").write_bytes(REPORT)
    with RecordingServer() as srv:
        tried = [str(run), f"{srv.url}/creds#", "s3://data/runs/r1"]
        for out in tried:
            plant(xcoms, out)
            r = get(client)
            assert r.status_code == 403 and "[vllm_batch] allowed_uri_prefixes" in r.json()["detail"], r.text
        assert srv.requests == []
    record_malicious("report page without an allow-list", len(tried), len(tried))
    # a malformed allow-list refuses too (a deployment error, named)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", "http://127.0.0.1/")
    plant(xcoms, str(run))
    r = get(client)
    assert r.status_code == 403 and "is malformed" in r.json()["detail"]
    # the deployment's explicit opt-out of the allow-list: syntax rules still hold
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION", "True")
    r = get(client)
    assert r.status_code == 200 and r.content == REPORT
    plant(xcoms, "http://127.0.0.1:9/creds#")
    assert get(client).status_code == 403


def test_a_local_runs_own_report_is_served(page, tmp_path, monkeypatch):
    client, xcoms = page
    run = tmp_path / "data" / "runs" / "r1"
    (run / "qa").mkdir(parents=True)
    (run / "qa" / "report.html").write_bytes(REPORT)
    (run / "qa" / "report.json").write_bytes(REPORT_JSON)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", str(tmp_path / "data"))
    plant(xcoms, f"file://{run}/")
    r = get(client)
    assert r.status_code == 200 and r.content == REPORT
    assert r.headers["content-security-policy"].startswith("default-src 'none'")
    assert get(client, "report.json").json() == {"status": "pass"}
    # a report rewritten after QA (a writer of the prefix shows the reviewer another verdict): refused, named
    (run / "qa" / "report.html").write_bytes(REPORT.replace(b"own report", b"PASS, approve"))
    r = get(client)
    assert r.status_code == 403 and "qa/report.html is not the report the QA task wrote" in r.json()["detail"]
    assert b"approve" not in r.content
    # one of many GB (sparse here): refused unread, the API server never holds it
    with open(run / "qa" / "report.html", "wb") as f:
        f.truncate(4 << 30)
    r = get(client)
    assert r.status_code == 403 and "qa/report.html is larger than" in r.json()["detail"]
    (run / "qa" / "report.html").write_bytes(REPORT)
    # a QA summary that vouches for no bytes (an earlier provider's): nothing is served
    xcoms[("job.qa", "return_value")].pop("report_sha256")
    r = get(client)
    assert r.status_code == 403 and "vouches for no report bytes" in r.json()["detail"]
    plant(xcoms, f"file://{run}/")
    # report_roots narrows further
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__REPORT_ROOTS", str(tmp_path / "data" / "other"))
    r = get(client)
    assert r.status_code == 403 and "report_roots" in r.json()["detail"]


def test_s3_report_is_read_through_the_connection_only_never_xcom_options(page, monkeypatch):
    """No AWS_* in the environment; keys and endpoint in AIRFLOW_CONN_*; XCom options pointing at a recorder."""
    client, xcoms = page
    assert not [k for k in os.environ if k.startswith("AWS_")]
    with MotoServer() as moto, RecordingServer() as srv:
        s3 = s3_client(moto.endpoint)
        s3.create_bucket(Bucket="data")
        s3.put_object(Bucket="data", Key="runs/r1/qa/report.html", Body=REPORT)
        monkeypatch.setenv("AIRFLOW_CONN_VLLM_REPORTS", aws_connection(moto.endpoint))
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__AWS_CONN_ID", "vllm_reports")
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", "s3://data/runs")
        plant(
            xcoms,
            "s3://data/runs/r1/",
            storage_options={
                "endpoint_url": srv.url,
                "key": "attacker",
                "secret": "attacker",
                "client_kwargs": {"endpoint_url": srv.url, "headers": {"Metadata-Flavor": "Google"}},
            },
        )
        r = get(client)
        assert r.status_code == 200 and r.content == REPORT, r.text[:500]
        r = get(client, "report.json")
        assert r.status_code == 404 and "does not exist" in r.json()["detail"]
        # the request cannot name a Connection, an endpoint or a path either: extra query fields are ignored
        monkeypatch.setenv("AIRFLOW_CONN_EVIL", aws_connection(srv.url))
        r = client.get(
            "/report",
            params={
                "dag_id": "d",
                "run_id": "r",
                "task_id": "job.qa",
                "aws_conn_id": "evil",
                "endpoint_url": srv.url,
                "output_uri": f"{srv.url}/creds#",
            },
        )
        assert r.status_code == 200 and r.content == REPORT
        assert srv.requests == []


# ---- against a real metadata DB: real runs of two teams' DAGs, then forged XComs -------------
TEAM_DAGS = """
import hashlib
import json
from pathlib import Path

import pendulum
from airflow.sdk import DAG, TaskGroup, get_current_context, task

DATA = {data!r}

for team in ("team_a", "team_b"):
    with DAG(team, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
        out = f"{{DATA}}/{{team}}/run"

        with TaskGroup("job"):

            @task(task_id="plan")
            def plan(out=out):
                spec = {{"io": {{"input_uri": f"{{DATA}}/in", "output_uri": out}}}}
                get_current_context()["ti"].xcom_push(key="spec", value=spec)

            @task(task_id="qa")
            def qa(out=out, team=team):
                Path(out, "qa").mkdir(parents=True, exist_ok=True)
                body = f"<p>report of {{team}}</p>".encode()
                Path(out, "qa", "report.html").write_bytes(body)
                vouched = {{"html": hashlib.sha256(body).hexdigest()}}
                return {{"status": "pass", "report_html": f"{{out}}/qa/report.html", "report_sha256": vouched}}

            plan() >> qa()
"""

PROBE = """
import json, sys
from fastapi.testclient import TestClient
from sqlalchemy import select
from airflow.models.dagrun import DagRun
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from airflow_provider_vllm.plugins import report as plugin

plugin.app.dependency_overrides[plugin._can_read_task_instances.dependency] = lambda: None  # the user may read
client = TestClient(plugin.app)
with create_session() as s:
    runs = {d: r for d, r in s.execute(select(DagRun.dag_id, DagRun.run_id))}
out = []
for step in json.loads(sys.argv[1]):
    if "forge" in step:  # what the REST API's POST/PATCH .../xcomEntries does: XComModel.set, stamped now
        f = step["forge"]
        with create_session() as s:
            XComModel.set(key=f["key"], value=f["value"], dag_id=f["dag_id"], task_id=f["task_id"],
                          run_id=runs[f["dag_id"]], map_index=-1, serialize=False, session=s)
        continue
    q = {**step["get"]}
    q["run_id"] = runs.get(q.pop("run_of"), "no-such-run")
    r = client.get("/report", params=q)
    out.append([r.status_code, r.text[:300]])
print("PROBE " + json.dumps(out))
"""


@pytest.mark.reliability
def test_real_runs_the_page_reads_only_what_the_runs_own_tasks_wrote(tmp_path):
    """Two teams' DAGs ran (``airflow dags test``, SQLite); team A's XComs are then forged to team B's run."""
    import json
    import subprocess

    from tests.support.airflow_env import AirflowSandbox, tail

    data, dags = tmp_path / "data", tmp_path / "dags"
    dags.mkdir()
    (dags / "teams.py").write_text(TEAM_DAGS.format(data=str(data)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "AWS_"))}
    env.update(
        AIRFLOW_HOME=str(tmp_path / "home"),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        **LOADED_MACHINE,
        AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES=str(data),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]),
    )
    box = AirflowSandbox(home=tmp_path / "home", data=data, env=env)
    (tmp_path / "home").mkdir()
    for args in (["db", "migrate"], ["dags", "test", "team_a"], ["dags", "test", "team_b"]):
        p = box.run(*args, timeout=600)
        assert p.returncode == 0, tail(p)
    own = {"get": {"dag_id": "team_a", "run_of": "team_a", "task_id": "job.qa"}}
    b_out = str(data / "team_b" / "run")
    steps = [
        own,
        {"get": {"dag_id": "team_a", "run_of": "team_b", "task_id": "job.qa"}},  # B's run id under A's DAG
        {"get": {"dag_id": "team_a", "run_of": "team_a", "task_id": "job.plan"}},  # not a QA task: no summary
        {"get": {"dag_id": "team_a", "run_of": "team_a", "task_id": "other.qa"}},
        {"get": {"dag_id": "team_a", "run_of": "team_a", "task_id": "job.qa", "map_index": 3}},
        {"get": {"dag_id": "~", "run_of": "team_a", "task_id": "job.qa"}},
        # whoever may edit team A's XComs points A's run at team B's report
        {"forge": {"dag_id": "team_a", "task_id": "job.plan", "key": "spec", "value": {"io": {"output_uri": b_out}}}},
        {
            "forge": {
                "dag_id": "team_a",
                "task_id": "job.qa",
                "key": "return_value",
                "value": {"status": "pass", "report_html": f"{b_out}/qa/report.html"},
            }
        },
        own,
        {"get": {"dag_id": "team_b", "run_of": "team_b", "task_id": "job.qa"}},  # B's own page is B's report
    ]
    p = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(steps)], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("PROBE "))[6:])
    assert got[0] == [200, "<p>report of team_a</p>"], got[0]
    assert got[1][0] == 404 and "no such run" in got[1][1], got[1]
    assert got[2][0] == 404 and got[3][0] == 404 and got[4][0] == 404 and got[5][0] == 404, got[2:6]
    assert got[6][0] == 403 and "not written by task job.plan while it ran" in got[6][1], got[6]
    assert "report of team_b" not in got[6][1]
    assert got[7] == [200, "<p>report of team_b</p>"], got[7]
    record_malicious("report page: real runs, forged XComs and foreign run ids", 6, 6)
