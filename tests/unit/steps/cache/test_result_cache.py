"""The result cache (steps/cache/result_cache.py) end to end on local files with the fake engine.

Store (only committed entries are read), plan (hits and misses files, shards over the misses, a
rerun keeps its plan), merge (hits in the results, the verification against the original input,
this run's entry appended once) and the kill/raise drills at each cache step. The key (what busts
it, the typed injective encoding, pinned revisions, the weights fingerprint): test_cache_key.py.
"""

from __future__ import annotations

import hashlib
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
from airflow_provider_vllm.core.errors import CommitError, EngineError, InputChangedError, SpecError
from airflow_provider_vllm.core.plan import PLAN_FILE, Plan
from airflow_provider_vllm.core.records import CacheCommit
from airflow_provider_vllm.core.rows import RESULT_SCHEMA
from airflow_provider_vllm.core.seal import CACHE_ENTRY, CACHE_PUBLISHED, Keyring, record_bytes, scope_of, seal_record
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.cache import result_cache as cache
from airflow_provider_vllm.steps.cache.store import CacheStore
from airflow_provider_vllm.steps.merge.merger import MERGED, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import (
    LABELS,
    PINNED_REVISION,
    cache_entry_id,
    make_spec,
    merge,
    shard_task,
    vouch_cache,
    write_parquet,
)
from tests.support.ledger import record_fault

ROOT = Path(__file__).resolve().parents[3]
ENGINE = local_engine_identity()  # the identity the (in-process) workers seal: the fake engine runs in this Python
IDS = [f"r{i:03d}" for i in range(50)]
TEXTS = [f"ticket {i} about {'billing' if i % 3 else 'a bug'}" for i in range(50)]


