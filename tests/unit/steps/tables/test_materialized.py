"""A materialized table snapshot (``TablePin.read`` 'materialized') lies under the output prefix, which has other
writers than the plan: every reader after the plan reads only the bytes the sealed plan pins, and the plan never
pins a file it did not write."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import CommitError, InputChangedError, LinkRefused
from airflow_provider_vllm.core.plan import PLAN_FILE, TablePin, load_plan
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.plan import planner
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.steps.tables.access import Tables
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import merge, shard_task, vouch_cache
from tests.support.iceberg import run_job, source_table, sql_catalog, table_spec
from tests.support.security import PLANTED_KINDS, plant, untouched

FILTER = "lang = 'fr'"  # not on a partition column: the plan materializes the matching rows


@pytest.fixture
def lake(tmp_path):
    catalog = sql_catalog(tmp_path)
    source_table(catalog)
    return Tables(catalog=catalog, allowed=["lake.*"])


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def forge(path: Path) -> None:
    """Rewrite the Parquet file at ``path``: the same ids, other texts, the same size and mtime (as another writer
    of the prefix could on local disk, or on a store whose ETags are weak)."""
    st = os.stat(path)
    real = pq.read_table(path)
    tmp = path.with_suffix(".forging")
    pad = 0
    for _ in range(20):  # text plain and uncompressed, no statistics: the size grows with the padding byte for byte
        texts = ["F"] * (real.num_rows - 1) + ["F" + "x" * pad]
        forged = real.set_column(real.schema.get_field_index("text"), "text", pa.array(texts, pa.string()))
        codecs = {c: "none" if c == "text" else "zstd" for c in forged.column_names}
        pq.write_table(
            forged, tmp, compression=codecs, use_dictionary=False, write_statistics=False, store_schema=False
        )
        gap = st.st_size - tmp.stat().st_size
        if gap == 0:
            break
        assert pad + gap >= 0, "the forged rows take more bytes than the real ones"
        pad += gap
    assert tmp.stat().st_size == st.st_size
    os.replace(tmp, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert all(t.startswith("F") for t in pq.read_table(path).column("text").to_pylist())


def table_files(run: Path) -> list[Path]:
    """Every Parquet file the plan wrote under ``_table/`` (the materialized snapshot, the shards' own files)."""
    return sorted((run / "_table").rglob("*.parquet"))


def snapshot_file(run: Path) -> Path:
    (found,) = sorted((run / "_table").glob("input-*.parquet"))
    return found


def test_a_materialized_plan_pins_its_file_and_gives_each_shard_its_own_rows(lake, tmp_path, fake_engine_factory):
    spec = table_spec(str(tmp_path / "run"), row_filter=FILTER)
    plan = run_job(spec, lake, fake_engine_factory)
    pin = plan.table
    assert pin.read == "materialized" and len(plan.shards) == 2
    f = snapshot_file(tmp_path / "run")
    assert (pin.input_bytes, pin.input_sha256) == (f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest())
    for s in plan.shards:  # each shard fetches and hashes only its own rows
        assert s.input_file is not None and s.input_file.path.startswith("_table/shard-inputs/")
        assert s.input_file.rows == s.rows
    assert sum(s.rows for s in plan.shards) == plan.total_rows == 14
    assert sum(e.submitted for e in fake_engine_factory.made) == 14  # every row inferred exactly once


@pytest.mark.parametrize("how", ["bytes", "link"])
def test_a_shard_never_reads_a_materialized_file_changed_after_the_plan(lake, tmp_path, how, fake_engine_factory):
    run = tmp_path / "run"
    spec = table_spec(str(run), row_filter=FILTER)
    plan = plan_job(spec, tables=lake)
    assert plan.table.read == "materialized"
    for path in table_files(run):  # the same size and mtime, other rows under the real ids
        if how == "bytes":
            forge(path)
        else:  # a link to forged bytes elsewhere
            elsewhere = tmp_path / "elsewhere" / path.name
            elsewhere.parent.mkdir(exist_ok=True)
            os.replace(path, elsewhere)
            forge(elsewhere)
            path.symlink_to(elsewhere)
    before = files_of(run)
    for s in plan.shards:
        err = CommitError if how == "bytes" else LinkRefused
        with pytest.raises(err, match=r"_table/\S+\.parquet"):
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    assert files_of(run) == before  # nothing written, nothing committed
    assert not fake_engine_factory.made  # no engine started


def test_merge_and_qa_read_only_the_pinned_bytes_of_the_materialized_file(lake, tmp_path, fake_engine_factory):
    run = tmp_path / "run"
    spec = table_spec(str(run), row_filter=FILTER, io={"passthrough": ["lang"]})
    plan = plan_job(spec, tables=lake)
    for s in plan.shards:
        assert run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)["status"]
    path = snapshot_file(run)
    real = path.read_bytes()
    forge(path)
    before = files_of(run)
    with pytest.raises(CommitError, match=rf"_table/{path.name} is not the file its sealed record names"):
        merge(spec)
    assert files_of(run) == before  # nothing merged
    path.write_bytes(real)
    merge(spec)
    forge(path)  # QA's input excerpts read the file too
    with pytest.raises(CommitError, match=rf"_table/{path.name} is not the file its sealed record names"):
        qa_run(spec)
    assert not (run / "qa" / "report.json").exists()


