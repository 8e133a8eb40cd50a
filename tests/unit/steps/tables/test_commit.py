"""Publishing a run to an Iceberg table: one snapshot adding the parts by reference, once, never half."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import textwrap

import duckdb
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import RESULTS, read_merged, verified_parts
from airflow_provider_vllm.steps.tables.access import Tables, summary_of
from airflow_provider_vllm.steps.tables.commit import RUN_ID
from tests.support.iceberg import publish, rows, run_job, source_table, sql_catalog, table_spec


@pytest.fixture
def lake(tmp_path):
    catalog = sql_catalog(tmp_path)
    source_table(catalog)
    return catalog, Tables(catalog=catalog, allowed=["lake.*"])


def merged_rows(spec) -> list[tuple]:
    out = Storage(spec.io.output_uri)
    parts = verified_parts(out, RESULTS, read_merged(out))
    t = pq.read_table([out.path(p) for p in parts] if len(parts) > 1 else out.path(parts[0]), columns=["id", "label"])
    return sorted(zip(t.column("id").to_pylist(), t.column("label").to_pylist()))


def run(tmp_path, lake, factory, name="run", **out_table):
    catalog, tables = lake
    spec = table_spec(str(tmp_path / name), out_table={"identifier": "lake.triage", "create": True, **out_table})
    run_job(spec, tables, factory)
    return spec


def test_publish_is_one_snapshot_and_readers_get_exactly_the_merged_rows(tmp_path, lake, fake_engine_factory):
    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)
    commit = publish(spec, tables)
    table = catalog.load_table("lake.triage")
    assert [s.snapshot_id for s in table.snapshots()] == [commit.snapshot_id]
    summary = summary_of(table.current_snapshot())
    assert summary[RUN_ID] == spec.io.output_uri and summary["vllm-batch.airflow-run"] == "dag/run"
    assert summary["operation"] == "append" and int(summary["added-records"]) == 30
    want = merged_rows(spec)
    got = table.scan(selected_fields=("id", "label")).to_arrow()
    assert sorted(zip(got.column("id").to_pylist(), got.column("label").to_pylist())) == want
    # by reference: the table's data files are the run's parts, not copies
    files = sorted(t.file.file_path for t in table.scan().plan_files())
    paths = [f.removeprefix("file://") for f in files]
    assert len(paths) == len(
        verified_parts(Storage(spec.io.output_uri), RESULTS, read_merged(Storage(spec.io.output_uri)))
    ) and all(p.startswith(f"{spec.io.output_uri}/results/part-") for p in paths)
    duck = duckdb.sql(f"SELECT id, label FROM read_parquet({json.dumps(paths)}) ORDER BY id").fetchall()
    assert duck == want


def test_publishing_the_same_run_again_is_a_no_op(tmp_path, lake, fake_engine_factory):
    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)
    first = publish(spec, tables)
    again = publish(spec, tables)
    assert again.already and not first.already and again.snapshot_id == first.snapshot_id
    table = catalog.load_table("lake.triage")
    assert len(table.snapshots()) == 1 and table.scan().to_arrow().num_rows == 30
    other = run(tmp_path, lake, fake_engine_factory, name="run2")
    second = publish(other, tables)  # another run appends its own snapshot
    table = catalog.load_table("lake.triage")
    assert len(table.snapshots()) == 2 and second.snapshot_id == table.current_snapshot().snapshot_id
    assert table.scan().to_arrow().num_rows == 60


def test_overwrite_replaces_the_run_dates_partition_in_one_snapshot(tmp_path, lake, fake_engine_factory):
    catalog, tables = lake
    day1, day2 = dt.date(2026, 12, 1), dt.date(2026, 12, 2)
    a = run(tmp_path, lake, fake_engine_factory, "a", mode="overwrite", date_column="run_date")
    publish(a, tables, run_date=day1)
    b = run(tmp_path, lake, fake_engine_factory, "b", mode="overwrite", date_column="run_date")
    publish(b, tables, run_date=day2)
    c = run(tmp_path, lake, fake_engine_factory, "c", mode="overwrite", date_column="run_date")
    commit = publish(c, tables, run_date=day1)  # a re-run of day 1
    table = catalog.load_table("lake.triage")
    assert summary_of(table.current_snapshot())["operation"] == "overwrite"
    assert len(table.snapshots()) == 3 and commit.snapshot_id == table.current_snapshot().snapshot_id
    got = table.scan(selected_fields=("run_date",)).to_arrow().column("run_date").to_pylist()
    assert sorted(set(got)) == [day1, day2] and got.count(day1) == 30 and got.count(day2) == 30
    files = {t.file.file_path for t in table.scan().plan_files()}
    assert any("/c/results/" in f for f in files) and not any("/a/results/" in f for f in files)


def test_a_missing_table_or_one_that_does_not_take_the_results_is_refused(tmp_path, lake, fake_engine_factory):
    import pyarrow as pa

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory, create=False)
    with pytest.raises(SpecError, match="no such table .*set io.output_table.create"):
        publish(spec, tables)
    catalog.create_table("lake.triage", schema=pa.schema([pa.field("id", pa.string())]))
    with pytest.raises(SpecError, match="does not take the results' schema"):
        publish(spec, tables)
    assert catalog.load_table("lake.triage").current_snapshot() is None
    with pytest.raises(SpecError, match="is not among the tables"):
        publish(spec, Tables(catalog=catalog, allowed=["lake.tickets"]))


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from pyiceberg.catalog.sql import SqlCatalog
    def die(self, *a, **k):
        os.kill(os.getpid(), signal.SIGKILL)  # the process dies as the catalog is asked to commit
    SqlCatalog.commit_table = die
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.steps.tables.access import Tables
    from tests.support.iceberg import publish, sql_catalog
    from pathlib import Path
    spec = JobSpec.load(sys.argv[2])
    publish(spec, Tables(catalog=sql_catalog(Path(sys.argv[1])), allowed=["lake.*"]))
    """
)


