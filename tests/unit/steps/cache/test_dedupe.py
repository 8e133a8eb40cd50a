"""Each distinct prompt once per run (steps/cache/dedupe.py) end to end on local files with the strict fake engine.

The fake engine counts what it received (``submitted``: generation requests, ``pooled``: embed/classify
prompts), so every saving asserted here is what the engine saw, not what the plan says. Which jobs qualify,
the leaders and followers across shards, a leader's error, the result cache, passthrough columns, a forged
followers file, a failed leader shard, kill -9 at the new steps, and the dry run's figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.engine_identity import local_engine_identity
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.steps.cache import dedupe
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import PINNED_REVISION, make_spec, merge, shard_task, vouch_cache, write_parquet
from tests.support.ledger import record_fault

ROOT = Path(__file__).resolve().parents[4]
ENGINE = local_engine_identity()
N = 60
IDS = [f"r{i:03d}" for i in range(N)]
# 30% of the rows repeat an earlier row's text: 42 distinct texts, the last 18 rows copies of earlier ones
TEXTS = [f"ticket {i} about {'billing' if i % 3 else 'a bug'}" for i in range(42)] + [
    f"ticket {i} about {'billing' if i % 3 else 'a bug'}" for i in range(0, 36, 2)
]


def spec_for(tmp: Path, run: str = "a", **over):
    over.setdefault("sharding", {"target_rows": 20, "chunk_rows": 8})
    return make_spec(tmp / f"in-{run}.parquet", tmp / f"out-{run}", **over)


def run_job(spec, factory):
    plan = plan_job(spec, engine_identity=ENGINE)
    for s in plan.mapped_shards():
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    merged = merge(spec)
    vouch_cache(spec)  # publish's step for the cache: the entry serves later runs
    return plan, merged


def received(factory) -> int:
    """Requests the engines received (generation) plus prompts they pooled (embed, classify)."""
    return sum(e.submitted + e.pooled for e in factory.made)


def rows(spec, kind=RESULTS) -> dict[str, dict]:
    t = pq.read_table(Path(spec.io.output_uri) / kind)
    return {r["id"]: r for r in t.to_pylist()}


def answer(r: dict) -> tuple:
    """What a row answers (its provenance and its own id aside)."""
    return tuple(
        r.get(c) for c in ("output", "label", "valid", "finish_reason", "prompt_tokens", "prompt_hash", "embedding")
    )


# ---- which jobs -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "over, why",
    [
        ({}, None),
        ({"sampling": {"temperature": 0.0}}, None),
        ({"sampling": {"temperature": 0.8, "seed": 7}}, None),  # one per-request seed: same prompt, same draw
        ({"sampling": {"temperature": 0.8}}, "without a sampling.seed"),
        ({"engine": {"seed": 3}, "sampling": {"temperature": 0.8}}, "without a sampling.seed"),  # engine seed: not
        ({"task": "embed", "prompt": {"system_prompt": None}, "sampling": {"structured": None}}, None),
        ({"task": "classify", "prompt": {"system_prompt": None}, "sampling": {"structured": None}}, None),
        ({"sharding": {"dedupe": False}}, "sharding.dedupe is false"),
    ],
)
def test_which_jobs_are_deduplicated(tmp_path, over, why):
    spec = spec_for(tmp_path, **over)
    got = dedupe.why_not(spec, "parquet")
    assert got is None if why is None else why in got
    assert "only Parquet input" in dedupe.why_not(spec_for(tmp_path), "jsonl")
    assert "only Parquet input" in dedupe.why_not(spec_for(tmp_path), "openai_batch")


def test_spec_hash_unchanged_at_the_default_and_changed_when_off(tmp_path):
    on, off = spec_for(tmp_path), spec_for(tmp_path, sharding={"target_rows": 20, "chunk_rows": 8, "dedupe": False})
    assert "dedupe" not in json.loads(on.canonical_json())["sharding"]  # specs of earlier runs keep their hash
    assert on.content_hash() != off.content_hash()
    assert on.output_hash() == off.output_hash()  # the answers do not depend on it


# ---- plan + shards + merge -------------------------------------------------------------------
def test_thirty_percent_duplicates_send_seventy_percent_of_the_rows_to_the_engine(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path)
    plan, summary = run_job(spec, fake_engine_factory)
    d = plan.dedupe
    assert (d.rows, d.leaders, d.followers) == (60, 42, 18)
    assert sum(s.rows for s in plan.shards) == 42 and len(plan.shards) == 3  # leaders cut into shards
    assert received(fake_engine_factory) == 42  # what the engine saw: 70% of the rows
    assert (summary.rows, summary.ok_rows, summary.error_rows) == (60, 60, 0)
    assert summary.dedupe.model_dump() == {"leaders": 42, "followers": 18, "ok_rows": 18, "error_rows": 0}
    got = rows(spec)
    assert sorted(got) == IDS  # every id once
    first = {}
    for i, t in zip(IDS, TEXTS):
        first.setdefault(t, i)
        assert answer(got[i]) == answer(got[first[t]]), i  # twins share one answer
        assert got[i]["cached_from"] is None
    # followers of leaders in another shard: the leaders of the last 18 rows sit in shards 0 and 1
    leaders_shard = {got[first[t]]["shard_id"] for t in TEXTS[42:]}
    assert len(leaders_shard) >= 2
    # a recompute with the dedupe off infers every row and answers each the same
    off = spec_for(tmp_path, "a", sharding={"target_rows": 20, "chunk_rows": 8, "dedupe": False})
    off = off.model_copy(update={"io": off.io.model_copy(update={"output_uri": str(tmp_path / "out-off")})})
    fake_engine_factory.made.clear()
    p_off, _ = run_job(off, fake_engine_factory)
    assert p_off.dedupe is None and received(fake_engine_factory) == 60
    full = rows(off)
    assert {i: answer(r) for i, r in full.items()} == {i: answer(r) for i, r in got.items()}


def test_a_leaders_error_goes_to_its_followers_and_null_and_empty_texts_are_two_prompts(tmp_path, fake_engine_factory):
    ids = [f"e{i}" for i in range(8)]
    texts = [None, "", None, "same", "", "same", "   ", "   "]
    write_parquet(tmp_path / "in-a.parquet", ids, texts)
    spec = spec_for(tmp_path)
    plan, summary = run_job(spec, fake_engine_factory)
    assert (plan.dedupe.leaders, plan.dedupe.followers) == (4, 4)  # NULL, '', 'same', '   '
    assert received(fake_engine_factory) == 1  # only 'same' is a prompt; the rest are EMPTY_INPUT
    errs = rows(spec, ERRORS)
    assert sorted(errs) == ["e0", "e1", "e2", "e4", "e6", "e7"]
    assert {e["error_code"] for e in errs.values()} == {"EMPTY_INPUT"}
    assert errs["e2"]["error_message"] == errs["e0"]["error_message"]
    assert summary.dedupe.error_rows == 3 and summary.dedupe.ok_rows == 1
    assert (summary.ok_rows, summary.error_rows) == (2, 6)


def test_no_duplicates_plans_as_before(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS[:42] + [f"fresh {i}" for i in range(18)])
    spec = spec_for(tmp_path)
    plan, summary = run_job(spec, fake_engine_factory)
    assert plan.dedupe.followers == 0 and plan.dedupe.followers_file is None
    assert all(s.input_file is None for s in plan.shards)  # shards read the input itself
    assert received(fake_engine_factory) == 60 and summary.dedupe.followers == 0
    assert not (tmp_path / "out-a" / "_cache").exists()


def test_a_collision_of_the_cheap_check_falls_back_to_the_exact_key(tmp_path, fake_engine_factory, monkeypatch):
    """The 64-bit pre-check only proves distinct prompts; hashes that collide go to the sha256 keys, which never
    make a follower of another prompt's row (every hash made equal here)."""
    from airflow_provider_vllm.steps.cache import key

    exact = key.key_message_sql  # the sha256 keys keep the real message
    monkeypatch.setattr(key, "key_text_sql", lambda spec, khash, types: f"sha256({exact(spec, khash, types)})")
    monkeypatch.setattr(key, "key_message_sql", lambda spec, khash, types: "'the same message'")
    write_parquet(tmp_path / "in-a.parquet", IDS, [f"fresh {i}" for i in range(60)])
    plan, summary = run_job(spec_for(tmp_path), fake_engine_factory)
    assert (plan.dedupe.leaders, plan.dedupe.followers) == (60, 0) and received(fake_engine_factory) == 60
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    fake_engine_factory.made.clear()
    plan, summary = run_job(spec_for(tmp_path, "b"), fake_engine_factory)
    assert (plan.dedupe.leaders, plan.dedupe.followers) == (42, 18) and received(fake_engine_factory) == 42


