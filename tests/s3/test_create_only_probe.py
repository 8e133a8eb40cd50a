"""Create-only per store: the plan's probe (two create-only writes of one new object; the second
must be refused) on a local folder, on S3 (moto on loopback), on an S3-compatible store that
ignores ``If-None-Match`` (the fault proxy strips it: the store overwrites), and on GCS through
gcsfs against ``gcp-storage-emulator`` on loopback.

What the GCS emulator really does (asserted below, stated in docs/data-plane.md): gcsfs sends
``ifGenerationMatch=0`` with a create-only upload, the emulator ignores the precondition and
overwrites, so the probe refuses it as a store; real GCS answers 412, which gcsfs raises as
``FileExistsError`` and ``Storage.create_only`` turns into False.
"""

from __future__ import annotations

import io
import logging
import os

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.plan.planner import PROBE_DIR, plan_job, probe_create_only
from tests.s3.test_storage_s3 import check_reads_after_a_listing
from tests.support.data import make_spec, write_parquet
from tests.support.ledger import record_fault
from tests.support.s3faults import FaultProxy
from tests.support.s3server import MotoServer, free_port
from tests.unit.core.test_storage import check_bounded_listings, check_capped_reads

# gcsfs >= 2026 first asks the storage-control gRPC API whether a bucket is zonal/hierarchical,
# which the emulator does not serve (a 60 s timeout per bucket); the plain JSON API is what we use.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

IDS = [f"p{i}" for i in range(12)]


def _input(tmp_path):
    return write_parquet(tmp_path / "in.parquet", IDS, [f"ticket {i}" for i in range(len(IDS))])


# ---- local -------------------------------------------------------------------------------------
def test_local_store_passes_the_probe_and_leaves_nothing(tmp_path):
    spec = make_spec(_input(tmp_path), tmp_path / "out")
    plan_job(spec)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [PLAN_FILE]  # probe removed, dir too


def test_a_local_store_that_overwrites_is_refused_before_the_plan_is_written(tmp_path, monkeypatch):
    """A filesystem whose create-only write silently replaces (simulated: create_only always 'creates')."""

    def overwrite(self, rel, data):
        self.write_atomic(rel, data)
        return True

    monkeypatch.setattr(Storage, "create_only", overwrite)
    spec = make_spec(_input(tmp_path), tmp_path / "out")
    with pytest.raises(SpecError) as e:
        plan_job(spec)
    msg = str(e.value)
    assert f"output store {tmp_path / 'out'} does not honour create-only writes" in msg
    assert "succeeded and replaced it" in msg and "If-None-Match" in msg and e.value.terminal
    assert not (tmp_path / "out" / PLAN_FILE).exists()
    assert not list((tmp_path / "out").rglob("*create-only*"))  # the probe object was removed


def test_a_store_that_says_refused_but_replaced_is_refused_too(tmp_path, monkeypatch):
    real = Storage.create_only

    def liar(self, rel, data):
        if rel.startswith(PROBE_DIR) and self.exists(rel):
            self.write_atomic(rel, data)
            return False
        return real(self, rel, data)

    monkeypatch.setattr(Storage, "create_only", liar)
    with pytest.raises(SpecError, match="was reported refused, but the object was replaced"):
        probe_create_only(Storage(str(tmp_path / "out")), "the store")


def test_a_store_without_create_only_is_refused_naming_the_error(tmp_path, monkeypatch):
    def unsupported(self, rel, data):
        raise NotImplementedError("no atomic create-only write for protocol 'xyz'")

    monkeypatch.setattr(Storage, "create_only", unsupported)
    with pytest.raises(SpecError, match=r"output store s3://x/y: a create-only write .* failed \(NotImplementedError"):
        probe_create_only(Storage(str(tmp_path / "out")), "s3://x/y")