def spec_for(tmp: Path, run: str, cache_dir: Path | None = None, **over):
    over.setdefault("model", {"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION})
    over.setdefault("cache", {"uri": str(cache_dir or tmp / "cache")})
    over.setdefault("sharding", {"target_rows": 20, "chunk_rows": 8})
    return make_spec(tmp / f"in-{run}.parquet", tmp / f"out-{run}", **over)


def run_job(spec, factory, publish: bool = True) -> tuple[Plan, dict]:
    """Plan, shards, merge and (``publish``) what publish does for the cache: its entry then serves later runs."""
    plan = plan_job(spec, engine_identity=ENGINE)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    merged = merge(spec).dump()
    if publish:
        vouch_cache(spec)
    return plan, merged


def results(spec) -> dict[str, dict]:
    t = pq.read_table(Path(spec.io.output_uri) / RESULTS)
    return {r["id"]: r for r in t.to_pylist()}


def inferred(factory) -> int:
    return sum(e.submitted for e in factory.made)


# ---- key (more in test_cache_key.py) ---------------------------------------------------
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
    mac = json.loads(_commit(tmp_path / "cache", p2, cache_entry_id(s2, p2)).read_text())["seal"]["mac"]
    assert (
        m2["rows"] == 51
        and m2["ok_rows"] == 51
        and m2["cache"]
        == {
            "uri": str(tmp_path / "cache"),
            "hits": 46,
            "appended": 5,
            "entry_id": cache_entry_id(s2, p2),
            "committed_by": "this_merge",
            "commit_mac": mac,  # what publish vouches for
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
        model={"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
    )
    run_job(s3, fake_engine_factory)
    full = results(s3)
    assert {i: full[i]["label"] for i in full} == {i: r2[i]["label"] for i in r2}


def test_hits_are_published_by_reference_as_the_last_results_part(tmp_path, fake_engine_factory):
    """The plan writes the hits in the results schema; merge links that file into results/ (no re-encoding)."""
    from airflow_provider_vllm.core.rows import RESULT_SCHEMA
    from airflow_provider_vllm.steps.merge.merger import read_manifest

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
    p = plan_job(spec_for(tmp_path, "b", prompt={"template": "T: {text}"}), engine_identity=ENGINE)
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
    p2 = plan_job(s2, engine_identity=ENGINE)
    assert p2.cache.hits == 0
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)  # the cache now knows every row
    again = plan_job(s2, engine_identity=ENGINE)
    assert again == p2
    other = spec_for(tmp_path, "b", sampling={"max_tokens": 9})
    with pytest.raises(SpecError, match="another input or spec"):
        plan_job(other, engine_identity=ENGINE)


def test_merge_refuses_a_changed_hits_file(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    p2 = plan_job(s2, engine_identity=ENGINE)
    hits = tmp_path / "out-b" / p2.cache.hits_file.path
    t = pq.read_table(hits)
    pq.write_table(t.set_column(t.schema.get_field_index("label"), "label", pa.array(["x"] * t.num_rows)), hits)
    with pytest.raises(CommitError, match="does not match the plan"):
        merge(s2)


def _commit(store: Path, plan, eid: str) -> Path:
    return store / CacheStore.commit_dir(plan.cache.key_hash) / f"{eid}.json"


def _vouch(store: Path, khash: str, eid: str) -> None:
    """What publish writes for an entry (``CacheStore.vouch``), naming its commit as it is now."""
    mac = json.loads((store / CacheStore.commit_dir(khash) / f"{eid}.json").read_text())["seal"]["mac"]
    CacheStore(str(store), {}, Keyring.from_env()).vouch(khash, eid, mac, "publish", "")


def test_only_sealed_committed_entries_of_this_key_are_read(tmp_path, fake_engine_factory, caplog):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, _ = run_job(s1, fake_engine_factory)
    eid = cache_entry_id(s1, p1)
    store = tmp_path / "cache"
    marker = _commit(store, p1, eid)
    # an entry whose part changed (even keeping its size) is skipped whole; a stray or half file is ignored
    part = store / "entries" / eid / "part-00000.parquet"
    saved = part.read_bytes()
    flipped = saved[:100] + bytes([saved[100] ^ 1]) + saved[101:]
    part.write_bytes(flipped)
    (marker.parent / f"{eid}.json.tmp-123").write_text("{")
    (marker.parent / f"{'f' * 32}.json").write_text("{not json")
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "b"), engine_identity=ENGINE).cache.hits == 0
    assert "not the file its sealed record names" in caplog.text
    # a marker edited to name another entry's part breaks its seal
    part.write_bytes(saved)
    doc = json.loads(marker.read_text())
    doc["files"][0]["path"] = f"entries/{'0' * 32}/part-00000.parquet"
    marker.write_text(json.dumps(doc))
    write_parquet(tmp_path / "in-c.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "c"), engine_identity=ENGINE).cache.hits == 0
    assert "seal does not match its content" in caplog.text
    # even sealed with the deployment's key (a writer bug), a commit naming another entry's part is not read
    c = CacheCommit.model_validate(doc | {"seal": None})
    sealed = seal_record(Keyring.from_env(), CACHE_ENTRY, scope_of(str(store)), c)
    marker.write_bytes(record_bytes(sealed))
    write_parquet(tmp_path / "in-d.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "d"), engine_identity=ENGINE).cache.hits == 0
    assert "not a part of its own entry" in caplog.text


def _forged_entry(store: Path, plan, template_eid: str, eid: str, label: str, created: str, key: Keyring | None):
    """Another writer of the cache folder: a copy of a genuine entry with other labels, dated ``created``,
    unsealed (``key`` None) or sealed with a key that is not the deployment's."""
    t = pq.read_table(store / "entries" / template_eid / "part-00000.parquet")
    t = t.set_column(t.schema.get_field_index("label"), "label", pa.array([label] * t.num_rows))
    t = t.set_column(t.schema.get_field_index("computed_at"), "computed_at", pa.array([created] * t.num_rows))
    (store / "entries" / eid).mkdir()
    pq.write_table(t, store / "entries" / eid / "part-00000.parquet")
    st = Storage(str(store))
    rel = f"entries/{eid}/part-00000.parquet"
    doc = json.loads(_commit(store, plan, template_eid).read_text())
    doc.pop("seal")
    doc.update(
        entry_id=eid,
        created=created,
        files=[{"path": rel, "rows": t.num_rows, "bytes": st.size(rel), "sha256": st.sha256(rel)}],
    )
    c = CacheCommit.model_validate(doc)
    if key is not None:
        c = seal_record(key, CACHE_ENTRY, scope_of(str(store)), c)
    _commit(store, plan, eid).write_bytes(record_bytes(c))


@pytest.mark.reliability
def test_a_future_dated_entry_of_another_writer_never_wins(tmp_path, fake_engine_factory):
    """A writer of the cache folder dates entries far in the future: unsealed, or sealed with another key, they
    are never read, so the answers the pipeline computed keep their keys."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, _ = run_job(s1, fake_engine_factory)
    genuine = {i: r["label"] for i, r in results(s1).items()}
    store = tmp_path / "cache"
    eid = cache_entry_id(s1, p1)
    _forged_entry(store, p1, eid, "e" * 32, "forged", "2999-01-01T00:00:00+00:00", None)
    _forged_entry(store, p1, eid, "d" * 32, "forged2", "2999-01-01T00:00:00+00:00", Keyring.from_text("x" * 48))
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    p2, _ = run_job(s2, fake_engine_factory)
    assert p2.cache.hits == 50 and p2.cache.commits_read == [eid]
    assert {i: r["label"] for i, r in results(s2).items()} == genuine
    record_fault("forged_cache_entry_future_dated", len(IDS), lost=0, duplicates=0, level="in_process")


def test_the_newest_sealed_answer_wins_a_key(tmp_path, fake_engine_factory):
    """Two sealed entries hold a key (sampling allowed: answers may differ): the answer computed last wins,
    by the rows' own computed_at inside the sealed bytes."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, _ = run_job(s1, fake_engine_factory)
    store = tmp_path / "cache"
    eid = cache_entry_id(s1, p1)
    _forged_entry(store, p1, eid, "e" * 32, "newer", "2999-01-01T00:00:00+00:00", Keyring.from_env())
    _vouch(store, p1.cache.key_hash, "e" * 32)  # its run published too
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    run_job(s2, fake_engine_factory)
    assert {r["label"] for r in results(s2).values()} == {"newer"}


# ---- fault drills -------------------------------------------------------------------------
def _entries(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "commits").glob("*/*.json"))


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
        "from airflow_provider_vllm.steps.plan.planner import plan_job; "
        "from airflow_provider_vllm.core.engine_identity import local_engine_identity; "
        "plan_job(JobSpec.load(sys.argv[1]), engine_identity=local_engine_identity())"
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
    plan = plan_job(s1, engine_identity=ENGINE)
    for s in plan.shards:
        run_shard(shard_task(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    if action == "raise":
        set_faults(f"{point}=raise")
        with pytest.raises(faults.InjectedFault):
            merge(s1)
        set_faults("")
    else:  # kill -9 of a real merge process: no clean-up, temp files stay
        code = (
            "import sys; from airflow_provider_vllm.core.spec import JobSpec; "
            "from airflow_provider_vllm.core.plan import current_plan_ref; "
            "from airflow_provider_vllm.steps.merge.merger import merge; "
            "s = JobSpec.load(sys.argv[1]); merge(s, plan=current_plan_ref(s))"
        )
        env = {**os.environ, faults.ENV: f"{point}=kill", "PYTHONPATH": str(ROOT)}
        p = subprocess.run(
            [sys.executable, "-c", code, s1.model_dump_json()], env=env, capture_output=True, text=True, timeout=120
        )
        assert p.returncode == -9, p.stderr[-2000:]
        if point == "cache.mid_commit":  # the marker's half-written temp file is there, and ignored
            assert list((tmp_path / "cache" / "commits").glob("*/*.tmp-*"))
    store = tmp_path / "cache"
    committed = point == "cache.after_commit"
    assert _entries(store) == ([f"{cache_entry_id(s1, plan)}.json"] if committed else [])
    # another run planned now sees nothing of it: whole or not, the run is not published
    write_parquet(tmp_path / "in-x.parquet", IDS, TEXTS)
    seen = plan_job(spec_for(tmp_path, "x"), engine_identity=ENGINE).cache.hits
    assert seen == 0
    summary = merge(s1).dump()
    vouch_cache(s1)  # published: the whole entry serves
    write_parquet(tmp_path / "in-y.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "y"), engine_identity=ENGINE).cache.hits == 50
    entry = pq.read_table(store / "entries" / cache_entry_id(s1, plan) / "part-00000.parquet")
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
    assert _entries(store) == [f"{cache_entry_id(s1, plan)}.json"]
    assert json.loads((tmp_path / "out-a" / MERGED).read_text())["ok_rows"] == 50
    # a third merge appends nothing new
    assert merge(s1).dump()["cache"]["committed_by"] == "earlier_merge"
    assert len(list((store / "entries").iterdir())) == 1


# ---- dry run ------------------------------------------------------------------------------
def test_dry_run_reports_expected_hits_and_saved_gpu_hours(tmp_path, fake_engine_factory, monkeypatch):
    from airflow_provider_vllm.core.formats import files
    from airflow_provider_vllm.steps.plan.dry_run import dry_run_report, format_report

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    write_parquet(tmp_path / "in-b.parquet", IDS + ["n1"], TEXTS[:-1] + ["edited", "new"])
    s2 = spec_for(tmp_path, "b")
    listings = []
    describe = files.describe_files
    monkeypatch.setattr(files, "describe_files", lambda *a: listings.append(a) or describe(*a))
    r = dry_run_report(s2, model_config={}, engine_identity=ENGINE)
    assert len(listings) == 1  # the cache's expected hits join the input the plan listed, not a second listing
    c = r.cache
    assert (c.rows, c.hits, c.misses, c.commits) == (51, 49, 2, 1)
    assert 0 < c.est_gpu_hours_saved < r.est_gpu_hours
    assert "49 of 51 rows answered by 1 committed entry, 2 to infer" in format_report(r)
    assert not (tmp_path / "out-b").exists()  # nothing written
    assert "cache" not in dry_run_report(spec_for(tmp_path, "b", cache={"uri": None}), model_config={}).dump()


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
    """The key names the local vLLM (where the plan ran); rows a different engine made (the identity each worker
    seals into its commit marker) stay out of the cache."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    plan = plan_job(s1, engine_identity="vllm==0.99.0")
    for s in plan.shards:
        run_shard(shard_task(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)  # engine fake-0
    c = merge(s1).cache
    assert c is not None and c.appended == 0 and ENGINE in (c.skipped or "") and "vllm==0.99.0" in c.skipped
    assert not (tmp_path / "cache" / "commits").exists()
    assert results(s1).keys() == set(IDS)


def test_rows_of_workers_that_saw_a_model_redirect_are_not_appended(tmp_path, fake_engine_factory, monkeypatch):
    """On Kubernetes a worker may see engine variables the key does not name (the image's own, a Secret mounted
    whole): one that redirects vLLM to other weights (VLLM_MODEL_REDIRECT_PATH) keeps the rows out of the cache,
    naming it; the results are still published."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    plan = plan_job(s1, engine_identity="image r/w:1@sha256:" + "a" * 64)
    monkeypatch.setenv("VLLM_MODEL_REDIRECT_PATH", "/mnt/secret/redirect.json")  # the workers' environment
    for s in plan.shards:
        run_shard(shard_task(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    c = merge(s1).cache
    assert c is not None and c.appended == 0 and "VLLM_MODEL_REDIRECT_PATH" in (c.skipped or "")
    assert not (tmp_path / "cache" / "commits").exists()
    assert results(s1).keys() == set(IDS)


@pytest.mark.parametrize("last_attempt_infers", [True, False])
def test_rows_an_earlier_attempt_made_under_another_engine_are_not_appended_after_a_resume(
    tmp_path, fake_engine_factory, monkeypatch, set_faults, last_attempt_infers
):
    """An attempt whose engine saw a variable the key cannot stand for (a model redirect) dies mid-shard; the retry
    runs on the key's engine and reuses its finished chunks (resume). Its marker must not name its own engine for
    rows the other one made (nor, when every chunk was reused, the engine of a worker that ran none): the results
    are published whole, and the cache files none of them."""
    from airflow_provider_vllm.core.commit import MARKER, ChunkSeal

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a", sharding={"target_rows": 50, "chunk_rows": 8})
    plan = plan_job(s1, engine_identity=ENGINE)
    (shard,) = plan.shards
    task = shard_task(spec=s1, shard_id=shard.shard_id)
    monkeypatch.setenv("VLLM_MODEL_REDIRECT_PATH", "/mnt/secret/redirect.json")  # the first attempt's environment
    if last_attempt_infers:
        with pytest.raises(EngineError):
            run_shard(task, engine_factory=lambda s: fake_engine_factory(s, crash_after=30))
    else:  # every chunk done, stopped before its commit
        set_faults("commit.after_data=raise")
        with pytest.raises(faults.InjectedFault):
            run_shard(task, engine_factory=fake_engine_factory)
        set_faults("")
    shard_dir = tmp_path / "out-a" / "shards" / shard.shard_id
    first = {p.name: p.read_bytes() for p in shard_dir.glob("attempts/*/chunk-*.seal.json")}
    monkeypatch.delenv("VLLM_MODEL_REDIRECT_PATH")
    m = run_shard(task, engine_factory=fake_engine_factory)
    assert m["status"] == "committed" and m["stats"]["reused_chunks"] == len(first) >= 1
    marker = json.loads((shard_dir / MARKER).read_text())
    assert marker["engine_identity"] != ENGINE
    c = merge(s1).cache
    assert c is not None and c.appended == 0 and c.skipped
    assert not (tmp_path / "cache" / "commits").exists()
    assert results(s1).keys() == set(IDS)
    # each chunk seals the engine that made it
    assert all("VLLM_MODEL_REDIRECT_PATH" in ChunkSeal.model_validate_json(b).engine_identity for b in first.values())


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ({"confidence": False}, {}),  # structured choice: on by default
        ({}, {"confidence": True}),  # free text: off by default
    ],
)
def test_a_job_that_asks_for_confidence_is_never_served_rows_without_one(tmp_path, fake_engine_factory, first, then):
    """The rows of a run that did not ask for a confidence (qa.confidence) have none; a later run that asks for
    it gets no hit from them: every row computed, with its confidence."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    sampling = {} if "confidence" in first else {"sampling": {"max_tokens": 8, "structured": None}}
    s1 = spec_for(tmp_path, "a", qa=first, **sampling)
    run_job(s1, fake_engine_factory)
    assert all(r["confidence"] is None for r in results(s1).values())
    s2 = spec_for(tmp_path, "b", qa=then, **sampling)
    p2, _ = run_job(s2, fake_engine_factory)
    assert p2.cache is not None and p2.cache.hits == 0
    assert all(r["confidence"] is not None and r["cached_from"] is None for r in results(s2).values())


def test_rows_rendered_by_a_chat_template_that_reads_the_clock_are_not_appended(tmp_path, fake_engine_factory):
    """A chat template that reads the clock (transformers' strftime_now: Llama 3.x's "Today Date: ...") renders
    another prompt for the same row and key on another day. The worker finds it (its probe rendered at two dates)
    and seals it into its commit marker; the merge files none of the run's rows (cache.skipped says why), the
    results are published, and the next run infers every row again. A template that does not read it: cached."""
    from tests.support.fakes import FakeTokenizer

    class Dated(FakeTokenizer):
        def apply_chat_template(self, messages, **kw):
            from transformers.utils import chat_template_utils as ctu

            today = ctu.datetime.now().strftime("%d %b %Y")
            return f"Today Date: {today}\n" + super().apply_chat_template(messages, **kw)

    def dated(spec):
        e = fake_engine_factory(spec)
        e.tokenizer = Dated()
        return e

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    _, m1 = run_job(s1, dated)
    assert m1["cache"]["appended"] == 0 and "reads the clock" in m1["cache"]["skipped"]
    assert not (tmp_path / "cache" / "commits").exists()
    assert results(s1).keys() == set(IDS)
    markers = list((tmp_path / "out-a" / "shards").glob("*/_COMMITTED.json"))
    assert markers and all(json.loads(m.read_text())["prompt_reads_clock"] is True for m in markers)
    p2, m2 = run_job(spec_for(tmp_path, "b"), fake_engine_factory)  # the clock-free template
    assert p2.cache is not None and p2.cache.hits == 0 and m2["cache"]["appended"] == len(IDS)


def test_a_chat_jobs_rows_are_appended_only_when_every_shard_probed_its_template(tmp_path):
    """A shard that started no engine (every chunk an earlier attempt's) or a worker before the probe did not
    record whether the template reads the clock: its run's rows are not filed. Jobs without a chat template
    are not held to it."""
    chat = spec_for(tmp_path, "a")
    assert cache.prompts_vary(chat, [False, False]) is None
    assert "did not record" in (cache.prompts_vary(chat, [False, None]) or "")
    assert "reads the clock" in (cache.prompts_vary(chat, [None, True]) or "")
    assert cache.prompts_vary(spec_for(tmp_path, "g", task="generate", prompt={"system_prompt": None}), [None]) is None


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


# ---- laundering ---------------------------------------------------------------------------
def _forge_committed_run(out: Path) -> int:
    """What any writer of a run's output prefix can do before merge: rewrite every committed chunk with other
    labels and update each marker's sizes and sha256 (no signing key). Returns the rows forged."""
    import hashlib

    forged = 0
    for marker in (out / "shards").glob("*/_COMMITTED.json"):
        doc = json.loads(marker.read_text())
        for f in doc["files"]:
            path = out / f["path"]
            t = pq.read_table(path)
            t = t.set_column(t.schema.get_field_index("label"), "label", pa.array(["forged"] * t.num_rows))
            pq.write_table(t, path)
            f["bytes"], f["sha256"] = path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()
            forged += t.num_rows
        marker.write_text(json.dumps(doc))
    return forged


@pytest.mark.reliability
def test_forged_chunks_and_markers_are_never_merged_cached_or_served(tmp_path, fake_engine_factory):
    """The laundering path: forged chunks and markers in run a's prefix before its merge. Merge refuses them
    (nothing published, nothing appended to the cache), and run b with the same settings infers every row."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    plan = plan_job(s1, engine_identity=ENGINE)
    for s in plan.shards:
        run_shard(shard_task(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    forged = _forge_committed_run(tmp_path / "out-a")
    with pytest.raises(CommitError, match="seal does not match"):
        merge(s1)
    assert not (tmp_path / "out-a" / MERGED).exists() and not (tmp_path / "out-a" / RESULTS).exists()
    assert not (tmp_path / "cache" / "commits").exists()
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    fake_engine_factory.made.clear()
    p2, _ = run_job(s2, fake_engine_factory)
    assert p2.cache.hits == 0 and inferred(fake_engine_factory) == 50
    assert "forged" not in {r["label"] for r in results(s2).values()}
    record_fault("laundering_forged_chunks_and_markers", forged, lost=0, duplicates=0, level="in_process")


@pytest.mark.reliability
def test_a_planted_chunk_is_never_reused_by_a_retry(tmp_path, fake_engine_factory):
    """A writer of the prefix plants a complete-looking chunk (right footer, a copied seal) in an attempt folder
    before the shard runs: the worker's reuse scan checks the seal against the bytes and redoes the chunk."""
    import shutil

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a", sharding={"target_rows": 50, "chunk_rows": 10})
    plan = plan_job(s1, engine_identity=ENGINE)
    (shard,) = plan.shards
    # a genuine run elsewhere gives the attacker well-formed chunks and seals to copy
    s_other = spec_for(tmp_path, "other", sharding={"target_rows": 50, "chunk_rows": 10})
    write_parquet(tmp_path / "in-other.parquet", IDS, TEXTS)
    other = plan_job(s_other, engine_identity=ENGINE)
    run_shard(shard_task(spec=s_other, shard_id=other.shards[0].shard_id), engine_factory=fake_engine_factory)
    src = next((tmp_path / "out-other" / "shards").glob("*/attempts/*"))
    planted = tmp_path / "out-a" / "shards" / shard.shard_id / "attempts" / "a-planted"
    shutil.copytree(src, planted)
    for f in planted.glob("chunk-*.parquet"):
        if not f.name.endswith(".errors.parquet"):
            t = pq.read_table(f)
            pq.write_table(
                t.set_column(t.schema.get_field_index("label"), "label", pa.array(["forged"] * t.num_rows)), f
            )
    m = run_shard(shard_task(spec=s1, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert m["stats"]["reused_chunks"] == 0
    merge(s1)
    assert "forged" not in {r["label"] for r in results(s1).values()}


def test_entries_written_before_a_result_column_existed_still_serve(tmp_path, fake_engine_factory):
    """An entry of an older version lacks the columns added since (confidence, prompt_hash, logprobs): its
    hits read them as null, and the hits file is still in the results schema."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    run_job(s1, fake_engine_factory)
    store = tmp_path / "cache"
    (marker,) = store.glob("commits/*/*.json")
    commit = CacheCommit.model_validate_json(marker.read_bytes())
    part = store / commit.files[0].path
    old = pq.read_table(part).drop_columns(["confidence", "prompt_hash", "logprobs"])
    os.chmod(part, 0o644)
    pq.write_table(old, part)
    # as that version's merge sealed it (the deployment's key): only its bytes lack the new columns
    files = [
        commit.files[0].model_copy(
            update={"bytes": part.stat().st_size, "sha256": Storage(str(store)).sha256(commit.files[0].path)}
        )
    ]
    resealed = seal_record(
        Keyring.from_env(), CACHE_ENTRY, scope_of(str(store)), commit.model_copy(update={"files": files, "seal": None})
    )
    os.chmod(marker, 0o644)
    marker.write_bytes(record_bytes(resealed))
    _vouch(store, commit.key_hash, commit.entry_id)  # and vouched for by publish (the record names the commit's seal)
    s2 = spec_for(tmp_path, "b")
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    p2, m2 = run_job(s2, fake_engine_factory)
    assert p2.cache.hits == 50 and m2["ok_rows"] == 50
    hits = pq.read_table(tmp_path / "out-b" / "results")
    assert hits.schema.equals(RESULT_SCHEMA) and hits.column("confidence").null_count == 50


def _rewrite_entry(store: Path, transform) -> None:
    """Replace the one entry's part by ``transform(table)`` and reseal its commit with the deployment's key, as
    a merge of that version would have written and sealed it; then vouch for that commit, as publish does."""
    (marker,) = store.glob("commits/*/*.json")
    commit = CacheCommit.model_validate_json(marker.read_bytes())
    part = store / commit.files[0].path
    t = transform(pq.read_table(part))
    os.chmod(part, 0o644)
    pq.write_table(t, part)
    files = [
        commit.files[0].model_copy(
            update={"bytes": part.stat().st_size, "sha256": Storage(str(store)).sha256(commit.files[0].path)}
        )
    ]
    resealed = seal_record(
        Keyring.from_env(), CACHE_ENTRY, scope_of(str(store)), commit.model_copy(update={"files": files, "seal": None})
    )
    os.chmod(marker, 0o644)
    marker.write_bytes(record_bytes(resealed))
    _vouch(store, commit.key_hash, commit.entry_id)


def test_entries_of_the_previous_format_still_serve(tmp_path, fake_engine_factory):
    """The previous version stored each key as its 64 hex characters, rows in source-id order: the same 32
    bytes, so its entries keep answering (the index sorts them); nothing is inferred again."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    run_job(s1, fake_engine_factory)
    store = tmp_path / "cache"
    (part,) = store.glob("entries/*/part-00000.parquet")
    new = pq.read_table(part)
    assert new.schema.field("key").type == pa.binary()
    assert new.column("key").to_pylist() == sorted(new.column("key").to_pylist())  # this version: sorted by key

    def as_before(t: pa.Table) -> pa.Table:
        hexed = pa.array([k.hex() for k in t.column("key").to_pylist()], pa.string())
        return t.set_column(0, pa.field("key", pa.string(), nullable=False), hexed).sort_by("source_id")

    _rewrite_entry(store, as_before)
    write_parquet(tmp_path / "in-b.parquet", IDS + ["new"], TEXTS + ["a new ticket"])
    s2 = spec_for(tmp_path, "b")
    fake_engine_factory.made.clear()
    p2, m2 = run_job(s2, fake_engine_factory)
    assert (p2.cache.hits, p2.cache.misses) == (50, 1) and inferred(fake_engine_factory) == 1
    r1, r2 = results(s1), results(s2)
    assert all(r2[i]["label"] == r1[i]["label"] and r2[i]["cached_from"] == s1.io.output_uri for i in IDS)
    # this run's entry is in the new format; the old one still serves beside it
    write_parquet(tmp_path / "in-c.parquet", IDS + ["new"], TEXTS + ["a new ticket"])
    p3, _ = run_job(spec_for(tmp_path, "c"), fake_engine_factory)
    assert p3.cache.hits == 51 and len(p3.cache.commits_read) == 2


def test_an_entry_whose_keys_are_of_neither_format_is_skipped_whole(tmp_path, fake_engine_factory, caplog):
    """Sealed but unreadable keys (a writer's bug: 16 bytes each) are never half-used: the entry is a miss."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)

    def cut(t: pa.Table) -> pa.Table:
        return t.set_column(0, "key", pa.array([k[:16] for k in t.column("key").to_pylist()], pa.binary()))

    _rewrite_entry(tmp_path / "cache", cut)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    p2 = plan_job(spec_for(tmp_path, "b"), engine_identity=ENGINE)
    assert p2.cache.hits == 0 and p2.cache.commits_read == []
    assert "its keys cannot be read" in caplog.text and "not all 32 bytes" in caplog.text


def test_hits_file_holds_each_hit_once_with_its_own_id_and_answer(tmp_path, fake_engine_factory):
    """Several input rows share a key (the same text under other ids), and rows come from two entries: every hit
    row is in the hits file once, with its own id and its key's answer."""
    texts = [f"ticket {i % 20}" for i in range(50)]  # 20 distinct texts
    write_parquet(tmp_path / "in-a.parquet", IDS[:30], texts[:30])
    p1, _ = run_job(spec_for(tmp_path, "a"), fake_engine_factory)  # computes texts 0..19
    write_parquet(tmp_path / "in-b.parquet", [f"x{i}" for i in range(5)], ["other 0", "other 1", *texts[:3]])
    run_job(spec_for(tmp_path, "b"), fake_engine_factory)  # entry 2: "other 0", "other 1"
    ids3 = IDS + ["y0", "y1"]
    write_parquet(tmp_path / "in-c.parquet", ids3, texts + ["other 1", "other 0"])
    s3 = spec_for(tmp_path, "c")
    fake_engine_factory.made.clear()
    p3 = plan_job(s3, engine_identity=ENGINE)
    assert p3.cache.hits == 52 and p3.shards == [] and len(p3.cache.commits_read) == 2
    hits = pq.read_table(Path(s3.io.output_uri) / p3.cache.hits_file.path)
    assert hits.schema.equals(RESULT_SCHEMA)
    assert sorted(hits.column("id").to_pylist()) == sorted(ids3)
    answers = {r["id"]: r["label"] for r in results(spec_for(tmp_path, "a")).values()}
    answers |= {r["id"]: r["label"] for r in results(spec_for(tmp_path, "b")).values()}
    by_text = {t: answers[i] for i, t in zip(IDS[:30], texts[:30])}
    by_text |= {"other 0": answers["x0"], "other 1": answers["x1"]}
    text_of = dict(zip(ids3, texts + ["other 1", "other 0"]))
    assert {r["id"]: r["label"] for r in hits.to_pylist()} == {i: by_text[text_of[i]] for i in ids3}


def _naive_key(khash: str, text: str | None) -> bytes:
    """The row key written out by hand (docs/cache.md): sha256 over the key hash and the one template column."""
    value = "N" if text is None else f"S{len(text.encode())}:{text}"
    return hashlib.sha256(f"{khash}|T7:VARCHAR{value}".encode()).digest()


def _planned(spec, plan) -> tuple[list[str], list[str]]:
    """The plan's hits (ids of the hits file) and misses (ids of the shards' input files), in file order."""
    out = Path(spec.io.output_uri)
    hits = pq.read_table(out / plan.cache.hits_file.path).column("id").to_pylist()
    misses = [i for s in plan.shards for i in pq.read_table(out / s.input_file.path).column("id").to_pylist()]
    return hits, misses


def test_hits_and_misses_equal_a_naive_lookup_of_every_row(tmp_path, fake_engine_factory):
    """Every row of run 2 is a hit exactly when the sha256 of its key message, computed here in Python, is a key of
    a sealed entry: repeated texts under several ids, NULL and empty texts (error rows: never cached), edited
    and new rows, ids repeated across runs with other texts. Then other settings (another key config) hit
    nothing, and an entry whose part changed after its seal serves nothing."""
    texts1 = [None if i == 4 else "" if i == 5 else f"t {i % 17} é" for i in range(60)]
    write_parquet(tmp_path / "in-a.parquet", [f"a{i}" for i in range(60)], texts1, row_group_size=7)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    texts2 = [None if i in (4, 40) else f"t {i % 23} é" if i % 5 else f"t {i % 17} é!" for i in range(80)]
    ids2 = [f"a{(i * 7) % 80}" for i in range(80)]  # ids of run 1 with other texts, and new ids
    write_parquet(tmp_path / "in-b.parquet", ids2, texts2, row_group_size=9)
    once = {"sharding": {"target_rows": 20, "chunk_rows": 8, "dedupe": False}}  # every miss in a shard's input
    s2 = spec_for(tmp_path, "b", **once)
    p2 = plan_job(s2, engine_identity=ENGINE)
    cached = set()
    for part in (tmp_path / "cache" / "entries").glob("*/part-*.parquet"):
        cached |= set(pq.read_table(part).column("key").to_pylist())
    naive_hits = [i for i, t in zip(ids2, texts2) if _naive_key(p2.cache.key_hash, t) in cached]
    hits, misses = _planned(s2, p2)
    assert 0 < len(naive_hits) < len(ids2)
    assert sorted(hits) == sorted(naive_hits) and p2.cache.hits == len(naive_hits)
    assert misses == [i for i in ids2 if i not in set(naive_hits)]  # in input order
    # another key config: no entry of it, every row a miss
    s3 = spec_for(tmp_path, "c", prompt={"template": "Ticket:  {text}"}, **once)
    write_parquet(tmp_path / "in-c.parquet", ids2, texts2)
    p3 = plan_job(s3, engine_identity=ENGINE)
    assert (p3.cache.hits, p3.cache.misses) == (0, 80) and _planned(s3, p3)[1] == ids2
    # the entry's part changed after its seal (same rows, other bytes): skipped whole, its keys hit nothing
    (part,) = (tmp_path / "cache" / "entries").glob("*/part-*.parquet")
    pq.write_table(pq.read_table(part), part, compression="snappy")
    s4 = spec_for(tmp_path, "d", **once)
    write_parquet(tmp_path / "in-d.parquet", ids2, texts2)
    p4 = plan_job(s4, engine_identity=ENGINE)
    assert p4.cache.hits == 0 and p4.cache.commits_read == [] and _planned(s4, p4)[1] == ids2


@pytest.mark.parametrize(
    "planted", ["a folder as an entry's part", "a folder as a commit", "a folder as an entry's vouch record"]
)
def test_a_folder_planted_in_the_cache_is_skipped_not_the_plans_failure(tmp_path, fake_engine_factory, caplog, planted):
    """Whoever can write the cache folder can put anything there: one odd object costs that entry (a warning),
    never every later plan of the key config (it was a raw IsADirectoryError)."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)
    commit = next((tmp_path / "cache").glob("commits/*/*.json"))
    if planted == "a folder as an entry's part":
        part = tmp_path / "cache" / "entries" / commit.stem / "part-00000.parquet"
        part.unlink()
        part.mkdir()
    elif planted == "a folder as a commit":  # with a record beside it, or it is not even read
        (commit.parent / ("0" * 32 + ".json")).mkdir()
        (tmp_path / "cache" / "published" / commit.parent.name / ("0" * 32 + ".json")).mkdir()
    else:
        vouch = tmp_path / "cache" / "published" / commit.parent.name / commit.name
        vouch.unlink()
        vouch.mkdir()
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    plan = plan_job(spec_for(tmp_path, "b"), engine_identity=ENGINE)
    assert plan.cache.hits == (len(IDS) if planted == "a folder as a commit" else 0)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(("is not read" if "vouch" in planted else "cache: skipping") in m for m in warned)


def test_an_input_rewritten_between_the_plans_two_reads_never_files_an_answer_under_another_texts_key(
    tmp_path, fake_engine_factory, monkeypatch
):
    """The plan reads the input twice when the cache has entries: the keys pass (hit or miss, each row's key), then
    the misses file (the values the worker renders). A writer of the input swaps a row's text in between and puts
    the first bytes back before the merge (an S3 object rewritten with its old bytes keeps its ETag, so the merge's
    check that the input is unchanged passes; simulated here). The misses file must carry the key of the values it
    holds: before, it carried the first read's key beside the second read's text, so the merge filed the answer to
    the swapped-in text under the key of the original one, and every later run asking the original text got it."""
    from airflow_provider_vllm.steps.cache import matching
    from airflow_provider_vllm.steps.merge import merger

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    run_job(spec_for(tmp_path, "a"), fake_engine_factory)  # the cache has entries: the plan reads the input twice
    original = tmp_path / "in-b.parquet"
    write_parquet(original, IDS + ["asked"], TEXTS + ["the text a later run asks"])
    first = original.read_bytes()
    swapped = tmp_path / "swapped.parquet"
    write_parquet(swapped, IDS + ["asked"], TEXTS + ["another text altogether"])
    real = matching.write_misses

    def racing(*args, **kwargs):  # between the keys pass and the misses file: the text swapped, then put back
        original.write_bytes(swapped.read_bytes())
        try:
            return real(*args, **kwargs)
        finally:
            original.write_bytes(first)

    monkeypatch.setattr(matching, "write_misses", racing)
    monkeypatch.setattr(merger, "check_unchanged", lambda *a, **k: None)  # S3: the same bytes, the same ETag
    s2 = spec_for(tmp_path, "b")
    with pytest.raises(InputChangedError, match="changed while the plan read it"):
        run_job(s2, fake_engine_factory)
    assert not (tmp_path / "out-b" / PLAN_FILE).exists()  # nothing a worker or the merge could act on
    monkeypatch.undo()
    p2, _ = run_job(s2, fake_engine_factory)  # planned again once the input holds still
    assert p2.cache.misses == 1

    # a later run asks the original text: it must get that text's answer, as a run without the cache computes it
    write_parquet(tmp_path / "in-c.parquet", ["later"], ["the text a later run asks"])
    s3 = spec_for(tmp_path, "c")
    run_job(s3, fake_engine_factory)
    fresh = make_spec(
        tmp_path / "in-c.parquet",
        tmp_path / "out-fresh",
        model={"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
    )
    run_job(fresh, fake_engine_factory)
    got, want = results(s3)["later"], results(fresh)["later"]
    assert got["prompt_hash"] == want["prompt_hash"], "the answer of another text was served from the cache"


@pytest.mark.parametrize(
    "forged",
    [
        "a genuine entry of another cache folder copied here",
        "an entry sealed with the worker key for the cache-entry domain",
        "a genuine entry of another key config moved under this one",
    ],
)
def test_entries_no_trusted_writer_vouched_for_here_serve_nothing(tmp_path, fake_engine_factory, caplog, forged):
    """What a shard worker (the worker key only) or a writer of one cache folder can make of genuine entries: a
    commit sealed for another cache folder (the seal's scope), one a worker sealed itself with its key for the
    cache-entry domain (its HMAC made by hand: the worker keyring refuses the domain), and one of another key config
    put in this key config's folder (the sealed key_hash) are read as no entry: every row is a miss."""
    import hmac
    import shutil

    from airflow_provider_vllm.core.seal import FORMAT, Seal, canonical, kid_of, sealed_doc

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    other = "other-cache" if "cache folder" in forged else "cache"
    prompt = {"template": "Ticket:  {text}"} if "key config" in forged else {}
    s1 = spec_for(tmp_path, "a", cache_dir=tmp_path / other, **({"prompt": prompt} if prompt else {}))
    p1, _ = run_job(s1, fake_engine_factory)
    eid = cache_entry_id(s1, p1)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    here = tmp_path / "cache"
    src_commit = _commit(tmp_path / other, p1, eid)
    if "cache folder" in forged:
        shutil.copytree(tmp_path / other, here)
    elif "worker key" in forged:
        c = CacheCommit.model_validate_json(src_commit.read_bytes())
        wk = Keyring.from_env().worker_keyring()
        key = next(iter(wk._workers.by_kid.values()))
        doc = sealed_doc(c)
        msg = b"\x00".join([FORMAT, CACHE_ENTRY.encode(), scope_of(str(here)).encode(), canonical(doc)])
        seal = Seal(kid=kid_of(key), mac=hmac.new(key, msg, hashlib.sha256).hexdigest())
        src_commit.write_bytes(record_bytes(c.model_copy(update={"seal": seal})))
    p2, _ = run_job(s2, fake_engine_factory)
    if "key config" in forged:  # moved into the folder this key config's plan lists
        assert p2.cache.hits == 0
        s3 = spec_for(tmp_path, "c")
        write_parquet(tmp_path / "in-c.parquet", IDS, TEXTS)
        mine = _commit(here, p2, "f" * 32)
        mine.write_bytes(src_commit.read_bytes())
        p3 = plan_job(s3, engine_identity=ENGINE)
        assert p3.cache.commits_read == [cache_entry_id(s2, p2)]  # only run b's own entry
        return
    assert p2.cache.hits == 0 and p2.cache.commits_read == []
    assert f"cache: skipping {src_commit if 'worker' in forged else _commit(here, p1, eid)}" in caplog.text


def test_a_run_merged_again_with_other_answers_files_those_answers_not_the_first_merges(
    tmp_path, fake_engine_factory, monkeypatch
):
    """A run's shards answered wrongly (say, a faulty GPU: every row one label), its merge filed those answers in the
    cache, QA caught them; the shards' folders are deleted, the shards run again and the run is merged again with
    the right answers, which it publishes. The cache must then serve what that run published. Before, the entry's id
    came from the run alone: the second merge found the first merge's commit, appended nothing
    (``committed_by: earlier_merge``), and every later run was served the wrong answers."""
    import shutil

    from tests.support import fakes

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    with monkeypatch.context() as m:
        m.setattr(fakes, "answer", lambda spec, *a, **k: spec.sampling.structured.choice[0])  # the faulty node
        p1, m1 = run_job(s1, fake_engine_factory, publish=False)  # QA caught them: not published
    assert m1["cache"]["committed_by"] == "this_merge"
    wrong = {i: r["label"] for i, r in results(s1).items()}
    shutil.rmtree(tmp_path / "out-a" / "shards")  # the operator deletes the shards' folders and runs them again
    for s in p1.shards:
        run_shard(shard_task(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    m1b = merge(s1).dump()
    vouch_cache(s1)  # the run is published with the right answers
    published = {i: r["label"] for i, r in results(s1).items()}
    assert published != wrong and m1b["cache"]["appended"] == len(IDS)
    assert m1b["cache"]["entry_id"] != m1["cache"]["entry_id"]
    assert _entries(tmp_path / "cache") == [f"{m1b['cache']['entry_id']}.json"]  # the first merge's: superseded, gone
    assert merge(s1).dump()["cache"]["committed_by"] == "earlier_merge"  # merged again over the same parts: once

    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    p2, _ = run_job(s2, fake_engine_factory)
    assert p2.cache.hits == len(IDS)
    assert {i: r["label"] for i, r in results(s2).items()} == published


def test_a_merge_killed_before_it_removed_the_entries_it_supersedes_serves_only_what_is_published(
    tmp_path, fake_engine_factory, monkeypatch, set_faults
):
    """A run merged over parts A, then B, then A again (its shards run again each time; a rerun's parts are other bytes,
    so each merge files its own entry): the third merge stops right after its commit, before it removes the second
    merge's entry. No merge of the run is published yet: a later run is served nothing. Merged to the end and
    published, a later run is served the answers the run's last merge published, never the second merge's."""
    import shutil

    from tests.support import fakes

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    faulty = lambda spec, *a, **k: spec.sampling.structured.choice[0]  # noqa: E731

    def merge_again(answer=None):
        shutil.rmtree(tmp_path / "out-a" / "shards")
        with monkeypatch.context() as m:
            if answer is not None:
                m.setattr(fakes, "answer", answer)
            for s in p1.shards:
                run_shard(shard_task(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)
        return merge(s1)

    with monkeypatch.context() as m:
        m.setattr(fakes, "answer", faulty)
        p1, _ = run_job(s1, fake_engine_factory, publish=False)
    merge_again()  # B: the right answers
    set_faults("cache.after_commit=raise")
    with pytest.raises(faults.InjectedFault):
        merge_again(faulty)  # A again, stopped before it removed B's entry
    set_faults("")
    published = {i: r["label"] for i, r in results(s1).items()}  # the parts A, as merged last (not yet sealed)
    assert set(published.values()) == {LABELS[0]}
    write_parquet(tmp_path / "in-x.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "x"), engine_identity=ENGINE).cache.hits == 0  # nothing published

    merge(s1)  # to the end (the second merge's entry removed), then published
    vouch_cache(s1)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    p2, _ = run_job(spec_for(tmp_path, "b"), fake_engine_factory)
    assert p2.cache.hits == len(IDS)
    assert {i: r["label"] for i, r in results(spec_for(tmp_path, "b")).items()} == published


def test_a_run_planned_again_at_its_prefix_keeps_the_entry_its_plan_was_served_from(tmp_path, fake_engine_factory):
    """The operator deletes a run's output prefix and runs the job again there (same spec): its new plan is served
    the first plan's answers from the cache (its entry, in commits_read) and sends only the new rows to the shards.
    Its merge files those as a new entry; the first plan's entry is no earlier merge of this plan (its answers are
    what the new run published as hits) and must stay live. Before, every live entry of the same output prefix and
    spec was superseded and removed: the next run paid again for every row the first plan had answered."""
    import shutil

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    _, m1 = run_job(s1, fake_engine_factory)
    first = m1["cache"]["entry_id"]
    shutil.rmtree(tmp_path / "out-a")  # the prefix deleted; the job runs again there over a grown input
    write_parquet(tmp_path / "in-a.parquet", IDS + ["n1", "n2"], TEXTS + ["new ticket one", "new ticket two"])
    p1b, m1b = run_job(s1, fake_engine_factory)
    assert p1b.cache.hits == len(IDS) and first in p1b.cache.commits_read
    assert m1b["cache"]["appended"] == 2 and m1b["cache"]["committed_by"] == "this_merge"
    assert _entries(tmp_path / "cache") == sorted([f"{first}.json", f"{m1b['cache']['entry_id']}.json"])

    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    p2, _ = run_job(spec_for(tmp_path, "b"), fake_engine_factory)
    assert p2.cache.hits == len(IDS)


def test_a_supersede_cut_short_is_finished_by_the_merge_run_again(
    tmp_path, fake_engine_factory, monkeypatch, set_faults
):
    """A run merged again over other parts commits its entry (superseding its first merge's) and fails before it
    removed the first merge's entry. The merge run again (Airflow's retry) finds its commit; it must remove what that
    commit supersedes. Before, it returned at once: the first merge's commit stayed, hidden only by the new commit's
    ``supersedes``, and the first compaction that took the new entry in (and removed its commit) brought the replaced
    answers back to life for every key the new entry lacks."""
    import shutil

    from airflow_provider_vllm.steps.cache import store as store_mod
    from tests.support import fakes

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    with monkeypatch.context() as m:
        m.setattr(fakes, "answer", lambda spec, *a, **k: spec.sampling.structured.choice[0])  # the faulty node
        p1, m1 = run_job(s1, fake_engine_factory)
    first = m1["cache"]["entry_id"]
    shutil.rmtree(tmp_path / "out-a" / "shards")
    for s in p1.shards:
        run_shard(shard_task(spec=s1, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    set_faults("cache.after_commit=raise")
    with pytest.raises(faults.InjectedFault):
        merge(s1)
    set_faults("")
    again = merge(s1).dump()["cache"]
    assert again["committed_by"] == "earlier_merge"
    assert _entries(tmp_path / "cache") == [f"{again['entry_id']}.json"]  # the first merge's: gone
    vouch_cache(s1)  # the run merged again is published: its new entry is vouched for, compaction takes it in

    # another run's entry, then a compaction of the live entries: the first merge's stays gone
    write_parquet(tmp_path / "in-b.parquet", ["b1", "b2"], ["other ticket one", "other ticket two"])
    run_job(spec_for(tmp_path, "b"), fake_engine_factory)
    monkeypatch.setattr(store_mod, "COMPACT_AFTER", 1)
    st = CacheStore(str(tmp_path / "cache"), {}, Keyring.from_env())
    khash = p1.cache.key_hash
    assert st.compact(khash, str(tmp_path / "work")) is not None
    assert first not in [c.entry_id for c in st.committed(khash)]


def _typed_input(path: Path, n: int) -> None:
    import decimal

    pq.write_table(
        pa.table(
            {
                "id": [f"t{i}" for i in range(n)],
                "text": [f"x{i}" for i in range(n)],
                "f": pa.array([[None, float("nan"), -0.0, 0.0, 1 / 3, 1e300, -7.5][i % 7] for i in range(n)]),
                "g": pa.array([i * 0.1 for i in range(n)], pa.float32()),
                "d": pa.array(
                    [None if i % 6 == 0 else decimal.Decimal(f"{i}.{i:02d}") for i in range(n)], pa.decimal128(10, 2)
                ),
                "b": pa.array([None if i % 3 == 0 else bool(i % 2) for i in range(n)], pa.bool_()),
                "u": pa.array(list(range(n)), pa.uint64()),
                "i8": pa.array([None if i % 2 else -i for i in range(n)], pa.int8()),
                "nul": pa.nulls(n),
            }
        ),
        path,
    )


def test_the_misses_files_key_computed_again_is_the_keys_passes_for_typed_values(tmp_path, fake_engine_factory):
    """The misses file's key is computed again over the values written beside it and must equal the keys pass's
    (else InputChangedError): for NULLs, NaN, -0.0, floats, decimals, booleans, unsigned and small integers and a
    column of Parquet's null type, the two agree, so a plan over such an input with cache entries to look in is
    made, and its hits are the rows the first run answered."""
    prompt = {"template": "{text}|{f}|{g}|{d}|{b}|{u}|{i8}|{nul}", "text_columns": ["text"]}
    _typed_input(tmp_path / "in-a.parquet", 30)
    _, m1 = run_job(spec_for(tmp_path, "a", prompt=prompt), fake_engine_factory)
    assert m1["cache"]["appended"] == m1["ok_rows"] > 0
    _typed_input(tmp_path / "in-b.parquet", 40)
    p2, m2 = run_job(spec_for(tmp_path, "b", prompt=prompt), fake_engine_factory)
    assert p2.cache.hits == m1["ok_rows"] and p2.cache.misses == 40 - m1["ok_rows"]
    assert m2["rows"] == 40


# ---- only the entries of published runs serve ---------------------------------------------
def _vouch_path(store: Path, khash: str, eid: str) -> Path:
    return store / CacheStore.vouch_dir(khash) / f"{eid}.json"


def test_a_merged_run_serves_later_runs_only_once_it_is_published(tmp_path, fake_engine_factory):
    """The merge files a run's answers before QA and the review: a run that fails them is never published, and its
    answers must serve no later run (QA's gates are statistical: a later night could pass and publish them). Before,
    the next plan was served every row of a run merged and never published."""
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, m1 = run_job(s1, fake_engine_factory, publish=False)
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    p2 = plan_job(spec_for(tmp_path, "b"), engine_identity=ENGINE)
    assert (p2.cache.hits, p2.cache.commits_read) == (0, [])
    assert m1["cache"]["appended"] == 50 and m1["cache"]["commit_mac"]
    assert vouch_cache(s1) == cache_entry_id(s1, p1)  # what publish does once the run is published
    write_parquet(tmp_path / "in-c.parquet", IDS, TEXTS)
    p3, _ = run_job(spec_for(tmp_path, "c"), fake_engine_factory)
    assert (p3.cache.hits, p3.cache.commits_read) == (50, [cache_entry_id(s1, p1)])
    assert {i: r["label"] for i, r in results(spec_for(tmp_path, "c")).items()} == {
        i: r["label"] for i, r in results(s1).items()
    }
    assert vouch_cache(s1) == cache_entry_id(s1, p1)  # published again (a retried publish): the same
    write_parquet(tmp_path / "in-d.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "d"), engine_identity=ENGINE).cache.hits == 50


def _worker_sealed(record, store: Path) -> bytes:
    """The record sealed by hand with the worker key for the cache-published domain (a worker keyring refuses it)."""
    import hmac

    from airflow_provider_vllm.core.seal import CACHE_PUBLISHED, FORMAT, canonical, kid_of

    wkey = Keyring.from_env().worker_text().split(",")[0].encode()
    doc = record.model_dump(mode="json", exclude_unset=True, exclude={"seal"})
    msg = b"\x00".join([FORMAT, CACHE_PUBLISHED.encode(), scope_of(str(store)).encode(), canonical(doc)])
    doc["seal"] = {"kid": kid_of(wkey), "mac": hmac.new(wkey, msg, hashlib.sha256).hexdigest()}
    return json.dumps(doc).encode()


@pytest.mark.reliability
@pytest.mark.parametrize(
    "forged",
    [
        "an unsealed record",
        "a record sealed with the worker key",
        "a genuine record of another cache folder",
        "a genuine record of another entry",
        "a genuine record of the entry's commit before it was written again",
    ],
)
def test_a_vouch_record_no_publish_of_this_cache_wrote_for_this_commit_serves_nothing(
    tmp_path, fake_engine_factory, caplog, forged
):
    """Whoever can write the cache folder plants a vouch record beside the entry of a run that was never published:
    every row of the next run is a miss."""
    from airflow_provider_vllm.core.records import CacheVouch

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, m1 = run_job(s1, fake_engine_factory, publish=False)  # failed QA: never published
    store, khash, eid = tmp_path / "cache", p1.cache.key_hash, cache_entry_id(s1, p1)
    mac = m1["cache"]["commit_mac"]
    genuine = CacheVouch(
        entry_id=eid, key_hash=khash, commit_mac=mac, vouched_by="publish", source_output_uri="", created="x"
    )
    path = _vouch_path(store, khash, eid)
    path.parent.mkdir(parents=True)
    if forged == "an unsealed record":
        path.write_bytes(record_bytes(genuine))
    elif forged == "a record sealed with the worker key":
        path.write_bytes(_worker_sealed(genuine, store))
    elif forged == "a genuine record of another cache folder":
        # what a publish of that other cache writes (CacheStore.vouch): sealed for its own folder
        other = scope_of(str(tmp_path / "other-cache"))
        path.write_bytes(record_bytes(seal_record(Keyring.from_env(), CACHE_PUBLISHED, other, genuine)))
    elif forged == "a genuine record of another entry":
        write_parquet(tmp_path / "in-o.parquet", IDS, [t + " (other)" for t in TEXTS])
        so = spec_for(tmp_path, "o")
        po, _ = run_job(so, fake_engine_factory)  # published: its own texts serve
        path.write_bytes(_vouch_path(store, khash, cache_entry_id(so, po)).read_bytes())
    else:  # vouched for once, then the commit under that id replaced by another the merge sealed (a later merge)
        _vouch(store, khash, eid)
        marker = _commit(store, p1, eid)
        c = CacheCommit.model_validate_json(marker.read_bytes())
        os.chmod(marker, 0o644)
        again = c.model_copy(update={"created": "2999-01-01T00:00:00+00:00", "seal": None})
        marker.write_bytes(record_bytes(seal_record(Keyring.from_env(), CACHE_ENTRY, scope_of(str(store)), again)))
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    p2 = plan_job(spec_for(tmp_path, "b"), engine_identity=ENGINE)
    assert p2.cache.hits == 0 and eid not in p2.cache.commits_read
    assert f"cache: entry {eid} is not read" in caplog.text


@pytest.mark.reliability
def test_an_unpublished_entry_hides_no_published_entry_and_is_removed_after_the_bound(tmp_path, fake_engine_factory):
    """An unpublished commit's ``supersedes`` counts for no reader (the answers last published keep serving); an entry
    no publish vouched for is removed by the sweep a merge of its key config runs once it is older than
    ``UNPUBLISHED_KEEP``, never before."""
    import shutil
    from datetime import UTC, datetime

    from airflow_provider_vllm.steps.cache import store as store_mod

    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    p1, m1 = run_job(s1, fake_engine_factory)  # published
    store = tmp_path / "cache"
    c = CacheStore(str(store), {}, Keyring.from_env())
    khash = p1.cache.key_hash
    assert [x.entry_id for x in c.committed(khash)] == [m1["cache"]["entry_id"]]
    # an entry of this deployment's merge, never published, whose commit supersedes the published entry
    written = CacheCommit.model_validate_json(_commit(store, p1, m1["cache"]["entry_id"]).read_bytes())
    forged = written.model_copy(update={"entry_id": "c" * 32, "supersedes": [written.entry_id], "seal": None})
    shutil.copytree(store / "entries" / written.entry_id, store / "entries" / ("c" * 32))
    forged_files = [f.model_copy(update={"path": f"entries/{'c' * 32}/part-00000.parquet"}) for f in forged.files]
    forged = forged.model_copy(update={"files": forged_files})
    _commit(store, p1, "c" * 32).write_bytes(
        record_bytes(seal_record(Keyring.from_env(), CACHE_ENTRY, scope_of(str(store)), forged))
    )
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    assert plan_job(spec_for(tmp_path, "b"), engine_identity=ENGINE).cache.hits == 50  # the published entry
    # the sweep: a month on, the unpublished entry is removed; the published one stays
    assert c.sweep(khash, keep="") == []  # within the bound: kept for its publish
    later = datetime.now(UTC) + store_mod.UNPUBLISHED_KEEP + store_mod.timedelta(days=1)
    assert c.sweep(khash, keep="", at=later) == ["c" * 32]
    assert not (store / "entries" / ("c" * 32)).exists() and not _commit(store, p1, "c" * 32).exists()
    assert [x.entry_id for x in c.committed(khash)] == [m1["cache"]["entry_id"]]


@pytest.mark.reliability
def test_compaction_folds_only_published_entries_and_its_entry_keeps_serving(
    tmp_path, fake_engine_factory, monkeypatch, set_faults
):
    """Compaction (here after 2 live entries) reads what the plan reads: only published entries. Its entry holds only
    their answers, is vouched for by construction and serves them; a run never published is neither folded in nor
    superseded. Stopped between its commit and its vouch record, the entries it would fold keep serving, and a later
    merge completes it."""
    from airflow_provider_vllm.steps.cache import store as store_mod

    monkeypatch.setattr(store_mod, "COMPACT_AFTER", 2)
    texts = {r: [f"{t} ({r})" for t in TEXTS] for r in "abcdef"}
    specs, plans = {}, {}
    for r, published in (("a", True), ("b", True), ("c", False), ("d", True)):
        write_parquet(tmp_path / f"in-{r}.parquet", IDS, texts[r])
        specs[r] = spec_for(tmp_path, r)
        plans[r], m = run_job(specs[r], fake_engine_factory, publish=published)
        assert "compacted_into" not in m["cache"]
    store = tmp_path / "cache"
    khash = plans["a"].cache.key_hash
    unpublished = cache_entry_id(specs["c"], plans["c"])
    # run e's merge finds 3 published entries: it compacts them, stopped before its vouch record
    write_parquet(tmp_path / "in-e.parquet", IDS, texts["e"])
    specs["e"] = spec_for(tmp_path, "e")
    set_faults("cache.before_vouch=raise")
    with pytest.raises(faults.InjectedFault):
        run_job(specs["e"], fake_engine_factory, publish=False)
    set_faults("")
    folded = sorted(cache_entry_id(specs[r], plans[r]) for r in "abd")
    eid = hashlib.sha256("\n".join(folded).encode()).hexdigest()[:32]
    assert _commit(store, plans["a"], eid).exists() and not _vouch_path(store, khash, eid).exists()
    everything = IDS + [f"{i}-{r}" for r in "bcd" for i in IDS]
    write_parquet(tmp_path / "in-x.parquet", everything, texts["a"] + texts["b"] + texts["c"] + texts["d"])
    px = plan_job(spec_for(tmp_path, "x"), engine_identity=ENGINE)
    assert px.cache.hits == 150 and sorted(px.cache.commits_read) == folded  # the three, not the unfinished one

    # the next run's merge completes the compaction (the same entries: the same entry)
    write_parquet(tmp_path / "in-f.parquet", IDS, texts["f"])
    _, mf = run_job(spec_for(tmp_path, "f"), fake_engine_factory)
    assert mf["cache"]["compacted_into"] == eid
    vouch = json.loads(_vouch_path(store, khash, eid).read_text())
    assert vouch["vouched_by"] == "compaction"
    assert vouch["commit_mac"] == json.loads(_commit(store, plans["a"], eid).read_text())["seal"]["mac"]
    compacted = pq.read_table(store / "entries" / eid / "part-00000.parquet")
    assert compacted.num_rows == 150 and set(compacted.column("cached_from").to_pylist()) == {
        specs[r].io.output_uri.rstrip("/") for r in "abd"
    }
    assert all(not _commit(store, plans["a"], e).exists() for e in folded)  # superseded, removed
    assert _commit(store, plans["a"], unpublished).exists()  # never folded in, never superseded: still waits
    write_parquet(tmp_path / "in-y.parquet", everything, texts["a"] + texts["b"] + texts["c"] + texts["d"])
    py, _ = run_job(spec_for(tmp_path, "y"), fake_engine_factory)
    assert py.cache.hits == 150 and eid in py.cache.commits_read and unpublished not in py.cache.commits_read
    labels = {i: r["label"] for i, r in results(spec_for(tmp_path, "y")).items()}
    assert all(labels[i] == r["label"] for i, r in results(specs["a"]).items())


def _zoned_input(path: Path, zone: str, n: int) -> None:
    """Rows with a date, a timestamp in ``zone`` (the same instants in every zone) and a decimal."""
    import datetime as dt
    import decimal

    at = [dt.datetime(2024, 3, 1, 9, i, 30, i, tzinfo=dt.UTC) for i in range(n)]
    pq.write_table(
        pa.table(
            {
                "id": [f"t{i}" for i in range(n)],
                "text": [f"x{i}" for i in range(n)],
                "due": pa.array([None if i % 7 == 0 else dt.date(2024, 3, 1 + i % 20) for i in range(n)], pa.date32()),
                "opened": pa.array(at, pa.timestamp("us", tz=zone)),
                "amount": pa.array([decimal.Decimal(f"{i}.{i % 10}0") for i in range(n)], pa.decimal128(10, 2)),
            }
        ),
        path,
    )


def test_the_same_instants_in_another_time_zone_are_cache_hits_with_the_same_prompts(tmp_path, fake_engine_factory):
    """The key of a TIMESTAMPTZ is its instant, so a file that carries the same instants in another zone has the same
    keys: its rows are hits. That is right only because the worker renders the instant (in UTC), never the file's
    zone: the same file run without the cache sends prompts byte-identical (the same prompt hashes) to the first
    run's, whose prompts the worker rendered from the misses file (DuckDB's copy) of the other zone's file."""
    prompt = {"template": "{text} due {due} opened {opened} amount {amount}", "text_columns": ["text"]}
    _zoned_input(tmp_path / "in-a.parquet", "Europe/Berlin", 30)
    _, m1 = run_job(spec_for(tmp_path, "a", prompt=prompt), fake_engine_factory)
    assert m1["ok_rows"] == m1["cache"]["appended"] == 30 and m1["error_rows"] == 0
    _zoned_input(tmp_path / "in-b.parquet", "America/New_York", 30)
    p2, m2 = run_job(spec_for(tmp_path, "b", prompt=prompt), fake_engine_factory)
    assert (p2.cache.hits, p2.cache.misses, m2["ok_rows"]) == (30, 0, 30)
    fresh = spec_for(tmp_path, "b", prompt=prompt, cache={"uri": None}, io={"output_uri": str(tmp_path / "out-c")})
    _, m3 = run_job(fresh, fake_engine_factory)
    assert m3["ok_rows"] == 30
    first, again = results(spec_for(tmp_path, "a", prompt=prompt)), results(fresh)
    assert all(r["prompt_hash"] for r in first.values())
    assert {i: r["prompt_hash"] for i, r in again.items()} == {i: r["prompt_hash"] for i, r in first.items()}