def test_a_publish_killed_at_the_commit_leaves_no_snapshot_and_a_retry_commits_once(
    tmp_path, lake, fake_engine_factory
):
    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)
    catalog.create_table("lake.triage", schema=_results_schema(spec))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(tmp_path), spec.model_dump_json()], env=env, capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    table = catalog.load_table("lake.triage")
    assert table.current_snapshot() is None and table.snapshots() == []  # nothing half-committed
    commit = publish(spec, tables)
    table = catalog.load_table("lake.triage")
    assert [s.snapshot_id for s in table.snapshots()] == [commit.snapshot_id] and not commit.already
    assert table.scan().to_arrow().num_rows == 30


def _results_schema(spec):
    from airflow_provider_vllm.core.plan import load_plan

    return load_plan(spec).result_schema()


def test_changes_compare_with_the_run_of_the_output_tables_last_snapshot(tmp_path, lake, fake_engine_factory):
    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.steps.merge.changes import read_changes
    from airflow_provider_vllm.steps.qa.stage import qa_run

    catalog, tables = lake
    first = run(tmp_path, lake, fake_engine_factory, "a")
    publish(first, tables)
    catalog.load_table("lake.tickets").append(rows(3, start=30))  # the next night: 3 new tickets

    second = table_spec(str(tmp_path / "b"), out_table={"identifier": "lake.triage"})
    second = second.model_validate({**second.model_dump(mode="json"), "changes": {"previous_table": True}})
    run_job(second, tables, fake_engine_factory)
    plan = load_plan(second)
    assert plan.changes_from.previous_uri == first.io.output_uri and plan.changes_from.identifier == "lake.triage"
    qa_run(second)
    summary = read_changes(Storage(second.io.output_uri))
    assert summary.counts.added == 3 and summary.counts.unchanged + summary.counts.error == 30
    assert summary.previous_uri == first.io.output_uri
    publish(second, tables)
    # the first publish of a table has nothing to compare with; a run outside the allowed prefixes is refused
    third = table_spec(str(tmp_path / "c"), out_table={"identifier": "lake.fresh", "create": True})
    third = third.model_validate({**third.model_dump(mode="json"), "changes": {"previous_table": True}})
    from airflow_provider_vllm.steps.plan.planner import plan_job

    assert plan_job(third, tables=tables).changes_from.previous_uri is None
    fourth = third.model_validate(
        {
            **third.model_dump(mode="json"),
            "io": {
                **third.io.model_dump(mode="json"),
                "output_uri": str(tmp_path / "d"),
                "output_table": {"identifier": "lake.triage"},
            },
        }
    )
    narrow = Tables(
        catalog=catalog, allowed=["lake.*"], uri_prefixes=[str(tmp_path / "d"), str(tmp_path / "warehouse")]
    )
    with pytest.raises(SpecError, match=r"table lake.triage snapshot \d+ names run .* outside the allowed prefixes"):
        plan_job(fourth, tables=narrow)