def test_a_template_column_the_key_cannot_encode_infers_every_row(tmp_path):
    from airflow_provider_vllm.steps.plan.dry_run import dry_run_report

    # a timestamp with a time zone in nanoseconds: the worker renders it, the key does not encode it (DuckDB's
    # TIMESTAMPTZ_NS); a nested column, the example before, is refused by the plan now (the worker cannot render it)
    at = pa.array([1, 1, 2, 2], pa.timestamp("ns", tz="UTC"))
    t = pa.table({"id": [f"n{i}" for i in range(4)], "text": ["a", "a", "b", "b"], "tags": at})
    pq.write_table(t, tmp_path / "in-a.parquet")
    spec = spec_for(tmp_path, prompt={"template": "{text} {tags}", "text_columns": ["text"]})
    plan = plan_job(spec, engine_identity=ENGINE)
    assert plan.dedupe is None and sum(s.rows for s in plan.shards) == 4
    reason = dry_run_report(
        spec_for(tmp_path, "a", prompt={"template": "{text} {tags}", "text_columns": ["text"]})
    ).dedupe.reason
    assert "template column 'tags' has a type the key does not encode" in reason


def test_sampling_without_a_seed_infers_every_row(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path, sampling={"temperature": 0.7})
    plan, summary = run_job(spec, fake_engine_factory)
    assert plan.dedupe is None and summary.dedupe is None
    assert received(fake_engine_factory) == 60


