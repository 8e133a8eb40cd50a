"""What the pipeline reuses or publishes is read from local copies checked as they were copied
(``storage.CheckedCopies``), never from a second read of the bucket after a check.

Each test is a writer of the output prefix who replaces files right after the pipeline checked them and (where
it says so) puts the genuine bytes back afterwards, so that every later check passes. The write lands at the
pipeline's own seams (a checking function returning, a fault point); the write itself is an ordinary file
replacement that anyone who can write the prefix can make."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.storage import CheckedCopies, Storage
from airflow_provider_vllm.steps.merge import merger
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa import stage
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, openai_batch_spec, shard_task, vouch_cache, write_parquet
from tests.support.ledger import record_malicious
from tests.unit.steps.cache.test_result_cache import ENGINE, IDS, TEXTS, results, spec_for
from tests.unit.steps.test_golden import _golden_file, _input, _run_shards, _spec


def _forge(path: Path, column: str, value) -> bytes:
    """Replace the Parquet file ``path`` by one whose ``column`` is ``value(table)``; its genuine bytes."""
    genuine = path.read_bytes()
    t = pq.read_table(path)
    t = t.set_column(t.schema.get_field_index(column), column, value(t))
    path.unlink()  # a new file under the same name, as a bucket writer's PUT makes
    pq.write_table(t, path)
    return genuine


def _put_back(saved: dict[Path, bytes]) -> None:
    for p, b in saved.items():
        p.unlink()
        p.write_bytes(b)


def _forged(t: pa.Table) -> pa.Array:
    return pa.array(["FORGED"] * t.num_rows)


def _shards(spec, plan, fake_engine_factory) -> None:
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)


def test_a_checked_copy_is_the_checked_bytes_whatever_the_folder_holds_later(tmp_path):
    (tmp_path / "run").mkdir()
    f = tmp_path / "run" / "a.bin"
    f.write_bytes(b"genuine")
    digest = hashlib.sha256(b"genuine").hexdigest()
    copies = CheckedCopies(Storage(str(tmp_path / "run")), str(tmp_path / "copies"))
    local = copies.get("a.bin", 7, digest)
    f.write_bytes(b"forged!")  # same size, other bytes: the copy is what was checked
    assert Path(local).read_bytes() == b"genuine"
    assert copies.get("a.bin", 7, digest) == local  # fetched once per (size, sha256)
    with pytest.raises(CommitError, match=r"a\.bin is not the file its sealed record names"):
        CheckedCopies(Storage(str(tmp_path / "run")), str(tmp_path / "other")).get("a.bin", 7, digest)
    assert not list((tmp_path / "other").iterdir())  # nothing of a file that failed its check is left to read


def test_parts_replaced_after_the_merge_checked_them_never_reach_the_cache(tmp_path, fake_engine_factory, monkeypatch):
    write_parquet(tmp_path / "in-a.parquet", IDS, TEXTS)
    s1 = spec_for(tmp_path, "a")
    _shards(s1, plan_job(s1, engine_identity=ENGINE), fake_engine_factory)
    out = Path(s1.io.output_uri)
    saved: dict[Path, bytes] = {}
    real_hit = faults.hit

    def writer(point, *a, **kw):
        if point == "merge.after_manifests":  # after the parts were checked and published, before the cache append
            for p in sorted((out / RESULTS).glob("part-*.parquet")):
                saved[p] = _forge(p, "label", _forged)
        return real_hit(point, *a, **kw)

    monkeypatch.setattr(faults, "hit", writer)
    # the entry is made from the copies the merge checked the parts with: the published parts are not read again
    merge(s1)
    monkeypatch.setattr(faults, "hit", real_hit)
    assert saved
    _put_back(saved)  # the genuine bytes again: the forged ones were in the bucket only while the merge ran

    # another run of the same settings and input: a cache entry made of the forged bytes would answer it
    write_parquet(tmp_path / "in-b.parquet", IDS, TEXTS)
    s2 = spec_for(tmp_path, "b")
    _shards(s2, plan_job(s2, engine_identity=ENGINE), fake_engine_factory)
    merge(s2)
    assert "FORGED" not in {r["label"] for r in results(s2).values()}
    merge(s1)  # the first run's merge, rerun over the genuine bytes, goes through
    assert "FORGED" not in {r["label"] for r in results(s1).values()}


@pytest.mark.reliability
def test_parts_replaced_after_the_merge_checked_them_never_reach_the_openai_files_it_seals(
    tmp_path, fake_engine_factory, monkeypatch
):
    """io.output_format=openai_batch: merge writes openai/output.jsonl from the parts and seals its sha256, so publish
    and verify_published pass whatever it wrote. Parts replaced in the bucket right after merge checked them must
    not be what it writes: it reads the copies its check made."""
    import json

    spec = openai_batch_spec(tmp_path, sharding={"target_rows": 6, "chunk_rows": 3})
    _shards(spec, plan_job(spec), fake_engine_factory)
    out = Path(spec.io.output_uri)
    saved: dict[Path, bytes] = {}
    real_hit = faults.hit

    def writer(point, *a, **kw):
        if point == "merge.after_manifests":  # the parts checked and published, the manifests written and hashed
            for p in sorted((out / RESULTS).glob("part-*.parquet")):
                saved[p] = _forge(p, "output", _forged)
        return real_hit(point, *a, **kw)

    monkeypatch.setattr(faults, "hit", writer)
    with pytest.raises(CommitError, match=r"results/part-\S+ is not the file its sealed record names"):
        merge(spec)  # the code before wrote the forged answers and sealed them
    monkeypatch.setattr(faults, "hit", real_hit)
    assert saved and not (out / "openai" / "output.jsonl").exists() and not (out / "_MERGED.json").exists()
    _put_back(saved)  # the genuine parts again
    merge(spec)  # the retry
    lines = [json.loads(x) for x in (out / "openai" / "output.jsonl").read_text().splitlines()]
    contents = {x["response"]["body"]["choices"][0]["message"]["content"] for x in lines}
    assert len(lines) == 12 and "FORGED" not in contents
    record_malicious("openai output written from parts replaced after merge's check", 1, 1)


def test_qa_measures_the_checked_bytes_when_parts_are_swapped_while_it_reads(
    tmp_path, fake_engine_factory, monkeypatch
):
    ids = [f"r{i:03d}" for i in range(50)]
    texts = ["" if i % 10 == 0 else f"ticket {i} about billing" for i in range(50)]  # 10 % EMPTY_INPUT errors
    write_parquet(tmp_path / "in.parquet", ids, texts)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 25, "chunk_rows": 10})
    _shards(spec, plan_job(spec), fake_engine_factory)
    merge(spec)
    out = Path(spec.io.output_uri)
    honest, _ = stage.qa_run(spec)
    assert honest.metrics["errors"] == 5
    saved: dict[Path, bytes] = {}
    real = stage.checked_parts

    def then_swapped(o, kind, merged, copies):
        parts = real(o, kind, merged, copies)
        if kind == ERRORS:  # the errors emptied right after their check, put back once QA is done
            for p in sorted((out / ERRORS).glob("part-*.parquet")):
                saved[p] = _forge(p, "error_code", _forged)
                pq.write_table(pq.read_table(p).slice(0, 0), p)
        return parts

    monkeypatch.setattr(stage, "checked_parts", then_swapped)
    swapped, _ = stage.qa_run(spec)
    _put_back(saved)
    assert saved
    assert (swapped.status, swapped.metrics["errors"], swapped.metrics["rates"]) == (
        honest.status,
        5,
        honest.metrics["rates"],
    )


def test_qa_refuses_a_manifest_whose_rows_are_not_the_sealed_ones(tmp_path, fake_engine_factory):
    """A manifest of other parts would need the sealed summary's sha256; this one checks the counts QA takes."""
    ids = [f"r{i:03d}" for i in range(20)]
    write_parquet(tmp_path / "in.parquet", ids, [f"ticket {i}" for i in ids])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 10})
    _shards(spec, plan_job(spec), fake_engine_factory)
    summary = merge(spec)
    copies = CheckedCopies(Storage(spec.io.output_uri), str(tmp_path / "copies"))
    forged = summary.model_copy(update={"ok_rows": summary.ok_rows + 1})
    with pytest.raises(CommitError, match="names 20 rows; the sealed _MERGED.json 21"):
        merger.checked_parts(Storage(spec.io.output_uri), RESULTS, forged, copies)


