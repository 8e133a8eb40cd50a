"""The order-based exactly-once check against corrupted commits (fake engine, local dir).

Each corruption is made as a worker with a bug would make it: the part rewritten and its marker entry resealed
with the deployment's key, so that the sizes, checksums and seals all hold and only the rows are wrong. Merge
must refuse every one naming the shard (and the part, row and ids), publish nothing, or, for an identical copy
of a row, drop it and report it (as before the order-based check).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.commit import MARKER, CommitMarker
from airflow_provider_vllm.core.errors import CommitError, VerificationError
from airflow_provider_vllm.core.plan import Plan, Segment
from airflow_provider_vllm.core.seal import COMMIT, Keyring, record_bytes, scope_of, seal_record
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge import merger, ordered
from airflow_provider_vllm.steps.merge.merger import MERGED, result_parts
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task, write_parquet
from tests.support.ledger import record_bad_rows

N = 60
IDS = [f"r{i:03d}" for i in range(N)]
EMPTY = {4, 11, 23, 40, 41, 57}  # rows with an empty text: EMPTY_INPUT error rows, between ok rows


@pytest.fixture
def run(tmp_path, fake_engine_factory):
    """A planned, fully committed run over two input files of several row groups, with error rows between
    ok rows, not merged yet: (spec, plan, out dir). Shards and chunks cross the files' and row groups' edges."""
    # blank texts of different lengths: no prompt repeats, so the dedupe leaves the shards on the input itself
    texts = [" " * i if i in EMPTY else f"ticket {i}" for i in range(N)]
    write_parquet(tmp_path / "in" / "a.parquet", IDS[:35], texts[:35], row_group_size=7)
    write_parquet(tmp_path / "in" / "b.parquet", IDS[35:], texts[35:], row_group_size=7)
    spec = make_spec(tmp_path / "in", tmp_path / "out", sharding={"target_rows": 20, "chunk_rows": 8})
    plan = plan_job(spec)
    assert len(plan.shards) == 3 and ordered.why_not(plan) is None
    for s in plan.shards:
        task = shard_task(spec=spec, shard_id=s.shard_id)
        assert run_shard(task, engine_factory=fake_engine_factory)["status"] == "committed"
    return spec, plan, tmp_path / "out"


def marker(out: Path, shard_id: str) -> dict:
    return json.loads((out / "shards" / shard_id / MARKER).read_text())


def rewrite(out: Path, shard_id: str, chunk: int, kind: str, fn) -> str:
    """Rewrite one part of a committed chunk with ``fn(table) -> table`` and reseal the shard's marker with the
    part's new size, sha256 and rows, as a worker with a bug would (the marker's total rows stay). Returns the
    part's path under ``out``."""
    p = out / "shards" / shard_id / MARKER
    m = json.loads(p.read_text())
    entry = m["files"][chunk]
    ref = entry if kind == "results" else entry["errors"]
    rel = ref["path"]
    table = fn(pq.read_table(out / rel))
    pq.write_table(table, out / rel, compression="zstd")
    data = (out / rel).read_bytes()
    ref.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    if kind == "results":
        entry["ok_rows"] = table.num_rows
    else:
        ref["rows"] = entry["error_rows"] = table.num_rows
    entry["rows"] = entry["ok_rows"] + entry["error_rows"]
    m.pop("seal", None)
    sealed = seal_record(Keyring.from_env(), COMMIT, scope_of(str(out)), CommitMarker.model_validate(m))
    p.write_bytes(record_bytes(sealed))
    return rel


def take(t: pa.Table, rows: list[int]) -> pa.Table:
    return t.take(pa.array(rows, pa.int64()))


def with_id(t: pa.Table, row: int, new_id: str) -> pa.Table:
    ids = t.column("id").to_pylist()
    ids[row] = new_id
    return t.set_column(t.column_names.index("id"), pa.field("id", pa.string(), nullable=False), pa.array(ids))


def refused(spec, out: Path, *needles: str) -> str:
    with pytest.raises(VerificationError) as e:
        merge(spec)
    msg = str(e.value)
    for n in needles:
        assert n in msg, (n, msg)
    assert not (out / "results").exists() and not (out / MERGED).exists()
    return msg


def published_ids(out: Path) -> list[str]:
    o = Storage(str(out))
    return [
        i
        for kind in ("results", "errors")
        for rel in result_parts(o, kind)
        for i in pq.read_table(out / rel, columns=["id"])["id"].to_pylist()
    ]


