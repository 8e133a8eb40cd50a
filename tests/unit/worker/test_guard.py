"""Engine faults through run_shard with the fake engine (fast): OOM back-off, OOM at the floor,
engine death, the rebuild cap, pooling. The same paths on real vLLM: test_reliability_worker.py."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.core.errors import EngineError, SpecError
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task, write_parquet
from tests.support.reconcile import check

pytestmark = pytest.mark.reliability

IDS = [f"r{i:04d}" for i in range(120)]


def job(tmp_path, task="chat", **worker):
    write_parquet(tmp_path / "in.parquet", IDS, [f"ticket {i} about my invoice" for i in range(len(IDS))])
    over = {
        "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 1024},
        "worker": {"oom_min_num_seqs": 2, "oom_min_batched_tokens": 128, **worker},
        "sharding": {"target_rows": 1000, "chunk_rows": 20},
    }
    if task == "embed":
        over.update(task="embed", prompt={"system_prompt": None, "template": "{text}"}, sampling={"structured": None})
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", **over)
    (shard,) = plan_job(spec).shards
    return spec, shard


def test_transient_oom_backs_off_rebuilds_and_finishes_every_row(tmp_path, fake_engine_factory, set_faults):
    spec, shard = job(tmp_path)
    set_faults("engine.step#3=oom")
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert m["status"] == "committed" and m["ok_rows"] == 120 and m["error_rows"] == 0
    s = m["stats"]
    assert s["oom_events"] == 1 and s["engine_rebuilds"] == 1 and s["oom_error_rows"] == 0
    assert s["engine_limits"] == {"max_num_seqs": 8, "max_num_batched_tokens": 512}
    first, second = fake_engine_factory.made
    assert first.closed and second.spec.engine.max_num_seqs == 8
    assert second.spec.output_hash() != spec.output_hash()  # the rebuild's engine args ...
    merge(spec)
    res = pq.read_table(tmp_path / "out" / "results").to_pylist()
    assert {r["config_hash"] for r in res} == {spec.output_hash()}  # ... do not change the run's config hash
    check(tmp_path / "out", IDS, kind="oom_transient")


def test_oom_that_persists_at_the_floor_makes_one_error_row(tmp_path, fake_engine_factory, set_faults):
    spec, shard = job(tmp_path)
    set_faults("engine.step@r0050=oom")  # whenever r0050 runs, memory runs out
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    s = m["stats"]
    assert m["error_rows"] == 1 and m["ok_rows"] == 119
    # 16 -> 8 -> 4 -> 2 (the floor), then the 2 in flight run alone: r0050 fails alone
    assert s["engine_rebuilds"] == 3 and s["oom_events"] == 5 and s["oom_error_rows"] == 1
    assert s["engine_limits"] == {"max_num_seqs": 2, "max_num_batched_tokens": 128}
    merge(spec)
    rec = check(tmp_path / "out", IDS, kind="oom_persistent_row", faults=s["oom_events"])
    assert rec.error_codes == {"r0050": "ENGINE_OOM"}
    err = pq.read_table(tmp_path / "out" / "errors").to_pylist()
    assert "alone in the engine" in err[0]["error_message"] and "max_num_seqs=2" in err[0]["error_message"]


def test_rebuilds_are_capped_then_the_worker_fails_transiently(tmp_path, fake_engine_factory, set_faults):
    spec, shard = job(tmp_path, oom_max_rebuilds=1)
    set_faults("engine.step#1+=oom")  # every step
    with pytest.raises(EngineError, match="after 1 engine rebuild") as e:
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert not e.value.terminal and e.value.exit_code == 75
    assert not (tmp_path / "out" / "shards" / shard.shard_id / MARKER).exists()


def test_the_retry_after_the_rebuild_cap_starts_at_the_lowered_limits(tmp_path, fake_engine_factory, set_faults):
    """16 -> 8 (rebuild 1), OOM again -> the cap: the retry starts at 4/256, not at the spec's 16."""
    spec, shard = job(tmp_path, oom_max_rebuilds=1)
    set_faults("engine.step#3=oom,engine.step#5=oom")
    with pytest.raises(EngineError, match="after 1 engine rebuild"):
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    hint = tmp_path / "out" / "shards" / shard.shard_id / "_ENGINE_LIMITS.json"
    assert json.loads(hint.read_text())["max_num_seqs"] == 4
    set_faults("")
    fake_engine_factory.made.clear()
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    (retry,) = fake_engine_factory.made
    assert retry.spec.engine.max_num_seqs == 4 and retry.spec.engine.max_num_batched_tokens == 256
    assert m["status"] == "committed" and m["stats"]["engine_limits"]["max_num_seqs"] == 4
    merge(spec)
    check(tmp_path / "out", IDS, kind="oom_limits_carried")