def test_followers_are_made_from_the_leaders_rows_that_were_checked(tmp_path, fake_engine_factory, monkeypatch):
    ids = [f"r{i:03d}" for i in range(40)]
    write_parquet(tmp_path / "in.parquet", ids, [f"ticket {i % 20} about billing" for i in range(40)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    plan = plan_job(spec)
    assert plan.dedupe is not None and plan.dedupe.followers == 20
    _shards(spec, plan, fake_engine_factory)
    out = Path(spec.io.output_uri)
    real = merger._follower_sources

    def swapped_meanwhile(o, p, sources, copies):  # the leaders' chunks forged while the followers are made
        saved = {out / sp.rel: _forge(out / sp.rel, "label", _forged) for sp in sources[RESULTS]}
        try:
            return real(o, p, sources, copies)
        finally:
            _put_back(saved)

    monkeypatch.setattr(merger, "_follower_sources", swapped_meanwhile)
    merge(spec)  # the followers are made from the copies the leaders' chunks were checked with, not a second read
    assert "FORGED" not in {r["label"] for r in results(spec).values()}


def test_the_parts_merge_reads_again_are_read_from_the_bucket_once(tmp_path, fake_engine_factory, monkeypatch):
    """The computed parts that the followers (and a cache entry) are made from are checked by copying them: one
    read of each from the bucket, not a streaming check and then a copy."""
    ids = [f"r{i:03d}" for i in range(40)]
    write_parquet(tmp_path / "in.parquet", ids, [f"ticket {i % 20} about billing" for i in range(40)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 10, "chunk_rows": 5})
    plan = plan_job(spec)
    assert plan.dedupe is not None and plan.dedupe.followers == 20
    _shards(spec, plan, fake_engine_factory)
    chunk = sorted(Path(spec.io.output_uri).glob("shards/*/attempts/*/chunk-00001.parquet"))[0]
    genuine = _forge(chunk, "label", _forged)  # a part checked by copying fails like one checked by reading
    with pytest.raises(CommitError, match=rf"{chunk.name} does not match its commit marker"):
        merge(spec)
    _put_back({chunk: genuine})
    reads: dict[str, int] = {}
    real_open, real_open_read = Storage.open, Storage._open_read

    def count(rel: str) -> None:
        if rel.startswith("shards/") and rel.endswith(".parquet"):  # the parts, not the JSON markers beside them
            reads[rel] = reads.get(rel, 0) + 1

    def counted(self, rel, mode="rb"):
        if "r" in mode:
            count(rel)
        return real_open(self, rel, mode)

    def counted_read(self, rel):  # the checked readers' open (sha256, fetch_verified)
        count(rel)
        return real_open_read(self, rel)

    monkeypatch.setattr(Storage, "open", counted)
    monkeypatch.setattr(Storage, "_open_read", counted_read)
    merge(spec)
    monkeypatch.setattr(Storage, "open", real_open)
    monkeypatch.setattr(Storage, "_open_read", real_open_read)
    parts = {
        p.rel
        for k in (RESULTS, ERRORS)
        for p in merger.committed_parts(
            Storage(spec.io.output_uri), plan, merger.RunSeal(merger.Keyring.from_env(), plan.seal.mac)
        )[0][k]
    }
    assert len(parts) >= 8 and set(reads) == parts
    assert reads == dict.fromkeys(parts, 1)  # the followers' source rows came from the copies the check made
    assert "FORGED" not in {r["label"] for r in results(spec).values()}


def test_golden_answers_replaced_after_their_check_are_never_scored(tmp_path, monkeypatch):
    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    plan = plan_job(spec)
    _run_shards(spec, plan)
    out = Path(spec.io.output_uri)
    truth = pq.read_table(out / plan.golden.input_file.path)
    known = dict(zip(truth.column("id").to_pylist(), truth.column("_vllm_golden_label").to_pylist()))
    real = merger.committed_parts

    answered: dict[str, str] = {}

    def then_swapped(o, p, run, *copying):
        got = real(o, p, run, *copying)
        if any(s.shard_id.startswith("golden") for s in p.shards):  # the golden shards: every answer made right
            for sp in got[0][RESULTS]:
                t = pq.read_table(out / sp.rel)
                answered.update(zip(t.column("id").to_pylist(), t.column("label").to_pylist()))
                _forge(out / sp.rel, "label", lambda t: pa.array([known[i] for i in t.column("id").to_pylist()]))
        return got

    monkeypatch.setattr(merger, "committed_parts", then_swapped)
    merge(spec)  # the golden rows are read from the copies their check made, never from the forged files
    scored = pq.read_table(out / "golden" / "results.parquet")
    assert answered and answered != {i: known[i] for i in answered}  # the forgery would have changed the answers
    assert dict(zip(scored.column("id").to_pylist(), scored.column("label").to_pylist())) == answered


def test_a_copies_folder_left_by_a_killed_task_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """A task killed with SIGKILL leaves its copies (up to a run's results/): the next task of that step removes
    folders of a process that is gone once they are a day old, and nothing else."""
    import os
    import subprocess
    import sys
    import time

    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    old = time.time() - storage.STALE_COPIES_S - 60

    def folder(name: str, age: float | None = None) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "part.parquet").write_bytes(b"x" * 100)
        if age is not None:
            os.utime(tmp_path / name, (age, age))
        return tmp_path / name

    stale = folder(f"vllm-batch-qa-{gone.pid}-abc", old)
    recent = folder(f"vllm-batch-qa-{gone.pid}-def")  # the same dead process, not yet a day old
    alive = folder(f"vllm-batch-qa-{os.getppid()}-ghi", old)  # a process that still runs
    other_step = folder(f"vllm-batch-merge-{gone.pid}-jkl", old)
    with storage.copies_folder("qa") as mine:
        assert Path(mine).parent == tmp_path and Path(mine).name.startswith(f"vllm-batch-qa-{os.getpid()}-")
        assert oct(Path(mine).stat().st_mode & 0o777) == "0o700"
        assert not stale.exists() and recent.exists() and alive.exists() and other_step.exists()
    assert not Path(mine).exists()


def test_every_private_folder_of_plan_merge_cache_and_changes_is_swept_after_a_kill(tmp_path, monkeypatch):
    """The plan's misses file and ride-along copies, the cache's and the dedupe's copies, the merge's re-encoded
    parts and the change set's copies (each up to GBs) live in a ``copies_folder`` of their step, and DuckDB's
    spill directories in the process's ``duckdb`` one: what a task killed with SIGKILL leaves under ``TMPDIR`` is
    removed by the next task of that step, not kept for ever."""
    import os
    import re
    import subprocess
    import sys
    import tempfile
    import time

    from airflow_provider_vllm.core import storage
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.core.formats.files import find_input
    from airflow_provider_vllm.steps.cache.result_cache import expected
    from airflow_provider_vllm.steps.merge.changes import compute_changes
    from tests.support.data import PINNED_REVISION

    temp = tmp_path / "tmpdir"
    temp.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    old = time.time() - storage.STALE_COPIES_S - 60
    steps = ("plan", "golden", "cache", "dedupe", "merge", "changes", "duckdb")
    left = []
    for step in steps:  # what a task of each step killed a day ago left
        (temp / f"vllm-batch-{step}-{gone.pid}-left").mkdir()
        (temp / f"vllm-batch-{step}-{gone.pid}-left" / "copy.parquet").write_bytes(b"x" * 100)
        os.utime(temp / f"vllm-batch-{step}-{gone.pid}-left", (old, old))
        left.append(temp / f"vllm-batch-{step}-{gone.pid}-left")
    made: list[str] = []
    real = tempfile.mkdtemp

    def spy(*args, **kwargs):
        path = real(*args, **kwargs)
        if Path(path).parent == temp:
            made.append(Path(path).name)
        return path

    def swept(call, *args, **kwargs):
        """``call`` with ``TMPDIR`` the test's folder, each folder made directly in it recorded."""
        with monkeypatch.context() as m:
            m.setattr(tempfile, "tempdir", str(temp))
            m.setattr(tempfile, "mkdtemp", spy)
            return call(*args, **kwargs)

    _golden_file(tmp_path / "golden.parquet")
    over = {
        "cache": {"uri": str(tmp_path / "cache")},
        "model": {"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
    }
    texts = [f"ticket {i % 60}" for i in range(90)]  # 30 repeated texts: followers of a leader
    for run, prev in (("d1", None), ("d2", "d1")):
        _input(tmp_path, run, texts=texts)
        spec = _spec(tmp_path, run, changes={"previous_uri": str(tmp_path / prev / "out") if prev else None}, **over)
        plan = swept(plan_job, spec, engine_identity=local_engine_identity())
        _run_shards(spec, plan)  # the worker's own folders are not this test's
        swept(merge, spec)
        vouch_cache(spec)  # published: its entry serves the next night
    found = find_input(spec.io.input_uri, spec.io.storage_options, spec.io.input_format)
    swept(expected, spec, found, local_engine_identity())  # the cache's dry run
    swept(compute_changes, spec)
    assert plan.cache.hits == 90  # night 2: every row from the cache
    pattern = re.compile(rf"vllm-batch-({'|'.join(steps)})-{os.getpid()}-")
    assert made and [n for n in made if not pattern.match(n)] == []
    assert {pattern.match(n).group(1) for n in made} == set(steps)
    assert not any(p.exists() for p in left)  # each swept by the next task of its step
    storage._remove_process_folders()  # what the process's exit does (the DuckDB folder lives as long as it)
    assert list(temp.iterdir()) == []  # and each task removed its own