def test_a_clean_run_is_proven_in_order_without_the_id_join(run, monkeypatch):
    spec, plan, out = run
    monkeypatch.setattr(merger, "exactly_once", lambda *a: pytest.fail("the semi-join ran on the ordered path"))
    s = merge(spec).dump()
    assert s["ok_rows"] == N - len(EMPTY) and s["error_rows"] == len(EMPTY)
    assert s["duplicates"] == {"ids": 0, "rows_dropped": 0, "examples": []}
    assert sorted(published_ids(out)) == IDS


def test_a_missing_row_is_named_with_its_shard_and_input_row(run):
    spec, plan, out = run
    sid = plan.shards[1].shard_id  # rows r020..r039: chunk 0 is r020..r027, r023 an error row
    rewrite(out, sid, 0, "results", lambda t: take(t, [0, 1, 3, 4, 5, 6]))  # r022 dropped
    msg = refused(spec, out, f"shard {sid}", "'r022'", "a.parquet row 22", "1 missing")
    record_bad_rows("ordered_missing_row", 1, int("'r022'" in msg))


def test_a_missing_error_row_is_named_too(run):
    spec, plan, out = run
    sid = plan.shards[2].shard_id  # r040..r059: chunk 0 is r040..r047, r040 and r041 error rows
    rewrite(out, sid, 0, "errors", lambda t: take(t, [0]))
    refused(spec, out, f"shard {sid}", "'r041'", "b.parquet row 6")


def test_a_duplicated_row_with_other_content_is_refused(run):
    spec, plan, out = run
    sid = plan.shards[0].shard_id

    def dup_changed(t: pa.Table) -> pa.Table:
        t = pa.concat_tables([t, take(t, [2])])
        out_col = t.column("output").to_pylist()
        out_col[-1] = (out_col[-1] or "") + " (another answer)"
        return t.set_column(t.column_names.index("output"), "output", pa.array(out_col, pa.string()))

    rewrite(out, sid, 0, "results", dup_changed)
    msg = refused(spec, out, "have committed outputs that differ", "'r002'", f"{sid}/")
    record_bad_rows("ordered_duplicated_row_differing", 1, int("'r002'" in msg))


def test_a_duplicated_identical_row_is_dropped_and_reported_exactly_once(run):
    """As before the order-based check: an identical copy is not a second answer; it is dropped, counted in
    ``duplicates``, and the published rows are each input row once, in order."""
    spec, plan, out = run
    rewrite(out, plan.shards[0].shard_id, 1, "results", lambda t: pa.concat_tables([t, take(t, [0])]))
    s = merge(spec).dump()
    assert s["duplicates"] == {"ids": 1, "rows_dropped": 1, "examples": ["r008"]}
    assert sorted(published_ids(out)) == IDS


@pytest.mark.reliability
def test_a_part_re_encoded_without_its_dropped_copy_is_made_from_the_bytes_merge_checked(run, monkeypatch):
    """Merge re-encodes a part that held an identical copy of a row without it, and seals the new part's sha256 in
    the manifest. A writer of the prefix who replaces that part after merge checked it (here after the rows to drop
    are chosen) must not have its bytes re-encoded and sealed: merge reads the copy its check made (the one the
    drops were chosen on), and publishes the genuine rows."""
    from airflow_provider_vllm.core import faults
    from tests.support.ledger import record_malicious

    spec, plan, out = run
    rel = rewrite(out, plan.shards[0].shard_id, 1, "results", lambda t: pa.concat_tables([t, take(t, [0])]))
    part = out / rel
    real_hit = faults.hit

    def writer(point, *a, **kw):
        if point == "merge.before_write":  # the parts checked, the copy to drop chosen: nothing published yet
            t = pq.read_table(part)
            t = t.set_column(t.column_names.index("output"), "output", pa.array(["FORGED"] * t.num_rows))
            part.unlink()  # a new object under the same name, as a bucket writer's PUT makes
            pq.write_table(t, part)
        return real_hit(point, *a, **kw)

    monkeypatch.setattr(faults, "hit", writer)
    s = merge(spec).dump()  # the code before re-encoded the forged rows and sealed them into results/_manifest.json
    assert s["duplicates"]["rows_dropped"] == 1 and sorted(published_ids(out)) == IDS
    o = Storage(str(out))
    outputs = [x for r in result_parts(o, "results") for x in pq.read_table(out / r)["output"].to_pylist()]
    assert "FORGED" not in outputs
    record_malicious("a part re-encoded without a dropped copy, replaced after merge's check", 1, 1)