def test_long_and_short_buckets_cut_over_the_leaders(tmp_path, fake_engine_factory):
    texts = [("long ticket text " * 40 if i % 4 == 1 else f"short {i % 9}") for i in range(40)]
    write_parquet(tmp_path / "in-a.parquet", [f"b{i:02d}" for i in range(40)], texts)
    spec = spec_for(tmp_path, sharding={"target_rows": 4, "long_row_tokens": 60, "chunk_rows": 4})
    plan, summary = run_job(spec, fake_engine_factory)
    assert {s.bucket for s in plan.shards} == {"short", "long"}
    assert received(fake_engine_factory) == len(set(texts)) == plan.dedupe.leaders == 10
    got = rows(spec)
    assert sorted(got) == [f"b{i:02d}" for i in range(40)] and summary.ok_rows == 40
    first: dict[str, str] = {}
    for i, t in zip(sorted(got), texts):
        assert answer(got[i]) == answer(got[first.setdefault(t, i)]), i


def test_a_huge_group_is_one_request(tmp_path, fake_engine_factory):
    n = 5000
    write_parquet(tmp_path / "in-a.parquet", [f"h{i}" for i in range(n)], ["the same ticket"] * n)
    spec = spec_for(tmp_path, sharding={"target_rows": 1000, "chunk_rows": 256})
    plan, summary = run_job(spec, fake_engine_factory)
    assert (plan.dedupe.leaders, plan.dedupe.followers, len(plan.shards)) == (1, n - 1, 1)
    assert received(fake_engine_factory) == 1
    got = rows(spec)
    assert len(got) == n and len({answer(r) for r in got.values()}) == 1


def test_embeddings_are_deduplicated(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path, task="embed", prompt={"system_prompt": None}, sampling={"structured": None})
    plan, summary = run_job(spec, fake_engine_factory)
    assert plan.dedupe.followers == 18 and received(fake_engine_factory) == 42
    got = rows(spec)
    assert got["r042"]["embedding"] == got["r000"]["embedding"] is not None


def test_openai_batch_input_is_not_deduplicated(tmp_path, fake_engine_factory):
    path = tmp_path / "in-a.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "same ticket"}], "max_tokens": 8}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(6)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    spec = make_spec(
        path,
        tmp_path / "out-a",
        io={"input_format": "openai_batch", "output_format": "openai_batch"},
        prompt={"system_prompt": None},
        sampling={"structured": None},
    )
    plan, summary = run_job(spec, fake_engine_factory)
    assert plan.dedupe is None and summary.ok_rows == 6
    assert received(fake_engine_factory) == 6