def test_a_file_planted_at_the_predictable_name_before_the_plan_is_not_pinned(lake, tmp_path, fake_engine_factory):
    first = tmp_path / "first"
    pinned = plan_job(table_spec(str(first), row_filter=FILTER), tables=lake)
    real = snapshot_file(first).read_bytes()
    run = tmp_path / "run"
    planted = run / "_table" / snapshot_file(first).name
    planted.parent.mkdir(parents=True)
    planted.write_bytes(real)
    forge(planted)  # the name the plan will write, forged rows of the same size, before the plan
    spec = table_spec(str(run), row_filter=FILTER)
    plan = run_job(spec, lake, fake_engine_factory)
    assert plan.table.input_sha256 == pinned.table.input_sha256 == hashlib.sha256(real).hexdigest()
    assert planted.read_bytes() == real  # the plan wrote its own over it
    for s in plan.shards:  # the rows the shards inferred are the snapshot's
        assert not any(t.startswith("F") for t in pq.read_table(run / s.input_file.path).column("text").to_pylist())


@pytest.mark.parametrize("kind", PLANTED_KINDS)
def test_a_link_fifo_or_folder_at_the_predictable_name_is_replaced(lake, tmp_path, kind, fake_engine_factory):
    """``_table/input-<sha16>.parquet`` is predictable, and the prefix has other writers: a link there (even to
    the very bytes the plan writes), a FIFO or a folder (with links out of the prefix inside) is replaced by the
    plan's own file, never followed, opened or read (before, each failed the plan: a denial of service); nothing
    outside that one name is touched."""
    first = tmp_path / "first"
    pinned = plan_job(table_spec(str(first), row_filter=FILTER), tables=lake)
    real = snapshot_file(first).read_bytes()
    run = tmp_path / "run"
    planted = run / "_table" / snapshot_file(first).name
    plant(planted, kind, tmp_path / "outside", real)
    plan = run_job(table_spec(str(run), row_filter=FILTER), lake, fake_engine_factory)
    assert plan.table.input_sha256 == pinned.table.input_sha256
    assert planted.is_file() and not planted.is_symlink() and planted.read_bytes() == real
    assert untouched(tmp_path / "outside", real)
    assert not [n for n in os.listdir(run / "_table") if "displaced" in n]  # the folder moved aside is removed


def test_a_materialized_plan_from_before_the_pin_is_refused_by_every_reader(
    lake, tmp_path, fake_engine_factory, monkeypatch
):
    run = tmp_path / "run"
    spec = table_spec(str(run), row_filter=FILTER)
    # an old plan: the shards index the snapshot file itself, the pin names no bytes
    monkeypatch.setattr(planner, "split_materialized", lambda out, found, shards: shards, raising=False)
    plan = plan_job(spec, tables=lake)
    old_pin = TablePin(**plan.table.model_dump(exclude={"input_sha256", "input_bytes", "shard_inputs_root"}))
    old = plan.model_copy(update={"table": old_pin, "seal": None}).sealed(Keyring.from_env(), spec.io.output_uri)
    (run / PLAN_FILE).write_bytes(old.dump_json())
    assert load_plan(spec).table.read == "materialized"
    before = files_of(run)
    for s in plan.shards:
        with pytest.raises(InputChangedError, match="does not pin that file's bytes.*Plan the run again"):
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    # merge and QA read the plan's input through Plan.input_storage: refused the same way
    with pytest.raises(InputChangedError, match="does not pin that file's bytes"):
        load_plan(spec).input_storage(Storage(spec.io.output_uri), str(tmp_path))
    assert files_of(run) == before