@pytest.mark.reliability
def test_a_copy_planted_while_merge_reads_the_ids_never_gets_a_genuine_row_dropped(run, monkeypatch):
    """A writer of the prefix puts a part with an identical copy of a row in the bucket after merge checked the
    footers and puts the genuine part back before merge publishes: rows to drop chosen on the planted bytes would
    have the genuine part re-encoded without a row. Merge counts and drops on copies checked against the sealed
    markers, and fails naming the part whose bytes are not its marker's."""
    import re

    from airflow_provider_vllm.core import faults
    from tests.support.ledger import record_malicious

    spec, plan, out = run
    part = out / marker(out, plan.shards[0].shard_id)["files"][1]["path"]  # r008.. of shard 0, no duplicates
    genuine = part.read_bytes()
    real_footers, real_hit = merger.check_footer_rows, faults.hit

    def footers_then_plant(*a, **kw):
        real_footers(*a, **kw)
        t = pq.read_table(part)
        part.unlink()
        pq.write_table(pa.concat_tables([take(t, [0, 1, 1]), t.slice(2)]), part)  # r009 twice, as its own row

    def put_back(point, *a, **kw):
        if point == "merge.before_write":
            part.unlink()
            part.write_bytes(genuine)
        return real_hit(point, *a, **kw)

    monkeypatch.setattr(merger, "check_footer_rows", footers_then_plant)
    monkeypatch.setattr(faults, "hit", put_back)
    with pytest.raises(CommitError, match=re.escape(str(part)) + " is not the file its sealed record names"):
        merge(spec)  # the code before 8253c11 sealed a merge without r010
    monkeypatch.setattr(merger, "check_footer_rows", real_footers)
    monkeypatch.setattr(faults, "hit", real_hit)
    assert not (out / MERGED).exists()
    part.unlink()  # merge failed before it published: the writer's genuine bytes go back now
    part.write_bytes(genuine)
    s = merge(spec).dump()  # the retry
    assert s["duplicates"]["rows_dropped"] == 0 and sorted(published_ids(out)) == IDS
    record_malicious("a copy planted while merge reads the ids, to have a genuine row dropped", 1, 1)


def _plant_moved_copy(out: Path, plan: Plan) -> tuple[Path, bytes, bytes]:
    """A genuine identical copy (a worker bug: r008 again at the end of shard 0's chunk 1, resealed), and the bytes a
    writer of the prefix would plant in its place: the same rows, the copy moved to row 1, before the genuine r009.
    Returns (the part, its genuine bytes, the planted ones)."""
    part = out / rewrite(out, plan.shards[0].shard_id, 1, "results", lambda t: pa.concat_tables([t, take(t, [0])]))
    t = pq.read_table(part)
    planted = take(t, [0, t.num_rows - 1, *range(1, t.num_rows - 1)])
    assert planted["id"].to_pylist()[:3] == ["r008", "r008", "r009"]
    buf = pa.BufferOutputStream()
    pq.write_table(planted, buf, compression="zstd")
    return part, part.read_bytes(), buf.getvalue().to_pybytes()


def _swap(part: Path, data: bytes) -> None:
    part.unlink()  # a new object under the same name, as a bucket writer's PUT makes
    part.write_bytes(data)


def _writer(monkeypatch, when: str, part: Path, genuine: bytes, planted: bytes) -> None:
    """A writer of the prefix during the next merge: ``planted`` at ``part`` when merge first calls ``merger.<when>``,
    the ``genuine`` bytes back just before merge publishes (``merge.before_write``)."""
    from airflow_provider_vllm.core import faults

    real, real_hit, done = getattr(merger, when), faults.hit, []

    def plant(*a, **kw):
        if not done:
            _swap(part, planted)
            done.append(when)
        return real(*a, **kw)

    def put_back(point, *a, **kw):
        if point == "merge.before_write":
            _swap(part, genuine)
        return real_hit(point, *a, **kw)

    monkeypatch.setattr(merger, when, plant)
    monkeypatch.setattr(faults, "hit", put_back)


