"""The input snapshot of a table job: pinned by the plan, read by every shard and retry as the plan saw it."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import DatasetError, SpecError
from airflow_provider_vllm.core.plan import load_plan
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import RESULTS, read_merged, verified_parts
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.steps.tables.access import Tables
from airflow_provider_vllm.steps.tables.snapshot import resolve_table_input
from airflow_provider_vllm.worker.shard import read_shard_rows, run_shard, shard_input
from tests.support.data import merge, shard_task, vouch_cache
from tests.support.iceberg import append_equality_deletes, rows, run_job, source_table, sql_catalog, table_spec


@pytest.fixture
def lake(tmp_path):
    catalog = sql_catalog(tmp_path)
    return catalog, Tables(catalog=catalog, allowed=["lake.*"])


def shard_ids(spec, plan) -> list[str]:
    ids = []
    for s in plan.shards:
        with shard_input(spec, plan, s) as root:
            ids += read_shard_rows(spec, plan, s, root).ids
    return ids


def published_ids(spec) -> list[str]:
    out = Storage(spec.io.output_uri)
    parts = verified_parts(out, RESULTS, read_merged(out))
    return sorted(i for p in parts for i in pq.read_table(out.path(p), columns=["id"]).column(0).to_pylist())


def test_plan_pins_the_snapshot_and_a_later_append_changes_nothing_a_retry_reads(lake, tmp_path, fake_engine_factory):
    catalog, tables = lake
    table = source_table(catalog)
    pinned = table.current_snapshot().snapshot_id
    spec = table_spec(str(tmp_path / "run"))
    plan = plan_job(spec, tables=tables)
    assert plan.table is not None and plan.table.snapshot_id == pinned and plan.table.read == "reference"
    assert plan.total_rows == 30 and plan.table.data_files == 2
    before = shard_ids(spec, plan)
    table.append(rows(5, start=100))  # the table moves on
    assert catalog.load_table("lake.tickets").current_snapshot().snapshot_id != pinned
    again = plan_job(spec, tables=tables)  # a retried plan task keeps the pinned snapshot
    assert again.table == plan.table and again.shards == plan.shards
    assert shard_ids(spec, load_plan(spec)) == before  # a retried shard reads the same rows
    run_job(spec, tables, fake_engine_factory)
    assert published_ids(spec) == sorted(f"t{i:05d}" for i in range(30))
    qa_run(spec)  # QA names the snapshot the run read
    for name in ("report.json", "report.html"):
        assert f"lake.tickets@{pinned}" in (tmp_path / "run" / "qa" / name).read_text()


def test_a_row_filter_reads_exactly_the_matching_rows_of_the_snapshot(lake, tmp_path, fake_engine_factory):
    catalog, tables = lake
    table = source_table(catalog)
    spec = table_spec(str(tmp_path / "run"), row_filter="lang = 'fr' AND id >= 't00010'")
    plan = run_job(spec, tables, fake_engine_factory)
    assert plan.table.read == "materialized" and plan.table.row_filter == "lang = 'fr' AND id >= 't00010'"
    want = sorted(f"t{i:05d}" for i in range(10, 30) if i % 15 % 2 == 1)
    assert published_ids(spec) == want
    table.append(rows(10, start=200))  # more French rows after the plan: not in this run
    assert sorted(shard_ids(spec, load_plan(spec))) == want


def test_a_filter_on_an_identity_partition_reads_the_data_files_by_reference(lake, tmp_path):
    catalog, tables = lake
    source_table(catalog, partition_by_lang=True)
    spec = table_spec(str(tmp_path / "run"), row_filter="lang = 'en'", columns=["id", "text"])
    found, pin = resolve_table_input(spec, tables, Storage(spec.io.output_uri), None, str(tmp_path))
    assert pin.read == "reference" and pin.columns == ["id", "text"]
    assert all("/lang=en/" in found.root.uri(n) for n in found.names) and not Storage(spec.io.output_uri).exists(
        "_table"
    )


def test_an_explicit_snapshot_id_reads_that_snapshot(lake, tmp_path):
    catalog, tables = lake
    table = source_table(catalog)
    first = table.snapshots()[0].snapshot_id
    plan = plan_job(table_spec(str(tmp_path / "run"), snapshot_id=first), tables=tables)
    assert plan.table.snapshot_id == first and plan.total_rows == 15
    with pytest.raises(SpecError, match="has no snapshot 12345"):
        plan_job(table_spec(str(tmp_path / "run2"), snapshot_id=12345), tables=tables)


@pytest.mark.parametrize(
    "row_filter, message",
    [
        ("lang = ", "io.input_table.row_filter='lang = ' is not an Iceberg row filter"),
        ("nosuchcolumn = 'x'", "does not apply to table lake.tickets snapshot"),
        ("lang = 'en'; DROP TABLE x", "is not an Iceberg row filter"),
    ],
)
def test_a_row_filter_that_is_not_a_valid_expression_is_refused_naming_the_parameter(
    lake, tmp_path, row_filter, message
):
    catalog, tables = lake
    source_table(catalog)
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace("'", "'")):
        plan_job(table_spec(str(tmp_path / "run"), row_filter=row_filter), tables=tables)
    assert not (tmp_path / "run" / "_plan.json").exists()


def test_data_files_outside_the_allow_list_are_refused_naming_table_snapshot_and_file(lake, tmp_path):
    catalog, _ = lake
    table = source_table(catalog)
    tables = Tables(catalog=catalog, allowed=["lake.tickets"], uri_prefixes=[str(tmp_path / "elsewhere")])
    with pytest.raises(SpecError) as e:
        plan_job(table_spec(str(tmp_path / "run")), tables=tables)
    msg = str(e.value)
    assert f"snapshot {table.current_snapshot().snapshot_id}" in msg and "lake.tickets" in msg
    assert "outside the allowed prefixes" in msg and "warehouse" in msg


def test_tables_the_deployment_does_not_allow_are_refused_before_the_catalog_is_read(lake, tmp_path):
    catalog, _ = lake
    source_table(catalog)
    for allowed, match in (([], "no tables are allowed"), (["other.*", "lake.other"], "is not among the tables")):
        with pytest.raises(SpecError, match=match):
            plan_job(table_spec(str(tmp_path / "run")), tables=Tables(catalog=catalog, allowed=allowed))
    with pytest.raises(SpecError, match="no such table"):
        plan_job(table_spec(str(tmp_path / "run"), identifier="lake.missing"), tables=Tables(catalog, ["lake.*"]))


def test_columns_must_hold_what_the_job_reads(lake, tmp_path):
    catalog, tables = lake
    source_table(catalog)
    with pytest.raises(SpecError, match=r"reads column\(s\) \['text'\], which io.input_table.columns leaves out"):
        plan_job(table_spec(str(tmp_path / "run"), columns=["id", "lang"]), tables=tables)
    with pytest.raises(SpecError, match=r"io.input_table.columns \['nope'\] are not columns"):
        plan_job(table_spec(str(tmp_path / "run"), columns=["id", "text", "nope"]), tables=tables)


def test_non_parquet_and_delete_files_are_refused(lake, tmp_path, monkeypatch):
    from pyiceberg.manifest import FileFormat

    from airflow_provider_vllm.steps.tables import snapshot

    catalog, tables = lake
    source_table(catalog)

    class Task:  # what plan_files gives, with the one property under test changed
        def __init__(self, real, **over):
            self.file, self.residual, self.delete_files = real.file, real.residual, real.delete_files
            self.__dict__.update(over)

    class File:
        def __init__(self, real):
            self.file_path, self.record_count, self.file_format = real.file_path, real.record_count, FileFormat.ORC

    real_check = snapshot._check_tasks
    for over, match in (({"delete_files": {object()}}, "delete file"), ("orc", "is ORC; only Parquet is read")):

        def check(tasks, where, allowed, over=over):
            fake = [Task(t, **over) if isinstance(over, dict) else Task(t, file=File(t.file)) for t in tasks]
            return real_check(fake, where, allowed)

        monkeypatch.setattr(snapshot, "_check_tasks", check)
        with pytest.raises(DatasetError, match=match) as e:
            plan_job(table_spec(str(tmp_path / "run")), tables=tables)
        assert "table lake.tickets snapshot" in str(e.value)


def test_with_the_result_cache_the_next_snapshot_infers_only_new_rows(lake, tmp_path, fake_engine_factory):
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from tests.support.data import PINNED_REVISION, make_spec

    catalog, tables = lake
    table = source_table(catalog)

    def spec(run: str):
        return make_spec(
            "/unused",
            str(tmp_path / run),
            model={"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
            io={"input_uri": None, "input_table": {"identifier": "lake.tickets"}, "output_uri": str(tmp_path / run)},
            cache={"uri": str(tmp_path / "cache")},
            sharding={"target_rows": 10, "chunk_rows": 4},
        )

    def run(s):
        plan = plan_job(s, tables=tables, engine_identity=local_engine_identity())
        for sh in plan.shards:
            run_shard(shard_task(spec=s, shard_id=sh.shard_id), engine_factory=fake_engine_factory)
        merge(s)
        vouch_cache(s)  # publish's step for the cache: the entry serves the next night
        return plan

    first = run(spec("a"))
    assert (first.cache.hits, first.cache.misses) == (0, 30) and first.table.read == "reference"
    table.append(rows(4, start=30))  # the next night: 4 new tickets in a new snapshot
    fake_engine_factory.made.clear()
    second = run(spec("b"))
    assert second.table.snapshot_id != first.table.snapshot_id
    assert (second.cache.rows, second.cache.hits, second.cache.misses) == (34, 30, 4)
    assert sum(e.submitted for e in fake_engine_factory.made) == 4
    assert published_ids(spec("b")) == sorted(f"t{i:05d}" for i in range(34))


@pytest.mark.parametrize(
    "path, match",
    [
        ("http://evil.example/x.parquet", "unknown scheme|not allowed"),
        ("s3://other-bucket/x.parquet", "outside the allowed prefixes"),
        ("s3://lake/warehouse/%2e%2e/x.parquet", "percent-encoded"),
        ("/etc/../etc/passwd", r"'\.\.'|\.\. segments|not allowed"),
    ],
)
def test_a_data_file_the_table_points_anywhere_is_refused(lake, tmp_path, monkeypatch, path, match):
    from airflow_provider_vllm.steps.tables import snapshot

    catalog, _ = lake
    source_table(catalog)
    tables = Tables(catalog=catalog, allowed=["lake.*"], uri_prefixes=[str(tmp_path), "s3://lake/"])

    class File:
        def __init__(self, real):
            self.file_path, self.record_count, self.file_format = path, real.record_count, real.file_format

    class Task:
        def __init__(self, real):
            self.file, self.residual, self.delete_files = File(real.file), real.residual, real.delete_files

    real_check = snapshot._check_tasks
    monkeypatch.setattr(
        snapshot, "_check_tasks", lambda tasks, where, allowed: real_check([Task(t) for t in tasks], where, allowed)
    )
    with pytest.raises(SpecError, match=match) as e:
        plan_job(table_spec(str(tmp_path / "run")), tables=tables)
    assert "table lake.tickets snapshot" in str(e.value)


def test_a_filter_that_matches_no_row_plans_no_shard_and_publishes_an_empty_result(lake, tmp_path, fake_engine_factory):
    catalog, tables = lake
    source_table(catalog, partition_by_lang=True)
    for row_filter in ("lang = 'de'", "id = 'nope'"):  # pruned by partition; read and matched by nothing
        spec = table_spec(str(tmp_path / row_filter.split()[0]), row_filter=row_filter)
        plan = run_job(spec, tables, fake_engine_factory)
        assert plan.total_rows == 0 and plan.shards == [] and plan.table.row_filter == row_filter
        assert published_ids(spec) == []


def results_of(spec):
    out = Storage(spec.io.output_uri)
    parts = verified_parts(out, RESULTS, read_merged(out))
    return pa.concat_tables([pq.read_table(out.path(p)) for p in parts])


def test_the_current_snapshot_is_read_with_the_tables_current_schema(lake, tmp_path, fake_engine_factory):
    # a schema change makes no snapshot: the current one still names the schema it was written with, but readers of
    # the table (pyiceberg's scan(), Spark, Trino) see the current one: a dropped column is gone, a renamed one renamed
    catalog, tables = lake
    table = source_table(catalog)
    with table.update_schema() as u:
        u.delete_column("lang")  # e.g. a column that must no longer be read
        u.rename_column("text", "body")
    spec = table_spec(str(tmp_path / "run"), io={"passthrough": "all"})
    spec = spec.model_copy(update={"prompt": spec.prompt.model_copy(update={"template": "Ticket: {body}"})})
    plan = run_job(spec, tables, fake_engine_factory)
    assert plan.table.read == "materialized"  # the files store the column as 'text': read by field id
    assert plan.table.columns == ["id", "body"] and plan.passthrough.columns == ["body"]
    got = results_of(spec)
    assert "lang" not in got.schema.names
    assert sorted(got.column("body").to_pylist()) == sorted(f"ticket {i}" for i in range(30))
    # time travel reads the snapshot's own schema
    old = table_spec(str(tmp_path / "old"), snapshot_id=plan.table.snapshot_id, columns=["id", "text", "lang"])
    assert plan_job(old, tables=tables).table.columns == ["id", "text", "lang"]


def test_passthrough_all_of_a_table_is_its_columns_not_what_an_old_data_file_still_stores(
    lake, tmp_path, fake_engine_factory
):
    catalog, tables = lake
    table = source_table(catalog)
    with table.update_schema() as u:
        u.delete_column("lang")  # the data files, read by reference, still store it
    for name in ("run", "run-columns"):
        extra = {"columns": ["id", "text"]} if name == "run-columns" else {}
        spec = table_spec(str(tmp_path / name), io={"passthrough": "all", "passthrough_prefix": "in_"}, **extra)
        plan = run_job(spec, tables, fake_engine_factory)
        assert plan.table.read == "reference" and plan.passthrough.columns == ["text"]
        got = results_of(spec)
        assert [c for c in got.schema.names if c.startswith("in_")] == ["in_text"] and got.num_rows == 30


def test_a_column_promoted_since_some_files_were_written_is_read_as_the_tables_type(
    lake, tmp_path, fake_engine_factory
):
    from pyiceberg.types import LongType

    catalog, tables = lake
    narrow = pa.schema([pa.field("id", pa.string()), pa.field("text", pa.string()), pa.field("n", pa.int32())])
    table = catalog.create_table("lake.counts", schema=narrow)
    table.append(pa.table({"id": ["a", "b"], "text": ["x", "y"], "n": pa.array([1, 2], pa.int32())}, schema=narrow))
    with table.update_schema() as u:
        u.update_column("n", LongType())
    catalog.load_table("lake.counts").append(pa.table({"id": ["c"], "text": ["z"], "n": pa.array([2**40], pa.int64())}))
    spec = table_spec(str(tmp_path / "run"), identifier="lake.counts", io={"passthrough": ["n"]})
    plan = run_job(spec, tables, fake_engine_factory)
    # by reference the shards would read int32 from one file and int64 from the other
    assert plan.table.read == "materialized" and plan.passthrough.types == ["int64"]
    got = results_of(spec)
    assert sorted(got.column("n").to_pylist()) == [1, 2, 2**40]


def test_equality_deletes_are_refused_naming_the_table_and_snapshot(lake, tmp_path):
    # pyiceberg cannot read equality deletes: its ValueError named neither the table nor the snapshot, and the plan
    # task was retried on it
    catalog, tables = lake
    append_equality_deletes(source_table(catalog), tmp_path / "warehouse")
    current = catalog.load_table("lake.tickets").current_snapshot().snapshot_id
    with pytest.raises(DatasetError, match=f"table lake.tickets snapshot {current}: .*equality delete.*compact") as e:
        plan_job(table_spec(str(tmp_path / "run")), tables=tables)
    assert not (tmp_path / "run" / "_plan.json").exists() and "Traceback" not in str(e.value)


def test_a_snapshot_id_outside_mains_history_is_refused_naming_it_and_the_branch(lake, tmp_path):
    """io.input_table.snapshot_id may name a snapshot the table never published on main: one written to another
    branch (write-audit-publish staging that was never published) or one main was rolled back past. The plan read
    it as if it were the table's; it now refuses, naming the snapshot, the branch and where it lies."""
    catalog, tables = lake
    table = source_table(catalog)
    base = table.current_snapshot().snapshot_id
    table.manage_snapshots().create_branch(base, "audit").commit()
    catalog.load_table("lake.tickets").append(rows(3, start=30), branch="audit")
    staged = catalog.load_table("lake.tickets").refs()["audit"].snapshot_id
    with pytest.raises(SpecError, match=rf"snapshot {staged} is not in the history of branch main: .*'audit'"):
        plan_job(table_spec(str(tmp_path / "a"), snapshot_id=staged), tables=tables)
    catalog.load_table("lake.tickets").append(rows(3, start=40))
    undone = catalog.load_table("lake.tickets").current_snapshot().snapshot_id
    catalog.load_table("lake.tickets").manage_snapshots().rollback_to_snapshot(base).commit()
    with pytest.raises(SpecError, match=rf"snapshot {undone} is not in the history of branch main: .*rolled back"):
        plan_job(table_spec(str(tmp_path / "b"), snapshot_id=undone), tables=tables)
    assert not (tmp_path / "a" / "_plan.json").exists() and not (tmp_path / "b" / "_plan.json").exists()
    assert plan_job(table_spec(str(tmp_path / "c"), snapshot_id=base), tables=tables).table.snapshot_id == base
    # an old snapshot kept by a tag, beyond a snapshot of main that was expired: main's history cannot tell
    first = catalog.load_table("lake.tickets").snapshots()[0].snapshot_id
    catalog.load_table("lake.tickets").manage_snapshots().create_tag(first, "day1").commit()
    catalog.load_table("lake.tickets").append(rows(2, start=50))
    catalog.load_table("lake.tickets").maintenance.expire_snapshots().by_id(base).commit()
    with pytest.raises(
        SpecError,
        match=rf"snapshot {first}: whether it is in the history of branch main cannot .*expired; tag 'day1' hold",
    ):
        plan_job(table_spec(str(tmp_path / "d"), snapshot_id=first), tables=tables)
    # one main was rolled back past after the expiry is newer than where the walk stops: surely not main's
    kept = catalog.load_table("lake.tickets").current_snapshot().snapshot_id
    catalog.load_table("lake.tickets").append(rows(2, start=60))
    later = catalog.load_table("lake.tickets").current_snapshot().snapshot_id
    catalog.load_table("lake.tickets").manage_snapshots().rollback_to_snapshot(kept).commit()
    with pytest.raises(SpecError, match=rf"snapshot {later} is not in the history of branch main: .*rolled back"):
        plan_job(table_spec(str(tmp_path / "e"), snapshot_id=later), tables=tables)