def test_followers_keep_their_own_passthrough_values_and_integer_ids(tmp_path, fake_engine_factory):
    t = pa.table(
        {
            "id": pa.array(range(10), pa.int64()),
            "text": ["a", "b", "a", "c", "b", "a", "d", "d", "a", "e"],
            "team": [f"team-{i}" for i in range(10)],
            "at": pa.array([1_700_000_000_000 + i for i in range(10)], pa.timestamp("ms", tz="Europe/Paris")),
            "n": pa.array(range(10), pa.uint16()),
        }
    )
    pq.write_table(t, tmp_path / "in-a.parquet")
    spec = spec_for(tmp_path, io={"passthrough": ["team", "at", "n"]})
    plan, summary = run_job(spec, fake_engine_factory)
    assert (plan.dedupe.leaders, plan.dedupe.followers) == (5, 5) and received(fake_engine_factory) == 5
    got = rows(spec)
    assert sorted(got, key=int) == [str(i) for i in range(10)]
    assert {i: r["team"] for i, r in got.items()} == {str(i): f"team-{i}" for i in range(10)}
    want = {str(i): (t.column("at")[i].as_py(), i) for i in range(10)}
    assert {i: (r["at"], r["n"]) for i, r in got.items()} == want  # the input's own values, in the input's types
    (part,) = (Path(spec.io.output_uri) / "results").glob("part-*-followers.parquet")
    schema = pq.read_schema(part)
    assert schema.field("at").type == pa.timestamp("ms", tz="Europe/Paris") and schema.field("n").type == pa.uint16()
    assert answer(got["8"]) == answer(got["0"])