@pytest.mark.reliability
def test_copies_to_drop_are_never_chosen_on_bytes_planted_while_merge_reads_the_parts(run, monkeypatch):
    """A writer of the prefix swaps a part that holds a genuine identical copy for the same rows with the copy moved
    (the row count intact) while merge reads the ids, and puts the genuine bytes back before merge publishes. The
    copies to drop chosen on the planted bytes are the genuine r009 (the code before: r009 lost, r008 published twice,
    the row count intact, sealed). Merge decides what to drop on copies of the parts checked against their sealed
    markers: it fails naming the part while the planted bytes are there, and publishes every id once after."""
    import re

    from tests.support.ledger import record_malicious

    spec, plan, out = run
    part, genuine, planted = _plant_moved_copy(out, plan)
    _writer(monkeypatch, "_ids_view", part, genuine, planted)
    with pytest.raises(CommitError, match=re.escape(str(part)) + " is not the file its sealed record names"):
        merge(spec)
    assert not (out / MERGED).exists() and not (out / "results").exists()
    monkeypatch.undo()
    _swap(part, genuine)
    s = merge(spec).dump()  # the retry, over the genuine bytes
    assert s["duplicates"] == {"ids": 1, "rows_dropped": 1, "examples": ["r008"]}
    assert sorted(published_ids(out)) == IDS
    record_malicious("a part planted while merge reads the ids, to choose a genuine row as the copy to drop", 1, 1)


@pytest.mark.reliability
def test_a_part_planted_after_merge_checked_its_copy_decides_nothing(run, monkeypatch):
    """The same planted part, put in the bucket after merge copied and checked the parts (as it reads the rows to
    pick the copies to drop) and the genuine bytes put back before it publishes: merge reads only its checked copies
    from there (the code before read the bucket again, dropped the genuine r009 and sealed), so it publishes every
    id once, the genuine part re-encoded without its copy."""
    from tests.support.ledger import record_malicious

    spec, plan, out = run
    part, genuine, planted = _plant_moved_copy(out, plan)
    _writer(monkeypatch, "_rows_view", part, genuine, planted)
    s = merge(spec).dump()
    ids = published_ids(out)
    assert sorted(ids) == IDS, (sorted(set(IDS) - set(ids)), sorted({i for i in ids if ids.count(i) > 1}))
    assert s["duplicates"] == {"ids": 1, "rows_dropped": 1, "examples": ["r008"]}
    assert s["ok_rows"] + s["error_rows"] == N
    record_malicious("a part planted after merge checked its copy, to choose a genuine row as the copy to drop", 1, 1)


def test_a_duplicated_row_elsewhere_in_the_shard_is_refused_as_out_of_order(run):
    """An identical copy placed before its original: dropping the later copy leaves the rows out of input order."""
    spec, plan, out = run
    sid = plan.shards[0].shard_id
    copy = pq.read_table(out / marker(out, sid)["files"][1]["path"]).slice(3, 1)  # r012 (r011 is an error row)
    assert copy.column("id")[0].as_py() == "r012"
    rewrite(out, sid, 0, "results", lambda t: pa.concat_tables([copy, t]))
    msg = refused(spec, out, f"shard {sid}", "not as its shard's rows in input order")
    assert repr(copy.column("id")[0].as_py()) in msg


def test_a_foreign_id_is_named(run):
    spec, plan, out = run
    sid = plan.shards[2].shard_id
    rewrite(out, sid, 1, "results", lambda t: with_id(t, 2, "not-an-input-id"))
    msg = refused(spec, out, f"shard {sid}", "'not-an-input-id'", "not in the input")
    record_bad_rows("ordered_foreign_id", 1, int("'not-an-input-id'" in msg))


def test_a_row_moved_to_another_shard_is_refused_though_every_id_is_there_once(run):
    """The id semi-join alone would accept this (each id once); the order-based check names the shards."""
    spec, plan, out = run
    a, b = plan.shards[0].shard_id, plan.shards[1].shard_id
    moved = pq.read_table(out / marker(out, b)["files"][0]["path"]).slice(0, 1)  # r020, shard b's first row
    assert moved.column("id")[0].as_py() == "r020"
    rewrite(out, b, 0, "results", lambda t: t.slice(1))
    rewrite(out, a, 2, "results", lambda t: pa.concat_tables([t, moved]))
    msg = refused(spec, out, f"shard {a}", f"shard {b}", "'r020'", "every input id is committed once")
    record_bad_rows("ordered_row_from_another_shard", 1, int("'r020'" in msg))


def test_two_rows_swapped_between_shards_are_refused(run):
    spec, plan, out = run
    a, b = plan.shards[0].shard_id, plan.shards[2].shard_id
    rewrite(out, a, 0, "results", lambda t: with_id(t, 0, "r050"))
    rewrite(out, b, 1, "results", lambda t: with_id(t, 2, "r000"))
    refused(spec, out, f"shard {a}", f"shard {b}", "'r050'", "'r000'")