def test_a_carried_hint_only_lowers_and_a_broken_one_is_ignored(tmp_path):
    from airflow_provider_vllm.core.commit import ShardStore
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.worker.shard import start_limits
    from tests.unit.steps.merge.test_merger import run_seal

    spec, shard = job(tmp_path)
    store = ShardStore(Storage(str(tmp_path / "out")), shard.shard_id, run_seal(tmp_path / "out"))
    assert store.engine_limits() is None and start_limits(spec, None) is spec
    store.save_engine_limits({"max_num_seqs": 64, "max_num_batched_tokens": 512}, "a1")
    lowered = start_limits(spec, store.engine_limits())
    assert (lowered.engine.max_num_seqs, lowered.engine.max_num_batched_tokens) == (16, 512)
    unset = spec.model_copy(update={"engine": spec.engine.model_copy(update={"max_num_seqs": None})})
    assert start_limits(unset, store.engine_limits()).engine.max_num_seqs == 64
    (tmp_path / "out" / "shards" / shard.shard_id / "_ENGINE_LIMITS.json").write_text('{"max_num_seqs": "x"')
    assert store.engine_limits() is None


@pytest.mark.parametrize(
    "planted",
    ["nested too deep", "not an integer", "a folder", "too large"],
)
def test_a_planted_engine_limits_hint_never_fails_the_shard(tmp_path, fake_engine_factory, planted):
    """``_ENGINE_LIMITS.json`` is a hint in a file any writer of the bucket can replace: whatever it holds, the
    worker starts at the spec's limits and commits every row (before, JSON nested too deep and a number too
    large for an integer failed every retry with exit 75, and a folder there failed the shard terminally)."""
    spec, shard = job(tmp_path)
    hint = tmp_path / "out" / "shards" / shard.shard_id / "_ENGINE_LIMITS.json"
    hint.parent.mkdir(parents=True)
    if planted == "nested too deep":
        hint.write_text("[" * 100_000 + "]" * 100_000)
    elif planted == "not an integer":
        hint.write_text('{"max_num_seqs": 1e400, "max_num_batched_tokens": 256}')
    elif planted == "a folder":
        hint.mkdir()
    else:
        hint.write_bytes(b'{"max_num_seqs": 4, "max_num_batched_tokens": 256, "pad": "' + b"x" * (1 << 17) + b'"}')
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    (engine,) = fake_engine_factory.made
    assert m["status"] == "committed" and engine.spec.engine.max_num_seqs == 16
    summary = merge(spec)
    assert summary.rows == summary.ok_rows + summary.error_rows == len(IDS)


def test_engine_death_keeps_committed_chunks_and_the_retry_completes(tmp_path, fake_engine_factory, set_faults):
    spec, shard = job(tmp_path)
    set_faults("engine.step#12=dead")
    with pytest.raises(EngineError, match="the engine died") as e:
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert e.value.exit_code == 75
    # a GPU OOM inside vLLM's engine core arrives as a death: the retry starts at half the batch
    assert "the retry starts at max_num_seqs=8" in str(e.value)
    shard_dir = tmp_path / "out" / "shards" / shard.shard_id
    kept = sorted(p.name for p in shard_dir.glob("attempts/*/chunk-?????.parquet"))
    assert kept and not (shard_dir / MARKER).exists()
    set_faults("")
    fake_engine_factory.made.clear()
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert m["status"] == "committed" and m["stats"]["reused_chunks"] == len(kept)
    assert fake_engine_factory.made[0].spec.engine.max_num_seqs == 8
    merge(spec)
    check(tmp_path / "out", IDS, kind="engine_death")


def test_pooling_oom_backs_off_and_isolates_the_row(tmp_path, fake_engine_factory, set_faults):
    spec, shard = job(tmp_path, task="embed")
    set_faults("engine.step#2=oom,engine.step@r0033=oom")
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert m["error_rows"] == 1 and m["stats"]["oom_error_rows"] == 1
    merge(spec)
    rec = check(tmp_path / "out", IDS, kind="oom_pooling", faults=m["stats"]["oom_events"])
    assert rec.error_codes == {"r0033": "ENGINE_OOM"}


def test_a_spec_that_leaves_no_room_for_a_prompt_is_terminal(tmp_path, fake_engine_factory):
    job(tmp_path)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out2", sampling={"max_tokens": 1024})
    shard = plan_job(spec).shards[0]
    with pytest.raises(SpecError, match="leaves no room") as e:
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert e.value.exit_code == 2
