"""What another writer of the bucket can do, on an S3-compatible server (moto): forged chunks and markers
before merge, a part swapped for one of the same size, future-dated cache entries. Each ends with no
forged answer published, cached or served."""

from __future__ import annotations

import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.engine_identity import local_engine_identity
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.records import CacheCommit
from airflow_provider_vllm.core.seal import CACHE_ENTRY, Keyring, record_bytes, seal_record
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.cache.store import CacheStore
from airflow_provider_vllm.steps.merge.merger import (
    RESULTS,
    read_manifest,
    read_merged,
    result_parts,
    verified_parts,
)
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import PINNED_REVISION, make_spec, merge, shard_task, vouch_cache
from tests.support.ledger import record_fault
from tests.support.s3server import MotoServer

pytestmark = pytest.mark.reliability
N = 30
ENGINE = local_engine_identity()


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("data")
        yield server


@pytest.fixture
def env(s3, monkeypatch):
    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    return s3


def put_input(s3, name: str) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(N)], "text": [f"ticket {i}" for i in range(N)]}), buf)
    Storage("s3://data/in", s3.storage_options).write_atomic(f"{name}/p.parquet", buf.getvalue())


def spec(s3, name: str, cached: bool = True, cache_uri: str = "s3://data/cache"):
    put_input(s3, name)
    return make_spec(
        f"s3://data/in/{name}",
        f"s3://data/runs/{name}",
        model={"name": "fake", "revision": PINNED_REVISION},
        io={"storage_options": s3.storage_options},
        **({"cache": {"uri": cache_uri}} if cached else {}),
        sharding={"target_rows": 15, "chunk_rows": 8},
    )


def run_shards(sp, factory):
    plan = plan_job(sp, engine_identity=ENGINE)
    for s in plan.shards:
        run_shard(shard_task(spec=sp, shard_id=s.shard_id), engine_factory=factory)
    return plan


def labels(out: Storage) -> set:
    got = set()
    for rel in result_parts(out):
        with out.open(rel) as f:
            got |= set(pq.read_table(f, columns=["label"]).column(0).to_pylist())
    return got


def forge(out: Storage) -> int:
    """Rewrite every committed chunk with forged labels and update the markers' sizes and sha256 (no key)."""
    n = 0
    for shard in out.listdir("shards"):
        rel = f"shards/{shard}/_COMMITTED.json"
        doc = json.loads(out.read_bytes(rel))
        for f in doc["files"]:
            with out.open(f["path"]) as fh:
                t = pq.read_table(fh)
            t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(["forged"] * t.num_rows))
            buf = io.BytesIO()
            pq.write_table(t, buf)
            out.write_atomic(f["path"], buf.getvalue())
            f["bytes"], f["sha256"] = len(buf.getvalue()), hashlib.sha256(buf.getvalue()).hexdigest()
            n += t.num_rows
        out.write_atomic(rel, json.dumps(doc).encode())
    return n


def test_forged_chunks_and_markers_on_s3_reach_nothing(env, fake_engine_factory):
    sa = spec(env, "forged-a")
    run_shards(sa, fake_engine_factory)
    n = forge(Storage(sa.io.output_uri, env.storage_options))
    with pytest.raises(CommitError, match="seal does not match"):
        merge(sa)
    out = Storage(sa.io.output_uri, env.storage_options)
    assert not out.exists("_MERGED.json") and not out.exists(f"{RESULTS}/_manifest.json")
    sb = spec(env, "forged-b")
    fake_engine_factory.made.clear()
    pb = run_shards(sb, fake_engine_factory)
    merge(sb)
    assert pb.cache.hits == 0 and "forged" not in labels(Storage(sb.io.output_uri, env.storage_options))
    record_fault("laundering_forged_chunks_and_markers.s3", n, lost=0, duplicates=0, level="in_process")


def test_a_same_size_swap_of_a_published_part_on_s3_is_caught(env, fake_engine_factory):
    """Before: a part of the right size at a published name was kept without reading it. Now merge keeps an
    existing part only with the sealed sha256, and publish (or a consumer) checks every part's bytes."""
    sp = spec(env, "swap", cached=False)
    run_shards(sp, fake_engine_factory)
    out = Storage(sp.io.output_uri, env.storage_options)
    summary = merge(sp)
    part = read_manifest(out, RESULTS).parts[0]
    raw = bytearray(out.read_bytes(f"{RESULTS}/{part.name}"))
    raw[100] ^= 1
    out.write_atomic(f"{RESULTS}/{part.name}", bytes(raw))  # same size, other bytes
    again = merge(sp)  # a merge rerun (a retry) puts the genuine part back
    assert again.checksums == summary.checksums
    assert hashlib.sha256(out.read_bytes(f"{RESULTS}/{part.name}")).hexdigest() == part.sha256
    out.write_atomic(f"{RESULTS}/{part.name}", bytes(raw))  # and after the merge: the consumer's check names it
    with pytest.raises(CommitError, match=part.name):
        verified_parts(out, RESULTS, read_merged(out, Keyring.from_env()))
    record_fault("same_size_swap.s3", part.rows, lost=0, duplicates=0, level="in_process")


def test_a_future_dated_entry_on_s3_never_wins(env, fake_engine_factory):
    sa = spec(env, "dated-a", cache_uri="s3://data/dated-cache")
    pa_ = run_shards(sa, fake_engine_factory)
    merged = merge(sa)
    vouch_cache(sa)  # published: its entry serves
    genuine = labels(Storage(sa.io.output_uri, env.storage_options))
    st = Storage("s3://data/dated-cache", env.storage_options)
    assert merged.cache is not None
    eid = merged.cache.entry_id
    folder = CacheStore.commit_dir(pa_.cache.key_hash)
    doc = json.loads(st.read_bytes(f"{folder}/{eid}.json"))
    with st.open(doc["files"][0]["path"]) as f:
        t = pq.read_table(f)
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(["forged"] * t.num_rows))
    t = t.set_column(t.schema.get_field_index("computed_at"), "computed_at", pa.array(["2999-01-01"] * t.num_rows))
    buf = io.BytesIO()
    pq.write_table(t, buf)
    fake = "f" * 32
    st.write_atomic(f"entries/{fake}/part-00000.parquet", buf.getvalue())
    doc.pop("seal")
    doc.update(
        entry_id=fake,
        created="2999-01-01T00:00:00+00:00",
        files=[
            {
                "path": f"entries/{fake}/part-00000.parquet",
                "rows": t.num_rows,
                "bytes": len(buf.getvalue()),
                "sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
            }
        ],
    )
    st.write_atomic(f"{folder}/{fake}.json", json.dumps(doc).encode())  # unsealed
    other_key = seal_record(Keyring.from_text("x" * 48), CACHE_ENTRY, "s3://data/dated-cache", CacheCommit(**doc))
    st.write_atomic(f"{folder}/{'e' * 32}.json", record_bytes(other_key.model_copy(update={"entry_id": "e" * 32})))
    sb = spec(env, "dated-b", cache_uri="s3://data/dated-cache")
    pb = run_shards(sb, fake_engine_factory)
    merge(sb)
    assert pb.cache.hits == N and pb.cache.commits_read == [eid]
    assert labels(Storage(sb.io.output_uri, env.storage_options)) == genuine
    record_fault("forged_cache_entry_future_dated.s3", N, lost=0, duplicates=0, level="in_process")
