"""Merge against hostile commit markers and duplicate committed rows (fake engine, local dir).

A marker may only name chunk files (ok and error parts) under its own shard's attempt folders;
duplicates are counted over the committed parts before merge drops anything; identical copies
are dropped and reported (``_MERGED.json``, QA), differing copies fail the merge naming the ids.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from airflow_provider_vllm.core.commit import MARKER, ChunkMeta, CommitMarker, RunSeal, ShardStore, errors_rel
from airflow_provider_vllm.core.errors import CommitError, InputChangedError, VerificationError
from airflow_provider_vllm.core.plan import PLAN_FILE, Plan
from airflow_provider_vllm.core.rows import ROW_SCHEMA
from airflow_provider_vllm.core.seal import COMMIT, Keyring, record_bytes, scope_of, seal_record
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import MERGED, result_parts
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.stage import qa_run, qa_summary
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import files_under, make_spec, merge, shard_task, write_parquet
from tests.support.ledger import record_bad_rows, record_malicious
from tests.support.security import PLANTED_KINDS, plant, untouched

IDS = [f"r{i:03d}" for i in range(60)]


@pytest.fixture
def run(tmp_path, fake_engine_factory):
    """A planned and fully committed 3-shard run, not merged yet: (spec, plan, out dir)."""
    write_parquet(tmp_path / "in.parquet", IDS, [f"ticket {i}" for i in range(len(IDS))])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 20, "chunk_rows": 10})
    plan = plan_job(spec)
    assert len(plan.shards) == 3
    for s in plan.shards:
        assert (
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)["status"]
            == "committed"
        )
    return spec, plan, tmp_path / "out"


def marker_path(out: Path, shard_id: str) -> Path:
    return out / "shards" / shard_id / MARKER


def edit_marker(out: Path, shard_id: str, fn, reseal: bool = True) -> None:
    """Edit a shard's commit marker. ``reseal``: seal the edited marker again with the deployment's key, as a
    worker with a bug would (so merge's own path and content checks are what refuses it); without, it is what
    any other writer of the bucket can do (the seal no longer matches)."""
    p = marker_path(out, shard_id)
    m = json.loads(p.read_text())
    fn(m)
    m.pop("seal", None)
    try:
        marker = CommitMarker.model_validate(m)
    except ValidationError:
        p.write_text(json.dumps(m))  # not even a marker: no seal can be made for it
        return
    if reseal:
        marker = seal_record(Keyring.from_env(), COMMIT, scope_of(str(out)), marker)
    p.write_bytes(record_bytes(marker))


def run_seal(out: Path) -> RunSeal:
    """The sealing context of the run under ``out`` (its plan's seal), as its workers have it."""
    plan = Plan.model_validate_json((out / PLAN_FILE).read_bytes())
    return RunSeal(Keyring.from_env(), plan.seal.mac)


def entry_for(out: Path, rel: str) -> dict:
    """A marker entry with the right sizes and checksums for ``rel`` (a chunk's ok part: with its errors part)."""
    import hashlib

    data = (out / rel).read_bytes()
    entry = {"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if rel.endswith(".parquet"):
        ok = pq.ParquetFile(out / rel).metadata.num_rows
        err = errors_rel(rel)
        n_err = pq.ParquetFile(out / err).metadata.num_rows
        edata = (out / err).read_bytes()
        entry.update(
            rows=ok + n_err,
            ok_rows=ok,
            error_rows=n_err,
            errors={"path": err, "bytes": len(edata), "sha256": hashlib.sha256(edata).hexdigest(), "rows": n_err},
        )
    return entry


def chunk_rows(out: Path, rel: str) -> pa.Table:
    """The chunk whose ok part is ``rel`` as one ``ROW_SCHEMA`` table (ok rows, then error rows)."""
    ok = pq.read_table(out / rel)
    err = pq.read_table(out / errors_rel(rel))
    ok = ok.append_column("status", pa.array(["ok"] * ok.num_rows, pa.string()))
    err = err.append_column("status", pa.array(["error"] * err.num_rows, pa.string()))
    t = pa.concat_tables([ok, err], promote_options="default")
    return pa.Table.from_arrays(
        [t.column(f.name) if f.name in t.column_names else pa.nulls(t.num_rows, f.type) for f in ROW_SCHEMA],
        schema=ROW_SCHEMA,
    )


def nothing_published(out: Path) -> bool:
    return not (out / "results").exists() and not (out / "errors").exists() and not (out / MERGED).exists()


def test_a_clean_run_reports_zero_duplicates_counted_before_dedupe(run):
    spec, plan, out = run
    s = merge(spec).dump()
    assert s["duplicates"] == {"ids": 0, "rows_dropped": 0, "examples": []} and s["duplicates_dropped"] == 0
    assert json.loads((out / MERGED).read_text())["duplicates"]["ids"] == 0
    report, paths = qa_run(spec)
    assert report.metrics["duplicates"]["ids"] == 0 and "duplicates=0" in report.summary_line()
    assert qa_summary(report, paths, str(out))["duplicates"] == 0


def _other_shards_chunk(out: Path, plan) -> str:
    m = json.loads(marker_path(out, plan.shards[1].shard_id).read_text())
    return m["files"][0]["path"]


HOSTILE = {
    # each: marker edit -> what the message must say; the entry's bytes/sha256 are right where a file exists
    "another shard's chunk": lambda out, plan, m: m["files"].__setitem__(
        0, entry_for(out, _other_shards_chunk(out, plan))
    ),
    "the plan file": lambda out, plan, m: m["files"].__setitem__(0, entry_for(out, "_plan.json")),
    "a dot-dot path into another shard": lambda out, plan, m: m["files"].__setitem__(
        0,
        {
            **entry_for(out, _other_shards_chunk(out, plan)),
            "path": f"shards/{plan.shards[0].shard_id}/attempts/../../{plan.shards[1].shard_id}/attempts/"
            f"{_other_shards_chunk(out, plan).split('/')[3]}/chunk-00000.parquet",
        },
    ),
    "an attempt folder named ..": lambda out, plan, m: m["files"].__setitem__(
        0, {**m["files"][0], "path": f"shards/{plan.shards[0].shard_id}/attempts/../chunk-00000.parquet"}
    ),
    "an absolute path": lambda out, plan, m: m["files"].__setitem__(0, {**m["files"][0], "path": "/etc/passwd"}),
    "a file outside the run": lambda out, plan, m: m["files"].__setitem__(
        0, {**m["files"][0], "path": "../in.parquet"}
    ),
    "a non-chunk name in its own attempt": lambda out, plan, m: m["files"].__setitem__(
        0, {**m["files"][0], "path": m["files"][0]["path"].replace("chunk-00000.parquet", "x.parquet")}
    ),
    "a temp file of its own attempt": lambda out, plan, m: m["files"].__setitem__(
        0, {**m["files"][0], "path": m["files"][0]["path"] + ".tmp-0123"}
    ),
    "a path that is not a string": lambda out, plan, m: m["files"].__setitem__(0, {**m["files"][0], "path": 7}),
    "the same chunk twice": lambda out, plan, m: m["files"].append(dict(m["files"][0])),
    "another shard's id": lambda out, plan, m: m.__setitem__("shard_id", plan.shards[1].shard_id),
    "files that are not a list": lambda out, plan, m: m.__setitem__("files", {"path": m["files"][0]["path"]}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_marker_is_refused_terminally_and_nothing_is_published(run, case):
    spec, plan, out = run
    edit_marker(out, plan.shards[0].shard_id, lambda m, case=case: HOSTILE[case](out, plan, m))
    with pytest.raises(CommitError) as e:
        merge(spec)
    msg = str(e.value)
    assert e.value.terminal and e.value.exit_code == 2
    assert plan.shards[0].shard_id in msg and MARKER in msg
    assert nothing_published(out)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_marker_from_a_writer_without_the_key_is_refused_by_its_seal(run, case):
    """What any writer of the output prefix can do: edit the marker (its sizes and sha256 right); the seal then
    no longer matches and merge refuses it before it opens any file it names."""
    spec, plan, out = run
    edit_marker(out, plan.shards[0].shard_id, lambda m, case=case: HOSTILE[case](out, plan, m), reseal=False)
    with pytest.raises(CommitError, match=plan.shards[0].shard_id) as e:
        merge(spec).dump()
    assert e.value.terminal and nothing_published(out)


@pytest.mark.reliability
def test_every_hostile_marker_kind_is_refused(run):
    """The same cases in one run, recorded for the reliability figures."""
    spec, plan, out = run
    original = marker_path(out, plan.shards[0].shard_id).read_text()
    refused = 0
    for case in sorted(HOSTILE):
        marker_path(out, plan.shards[0].shard_id).write_text(original)
        edit_marker(out, plan.shards[0].shard_id, lambda m, case=case: HOSTILE[case](out, plan, m))
        try:
            merge(spec)
        except CommitError:
            refused += 1
        assert nothing_published(out)
    record_malicious("forged_commit_marker", len(HOSTILE), refused)
    assert refused == len(HOSTILE)
    marker_path(out, plan.shards[0].shard_id).write_text(original)
    assert merge(spec).dump()["ok_rows"] == len(IDS)  # the genuine marker still merges


def _copy_into_new_attempt(out: Path, plan, shard_index: int, edit=None) -> str:
    """Copy the shard's first chunk into a new attempt folder of the same shard (other attempt id
    in the rows; ``edit`` may change the table), add it to the marker; returns the ids it repeats."""
    shard_id = plan.shards[shard_index].shard_id
    first = json.loads(marker_path(out, shard_id).read_text())["files"][0]["path"]
    t = chunk_rows(out, first)
    t = t.set_column(
        t.column_names.index("attempt_id"),
        "attempt_id",
        pa.array(["a-forged-copy"] * t.num_rows, t.schema.field("attempt_id").type),
    )
    t = t.set_column(
        t.column_names.index("latency_ms"),
        "latency_ms",
        pa.array([1.5] * t.num_rows, t.schema.field("latency_ms").type),
    )
    if edit is not None:
        t = edit(t)
    meta = ChunkMeta(shard_id=shard_id, chunk=0, first_row=0, rows=t.num_rows, config_hash="forged")
    entry = ShardStore(Storage(str(out)), shard_id, run_seal(out)).write_chunk("a-forged-copy", meta, t)
    edit_marker(out, shard_id, lambda m: m["files"].append(entry.dump()))
    return t.column("id").to_pylist()


@pytest.mark.reliability
def test_identical_duplicates_are_counted_before_the_dedupe_dropped_and_reported(run):
    spec, plan, out = run
    repeated = _copy_into_new_attempt(out, plan, 0)
    assert len(repeated) == 10
    s = merge(spec).dump()
    record_bad_rows("committed_duplicates_identical_counted", len(repeated), s["duplicates"]["ids"])
    assert s["duplicates"] == {"ids": 10, "rows_dropped": 10, "examples": sorted(repeated)}
    assert s["duplicates_dropped"] == 10 and s["ok_rows"] + s["error_rows"] == len(IDS)
    on_disk = json.loads((out / MERGED).read_text())["duplicates"]
    assert on_disk["ids"] == 10 and on_disk["rows_dropped"] == 10
    o = Storage(str(out))
    res = [i for rel in result_parts(o, "results") for i in pq.read_table(out / rel, columns=["id"])["id"].to_pylist()]
    err = [i for rel in result_parts(o, "errors") for i in pq.read_table(out / rel, columns=["id"])["id"].to_pylist()]
    assert sorted(res + err) == IDS  # each id once after the dedupe
    # only the part that held the dropped copies was re-encoded; the others are the committed files
    assert pq.read_table(out / "results").num_rows == len(res)
    report, paths = qa_run(spec)
    assert report.metrics["duplicates"]["ids"] == 10 and "duplicates=10" in report.summary_line()
    assert any("committed more than once" in n for n in report.notes)
    assert qa_summary(report, paths, str(out))["duplicates"] == 10
    assert "Duplicate ids" in (out / "qa" / "report.html").read_text()


@pytest.mark.reliability
def test_two_committed_outputs_that_differ_fail_the_merge_naming_the_id(run):
    spec, plan, out = run
    victim = json.loads(marker_path(out, plan.shards[0].shard_id).read_text())["files"][0]

    def change_one(t: pa.Table) -> pa.Table:
        out_col = t.column("output").to_pylist()
        out_col[3] = (out_col[3] or "") + " (a different answer)"
        return t.set_column(t.column_names.index("output"), "output", pa.array(out_col, pa.string()))

    ids = _copy_into_new_attempt(out, plan, 0, edit=change_one)
    with pytest.raises(VerificationError) as e:
        merge(spec)
    msg = str(e.value)
    record_bad_rows("committed_duplicates_differing_refused", 1, int(repr(ids[3]) in msg))
    assert e.value.terminal
    assert "1 id(s) have committed outputs that differ" in msg and repr(ids[3]) in msg
    assert "a-forged-copy" in msg and victim["path"].split("/")[3] in msg  # both attempts named
    assert repr(ids[2]) not in msg  # identical copies are not blamed
    assert nothing_published(out)


def test_a_status_flip_is_a_difference_too(run):
    """An ok row and an error row for one id are two different outputs, not a choice to make."""
    spec, plan, out = run

    def flip(t: pa.Table) -> pa.Table:
        st = t.column("status").to_pylist()
        code = t.column("error_code").to_pylist()
        st[0], code[0] = "error", "ENGINE_ERROR"
        t = t.set_column(t.column_names.index("status"), "status", pa.array(st, pa.string()))
        return t.set_column(t.column_names.index("error_code"), "error_code", pa.array(code, pa.string()))

    ids = _copy_into_new_attempt(out, plan, 2, edit=flip)
    with pytest.raises(VerificationError, match=repr(ids[0])):
        merge(spec)
    assert nothing_published(out)


def test_a_copied_run_folder_is_refused_by_its_seals(run, tmp_path):
    """Seals name the run's folder: records copied into another prefix (a moved run, or genuine records planted
    in another run) are not trusted there; the original still merges."""
    spec, plan, out = run
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    spec2 = spec.model_copy(update={"io": spec.io.model_copy(update={"output_uri": str(moved)})})
    with pytest.raises(CommitError, match=r"moved/_plan.json.*moved from another run or folder"):
        merge(spec2)
    assert merge(spec).dump()["ok_rows"] == len(IDS)


@pytest.mark.reliability
def test_a_spec_changed_through_xcom_is_not_merged(run):
    """Whoever can write XCom changes the spec the merge task receives (another id column, another cache): the
    sealed plan names the spec it was made for, and merge refuses any other."""
    spec, plan, out = run
    changed = spec.model_copy(update={"prompt": spec.prompt.model_copy(update={"id_column": "text"})})
    with pytest.raises(CommitError, match="made for another spec"):
        merge(changed)
    assert nothing_published(out)
    record_malicious("xcom_spec_changed_before_merge", 1, 1)


def test_an_earlier_sealed_plan_of_the_folder_put_back_is_not_merged_under(tmp_path, fake_engine_factory):
    """The folder planned twice (emptied in between, the input changed): the first ``_plan.json`` is sealed for the
    folder too. Put back after the second plan, merge took it (any sealed plan of the folder) and failed on the
    shards' seals with an unclear error. Merge takes only the plan the plan task named (its XCom: seal and sha256)
    and refuses another before writing anything, naming ``_plan.json``, the plan expected and the one found."""
    from airflow_provider_vllm.core.plan import PlanRef

    out = tmp_path / "out"
    spec = make_spec(tmp_path / "in.parquet", out, sharding={"target_rows": 20, "chunk_rows": 10})
    write_parquet(tmp_path / "in.parquet", IDS[:40], [f"ticket {i}" for i in range(40)])
    first = plan_job(spec)
    earlier = (out / PLAN_FILE).read_bytes()
    shutil.rmtree(out)  # emptied and planned again, over other input
    write_parquet(tmp_path / "in.parquet", IDS, [f"ticket {i}" for i in range(len(IDS))])
    plan = plan_job(spec)
    named = plan.ref()  # what the plan task pushed
    assert isinstance(named, PlanRef) and named != first.ref() and first.spec_hash == plan.spec_hash
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    now = (out / PLAN_FILE).read_bytes()
    (out / PLAN_FILE).write_bytes(earlier)  # the earlier genuine sealed plan put back
    before = files_under(out)
    with pytest.raises(CommitError) as e:
        merge(spec, plan=named)
    assert e.value.terminal  # no retry
    message = str(e.value)
    assert f"{out}/{PLAN_FILE} is not the plan this run's plan task wrote" in message
    assert f"it named seal {named.plan_mac[:12]}, sha256 {named.plan_sha256[:12]}" in message
    assert f"found seal {first.ref().plan_mac[:12]}, sha256 {first.ref().plan_sha256[:12]}" in message
    assert files_under(out) == before and nothing_published(out)  # nothing merged, nothing written
    record_malicious("merge: an earlier plan of the folder put back after the shards", 1, 1)
    (out / PLAN_FILE).write_bytes(now)  # the run's plan back: it merges
    assert merge(spec, plan=named).rows == len(IDS)


def test_duplicates_are_counted_when_the_parts_carry_a_passthrough_column_named_filename(tmp_path, fake_engine_factory):
    """The duplicate count reads the parts with DuckDB's file-name column: ``filename = true`` failed the merge on a
    passed-through ``filename`` (BinderException)."""
    ids = IDS[:20]
    pq.write_table(
        pa.table({"id": ids, "text": [f"t {i}" for i in ids], "filename": [f"{i}.pdf" for i in ids]}),
        tmp_path / "in.parquet",
    )
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out",
        io={"passthrough": ["filename"]},
        sharding={"target_rows": 10, "chunk_rows": 10},
    )
    plan = plan_job(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    out = tmp_path / "out"

    def with_filename(t: pa.Table) -> pa.Table:
        return t.append_column("filename", pa.array([f"{i}.pdf" for i in t.column("id").to_pylist()]))

    repeated = _copy_into_new_attempt(out, plan, 0, edit=with_filename)
    s = merge(spec).dump()
    assert s["duplicates"]["ids"] == len(repeated) == 10 and s["ok_rows"] + s["error_rows"] == len(ids)
    assert sorted(pq.read_table(out / "results", columns=["filename"]).column(0).to_pylist()) == sorted(
        f"{i}.pdf" for i in ids
    )


def test_an_input_file_deleted_since_the_plan_fails_the_merge_as_changed_input(run):
    """A raw FileNotFoundError before (retried as if transient); the input no longer matches the plan: terminal."""
    spec, _, out = run
    (out.parent / "in.parquet").unlink()
    with pytest.raises(InputChangedError, match="gone since the plan.*in.parquet.*new output prefix"):
        merge(spec)
    assert nothing_published(out)


def test_a_marker_whose_row_split_disagrees_with_its_part_footers_is_refused_naming_the_part(run):
    """A sealed marker (a worker with a bug) claims a chunk's ok rows are all error rows: the id checks read every
    part, publishing leaves out parts claimed empty, so the claim would drop real rows. Refused from the footers."""
    spec, plan, out = run
    sid = plan.shards[0].shard_id
    f0 = json.loads(marker_path(out, sid).read_text())["files"][0]
    assert f0["ok_rows"] > 0

    def swap(m):
        f = m["files"][0]
        f["ok_rows"], f["error_rows"] = 0, f["rows"]
        f["errors"]["rows"] = f["rows"]

    edit_marker(out, sid, swap)
    with pytest.raises(CommitError, match=rf"{f0['path']} holds {f0['ok_rows']} rows, its commit marker says 0"):
        merge(spec)
    assert nothing_published(out)
    edit_marker(out, sid, lambda m: m["files"].__setitem__(0, f0))  # the worker's true claim: merges
    s = merge(spec)
    assert s.ok_rows + s.error_rows == len(IDS)
    assert sorted(i for r in result_parts(Storage(str(out))) for i in pq.read_table(out / r)["id"].to_pylist()) == IDS


def test_a_jsonl_file_rewritten_with_its_size_and_mtime_kept_and_an_id_repeated_fails_the_merge(
    tmp_path, fake_engine_factory, monkeypatch
):
    """A file rewritten in place with its size and mtime kept (copied with its timestamps): on local disk the
    file check sees it (its version carries the change time and inode), and the shards refuse it. On a store whose
    version would not change (a weak ETag), the shards pass it: its line 2 now repeats line 1's id, the shards
    answer 'r00' twice and 'r01' never, and merge must not count that as complete (the exactly-once proof took
    distinct input ids from the plan)."""
    from airflow_provider_vllm.steps.merge import merger as merger_module
    from airflow_provider_vllm.worker import shard as worker_shard

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i:02d}", "text": f"ticket {i}"}) + "\n" for i in range(20)))
    spec = make_spec(src, tmp_path / "out", sharding={"target_rows": 10, "chunk_rows": 10})
    plan = plan_job(spec)
    before = src.stat()
    src.write_text(src.read_text().replace('"r01"', '"r00"'))
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert src.stat().st_size == before.st_size
    with pytest.raises(InputChangedError, match=r"in\.jsonl changed since the plan"):
        run_shard(shard_task(spec=spec, shard_id=plan.shards[0].shard_id), engine_factory=fake_engine_factory)
    monkeypatch.setattr(worker_shard, "check_unchanged", lambda storage, files: None)  # a store's weak version
    monkeypatch.setattr(merger_module, "check_unchanged", lambda storage, files: None)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    with pytest.raises(
        InputChangedError, match=r"'r00' is at in.jsonl \(its row 1\) and at in.jsonl \(its row 2\).*new output prefix"
    ):
        merge(spec)
    assert nothing_published(tmp_path / "out")


def test_merge_writes_no_part_through_a_link_planted_in_the_output(tmp_path):
    """Merge publishes a part it wrote (an empty part, a part re-encoded without dropped duplicates) through a
    temp file of a name a writer of the output can guess (``.<name>.tmp-<pid>``), and links committed parts into
    ``results/``: a link planted at the temp name gets nothing written through it (before, the part's bytes
    replaced the file it pointed to), and ``results -> another folder`` is refused naming it (before, the part was
    linked into that folder)."""
    import hashlib

    from airflow_provider_vllm.core.errors import LinkRefused
    from airflow_provider_vllm.steps.merge.merger import SourcePart, _publish_local, _publish_reference

    other = tmp_path / "other"
    other.mkdir()
    (other / "victim.parquet").write_bytes(b"another tenant's")
    run = tmp_path / "run"
    (run / "results").mkdir(parents=True)
    local = tmp_path / "part.parquet"
    pq.write_table(pa.table({"id": ["a"]}), local)
    (run / "results" / f".part-00000.parquet.tmp-{os.getpid()}").symlink_to(other / "victim.parquet")
    out = Storage(str(run))
    entry = _publish_local(out, "results", str(local), "part-00000.parquet")
    assert (run / "results" / "part-00000.parquet").read_bytes() == local.read_bytes() and entry.rows == 1
    assert (other / "victim.parquet").read_bytes() == b"another tenant's"
    assert sorted(os.listdir(run / "results")) == ["part-00000.parquet"]

    (run / "errors").symlink_to(other)
    data = (run / "results" / "part-00000.parquet").read_bytes()
    src = SourcePart(
        path="results/part-00000.parquet",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        rows=1,
        name="part-00001.parquet",
    )
    with pytest.raises(LinkRefused, match="errors is a symbolic link"):
        _publish_reference(out, src, "errors/part-00001.parquet")
    assert sorted(os.listdir(other)) == ["victim.parquet"]


@pytest.mark.parametrize(
    "kind, target",
    [("results", "a copy elsewhere"), ("results", "the chunk it was linked from"), ("errors", "a copy elsewhere")],
)
def test_a_rerun_replaces_a_part_swapped_for_a_link_to_a_file_of_the_right_bytes(run, tmp_path, kind, target):
    """A part already published is kept by a rerun only when it is a regular file of its sealed size and sha256: a
    link put in its place (by another writer of the prefix), even to a file of the very bytes, is replaced by the
    part itself, never stat'ed or read through (before, merge kept a link to the committed chunk, and refused a
    link to a copy elsewhere on every rerun)."""
    import hashlib

    spec, _, out = run
    merge(spec)
    manifest = json.loads((out / kind / "_manifest.json").read_text())
    entry = manifest["parts"][-1]
    part = out / kind / entry["name"]
    if target == "a copy elsewhere":
        dest = tmp_path / "elsewhere" / "part.parquet"
        dest.parent.mkdir()
        shutil.copyfile(part, dest)
    else:
        (dest,) = [p for p in (out / "shards").rglob("*.parquet") if os.path.samefile(p, part)]
    part.unlink()
    part.symlink_to(dest)
    assert merge(spec).dump()["ok_rows"] == len(IDS)
    assert part.is_file() and not part.is_symlink()
    assert hashlib.sha256(part.read_bytes()).hexdigest() == entry["sha256"]


def test_a_part_swapped_for_a_link_after_publish_is_refused_by_a_rerun_naming_it(run):
    """A published run's parts are referenced by path: a rerun does not replace one, even a link put in its place;
    it refuses, naming the part and what to do."""
    from airflow_provider_vllm.steps.publish import SUCCESS, success_bytes

    spec, _, out = run
    merged = merge(spec)
    body = success_bytes({"rows": merged.rows, "checksums": merged.checksums}, Keyring.from_env(), str(out))
    (out / SUCCESS).write_bytes(body)
    part = sorted((out / "results").glob("part-*.parquet"))[-1]
    dest = out.parent / "elsewhere.parquet"
    shutil.copyfile(part, dest)
    part.unlink()
    part.symlink_to(dest)
    with pytest.raises(CommitError, match=rf"results/{part.name}: the run under .* is published .* would replace"):
        merge(spec)
    assert part.is_symlink()  # nothing changed


@pytest.mark.parametrize("kind", PLANTED_KINDS)
def test_what_a_killed_merge_moved_aside_is_removed_by_the_next_one(run, tmp_path, kind):
    """A folder another writer put at a part's name is renamed aside (``.<part>.displaced-<uuid>``) and then removed;
    a merge killed in between leaves it. The next merge removes it (a link there itself, never what it points to;
    a folder's links unfollowed) instead of refusing the folder as a file merge did not write, which needed a person
    to clear it. Nothing outside is touched."""
    import uuid

    spec, _, out = run
    merge(spec)
    name = sorted(n for n in os.listdir(out / "results") if n.startswith("part-"))[0]
    aside = out / "results" / f".{name}.displaced-{uuid.uuid4().hex}"  # storage.displaced_name's form
    plant(aside, kind, tmp_path / "outside")
    assert merge(spec).dump()["ok_rows"] == len(IDS)
    assert not os.path.lexists(aside)
    assert untouched(tmp_path / "outside")
    assert all(not n.startswith(".") for n in os.listdir(out / "results"))


def test_an_entry_named_like_a_displaced_file_merge_does_not_write_is_still_refused(run):
    """Only what merge moves aside from its own parts' names is removed: another hidden name is refused as before."""
    spec, _, out = run
    merge(spec)
    (out / "results" / f".notes.txt.displaced-{'0' * 32}").write_text("a user's")
    with pytest.raises(CommitError, match="which merge did not write"):
        merge(spec)


@pytest.mark.parametrize("kind", PLANTED_KINDS)
def test_a_part_merge_writes_itself_replaces_a_link_fifo_or_folder_at_its_name(tmp_path, kind):
    """A part merge writes itself (an empty part, one re-encoded without dropped copies) is kept by a rerun only
    when it is a regular file of its bytes: a link there (even to those bytes), a FIFO or a folder is replaced,
    never followed or opened, and nothing outside is touched (before, each failed the merge)."""
    from airflow_provider_vllm.steps.merge.merger import _publish_local

    local = tmp_path / "part.parquet"
    pq.write_table(pa.table({"id": ["a"]}), local)
    data = local.read_bytes()
    plant(tmp_path / "run" / "results" / "part-00000.parquet", kind, tmp_path / "outside", data)
    entry = _publish_local(Storage(str(tmp_path / "run")), "results", str(local), "part-00000.parquet")
    part = tmp_path / "run" / "results" / "part-00000.parquet"
    assert entry.rows == 1 and part.is_file() and not part.is_symlink() and part.read_bytes() == data
    assert sorted(os.listdir(tmp_path / "run" / "results")) == ["part-00000.parquet"]
    assert untouched(tmp_path / "outside", data)


def test_on_an_object_store_a_name_like_a_displaced_part_is_refused_not_deleted():
    """Only local merges move a planted folder aside (an object store has no folders at a part's name): there, a key
    named like a displaced part was put by another writer and is refused, naming it, as any other name merge did not
    write; it is not deleted."""
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.merge.merger import check_folder

    out = Storage("memory://merge-displaced/run")
    name = f"results/.part-00000.parquet.displaced-{'0' * 32}"
    out.write_atomic(name, b"another writer's")
    out.write_atomic("results/part-00000.parquet", b"x")
    with pytest.raises(CommitError, match="which merge did not write"):
        check_folder(out, "results", 1)
    assert out.read_bytes(name) == b"another writer's"
    out.remove("", recursive=True)