def test_with_the_result_cache_hits_are_not_leaders_and_the_entry_holds_each_key_once(tmp_path, fake_engine_factory):
    cache = {"uri": str(tmp_path / "cache")}
    model = {"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION}
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a", cache=cache, model=model)
    p1, m1 = run_job(s1, fake_engine_factory)
    assert (p1.cache.misses, p1.dedupe.leaders, p1.dedupe.followers) == (60, 42, 18)
    assert received(fake_engine_factory) == 42 and m1.cache.appended == 42
    # run 2: 10 old texts (hits, one of them twice) and 3 new texts, each twice
    ids2 = [f"s{i}" for i in range(17)]
    texts2 = TEXTS[:10] + [TEXTS[0]] + ["new 1", "new 2", "new 3", "new 1", "new 2", "new 3"]
    write_parquet(tmp_path / "in-b.parquet", ids2, texts2)
    s2 = spec_for(tmp_path, "b", cache=cache, model=model)
    fake_engine_factory.made.clear()
    p2, m2 = run_job(s2, fake_engine_factory)
    assert (p2.cache.hits, p2.cache.misses) == (11, 6)
    assert (p2.dedupe.rows, p2.dedupe.leaders, p2.dedupe.followers) == (6, 3, 3)
    assert received(fake_engine_factory) == 3 and m2.ok_rows == 17 and m2.cache.appended == 3
    got = rows(s2)
    assert answer(got["s14"]) == answer(got["s11"]) and got["s14"]["cached_from"] is None
    assert got["s10"]["cached_from"] == str(tmp_path / "out-a")


def test_a_forged_followers_file_is_refused(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path)
    plan = plan_job(spec, engine_identity=ENGINE)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    f = tmp_path / "out-a" / plan.dedupe.followers_file.path
    t = pq.read_table(f)
    # the same size and schema, one follower pointed at another leader: an injected answer
    leaders = t.column(dedupe.LEADER).to_pylist()
    leaders[0] = "r041"
    pq.write_table(t.set_column(1, dedupe.LEADER, pa.array(leaders, pa.string())), f, compression="zstd")
    with pytest.raises(CommitError, match="does not match the plan"):
        merge(spec)
    assert not (tmp_path / "out-a" / RESULTS).exists()


def test_a_leader_shard_that_failed_is_retried_and_its_followers_get_the_retry_s_answer(tmp_path, fake_engine_factory):
    from tests.support.fakes import FakeEngine

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path)
    plan = plan_job(spec, engine_identity=ENGINE)
    first = plan.shards[0]
    with pytest.raises(Exception):  # noqa: B017 (the engine dies mid-shard: whatever the worker raises)
        run_shard(
            shard_task(spec=spec, shard_id=first.shard_id), engine_factory=lambda s, **kw: FakeEngine(s, crash_after=9)
        )
    with pytest.raises(CommitError, match="not committed"):
        merge(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    summary = merge(spec)
    assert summary.ok_rows == 60 and summary.dedupe.ok_rows == 18
    got = rows(spec)
    assert answer(got["r042"]) == answer(got["r000"])


@pytest.mark.reliability
@pytest.mark.parametrize("point", ["dedupe.after_followers", "cache.after_files"])
def test_plan_killed_at_a_dedupe_step_converges(tmp_path, fake_engine_factory, point):
    """kill -9 of a real plan process after the followers file (or the leaders' shard inputs); the rerun plans
    and merges every id once."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path)
    code = (
        "import sys; from airflow_provider_vllm.core.spec import JobSpec; "
        "from airflow_provider_vllm.steps.plan.planner import plan_job; plan_job(JobSpec.load(sys.argv[1]))"
    )
    env = {**os.environ, faults.ENV: f"{point}=kill", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", code, spec.model_dump_json()], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == -9, p.stderr[-2000:]
    assert not (tmp_path / "out-a" / PLAN_FILE).exists()
    assert list((tmp_path / "out-a" / "_cache").glob("followers-*.parquet"))  # an orphan no plan names
    plan, summary = run_job(spec, fake_engine_factory)
    got = pq.read_table(tmp_path / "out-a" / RESULTS).column("id").to_pylist()
    record_fault(
        f"kill9.{point}.dedupe", N, lost=len(set(IDS) - set(got)), duplicates=len(got) - len(set(got)), level="process"
    )
    assert received(fake_engine_factory) == 42 and summary.ok_rows == 60
    assert sorted(got) == IDS


@pytest.mark.reliability
@pytest.mark.parametrize("action", ["raise", "kill"])
def test_merge_failing_after_the_follower_parts_converges(tmp_path, fake_engine_factory, set_faults, action):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path)
    plan = plan_job(spec, engine_identity=ENGINE)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    if action == "raise":
        set_faults("dedupe.after_parts=raise")
        with pytest.raises(faults.InjectedFault):
            merge(spec)
        set_faults("")
    else:
        code = (
            "import sys; from airflow_provider_vllm.core.spec import JobSpec; "
            "from airflow_provider_vllm.core.plan import current_plan_ref; "
            "from airflow_provider_vllm.steps.merge.merger import merge; "
            "s = JobSpec.load(sys.argv[1]); merge(s, plan=current_plan_ref(s))"
        )
        env = {**os.environ, faults.ENV: "dedupe.after_parts=kill", "PYTHONPATH": str(ROOT)}
        p = subprocess.run(
            [sys.executable, "-c", code, spec.model_dump_json()], env=env, capture_output=True, text=True, timeout=120
        )
        assert p.returncode == -9, p.stderr[-2000:]
    assert not (tmp_path / "out-a" / RESULTS).exists()
    summary = merge(spec)
    again = merge(spec)  # a rerun after a whole merge converges to the same bytes
    assert summary.ok_rows == again.ok_rows == 60 and summary.checksums == again.checksums
    got = pq.read_table(tmp_path / "out-a" / RESULTS).column("id").to_pylist()
    record_fault(
        f"{'kill9' if action == 'kill' else 'raise'}.dedupe.after_parts",
        N,
        lost=len(set(IDS) - set(got)),
        duplicates=len(got) - len(set(got)),
        level="process" if action == "kill" else "in_process",
    )
    assert sorted(got) == IDS


# ---- dry run and QA ------------------------------------------------------------------------
def test_dry_run_reports_the_duplicate_rate_and_the_saving(tmp_path):
    from airflow_provider_vllm.steps.plan.dry_run import dry_run_report, format_report

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    report = dry_run_report(spec_for(tmp_path))
    d = report.dedupe
    assert (d.applied, d.rows, d.distinct, d.duplicates, d.duplicate_rate) == (True, 60, 42, 18, 0.3)
    assert d.duplicate_est_tokens > 0 and d.est_gpu_hours_saved > 0
    text = format_report(report)
    assert "18 of 60 rows (30.0%) repeat an earlier row's prompt: 42 to infer" in text
    off = dry_run_report(spec_for(tmp_path, sampling={"temperature": 0.5}))
    assert not off.dedupe.applied and "without a sampling.seed" in off.dedupe.reason
    assert "dedupe           off, every row is inferred" in format_report(off)
    assert not (tmp_path / "out-a").exists()  # nothing written


def test_qa_reports_the_duplicate_rate(tmp_path, fake_engine_factory):
    from airflow_provider_vllm.steps.qa.stage import qa_run

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path)
    run_job(spec, fake_engine_factory)
    report, paths = qa_run(spec)
    assert report.metrics["dedupe"] == {
        "rows": 60,
        "inferred": 42,
        "followers": 18,
        "duplicate_rate": 0.3,
        "saved_est_tokens": report.metrics["dedupe"]["saved_est_tokens"],
        "followers_ok": 18,
        "followers_error": 0,
    }
    assert report.metrics["dedupe"]["saved_est_tokens"] > 0
    html = (tmp_path / "out-a" / paths["report_html"]).read_text()
    assert "Repeated prompts" in html and "18 rows took a twin" in html


def test_one_text_for_two_adapters_is_two_prompts(tmp_path, fake_engine_factory):
    from tests.unit.worker.test_adapters import LLAMA, adapter_spec, write_adapter, write_rows

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    adapters = {
        n: write_adapter(tmp_path / "adapters" / n, model, seed=i) for i, n in enumerate(["billing", "refunds"])
    }
    write_rows(
        tmp_path / "in-a.parquet",
        [("a", "same", "billing"), ("b", "same", "refunds"), ("c", "same", "billing"), ("d", "same", None)],
    )
    spec = adapter_spec(tmp_path, adapters)
    plan, summary = run_job(spec, fake_engine_factory)
    assert (plan.dedupe.leaders, plan.dedupe.followers) == (3, 1) and received(fake_engine_factory) == 3
    got = rows(spec)
    assert [got[i]["adapter"] for i in "abcd"] == ["billing", "refunds", "billing", None]
    assert answer(got["c"]) == answer(got["a"]) and got["a"]["output"] != got["b"]["output"]


def test_golden_rows_that_ride_along_are_never_leaders_nor_followers(tmp_path):
    """Golden rows with the same texts as input rows (and as each other) are inferred in their own shards, every one
    of them; the input's followers take input leaders only, and no golden id is published."""
    from airflow_provider_vllm.core.spec import RESERVED_ID_PREFIX
    from tests.support.fakes import FakeEngine

    gold = {"id": [f"g{i}" for i in range(6)], "text": [TEXTS[0]] * 3 + [TEXTS[1]] * 3, "label": ["billing"] * 6}
    pq.write_table(pa.table(gold), tmp_path / "golden.parquet")
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    spec = spec_for(tmp_path, qa={"reference": {"ride_along_uri": str(tmp_path / "golden.parquet")}})
    made = []
    plan, summary = run_job(spec, lambda s, **kw: made.append(FakeEngine(s, real_vllm=False, **kw)) or made[-1])
    assert (plan.dedupe.leaders, plan.dedupe.followers, plan.golden.rows) == (42, 18, 6)
    assert sum(e.submitted for e in made) == 42 + 6  # every golden row inferred, apart from the input's
    out = Path(spec.io.output_uri)
    for kind in (RESULTS, ERRORS):
        ids = pq.read_table(out / kind, columns=["id"]).column("id").to_pylist()
        assert not any(i.startswith(RESERVED_ID_PREFIX) for i in ids)
    assert sorted(rows(spec)) == IDS and summary.golden.rows == 6


def test_a_text_column_of_only_nulls_in_the_first_file_is_read_with_the_others(tmp_path, fake_engine_factory):
    """Files whose text column has the Parquet type null (all empty) and string: DuckDB read the files with the first
    file's types and failed to cast the string file (a raw ConversionException, retried). The null rows are
    EMPTY_INPUT errors, the repeated prompt is inferred once, and every row is accounted for."""
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ["a", "b"], "text": pa.nulls(2, pa.null())}), tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table({"id": ["c", "d"], "text": ["same ticket", "same ticket"]}), tmp_path / "in" / "b.parquet")
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    plan, summary = run_job(spec, fake_engine_factory)
    assert plan.dedupe is not None and summary.rows == 4
    assert sorted(rows(spec)) == ["c", "d"] and answer(rows(spec)["c"])[:2] == answer(rows(spec)["d"])[:2]
    assert {i: r["error_code"] for i, r in rows(spec, ERRORS).items()} == {"a": "EMPTY_INPUT", "b": "EMPTY_INPUT"}


