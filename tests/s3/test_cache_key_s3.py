"""The result cache's typed key on a local S3-compatible server (moto).

A column whose type changes between runs (float32, then the same values re-exported as double)
gets no hit, and the worker (strict fake engine) renders other prompts for it; the same type
again hits every row. A hub model at a moving revision is refused before the plan writes
anything to S3.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.engine_identity import local_engine_identity
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import PINNED_REVISION, make_spec, merge, shard_task, vouch_cache
from tests.support.s3server import MotoServer
from tests.unit.steps.cache.test_key import recording

pytestmark = pytest.mark.s3
IDS = [f"s{i}" for i in range(12)]
TEXTS = [f"ticket {i % 4}" for i in range(12)]
SCORES = [0.1 * (i % 3) + 0.1 for i in range(12)]


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("data")
        yield server


def put_input(s3, name: str, score_type: pa.DataType) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": IDS, "text": TEXTS, "score": pa.array(SCORES, score_type)}), buf, row_group_size=5)
    Storage("s3://data/in", s3.storage_options).write_atomic(f"{name}/part-0.parquet", buf.getvalue())


def spec(s3, name: str, revision: str = PINNED_REVISION):
    return make_spec(
        f"s3://data/in/{name}",
        f"s3://data/runs/{name}",
        model={"name": "fake", "revision": revision},
        io={"storage_options": s3.storage_options},
        prompt={"template": "Ticket: {text} (score {score})", "text_columns": ["text"]},
        cache={"uri": "s3://data/typed-cache"},
        sharding={"target_rows": 5, "chunk_rows": 4},
    )


def run(sp, factory):
    factory.prompts.clear()
    plan = plan_job(sp, engine_identity=local_engine_identity())
    for s in plan.shards:
        assert run_shard(shard_task(spec=sp, shard_id=s.shard_id), engine_factory=factory)["status"] == "committed"
    merged = merge(sp)
    vouch_cache(sp)  # publish's step for the cache: the entry serves later runs
    return plan, merged, sorted(factory.prompts)


def test_a_column_type_change_between_runs_on_s3(s3, fake_engine_factory, monkeypatch):
    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    factory = recording(fake_engine_factory)
    put_input(s3, "float", pa.float32())
    p1, m1, seen1 = run(spec(s3, "float"), factory)
    assert p1.cache.hits == 0 and m1.cache is not None and m1.cache.appended == 12 and len(seen1) == 12

    put_input(s3, "double", pa.float64())  # the same values, re-exported as double
    p2, m2, seen2 = run(spec(s3, "double"), factory)
    assert p2.cache.hits == 0 and p2.cache.misses == 12 and m2.ok_rows == 12
    assert not set(seen1) & set(seen2)  # every prompt differs
    assert any("(score 0.10000000149011612)" in p for p in seen1) and any("(score 0.1)" in p for p in seen2)

    put_input(s3, "float-again", pa.float32())
    p3, m3, seen3 = run(spec(s3, "float-again"), factory)
    assert p3.cache.hits == 12 and seen3 == [] and m3.ok_rows == 12


@pytest.mark.parametrize("revision", ["main", "v1.0", "abc123", "x" * 40, "a" * 64])
def test_a_moving_revision_is_refused_before_anything_is_written_on_s3(s3, monkeypatch, revision):
    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    name = "moving-" + revision[:8].replace(".", "-")
    put_input(s3, name, pa.float32())
    with pytest.raises(SpecError, match="model.revision"):
        plan_job(spec(s3, name, revision), engine_identity=local_engine_identity())
    out = Storage(f"s3://data/runs/{name}", s3.storage_options)
    assert not out.exists(PLAN_FILE) and out.listdir("_cache") == []