def test_reordered_rows_are_refused_naming_the_part_and_row(run):
    spec, plan, out = run
    sid = plan.shards[1].shard_id
    rel = rewrite(out, sid, 1, "results", lambda t: take(t, [1, 0, *range(2, t.num_rows)]))
    msg = refused(spec, out, f"shard {sid}", f"results part {rel} row 0", "'r029'", "'r028'")
    record_bad_rows("ordered_reordered_rows", 1, int(f"{rel} row 0" in msg))


def test_chunks_listed_out_of_order_are_refused(run):
    spec, plan, out = run
    sid = plan.shards[0].shard_id
    p = out / "shards" / sid / MARKER
    m = json.loads(p.read_text())
    m["files"] = [m["files"][1], m["files"][0], *m["files"][2:]]
    m.pop("seal", None)
    p.write_bytes(record_bytes(seal_record(Keyring.from_env(), COMMIT, scope_of(str(out)), CommitMarker(**m))))
    refused(spec, out, f"shard {sid}", "not as its shard's rows in input order")


def test_an_id_in_both_the_ok_and_the_error_part_is_refused(run):
    spec, plan, out = run
    sid = plan.shards[1].shard_id
    ok_row = pq.read_table(out / marker(out, sid)["files"][0]["path"]).column("id")[0].as_py()
    rewrite(out, sid, 0, "errors", lambda t: with_id(t, 0, ok_row))  # r023's error row now says r020
    refused(spec, out, "'r020'", "differ")


def test_a_part_changed_after_its_commit_is_refused_by_its_checksum(run):
    """A forged part the marker does not vouch for never reaches the row check."""
    spec, plan, out = run
    rel = marker(out, plan.shards[0].shard_id)["files"][0]["path"]
    t = pq.read_table(out / rel)
    pq.write_table(with_id(t, 1, "r001-forged"), out / rel)
    with pytest.raises(CommitError, match="does not match its commit marker"):
        merge(spec)
    assert not (out / MERGED).exists()


def test_segments_that_overlap_or_leave_a_gap_are_named(run):
    """The plan is sealed; a planner bug that put a row in two shards, or in none, is still caught."""
    spec, plan, out = run
    o = Storage(str(out))
    in_root = o.at(plan.input_root)
    parts = merger._shard_parts(
        plan, merger.committed_parts(o, plan, merger.RunSeal(Keyring.from_env(), plan.seal.mac))[0]
    )
    assert ordered.check(o, in_root, plan, "id", parts) == []

    def moved(shard: int, start_delta: int) -> Plan:
        shards = [s.model_copy(deep=True) for s in plan.shards]
        seg = shards[shard].segments[0]
        shards[shard].segments[0] = Segment(**{**seg.model_dump(), "start": seg.start + start_delta})
        return plan.model_copy(update={"shards": shards})

    over = ordered.check(o, in_root, moved(1, -1), "id", parts)
    assert any("rows [19, 20) are in shard" in f and plan.shards[0].shard_id in f for f in over), over
    gap = ordered.check(o, in_root, moved(1, 1), "id", parts)
    assert any("rows [20, 21) are in no shard" in f for f in gap), gap


def test_plans_whose_shards_read_their_own_files_use_the_id_join(run):
    spec, plan, out = run
    assert ordered.why_not(plan.model_copy(update={"format": "jsonl"})) == "the input is jsonl"
    shards = [plan.shards[0].model_copy(update={"bucket": "short"}), *plan.shards[1:]]
    assert "short rows" in (ordered.why_not(plan.model_copy(update={"shards": shards})) or "")


def test_integer_ids_are_compared_as_the_worker_writes_them(tmp_path, fake_engine_factory, monkeypatch):
    ids = pa.array([7, 70, 700, -3, 2**40, 0], pa.int64())
    write_parquet(tmp_path / "in.parquet", ids, [f"ticket {i}" for i in range(len(ids))], row_group_size=4)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 3, "chunk_rows": 2})
    plan = plan_job(spec)
    assert ordered.why_not(plan) is None
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    monkeypatch.setattr(merger, "exactly_once", lambda *a: pytest.fail("the semi-join ran on the ordered path"))
    assert merge(spec).ok_rows == 6
    assert sorted(published_ids(tmp_path / "out")) == sorted(str(i) for i in ids.to_pylist())