def test_typed_template_columns_give_the_same_prompts_with_the_dedupe_on_and_off(tmp_path, fake_engine_factory):
    """Two files with one type per template column (bool, int, double, decimal, naive and aware timestamps), each
    row repeated: the dedupe reads them through DuckDB and the worker renders what it wrote; a run without the dedupe
    renders the files' own values. Every row's prompt hash is the same in both runs (the plan refuses files whose
    types differ, which DuckDB widened: ``core/formats/parquet.py``)."""
    import datetime as dt
    import decimal

    def part(name, ids, flag, n, x, d, at):
        t = pa.table(
            {
                "id": ids,
                "text": ["same"] * 2,
                "flag": pa.array([flag] * 2),
                "n": pa.array([n] * 2, pa.int64()),
                "x": pa.array([x] * 2, pa.float64()),
                "d": pa.array([decimal.Decimal(d)] * 2, pa.decimal128(5, 2)),
                "naive": pa.array([at] * 2, pa.timestamp("us")),
                "aware": pa.array([at.replace(tzinfo=dt.UTC)] * 2, pa.timestamp("us", "UTC")),
            }
        )
        (tmp_path / "in").mkdir(exist_ok=True)
        pq.write_table(t, tmp_path / "in" / name)

    part("a.parquet", ["a1", "a2"], True, 1, 1.0, "1.50", dt.datetime(2024, 3, 1, 14, 5))
    part("b.parquet", ["b1", "b2"], False, 2, 2.5, "2.25", dt.datetime(2024, 3, 2, 9, 0, 0, 250000))
    template = "{text} {flag} {n} {x} {d} {naive} {aware}"
    hashes = {}
    for on in (True, False):
        spec = make_spec(
            tmp_path / "in",
            tmp_path / f"out-{on}",
            prompt={"template": template, "text_columns": ["text"]},
            sharding={"dedupe": on},
        )
        plan, summary = run_job(spec, fake_engine_factory)
        assert (plan.dedupe is not None) is on and summary.rows == 4
        hashes[on] = {i: r["prompt_hash"] for i, r in rows(spec).items()}
    assert hashes[True] == hashes[False] and len(set(hashes[True].values())) == 2