def test_the_plan_operator_fails_without_retry_on_an_overwriting_store(tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPlanOperator

    monkeypatch.setattr(Storage, "create_only", lambda self, rel, data: (self.write_atomic(rel, data), True)[1])
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", str(tmp_path))
    doc = make_spec(_input(tmp_path), tmp_path / "out").model_dump(mode="json")
    ti = type("TI", (), {"xcoms": {}, "xcom_push": lambda self, key, value: self.xcoms.update({key: value})})()
    with pytest.raises(AirflowFailException, match="does not honour create-only writes"):
        VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": ti, "params": {}})
    assert ti.xcoms == {}  # no spec pushed: no shard task can start


# ---- S3 (moto) and an S3-compatible store that ignores If-None-Match ---------------------------
@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("data")
        yield server


def _s3_input(s3, opts):
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": IDS, "text": [f"ticket {i}" for i in range(len(IDS))]}), buf)
    Storage("s3://data/in", opts).write_atomic("part-0.parquet", buf.getvalue())


def test_s3_honours_create_only_and_passes_the_probe(s3):
    _s3_input(s3, s3.storage_options)
    spec = make_spec("s3://data/in", "s3://data/runs/ok", io={"storage_options": s3.storage_options})
    assert plan_job(spec).total_rows == len(IDS)
    out = Storage("s3://data/runs/ok", s3.storage_options)
    assert list(out.walk_files()) == [PLAN_FILE]  # the probe object was deleted


@pytest.mark.reliability
def test_an_s3_compatible_store_that_ignores_if_none_match_is_refused(s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with FaultProxy(s3.port, strip_headers={"if-none-match"}) as proxy:
        opts = proxy.storage_options()
        st = Storage("s3://data/ignores", opts)
        # what the store does: both create-only writes 'succeed', the second replaces the first
        assert st.create_only("m.json", b"one") is True and st.create_only("m.json", b"two") is True
        assert st.read_bytes("m.json") == b"two"
        _s3_input(s3, s3.storage_options)
        spec = make_spec("s3://data/in", "s3://data/runs/overwrites", io={"storage_options": opts})
        with pytest.raises(SpecError) as e:
            plan_job(spec)
        assert any(m == "PUT" and "create-only" in p for m, p in proxy.requests)
    msg = str(e.value)
    assert f"output store s3://data/runs/overwrites (endpoint_url {proxy.endpoint}) does not honour" in msg
    assert not Storage("s3://data/runs/overwrites", s3.storage_options).exists(PLAN_FILE)
    record_fault("store_ignores_create_only", rows=0, level="store")


# ---- GCS: gcsfs against gcp-storage-emulator on loopback -------------------------------------
@pytest.fixture(scope="module")
def gcs():
    pytest.importorskip("gcsfs")
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="gbucket")
    server.start()
    try:
        yield {"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon", "project": "test"}
    finally:
        server.stop()


def test_gcsfs_sends_if_generation_match_and_the_emulator_ignores_it(gcs, caplog):
    st = Storage("gs://gbucket/emu", gcs)
    with caplog.at_level(logging.INFO, logger="gcp_storage_emulator.server"):
        assert st.create_only("m.json", b"one") is True
        second = st.create_only("m.json", b"two")
    uploads = [r.getMessage() for r in caplog.records if "/upload/storage/v1/b/gbucket/o" in r.getMessage()]
    assert len(uploads) == 2 and all("ifGenerationMatch=0" in u for u in uploads)  # the precondition is sent
    # ... and the emulator overwrites anyway (real GCS answers 412 -> FileExistsError -> False)
    assert second is True and st.read_bytes("m.json") == b"two"


def test_whole_object_reads_stop_at_the_limit_on_gcs(gcs):
    check_capped_reads(Storage("gs://gbucket/limits", gcs))


def test_listings_stop_at_their_bound_page_by_page_on_gcs(gcs, monkeypatch):
    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage, "LIST_PAGE", 3)  # pages of 3 objects: the listings page through the folder
    check_bounded_listings(Storage("gs://gbucket/bounded", gcs))


def test_whole_object_reads_see_objects_another_process_wrote_after_a_listing_on_gcs(gcs):
    other = fsspec.filesystem("gs", skip_instance_cache=True, **gcs)  # another process's view
    check_reads_after_a_listing(Storage("gs://gbucket/relisted", gcs), other)


@pytest.mark.reliability
def test_the_probe_refuses_the_gcs_emulator_as_a_store(gcs, tmp_path):
    spec = make_spec(_input(tmp_path), "gs://gbucket/runs/r1", io={"storage_options": gcs})
    with pytest.raises(SpecError) as e:
        plan_job(spec)
    msg = str(e.value)
    assert "output store gs://gbucket/runs/r1 (endpoint_url http://127.0.0.1:" in msg
    assert "does not honour create-only writes" in msg and "ifGenerationMatch=0" in msg
    out = Storage("gs://gbucket/runs/r1", gcs)
    assert not out.exists(PLAN_FILE) and list(out.walk_files()) == []  # probe removed, nothing planned
    record_fault("store_ignores_create_only_gcs_emulator", rows=0, level="store")


def test_gcs_reads_and_atomic_writes_work_against_the_emulator(gcs, tmp_path):
    """The rest of the storage layer over gcsfs: a planned input on GCS, read back by range."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": IDS, "text": [f"t {i}" for i in range(len(IDS))]}), buf, row_group_size=4)
    Storage("gs://gbucket/in", gcs).write_atomic("part-0.parquet", buf.getvalue())
    spec = make_spec(
        "gs://gbucket/in", tmp_path / "out", io={"storage_options": gcs}, sharding={"target_rows": 6, "chunk_rows": 3}
    )
    plan = plan_job(spec)  # the output is local: the probe passes; the input is read from GCS
    assert plan.total_rows == len(IDS) and len(plan.shards) == 2
    assert plan.files[0].version  # generation / etag recorded for the unchanged-input check
