"""The QA report page as an attacker would try it: hostile XComs against real servers on loopback.

The plugin's FastAPI app answers through Starlette's TestClient; the XComs it reads are the
attacker's (a forged plan ``spec`` / QA summary, as anyone who can write an XCom or run a task
could leave them). The target of each SSRF attempt is a real HTTP server on 127.0.0.1 that
records every request: each attempt must get a 403 with a reason, and the server must have
seen nothing. The readable case goes to moto's S3 through an Airflow Connection only: no
``AWS_*`` variable in the process, and options planted in the XCom (endpoint, headers) unused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.ledger import record_malicious
from tests.support.loopback import SECRET_BODY, RecordingServer, aws_connection, s3_client
from tests.support.s3server import MotoServer

REPORT = b"<!doctype html><title>QA report</title><p>the run's own report</p>"


@pytest.fixture
def page(monkeypatch):
    """(client, xcoms): the plugin app, logged-in user assumed, XComs from the ``xcoms`` dict."""
    from airflow.api_fastapi.common.db.common import _get_session
    from fastapi.testclient import TestClient

    from airflow_provider_vllm.plugins import report as plugin

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    xcoms: dict[tuple[str, str], object] = {}
    monkeypatch.setattr(
        plugin, "_xcom", lambda session, *, dag_id, run_id, task_id, key, map_index: xcoms.get((task_id, key))
    )
    plugin.app.dependency_overrides[plugin._can_read_task_instances.dependency] = lambda: None
    plugin.app.dependency_overrides[_get_session] = lambda: None
    plugin._fs_cache.clear()  # each test brings its own Connection
    try:
        yield TestClient(plugin.app), xcoms
    finally:
        plugin.app.dependency_overrides.clear()
        plugin._fs_cache.clear()


def plant(xcoms: dict, output_uri: str, report_html: str | None = None, **io) -> None:
    """The attacker's XComs: the plan task's ``spec`` and the QA task's summary of one run."""
    xcoms[("job.plan", "spec")] = {"io": {"input_uri": "s3://data/in", "output_uri": output_uri, **io}}
    xcoms[("job.qa", "return_value")] = {
        "status": "pass",
        "report_html": report_html or f"{output_uri.rstrip('/')}/qa/report.html",
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
        "credentials in the s3 url": ({"output_uri": "s3://AKIA:secret@data/runs/r1"}, "not a valid bucket"),
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
    (run / "qa" / "report.json").write_text('{"status": "pass"}')
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", str(tmp_path / "data"))
    plant(xcoms, f"file://{run}/")
    r = get(client)
    assert r.status_code == 200 and r.content == REPORT
    assert r.headers["content-security-policy"].startswith("default-src 'none'")
    assert get(client, "report.json").json() == {"status": "pass"}
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