def test_with_the_result_cache_the_shards_read_the_caches_own_files(lake, tmp_path, fake_engine_factory):
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from tests.support.data import PINNED_REVISION, make_spec

    def spec(run: str):
        return make_spec(
            "/unused",
            str(tmp_path / run),
            model={"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
            io={
                "input_uri": None,
                "input_table": {"identifier": "lake.tickets", "row_filter": FILTER},
                "output_uri": str(tmp_path / run),
            },
            cache={"uri": str(tmp_path / "cache")},
            sharding={"target_rows": 10, "chunk_rows": 4},
        )

    for run, misses in (("a", 14), ("b", 0)):
        s = spec(run)
        plan = plan_job(s, tables=lake, engine_identity=local_engine_identity())
        assert plan.table.read == "materialized" and plan.cache.misses == misses
        assert all(sh.input_file.path.startswith("_cache/shard-inputs/") for sh in plan.shards)
        for sh in plan.shards:
            run_shard(shard_task(spec=s, shard_id=sh.shard_id), engine_factory=fake_engine_factory)
        if run == "b":  # merge reads the plan's input ids: a changed file is refused, not trusted
            forge(snapshot_file(tmp_path / run))
            with pytest.raises(CommitError, match="is not the file its sealed record names"):
                merge(s)
        else:
            merge(s)
            vouch_cache(s)  # publish's step for the cache: the entry serves the next run
    assert sum(e.submitted for e in fake_engine_factory.made) == 14  # the second run's rows are all hits


def test_the_plans_local_copy_of_the_snapshot_lives_in_a_swept_private_folder(tmp_path, lake, monkeypatch):
    """The plan reads the materialized rows from a local copy of a whole snapshot: it lives in a private folder
    (``copies_folder``, mode 0700) that the plan removes, and that the next plan removes when a plan killed with
    SIGKILL left it behind (its process gone, a day old)."""
    import subprocess
    import sys
    import time

    from airflow_provider_vllm.core import storage

    monkeypatch.setattr(storage.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / "tmp" / f"vllm-batch-table-{gone.pid}-abc"
    (left / "table-x").mkdir(parents=True)
    (left / "table-x" / "input.parquet").write_bytes(b"x" * 100)
    old = time.time() - storage.STALE_COPIES_S - 60
    os.utime(left, (old, old))
    seen: list[str] = []
    real = planner.resolve_table_input

    def spy(spec, tables, out, filesystems, workdir):
        seen.append(workdir)
        assert oct(os.stat(workdir).st_mode & 0o777) == "0o700"
        return real(spec, tables, out, filesystems, workdir)

    monkeypatch.setattr(planner, "resolve_table_input", spy)
    plan = plan_job(table_spec(str(tmp_path / "run"), row_filter=FILTER), tables=lake)
    assert plan.table is not None and plan.table.read == "materialized"
    assert len(seen) == 1 and Path(seen[0]).name.startswith("vllm-batch-table-")
    assert not Path(seen[0]).exists() and not left.exists()


def test_a_materialized_pin_over_more_than_one_file_is_refused_not_asserted(tmp_path, lake):
    """The plan writes one materialized file; a plan naming more (sealed by a buggy or other version) is refused
    with a clear error, also under ``python -O`` (no assert)."""
    spec = table_spec(str(tmp_path / "run"), row_filter=FILTER)
    plan = plan_job(spec, tables=lake)
    two = plan.model_copy(update={"files": [*plan.files, *plan.files]})
    with pytest.raises(CommitError, match="materialized table input of 2 files"):
        two.input_storage(Storage(spec.io.output_uri), str(tmp_path / "tmp"))


SHARD_READER = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
from airflow_provider_vllm.core.plan import load_plan
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.worker.shard import shard_input
with open(sys.argv[2]) as f:
    spec = JobSpec.model_validate_json(f.read())
plan = load_plan(spec)
with shard_input(spec, plan, plan.shards[0]) as root:
    print(root.root, flush=True)
    sys.stdin.readline()  # reads its rows until told to go on
"""


def test_a_shards_input_copy_left_by_a_worker_killed_with_sigkill_is_removed_by_the_next_one(
    lake, tmp_path, monkeypatch
):
    """A shard reads its own input file from a checked local copy in a private folder of the worker
    (``copies_folder("shard")``): a worker killed with SIGKILL while it reads leaves it, and the next worker's
    removes it at once; one whose worker lives is kept."""
    import subprocess
    import sys

    from airflow_provider_vllm.core import storage
    from airflow_provider_vllm.worker.shard import shard_input
    from tests.support import ROOT

    spec = table_spec(str(tmp_path / "run"), row_filter=FILTER)
    plan = plan_job(spec, tables=lake)
    assert plan.shards[0].input_file is not None
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(storage.tempfile, "tempdir", str(temp))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def reader() -> tuple[subprocess.Popen, Path]:
        args = [sys.executable, "-c", SHARD_READER, str(temp), str(tmp_path / "spec.json")]
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        return proc, Path(proc.stdout.readline().strip())

    live, kept = reader()
    try:
        killed, left = reader()
        killed.kill()
        killed.wait()
        assert left.parent == temp and kept.parent == temp
        assert [p for p in left.rglob("*") if p.is_file()] and [p for p in kept.rglob("*") if p.is_file()]
        with shard_input(spec, plan, plan.shards[1]) as root:
            assert not left.exists() and kept.is_dir()
            assert Path(root.root).name.startswith(f"vllm-batch-shard-{os.getpid()}-")
        assert left.name.startswith(f"vllm-batch-shard-{killed.pid}-")
    finally:
        live.communicate("go on\n")
    assert live.returncode == 0 and list(temp.iterdir()) == []