def test_an_int96_timestamp_template_column_gives_the_same_prompts_with_the_dedupe_on_and_off(
    tmp_path, fake_engine_factory
):
    """Parquet's deprecated INT96 timestamps (Spark, Hive, Impala) hold nanoseconds. DuckDB, which keys the rows and
    writes the file the worker renders with the dedupe (or the result cache) on, reads them in microseconds (floored);
    pyarrow read them in nanoseconds, so a plain run rendered other prompts than one whose input repeats a prompt,
    and two rows one nanosecond apart shared a key but not a prompt. The worker reads an INT96 template column in
    microseconds as DuckDB does: every row's prompt is the same in both runs, before 1970 too."""
    ns = [1_700_000_000_000_000_123, 1_700_000_000_000_000_999, -1_000_000_123, -1_000_000_999]
    (tmp_path / "in").mkdir()
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b", "c", "d"],
                "text": ["same"] * 4,
                "at": pa.array(ns, pa.timestamp("ns")),
            }
        ),
        tmp_path / "in" / "a.parquet",
        use_deprecated_int96_timestamps=True,
    )
    assert pq.ParquetFile(tmp_path / "in" / "a.parquet").metadata.schema.column(2).physical_type == "INT96"
    hashes = {}
    for on in (True, False):
        spec = make_spec(
            tmp_path / "in",
            tmp_path / f"out-{on}",
            prompt={"template": "{text} {at}", "text_columns": ["text"]},
            sharding={"dedupe": on},
        )
        plan, summary = run_job(spec, fake_engine_factory)
        assert (plan.dedupe is not None) is on and summary.rows == 4
        hashes[on] = {i: r["prompt_hash"] for i, r in rows(spec).items()}
    assert hashes[True] == hashes[False] and len(set(hashes[True].values())) == 2
