"""Object-store faults against the local S3 server, through a fault-injecting proxy.

The real storage layer (s3fs + botocore + storage_retry) and the real plan -> worker (fake
engine) -> merge path, with throttling, 5xx, dropped connections, stalls past the client's
read timeout and truncated uploads injected on chosen requests. Each run ends with a
reconciliation: input ids == result ids + error ids, none twice, every committed file opens
and matches its marker, and no object under the output prefix is a partial file.
"""

from __future__ import annotations

import collections
import io

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.core.errors import TransientError
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.core.storage_retry import ATTEMPTS_ENV, is_transient
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS, result_parts
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task
from tests.support.ledger import record_fault
from tests.support.s3faults import FaultProxy
from tests.support.s3server import MotoServer

pytestmark = pytest.mark.reliability
N_ROWS = 120


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("data")
        yield server


@pytest.fixture
def proxy(s3, monkeypatch):
    # credentials reach s3fs from the environment, as in a deployment (never via the spec)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with FaultProxy(s3.port) as p:
        yield p


def direct(s3):
    """A boto3 client straight to the server (no proxy): what any reader would see."""
    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def keys(s3, prefix: str) -> list[str]:
    pages = direct(s3).get_paginator("list_objects_v2").paginate(Bucket="data", Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


# ---- the retry layer on its own ------------------------------------------------------
def test_transient_errors_are_retried_by_our_layer(proxy, s3):
    # botocore's own retries off: only storage_retry stands between the fault and the caller
    st = Storage("s3://data/unit/retry", proxy.storage_options(max_attempts=1))
    proxy.add("internal", method="PUT", path=r"/unit/retry/obj", count=3)
    st.write_atomic("obj", b"x" * 1000)
    assert [f[0] for f in proxy.fired] == ["internal"] * 3
    assert direct(s3).get_object(Bucket="data", Key="unit/retry/obj")["Body"].read() == b"x" * 1000
    proxy.add("internal", method="GET", path=r"/unit/retry/obj", count=2)
    assert st.read_bytes("obj") == b"x" * 1000
    record_fault("s3_internal_unit", rows=0, faults=len(proxy.fired), level="store")


def test_permanent_errors_are_not_retried(proxy):
    st = Storage("s3://data/unit/perm", proxy.storage_options(max_attempts=1))
    with pytest.raises(FileNotFoundError):
        st.read_bytes("missing")
    gets = [r for r in proxy.requests if r[0] == "GET" and "missing" in r[1]]
    assert len(gets) == 1  # a 404 is an answer, not a hiccup
    assert st.create_only("m", b"first") is True
    assert st.create_only("m", b"second") is False  # 412: another writer won; never retried as a fault
    assert st.read_bytes("m") == b"first"


def test_exhausted_retries_raise_transient_and_leave_nothing(proxy, s3, monkeypatch):
    monkeypatch.setenv(ATTEMPTS_ENV, "3")
    st = Storage("s3://data/unit/exhaust", proxy.storage_options(max_attempts=1))
    proxy.add("internal", method="PUT", path=r"/unit/exhaust/", count=1000)
    with pytest.raises(TransientError, match="failed after"):
        st.write_atomic("obj", b"y" * 100)
    assert keys(s3, "unit/exhaust/") == []


@pytest.mark.parametrize("kind", ["truncate", "drop"])
def test_failed_upload_never_leaves_a_partial_object(proxy, s3, kind, monkeypatch):
    """Every attempt cut off: the write fails as transient and no object (whole or part) is visible."""
    monkeypatch.setenv(ATTEMPTS_ENV, "2")
    st = Storage(f"s3://data/unit/{kind}", proxy.storage_options(read_timeout=1, max_attempts=2))
    proxy.add(kind, method="PUT", path=rf"/unit/{kind}/obj", count=1000)
    with pytest.raises(TransientError):
        st.write_atomic("obj", bytes(range(256)) * 4096)  # 1 MiB
    assert keys(s3, f"unit/{kind}/") == []
    record_fault(f"s3_{kind}_exhausted", rows=0, faults=len(proxy.fired), partial_visible=0, level="store")


def test_is_transient_sorts_botocore_and_s3fs_errors():
    import errno

    from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

    def client_error(code, status):
        return ClientError(
            {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

    def translated(code, status, err):
        e = OSError(err, code)
        e.__cause__ = client_error(code, status)
        return e

    assert is_transient(translated("SlowDown", 503, errno.EBUSY))
    assert is_transient(translated("InternalError", 500, errno.EIO))
    assert is_transient(client_error("RequestTimeout", 400))
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(ConnectionClosedError(endpoint_url="http://x"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError("k"))
    assert not is_transient(PermissionError("denied"))
    assert not is_transient(FileExistsError("k"))
    assert not is_transient(translated("PreconditionFailed", 412, errno.EINVAL))
    assert not is_transient(translated("InvalidRequest", 400, errno.EINVAL))
    assert not is_transient(ValueError("bug"))


# ---- the whole data plane ------------------------------------------------------------
FAULT_PLAN = [  # (method, path regex, nth, count): every step of the commit protocol is hit
    ("GET", r"/data/in-", 1, 2),  # input reads (plan footers, worker ranges)
    ("PUT", r"/attempts/.*chunk-", 1, 2),  # chunk uploads
    ("PUT", r"/" + MARKER, 0, 1),  # the create-only commit marker
    ("PUT", r"/_plan\.json", 0, 1),  # the create-only plan
    ("PUT", r"/results/", 0, 1),  # merged parts (server-side copies) and the manifest
    ("GET", r"/attempts/.*chunk-", 0, 1),  # merge reading chunks
]


@pytest.mark.parametrize("kind", ["slowdown", "internal", "drop", "stall", "truncate"])
def test_pipeline_survives_faults(proxy, s3, fake_engine_factory, kind):
    run = f"pipe-{kind}"
    texts = [f"ticket {i} ü 🙂" for i in range(N_ROWS)]
    texts[5] = ""
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(N_ROWS)], "text": texts}), buf, row_group_size=30)
    direct(s3).put_object(Bucket="data", Key=f"in-{run}/part-0.parquet", Body=buf.getvalue())
    for method, path, nth, count in FAULT_PLAN:
        if kind == "truncate" and method != "PUT":
            continue  # a request body to cut exists only on uploads
        proxy.add(
            kind, method=method, path=path.replace("/data/in-", f"/data/in-{run}/"), nth=nth, count=count, stall_s=2.5
        )
    opts = proxy.storage_options(read_timeout=2)
    spec = make_spec(
        f"s3://data/in-{run}",
        f"s3://data/runs/{run}",
        io={"storage_options": opts},
        sharding={"target_rows": 50, "chunk_rows": 20},
    )
    plan = plan_job(spec)
    assert len(plan.shards) == 3
    statuses = [
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)["status"]
        for s in plan.shards
    ]
    summary = merge(spec).dump()
    fired = len(proxy.fired)
    proxy.clear()

    lost, dups, partial = reconcile(s3, spec, plan, N_ROWS)
    record_fault(
        f"s3_{kind}", rows=N_ROWS, faults=fired, lost=lost, duplicates=dups, partial_visible=partial, level="store"
    )
    assert fired >= 5, proxy.fired
    assert set(statuses) <= {"committed", "already_committed"}
    assert summary["ok_rows"] == N_ROWS - 1 and summary["error_rows"] == 1
    assert (lost, dups, partial) == (0, 0, 0)


