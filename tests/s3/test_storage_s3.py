"""The storage layer and the whole data plane against a local S3-compatible server."""

import hashlib
import io
import threading

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import ListingTooLarge
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import result_parts
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import LABELS, make_spec, merge, shard_task
from tests.support.s3server import MotoServer
from tests.unit.core.test_storage import check_bounded_listings, check_capped_reads, check_listed_sizes


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("data")
        yield server


def test_create_only_is_atomic_on_s3(s3):
    st = Storage("s3://data/markers", s3.storage_options)
    results = []
    barrier = threading.Barrier(8)

    def go(i):
        barrier.wait()
        results.append((i, st.create_only("m.json", f"writer {i}".encode())))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    winners = [i for i, ok in results if ok]
    assert len(winners) == 1
    assert st.read_text("m.json") == f"writer {winners[0]}"
    assert st.create_only("m.json", b"late") is False
    assert st.read_text("m.json") == f"writer {winners[0]}"


def test_whole_object_reads_stop_at_the_limit_on_s3(s3):
    check_capped_reads(Storage("s3://data/limits", s3.storage_options))


def check_reads_after_a_listing(st: Storage, other: fsspec.AbstractFileSystem) -> None:
    """The store's client answers the size (and s3fs the ETag) an open asks for from a listing it holds: a record
    written, or replaced, by another process (``other``) since this one listed its folder read as missing, or failed
    s3fs's ``IfMatch`` on every retry (a TransientError naming nothing wrong). The checked readers see the objects
    as they are now."""
    st.write_atomic("a.json", b"one")
    st.write_atomic("c.json", b"three")
    assert st.listdir() == ["a.json", "c.json"]
    other.pipe_file(st.path("a.json"), b"one, replaced")
    other.pipe_file(st.path("b.json"), b"two")
    other.pipe_file(st.path("c.json"), b"three, replaced")
    assert st.read_bytes("a.json") == b"one, replaced"
    assert st.read_bytes("b.json") == b"two"
    assert st.sha256("c.json") == hashlib.sha256(b"three, replaced").hexdigest()


def test_whole_object_reads_see_objects_another_process_wrote_after_a_listing(s3):
    other = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options)  # another process's view
    check_reads_after_a_listing(Storage("s3://data/relisted", s3.storage_options), other)


def test_pipeline_on_s3(s3, fake_engine_factory, monkeypatch):
    """The endpoint and keys come from the deployment (environment), the spec names only s3:// locations."""
    from airflow_provider_vllm.core.spec_guard import check_deployment

    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    buf = io.BytesIO()
    n = 120
    texts = [f"ticket {i}" for i in range(n)]
    texts[7] = ""
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(n)], "text": texts}), buf, row_group_size=30)
    Storage("s3://data/in", s3.storage_options).write_atomic("part-0.parquet", buf.getvalue())
    spec = make_spec("s3://data/in", "s3://data/runs/r1", sharding={"target_rows": 50, "chunk_rows": 20})
    check_deployment(spec, ["s3://data"])  # what plan, shard and the worker check
    plan = plan_job(spec)
    assert len(plan.shards) == 3
    for s in plan.shards:
        assert (
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)["status"]
            == "committed"
        )
    summary = merge(spec).dump()
    assert summary["ok_rows"] == n - 1 and summary["error_rows"] == 1
    out = Storage("s3://data/runs/r1", s3.storage_options)
    res = pa.concat_tables([pq.read_table(out.open(rel)) for rel in result_parts(out)])
    assert res.num_rows == n - 1 and set(res.column("label").to_pylist()) <= set(LABELS)
    # a re-run of a shard is a no-op on S3 too
    again = run_shard(shard_task(spec=spec, shard_id=plan.shards[0].shard_id), engine_factory=fake_engine_factory)
    assert again["status"] == "already_committed"


def test_a_test_server_whose_port_another_server_took_moves_to_a_port_of_its_own(s3):
    """xdist: the port free_port() gave may be taken by another test's server before moto binds it; the other server
    then answered for this one, which stopped answering when that test stopped its server."""
    clash = MotoServer()
    clash.port, clash.endpoint = s3.port, s3.endpoint  # as if free_port() had given s3's port again
    with clash:
        assert clash.port != s3.port and clash.proc.poll() is None
        clash.make_bucket("own")
        assert Storage("s3://own", clash.storage_options).listdir() == []
        assert "own" not in Storage("s3://data", s3.storage_options).fs.ls("")


def test_listed_sizes_on_s3(s3):
    check_listed_sizes(Storage("s3://data/listed", s3.storage_options))


def test_listings_stop_at_their_bound_page_by_page_on_s3(s3, monkeypatch):
    """Pages of 3 keys: the listings page through the folder, and one over its bound asks for no page past it."""
    import s3fs

    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage, "LIST_PAGE", 3)
    st = Storage("s3://data/bounded", s3.storage_options)
    check_bounded_listings(st)
    for i in range(30):
        st.write_atomic(f"flood/p{i:02d}", b"")
    pages = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *a, **kw):
        if method == "list_objects_v2":
            pages.append(kw.get("MaxKeys"))
        return await real(self, method, *a, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    with pytest.raises(ListingTooLarge, match="s3://data/bounded/flood holds more than 4 entries"):
        st.listdir("flood", limit=4)
    assert pages == [3, 2]  # 5 keys asked for in all, not the 30
