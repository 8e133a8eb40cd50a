"""The result cache's commit rules on a local S3-compatible server (moto).

An entry's part without its commit marker is never read; the marker is create-only (a merge
rerun finds it and appends nothing); the shards read the misses file from S3 and the merged
results hold the hits with ``cached_from``.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.engine_identity import local_engine_identity
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.cache.store import CacheStore
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import PINNED_REVISION, cache_entry_id, make_spec, merge, shard_task, vouch_cache
from tests.support.ledger import record_fault
from tests.support.s3server import MotoServer

pytestmark = pytest.mark.reliability
ENGINE = local_engine_identity()  # what the in-process workers seal
N = 40


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("data")
        yield server


def put_input(s3, name: str, ids, texts, files: int = 1) -> str:
    step = -(-len(ids) // files)
    for k in range(files):
        buf = io.BytesIO()
        pq.write_table(
            pa.table({"id": ids[k * step : (k + 1) * step], "text": texts[k * step : (k + 1) * step]}),
            buf,
            row_group_size=16,
        )
        Storage("s3://data/in", s3.storage_options).write_atomic(f"{name}/part-{k}.parquet", buf.getvalue())
    return f"s3://data/in/{name}"


def spec(s3, name: str):
    return make_spec(
        f"s3://data/in/{name}",
        f"s3://data/runs/{name}",
        model={"name": "fake", "revision": PINNED_REVISION},
        io={"storage_options": s3.storage_options},
        cache={"uri": "s3://data/cache"},
        sharding={"target_rows": 20, "chunk_rows": 10},
    )


def shards(sp, factory):
    plan = plan_job(sp, engine_identity=ENGINE)
    for s in plan.shards:
        assert run_shard(shard_task(spec=sp, shard_id=s.shard_id), engine_factory=factory)["status"] == "committed"
    return plan


def test_cache_commit_rules_on_s3(s3, fake_engine_factory, set_faults, monkeypatch):
    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    ids, texts = [f"s{i}" for i in range(N)], [f"ticket {i}" for i in range(N)]
    put_input(s3, "a", ids, texts)
    sa = spec(s3, "a")
    plan_a = shards(sa, fake_engine_factory)
    set_faults("cache.entry_data=raise")  # the part is on S3, its marker is not
    with pytest.raises(faults.InjectedFault):
        merge(sa)
    set_faults("")
    st = Storage("s3://data/cache", s3.storage_options)
    eid = cache_entry_id(sa, plan_a)
    commit = f"{CacheStore.commit_dir(plan_a.cache.key_hash)}/{eid}.json"
    assert st.exists(f"entries/{eid}/part-00000.parquet") and not st.exists(commit)
    put_input(s3, "b", ids, texts)
    assert plan_job(spec(s3, "b"), engine_identity=ENGINE).cache.hits == 0  # uncommitted: invisible

    first = merge(sa).cache
    with st.open(f"entries/{eid}/part-00000.parquet") as f:
        got = pq.read_table(f, columns=["source_id"]).column(0).to_pylist()
    record_fault("raise.cache.entry_data.s3", N, lost=len(set(ids) - set(got)), duplicates=len(got) - len(set(got)))
    assert first is not None and (first.appended, first.committed_by) == (N, "this_merge")
    assert sorted(got) == sorted(ids)
    again = merge(sa).cache
    assert again is not None and again.committed_by == "earlier_merge"
    assert st.listdir(CacheStore.commit_dir(plan_a.cache.key_hash)) == [f"{eid}.json"]
    put_input(s3, "b2", ids, texts)
    assert plan_job(spec(s3, "b2"), engine_identity=ENGINE).cache.hits == 0  # committed, not published: invisible
    assert vouch_cache(sa) == eid  # publish's step: the entry serves from now on
    assert st.listdir(CacheStore.vouch_dir(plan_a.cache.key_hash)) == [f"{eid}.json"]

    # in reverse order over two files: the hits and misses files keep the input's order
    put_input(s3, "c", (ids + ["new"])[::-1], (texts[:-1] + ["edited", "brand new"])[::-1], files=2)
    sc = spec(s3, "c")
    fake_engine_factory.made.clear()
    plan_c = shards(sc, fake_engine_factory)
    assert (plan_c.cache.hits, plan_c.cache.misses) == (N - 1, 2)
    assert sum(e.submitted for e in fake_engine_factory.made) == 2
    out_c = Storage("s3://data/runs/c", s3.storage_options)
    with out_c.open(plan_c.cache.hits_file.path) as f:
        assert pq.read_table(f).column("id").to_pylist() == ids[:-1][::-1]
    shard_inputs = []  # each shard's own input file: its miss rows, in input order
    for s in plan_c.shards:
        with out_c.open(s.input_file.path) as f:
            shard_inputs += pq.read_table(f).column("id").to_pylist()
    assert shard_inputs == ["new", ids[-1]]
    summary = merge(sc)
    assert summary.ok_rows == N + 1 and summary.cache is not None and summary.cache.appended == 2
    from airflow_provider_vllm.steps.merge.merger import result_parts

    res = []
    for rel in result_parts(out_c):
        with out_c.open(rel) as f:
            res += pq.read_table(f).to_pylist()
    assert sorted(r["id"] for r in res) == sorted(ids + ["new"])
    assert sum(r["cached_from"] == "s3://data/runs/a" for r in res) == N - 1