def reconcile(s3, spec, plan, n_rows: int) -> tuple[int, int, int]:
    """(lost ids, duplicate ids, partial/unreadable files) of a merged run, read around the proxy.

    Duplicates are counted in the merged files and, before merge's dedupe, across the chunks
    the commit markers name."""
    out = Storage(
        spec.io.output_uri,
        {
            "endpoint_url": s3.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        },
    )
    ids = []
    for rel in result_parts(out, RESULTS) + result_parts(out, ERRORS):
        with out.open(rel) as f:
            ids += pq.read_table(f, columns=["id"]).column("id").to_pylist()
    want = {f"r{i}" for i in range(n_rows)}
    lost = len(want - set(ids))
    dup_ids = {i for i, n in collections.Counter(ids).items() if n > 1}
    partial = 0
    committed: list[str] = []
    prefix = spec.io.output_uri.split("://", 1)[1].split("/", 1)[1] + "/"
    for key in keys(s3, prefix):
        if key.endswith(".parquet"):
            body = direct(s3).get_object(Bucket="data", Key=key)["Body"].read()
            try:
                pq.read_table(io.BytesIO(body))
            except Exception:  # noqa: BLE001 - any unreadable file counts
                partial += 1
    for shard in plan.shards:
        marker = out.read_bytes(f"shards/{shard.shard_id}/{MARKER}")
        import json

        for f in json.loads(marker)["files"]:
            for part in (f, f["errors"]):
                if out.sha256(part["path"]) != part["sha256"]:
                    partial += 1
                with out.open(part["path"]) as fh:
                    committed += pq.read_table(fh, columns=["id"]).column("id").to_pylist()
    dup_ids |= {i for i, n in collections.Counter(committed).items() if n > 1}
    return lost, len(dup_ids), partial
