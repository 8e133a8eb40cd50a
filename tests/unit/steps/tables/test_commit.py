"""Publishing a run to an Iceberg table: one snapshot adding the parts by reference, once, never half."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import RESULTS, read_merged, verified_parts
from airflow_provider_vllm.steps.tables.access import Tables, summary_of
from airflow_provider_vllm.steps.tables.commit import RUN_ID
from tests.support.data import shard_task
from tests.support.iceberg import (
    append_equality_deletes,
    publish,
    rows,
    run_job,
    source_table,
    sql_catalog,
    table_spec,
)
from tests.support.ledger import record_malicious


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


def test_a_planted_snapshot_carrying_the_runs_id_is_never_taken_for_its_commit(tmp_path, lake, fake_engine_factory):
    """Another writer of the catalog (no signing key) commits forged rows in a snapshot whose summary carries
    tonight's run id (its output prefix: predictable) before tonight's publish. Publish commits the run's own parts
    in a snapshot of its own and reports that one. The code before took the planted snapshot for the run's commit:
    none of the run's parts reached the table, and its snapshot id was sealed into _SUCCESS.json and the event."""
    import pyarrow as pa

    from airflow_provider_vllm.core.allow_list import canonical_uri

    catalog, tables = lake
    publish(run(tmp_path, lake, fake_engine_factory, name="d1"), tables)  # yesterday's run creates the table
    tonight = table_spec(str(tmp_path / "d2"), out_table={"identifier": "lake.triage", "create": True})
    forged = catalog.load_table("lake.triage").scan().to_arrow()
    forged = forged.set_column(forged.schema.get_field_index("label"), "label", pa.array(["FORGED"] * len(forged)))
    run_id = canonical_uri(tonight.io.output_uri, "io.output_uri", resolve=False)
    catalog.load_table("lake.triage").append(forged, snapshot_properties={RUN_ID: run_id})
    planted = catalog.load_table("lake.triage").current_snapshot().snapshot_id
    run_job(tonight, tables, fake_engine_factory)
    commit = publish(tonight, tables)
    assert not commit.already and commit.snapshot_id != planted and commit.rows == 30
    table = catalog.load_table("lake.triage")
    assert commit.snapshot_id == table.current_snapshot().snapshot_id
    live = {e.file.file_path for e in table.scan(snapshot_id=commit.snapshot_id).plan_files()}
    out = Storage(tonight.io.output_uri)
    assert {f for f in live if "/d2/" in f} == {out.uri(p) for p in verified_parts(out, RESULTS, read_merged(out))}
    assert publish(tonight, tables).snapshot_id == commit.snapshot_id  # published again: the run's own snapshot
    record_malicious("planted_table_snapshot_with_the_runs_id", 1, 1)


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


def test_changes_compare_only_with_the_merge_the_tables_snapshot_published(tmp_path, lake, fake_engine_factory):
    """The catalog says which merge of the previous run the table holds (the results manifest's sha256 in the
    snapshot): an earlier merge of that run put back (sealed for its folder too), its summary removed or forged,
    is refused by QA's change set instead of comparing with answers the table never held (or calling every id
    'added'). A snapshot that records no manifest is refused by the plan."""
    import shutil

    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.steps.merge.changes import read_changes
    from airflow_provider_vllm.steps.merge.merger import MERGED
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa.stage import qa_run
    from tests.support.data import merge

    catalog, tables = lake
    first = run(tmp_path, lake, fake_engine_factory, "a")
    earlier = tmp_path / "a-first-merge"
    shutil.copytree(first.io.output_uri, earlier)  # what a writer of the bucket keeps: the first merge, sealed
    _rerun_first_shard(first, fake_engine_factory)
    merge(first)  # merged again: other parts, another results manifest
    published = read_merged(Storage(first.io.output_uri))
    publish(first, tables)
    catalog.load_table("lake.tickets").append(rows(3, start=30))

    second = table_spec(str(tmp_path / "b"), out_table={"identifier": "lake.triage"})
    second = second.model_validate({**second.model_dump(mode="json"), "changes": {"previous_table": True}})
    run_job(second, tables, fake_engine_factory)
    pinned = load_plan(second).changes_from
    assert pinned.results_manifest_sha256 == published.checksums["results/_manifest.json"]

    shutil.copytree(first.io.output_uri, tmp_path / "a-published")
    shutil.copytree(earlier, first.io.output_uri, dirs_exist_ok=True)  # the first merge put back
    assert read_merged(Storage(first.io.output_uri)).checksums != published.checksums  # genuine, sealed
    with pytest.raises(CommitError, match=r"snapshot \d+ published run .* not the merge that was published"):
        qa_run(second)
    os.remove(os.path.join(first.io.output_uri, MERGED))
    with pytest.raises(CommitError, match="which now has no _MERGED.json"):
        qa_run(second)
    with open(os.path.join(first.io.output_uri, MERGED), "w") as f:
        f.write(json.dumps(published.model_dump(mode="json", exclude={"seal"})))  # the right content, unsealed
    with pytest.raises(CommitError, match="without this deployment's seal"):
        qa_run(second)
    assert not os.path.exists(os.path.join(second.io.output_uri, "changes", "_changes.json"))

    # the published merge's files back: compared with it
    shutil.rmtree(first.io.output_uri)
    shutil.copytree(tmp_path / "a-published", first.io.output_uri)
    qa_run(second)
    summary = read_changes(Storage(second.io.output_uri))
    assert summary.counts.added == 3 and summary.counts.unchanged + summary.counts.error == 30

    # a snapshot without the manifest's sha256 (another tool, an older provider): the plan refuses to pin it
    third = table_spec(str(tmp_path / "c"), out_table={"identifier": "lake.other", "create": True})
    run_job(third, tables, fake_engine_factory)
    publish(third, tables, record_manifest=False)
    fourth = table_spec(str(tmp_path / "d"), out_table={"identifier": "lake.other"})
    fourth = fourth.model_validate({**fourth.model_dump(mode="json"), "changes": {"previous_table": True}})
    with pytest.raises(SpecError, match=r"lake.other snapshot \d+ names run .* records no results manifest sha256"):
        plan_job(fourth, tables=tables)


@pytest.mark.reliability
def test_changes_compare_only_with_a_run_this_deployments_publish_committed(tmp_path, lake, fake_engine_factory):
    """The catalog has other writers: a snapshot that names a run and its results manifest is taken only when that
    run's _PUBLISHING.json, sealed by this deployment's publish for that folder, names the same table, run and
    manifest. A run that failed QA never got one: a snapshot another tool committed with its id and manifest
    copied does not make it the baseline; nor does a record of another deployment or of another merge."""
    from airflow_provider_vllm.core.allow_list import canonical_uri
    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.steps.merge.merger import PUBLISHING
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.tables.commit import _write_publishing
    from tests.support.ledger import record_malicious

    catalog, tables = lake
    failed = run(tmp_path, lake, fake_engine_factory, "a")  # say its QA failed: publish never ran for it
    publish(failed, tables)  # stands for the other tool's commit: the same snapshot summary ...
    record = os.path.join(failed.io.output_uri, PUBLISHING)
    os.remove(record)  # ... and no record of this deployment's publish

    def plan_next(name: str):
        nxt = table_spec(str(tmp_path / name), out_table={"identifier": "lake.triage"})
        nxt = nxt.model_validate({**nxt.model_dump(mode="json"), "changes": {"previous_table": True}})
        return plan_job(nxt, tables=tables)

    with pytest.raises(CommitError, match=r"lake.triage snapshot \d+ names run .*which has no _PUBLISHING.json"):
        plan_next("b")
    out = Storage(failed.io.output_uri)
    sha = read_merged(out).checksums["results/_manifest.json"]
    run_id = canonical_uri(failed.io.output_uri, "io.output_uri", resolve=False)
    other = Keyring.from_text("another-deployment-" + "x" * 40)
    _write_publishing(out, other, failed.io.output_table, run_id, sha)
    with pytest.raises(CommitError, match=r"lake.triage snapshot \d+ names run .*seal"):
        plan_next("c")
    _write_publishing(out, Keyring.from_env(), failed.io.output_table, run_id, "0" * 64)  # another merge's
    with pytest.raises(CommitError, match=r"but that run's sealed _PUBLISHING.json names table lake.triage, run"):
        plan_next("d")
    with open(record, "w") as f:
        f.write("{not json")
    with pytest.raises(CommitError, match="is not a publishing record"):
        plan_next("e")
    record_malicious("changes.previous_table: a snapshot without this deployment's publishing record", 4, 4)
    _write_publishing(out, Keyring.from_env(), failed.io.output_table, run_id, sha)  # what publish writes
    assert plan_next("f").changes_from.previous_uri == run_id


def _table_nightly(folder, tables, factory):
    """A nightly run into ``folder`` (planned, sharded, merged) that publishes to lake.triage with
    changes.previous_table and qa.previous_published; its spec."""
    spec = table_spec(str(folder), out_table={"identifier": "lake.triage", "create": True})
    doc = spec.model_dump(mode="json")
    spec = spec.model_validate(
        {**doc, "changes": {"previous_table": True}, "qa": {**doc["qa"], "previous_published": True}}
    )
    run_job(spec, tables, factory)
    return spec


@pytest.mark.reliability
def test_qa_of_a_table_nightly_compares_with_the_report_of_the_run_the_table_published(
    tmp_path, lake, fake_engine_factory
):
    """changes.previous_table with qa.previous_published: QA's baseline is the report whose sha256 the last
    published run's sealed _PUBLISHING.json names (publish writes it after QA's gate, so a night that failed QA is
    never the baseline). The first night has none (a note); that report changed since fails QA naming it; a record
    of an older publish, which names no report, makes the checks warn."""
    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.steps.qa.stage import qa_run
    from tests.support.ledger import record_malicious
    from tests.support.qa_rows import check

    catalog, tables = lake

    def nightly(name: str):
        spec = _table_nightly(tmp_path / name, tables, fake_engine_factory)
        return spec, qa_run(spec)[0]

    first, rep = nightly("a")
    assert load_plan(first).changes_from.previous_uri is None
    assert [n for n in rep.notes if "published nothing before this run" in n]
    publish(first, tables)
    report = Storage(first.io.output_uri).path("qa/report.json")
    with open(report, "rb") as f:
        genuine = f.read()

    second, rep = nightly("b")
    pin = load_plan(second).changes_from
    assert pin.previous_uri == first.io.output_uri and pin.report_sha256 == hashlib.sha256(genuine).hexdigest()
    was = json.loads(genuine)["metrics"]["label_distribution"]["fractions"]
    assert check(rep, "label_drift")["status"] == "pass" and check(rep, "label_drift")["value"] == 0.0  # same rows
    assert rep.metrics["label_drift"]["previous_fractions"] == pytest.approx(
        {k: was.get(k, 0.0) for k in rep.metrics["label_drift"]["delta"]}
    )
    forged = json.loads(genuine)
    forged["metrics"]["label_distribution"]["fractions"] = {"other": 1.0}
    with open(report, "w") as f:
        json.dump(forged, f)
    with pytest.raises(CommitError, match=r"is not the report .* sealed _PUBLISHING.json names"):
        qa_run(second)
    record_malicious("qa.previous_published with changes.previous_table: the published report rewritten", 1, 1)
    with open(report, "wb") as f:
        f.write(genuine)
    publish(second, tables, record_report=False)  # an older publish: its record names no report

    third, rep = nightly("c")
    assert load_plan(third).changes_from.previous_uri == second.io.output_uri
    assert check(rep, "label_drift")["status"] == "warn" and rep.metrics["label_drift"] is None
    assert [n for n in rep.notes if "_PUBLISHING.json names no qa/report.json" in n]


@pytest.mark.reliability
def test_qa_run_again_after_the_table_commit_keeps_the_report_publish_gated_on(
    tmp_path, lake, fake_engine_factory, monkeypatch
):
    """The table commit happened, publish died before _SUCCESS.json, then QA ran again and its report's bytes
    changed (here a provider upgrade). QA fails naming the report, before writing anything: _PUBLISHING.json names
    the report the commit gated on, and the next nights compare with it. The code before replaced the report, and
    every later night's QA, pinned to the first one, failed telling the user to restore a report QA had overwritten.
    Publish run again (the snapshot is there: nothing committed) keeps the record, and the next night compares with
    that report."""
    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.steps.merge.merger import read_publishing
    from airflow_provider_vllm.steps.qa import report as qa_report
    from airflow_provider_vllm.steps.qa.stage import qa_run
    from tests.support.data import files_under

    catalog, tables = lake

    first = _table_nightly(tmp_path / "a", tables, fake_engine_factory)
    qa_run(first)
    out = Storage(first.io.output_uri)
    earlier = hashlib.sha256(out.read_bytes("qa/report.json")).hexdigest()
    assert not publish(first, tables).already  # the table commit; publish then dies before _SUCCESS.json
    assert read_publishing(out, Keyring.from_env()).report_sha256 == earlier
    qa_run(first)  # QA again with the same code: the same bytes, nothing refused
    before = files_under(first.io.output_uri)
    version = qa_report.REPORT_VERSION
    monkeypatch.setattr(qa_report, "REPORT_VERSION", version + 1)
    with pytest.raises(
        CommitError,
        match=r"qa/report\.(html|json): the run under .* is published to table .*, and QA "
        r"would replace that file with other bytes.*Nothing was written",
    ):
        qa_run(first)
    monkeypatch.setattr(qa_report, "REPORT_VERSION", version)
    assert files_under(first.io.output_uri) == before  # the sealed QA record too
    assert publish(first, tables).already  # published again: nothing committed
    assert read_publishing(out, Keyring.from_env()).report_sha256 == earlier

    second = _table_nightly(tmp_path / "b", tables, fake_engine_factory)
    assert load_plan(second).changes_from.report_sha256 == earlier
    rep, _ = qa_run(second)
    assert not [n for n in rep.notes if "_PUBLISHING.json" in n]


def _rerun_first_shard(spec, factory) -> None:
    """operations.md's recovery for one shard: delete its folder, run it again (its parts get other bytes)."""
    import shutil

    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.worker.shard import run_shard

    sid = load_plan(spec).shards[0].shard_id
    shutil.rmtree(f"{spec.io.output_uri}/shards/{sid}")
    assert run_shard(shard_task(spec=spec, shard_id=sid), engine_factory=factory)["status"] == "committed"


def test_a_later_merge_never_changes_the_parts_a_table_commit_references(tmp_path, lake, fake_engine_factory):
    """The table adds the run's parts by path: once publish began its commit, a merge of the folder that would
    add, replace or remove a part is refused before writing anything; a merge that changes nothing still runs."""
    from airflow_provider_vllm.core.errors import CommitError
    from tests.support.data import merge

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)
    publish(spec, tables)  # the table commit alone: _SUCCESS.json is not written yet
    cols = ("id", "latency_ms", "attempt_id")
    before = sorted(catalog.load_table("lake.triage").scan(selected_fields=cols).to_arrow().to_pylist(), key=str)
    merge(spec)  # a retried merge task: the same parts, nothing changes
    _rerun_first_shard(spec, fake_engine_factory)
    with pytest.raises(CommitError, match=r"results/part-.* is published .* would replace that part.*new output"):
        merge(spec)
    after = sorted(catalog.load_table("lake.triage").scan(selected_fields=cols).to_arrow().to_pylist(), key=str)
    assert after == before and (tmp_path / "run" / "_PUBLISHING.json").exists()
    assert publish(spec, tables).already  # the run's parts and manifest are still the committed ones


def test_a_failed_first_commit_names_the_way_out_and_an_unsealed_marker_stops_no_merge(
    tmp_path, lake, fake_engine_factory, monkeypatch, caplog
):
    """``_PUBLISHING.json`` and ``_SUCCESS.json`` planted by a writer of the prefix (no key) made every later merge
    that changed a part fail; a failed first table commit left merge refused with no word on what to do. Only
    markers this deployment's publish sealed stop a merge, and a sealed ``_PUBLISHING.json`` says how to recover."""
    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.steps.tables import commit
    from tests.support.data import merge

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)
    out = tmp_path / "run"
    (out / "_PUBLISHING.json").write_text(json.dumps({"table": "lake.triage", "run_id": str(out)}))
    (out / "_SUCCESS.json").write_text(json.dumps({"format": "vllm-batch-success", "version": 1}))
    _rerun_first_shard(spec, fake_engine_factory)
    merge(spec)  # another part: merged, the unsealed markers named in warnings
    assert caplog.text.count("is not a marker this deployment's publish sealed; ignored") == 2
    (out / "_PUBLISHING.json").unlink()
    (out / "_SUCCESS.json").unlink()

    def refused(*args, **kwargs):
        raise OSError("the catalog went away")

    monkeypatch.setattr(commit, "_transaction", refused)  # the first commit fails after publish sealed its marker
    with pytest.raises(OSError):
        publish(spec, tables)
    monkeypatch.undo()
    assert catalog.load_table("lake.triage").current_snapshot() is None
    _rerun_first_shard(spec, fake_engine_factory)
    with pytest.raises(
        CommitError,
        match=r"is published to table lake.triage \(_PUBLISHING.json: .*would replace that part.*new output prefix.*"
        r"only when no snapshot of table lake.triage names run .*delete \S+_PUBLISHING.json and merge again",
    ):
        merge(spec)
    (out / "_PUBLISHING.json").unlink()  # the table holds no snapshot of the run: the operator's way out
    merge(spec)
    assert not publish(spec, tables).already


def test_a_republish_whose_results_manifest_is_not_the_committed_one_is_refused(tmp_path, lake, fake_engine_factory):
    """A snapshot carrying the run id stands for this publish only when it committed the same results manifest:
    otherwise its file sizes and statistics do not describe the files now at those paths."""
    from airflow_provider_vllm.core.errors import CommitError

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)
    first = publish(spec, tables)
    with pytest.raises(CommitError, match=rf"snapshot {first.snapshot_id} committed run .* with results manifest"):
        publish(spec, tables, manifest_sha256="0" * 64)
    again = publish(spec, tables)
    assert again.already and again.snapshot_id == first.snapshot_id
    assert len(catalog.load_table("lake.triage").snapshots()) == 1


@pytest.mark.parametrize("mode", ["append", "overwrite"])
def test_two_publishes_of_one_run_racing_commit_it_once(tmp_path, lake, fake_engine_factory, mode):
    """Publish B loaded the table before publish A of the same run committed: B's commit loses the race and is not
    retried by pyiceberg on the refreshed table (which would add the run again): commit_results decides again and
    finds A's snapshot."""
    extra = {"mode": "overwrite", "date_column": "run_date"} if mode == "overwrite" else {}
    catalog, tables = lake
    publish(run(tmp_path, lake, fake_engine_factory, **extra), tables)
    other = run(tmp_path, lake, fake_engine_factory, name="run2", **extra)
    stale = catalog.load_table("lake.triage")  # publish B loaded the table ...
    a = publish(other, tables)  # ... then publish A of the same run committed
    real = catalog.load_table
    catalog.load_table = lambda ident: stale if ident == "lake.triage" else real(ident)
    try:
        b = publish(other, tables)  # B goes on with the table as it loaded it
    finally:
        catalog.load_table = real
    assert b.already and b.snapshot_id == a.snapshot_id and not a.already
    t = catalog.load_table("lake.triage")
    runs = [summary_of(s).get(RUN_ID) for s in t.snapshots()]
    ids = t.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist()
    assert runs.count(other.io.output_uri) == 1 and len(ids) == (60 if mode == "append" else 30)
    assert "commit.retry.num-retries" not in t.properties  # the no-retry setting is never committed


def test_commits_that_keep_losing_races_fail_as_transient_naming_the_table(
    tmp_path, lake, fake_engine_factory, monkeypatch
):
    import time

    from pyiceberg.exceptions import ValidationException
    from pyiceberg.table import Transaction

    from airflow_provider_vllm.core.errors import TransientError

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory, mode="overwrite", date_column="run_date")
    monkeypatch.setattr(time, "sleep", lambda s: None)

    def lose(self):
        raise ValidationException("a concurrent overwrite deleted a file this one replaces")

    monkeypatch.setattr(Transaction, "commit_transaction", lose)
    with pytest.raises(TransientError, match=r"table lake\.triage: the catalog refused the commit of run .* 5 times"):
        publish(spec, tables)
    monkeypatch.undo()
    assert not publish(spec, tables).already  # the task's retry commits


def test_republishing_a_run_whose_snapshot_was_expired_does_not_add_it_twice(tmp_path, lake, fake_engine_factory):
    """A date re-run on an append table after maintenance expired the run's snapshot (its files live on in later
    snapshots): the current snapshot holding all the run's parts stands for it; some but not all is refused."""
    from airflow_provider_vllm.core.errors import CommitError

    catalog, tables = lake
    first = run(tmp_path, lake, fake_engine_factory, name="d1")
    a = publish(first, tables)
    publish(run(tmp_path, lake, fake_engine_factory, name="d2"), tables)
    catalog.load_table("lake.triage").maintenance.expire_snapshots().by_id(a.snapshot_id).commit()
    again = publish(first, tables)
    t = catalog.load_table("lake.triage")
    assert again.already and again.snapshot_id == t.current_snapshot().snapshot_id
    assert len(t.scan(selected_fields=("id",)).to_arrow()) == 60
    victim = next(f for f in t.scan().plan_files() if "/d1/results/" in f.file.file_path).file
    with t.transaction() as tx, tx.update_snapshot().overwrite() as producer:
        producer.delete_data_file(victim)  # one of d1's parts dropped by hand
    with pytest.raises(CommitError, match=r"holds \d+ of run .*d1's \d+ result parts"):
        publish(first, tables)


@pytest.mark.parametrize(
    "column, values",
    [
        ("when", pa.array([dt.datetime(2026, 1, 1)] * 3, pa.timestamp("us", tz="Europe/Paris"))),
        ("nothing", pa.array([None] * 3, pa.null())),
        ("took", pa.array([1] * 3, pa.duration("s"))),
    ],
)
def test_a_passthrough_column_an_iceberg_table_cannot_hold_is_refused_naming_it(
    tmp_path, lake, fake_engine_factory, column, values
):
    from airflow_provider_vllm.core.rows import result_schema
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.tables.commit import check_output_table
    from tests.support.data import make_spec

    catalog, tables = lake
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["x", "y", "z"], column: values}), tmp_path / "in.parquet")
    target = {"identifier": "lake.triage", "create": True}
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "run",
        io={"passthrough": [column], "passthrough_prefix": "in_", "output_table": target},
    )
    named = f"results column 'in_{column}' is {values.type}, which an Iceberg table cannot hold"
    with pytest.raises(SpecError, match=re.escape(named)):  # when planned, before any shard runs
        plan_job(spec, tables=tables)
    assert not (tmp_path / "run" / "_plan.json").exists()
    plan = run_job(spec, None, fake_engine_factory)  # planned without the check (an older provider)
    with pytest.raises(SpecError, match=re.escape(named)):  # refused at publish too: before, pyiceberg's exception
        publish(spec, tables)
    assert not catalog.table_exists("lake.triage")
    # an existing table: the same, and one that lacks the column is refused when planned as at publish
    catalog.create_table("lake.triage", schema=result_schema(None))
    with pytest.raises(SpecError, match=re.escape(named)):
        check_output_table(spec.io.output_table, tables, plan.result_schema())
    ok = result_schema(pa.schema([pa.field("in_n", pa.int64())]))
    with pytest.raises(SpecError, match="table lake.triage does not take the results' schema"):
        check_output_table(spec.io.output_table, tables, ok)
    check_output_table(spec.io.output_table, tables, result_schema(None))  # takes them: no error
    missing = spec.io.output_table.model_copy(update={"identifier": "lake.other", "create": False})
    check_output_table(missing, tables, plan.result_schema())  # missing, not created here: left to publish


@pytest.mark.parametrize("same_size", [True, False])
def test_a_part_swapped_after_publish_checked_it_never_reaches_the_table(
    tmp_path, lake, fake_engine_factory, same_size
):
    """A writer of the output prefix replaces a result part after publish checked it against the sealed manifest
    and before the table commit (forged labels; the same size, or another). The commit describes and adds only the
    bytes merge sealed: it fails naming the part, and no forged row, no snapshot, reaches the table. The code before
    read the part's footer and size again for the DataFile and committed the forged file."""
    from airflow_provider_vllm.core.errors import CommitError

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)
    out = Storage(spec.io.output_uri)

    def swap(parts):
        path = out.path(parts[0])
        size = os.path.getsize(path)
        t = pq.read_table(path)
        forged = t.set_column(t.schema.get_field_index("label"), "label", pa.array(["FORGED"] * len(t)))
        pq.write_table(forged, path)
        if same_size:  # padded or cut to the sealed size: a size check alone does not see it
            data = open(path, "rb").read()
            assert len(data) <= size, "the forged part must fit the sealed size"
            with open(path, "r+b") as f:
                f.seek(0)
                footer = 8 + int.from_bytes(data[-8:-4], "little")  # padded before the footer: offsets hold
                f.write(data[:-footer] + b"\0" * (size - len(data)) + data[-footer:])
            assert os.path.getsize(path) == size and pq.read_table(path).num_rows == t.num_rows

    with pytest.raises(CommitError, match=r"table lake\.triage: not committing: .*results/part-.* is not the file"):
        publish(spec, tables, before_commit=swap)
    table = catalog.load_table("lake.triage")
    assert table.current_snapshot() is None and table.snapshots() == []
    record_malicious("result_part_swapped_before_the_table_commit", 1, 1)


def test_a_run_whose_snapshot_the_table_rolled_back_is_not_reported_as_published(tmp_path, lake, fake_engine_factory):
    """The table's owner rolls main back past the run's snapshot (a bad night undone) before a retry of its publish
    (a publish killed after the catalog took the commit, or cleared). The snapshot still exists in the table's
    metadata, but the table no longer holds its rows: the retry fails naming the snapshot, rather than sealing it
    into _SUCCESS.json and the Asset event as the run's published state, and commits nothing. The code before found
    the snapshot among all of the table's snapshots and reported the run as committed."""
    from airflow_provider_vllm.core.errors import CommitError

    catalog, tables = lake
    first = publish(run(tmp_path, lake, fake_engine_factory, name="d1"), tables)
    spec = run(tmp_path, lake, fake_engine_factory, name="d2")
    commit = publish(spec, tables)
    catalog.load_table("lake.triage").manage_snapshots().rollback_to_snapshot(first.snapshot_id).commit()
    with pytest.raises(CommitError, match=rf"snapshot {commit.snapshot_id} committed run .*d2.* no longer holds it"):
        publish(spec, tables)
    table = catalog.load_table("lake.triage")
    assert table.current_snapshot().snapshot_id == first.snapshot_id and len(table.snapshots()) == 2
    assert table.scan().to_arrow().num_rows == 30  # d1's rows only: nothing added again either
    # put back by its owner: the run's snapshot is the table's again, and the retry finds it
    catalog.load_table("lake.triage").manage_snapshots().set_current_snapshot(commit.snapshot_id).commit()
    again = publish(spec, tables)
    assert again.already and again.snapshot_id == commit.snapshot_id


def test_a_schema_change_that_wins_the_race_is_checked_before_the_next_attempt(
    tmp_path, lake, fake_engine_factory, monkeypatch
):
    """The table's owner drops the results' `label` column while publish commits (their commit lands between
    publish's load and its own, so publish's commit loses the race and is decided again). The next attempt checks
    the table as it is now: the results no longer fit, publish fails naming the table and adds nothing. The code
    before checked the table once, before the first attempt, and committed the parts on the next attempt into a
    table with no `label` column: readers got the run's rows without their labels."""
    from pyiceberg.table import Transaction

    catalog, tables = lake
    publish(run(tmp_path, lake, fake_engine_factory, name="d1"), tables)  # the table exists, with d1's rows
    spec = run(tmp_path, lake, fake_engine_factory, name="d2")
    real = Transaction.commit_transaction
    raced = []

    def owner_first(self):
        if not raced:  # a real concurrent commit of the table's owner, through its own handle
            raced.append(True)
            with catalog.load_table("lake.triage").update_schema() as update:
                update.delete_column("label")
        return real(self)

    monkeypatch.setattr(Transaction, "commit_transaction", owner_first)
    with pytest.raises(SpecError, match=r"table lake\.triage does not take the results' schema"):
        publish(spec, tables)
    table = catalog.load_table("lake.triage")
    assert raced and "label" not in table.schema().column_names
    assert [summary_of(s).get(RUN_ID) for s in table.snapshots()].count(spec.io.output_uri) == 0


def test_overwrite_never_drops_a_data_file_that_holds_other_dates_rows(tmp_path, lake, fake_engine_factory):
    """The output table was written unpartitioned first (another tool stored `run_date` in its data files), then
    partitioned by identity(run_date). A file of the old spec holds several dates' rows. Overwriting one date
    replaces whole data files: the code before deleted that file, losing the other dates' rows with it. Publish now
    fails naming the file, and the table keeps every row."""
    import pyarrow as pa
    from pyiceberg.transforms import IdentityTransform

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory, mode="overwrite", date_column="run_date")
    results = _results_schema(spec)
    old = pa.schema([*[f.remove_metadata() for f in results], pa.field("run_date", pa.date32())])
    table = catalog.create_table("lake.triage", schema=old)
    day, other = dt.date(2026, 12, 1), dt.date(2026, 11, 30)
    first = pq.read_table(spec.io.output_uri + "/results").cast(results).slice(0, 2)
    rows_ = pa.concat_tables([first, first]).append_column("run_date", pa.array([day, day, other, other]))
    table.append(rows_.cast(old))  # one data file of the unpartitioned spec, two dates
    with catalog.load_table("lake.triage").update_spec() as update:
        update.add_field("run_date", IdentityTransform(), "run_date")
    with pytest.raises(SpecError, match=r"partition run_date=2026-12-01: data file .* holds rows of other"):
        publish(spec, tables, run_date=day)
    table = catalog.load_table("lake.triage")
    assert table.scan().to_arrow().num_rows == 4 and len(table.snapshots()) == 1


def test_a_merge_run_again_while_publish_commits_is_never_committed_under_the_checked_manifest(
    tmp_path, lake, fake_engine_factory
):
    """A cleared merge task runs again (one shard rerun: its parts get other bytes) after publish checked the parts
    and before its table commit. The table commit takes its parts' sizes and statistics only from the results
    manifest publish checked (its sha256 goes into the snapshot's summary): the new merge fails the commit, naming
    it, and nothing reaches the table; the task's retry (publish from the start) commits the new merge."""
    from airflow_provider_vllm.core.errors import CommitError
    from tests.support.data import merge

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)

    def merge_again(parts):
        _rerun_first_shard(spec, fake_engine_factory)
        merge(spec)

    with pytest.raises(CommitError, match=r"now names results manifest .* not the .* publish checked"):
        publish(spec, tables, before_commit=merge_again, manifest_sha256=None)
    assert catalog.load_table("lake.triage").snapshots() == []
    commit = publish(spec, tables)
    out = Storage(spec.io.output_uri)
    assert (
        summary_of(catalog.load_table("lake.triage").current_snapshot())["vllm-batch.results-manifest-sha256"]
        == read_merged(out).checksums["results/_manifest.json"]
        and not commit.already
    )


def _expire_all_but_current(catalog) -> None:
    t = catalog.load_table("lake.triage")
    keep = t.current_snapshot().snapshot_id
    t.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in t.snapshots() if s.snapshot_id != keep]).commit()


@pytest.mark.reliability
def test_a_publish_retried_after_expiry_and_compaction_never_commits_the_run_twice(tmp_path, lake, fake_engine_factory):
    """Publish is killed after the catalog took its commit (no _SUCCESS.json), then the table's maintenance
    compacts it (every data file rewritten) and expires the older snapshots, before publish's retry. The retry finds
    neither a snapshot carrying the run id nor the run's parts among the current files. The code before committed
    the run a second time (every row twice); the table property set in the commit's own transaction says it is in,
    so the retry fails naming it and adds nothing."""
    from airflow_provider_vllm.core.errors import CommitError

    catalog, tables = lake
    first = run(tmp_path, lake, fake_engine_factory, name="d1")
    a = publish(first, tables)  # the commit is in; the task dies before _SUCCESS.json
    publish(run(tmp_path, lake, fake_engine_factory, name="d2"), tables)
    t = catalog.load_table("lake.triage")
    t.overwrite(t.scan().to_arrow())  # compaction: the same rows in new data files
    _expire_all_but_current(catalog)
    t = catalog.load_table("lake.triage")
    assert not any("/d1/results/" in f.file.file_path for f in t.scan().plan_files())
    with pytest.raises(
        CommitError, match=rf"run .*d1 was committed to it in snapshot {a.snapshot_id} .*not committing"
    ):
        publish(first, tables)
    t = catalog.load_table("lake.triage")
    assert len(t.snapshots()) == 1 and t.scan().to_arrow().num_rows == 60


@pytest.mark.reliability
def test_a_planted_commit_property_fails_publish_closed_and_adds_nothing(tmp_path, lake, fake_engine_factory):
    """The run's commit property is written only with the commit itself: one planted by another writer of the
    catalog (no snapshot, no parts of the run in the table) fails publish closed rather than being taken for a
    commit or overwritten; the table is unchanged."""
    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.steps.tables.commit import committed_property

    catalog, tables = lake
    spec = run(tmp_path, lake, fake_engine_factory)
    publish(run(tmp_path, lake, fake_engine_factory, name="d0"), tables)
    key, _ = committed_property(spec.io.output_uri, 1, "0" * 64)
    with catalog.load_table("lake.triage").transaction() as tx:
        tx.set_properties({key: json.dumps({"run_id": spec.io.output_uri, "snapshot_id": 1})})
    with pytest.raises(CommitError, match=r"was committed to it in snapshot 1 .*not committing"):
        publish(spec, tables)
    assert len(catalog.load_table("lake.triage").snapshots()) == 1
    record_malicious("planted_table_commit_property", 1, 1)


def test_equality_deletes_in_the_output_table_fail_publish_naming_the_table_before_anything_is_written(
    tmp_path, lake, fake_engine_factory
):
    """pyiceberg cannot plan a scan of a table with equality deletes: publish failed with its bare ValueError. It
    now names the table and what to do, and neither the table nor the run folder changed."""
    catalog, tables = lake
    publish(run(tmp_path, lake, fake_engine_factory, name="d1"), tables)
    append_equality_deletes(catalog.load_table("lake.triage"), tmp_path / "warehouse")
    before = len(catalog.load_table("lake.triage").snapshots())
    spec = run(tmp_path, lake, fake_engine_factory, name="d2")
    with pytest.raises(SpecError, match=r"table lake\.triage has equality deletes .*compact the table") as e:
        publish(spec, tables)
    assert "Traceback" not in str(e.value) and not (tmp_path / "d2" / "_PUBLISHING.json").exists()
    assert len(catalog.load_table("lake.triage").snapshots()) == before


def test_an_expired_snapshot_between_the_runs_and_the_current_one_is_named_not_taken_for_a_rollback(
    tmp_path, lake, fake_engine_factory
):
    """Maintenance expires a snapshot between the run's own and the current one: the walk back from main's current
    snapshot stops there. The code before said main was rolled back past the run. Now, when the current snapshot
    holds every part of the run, the run stands (as for an expired run snapshot); when it holds none, publish fails
    naming the expired snapshot, and adds nothing."""
    from airflow_provider_vllm.core.errors import CommitError

    catalog, tables = lake
    d1 = run(tmp_path, lake, fake_engine_factory, name="d1")
    a = publish(d1, tables)
    b = publish(run(tmp_path, lake, fake_engine_factory, name="d2"), tables)
    publish(run(tmp_path, lake, fake_engine_factory, name="d3"), tables)
    catalog.load_table("lake.triage").maintenance.expire_snapshots().by_id(b.snapshot_id).commit()
    again = publish(d1, tables)
    assert again.already and again.snapshot_id == a.snapshot_id
    t = catalog.load_table("lake.triage")
    gone = [f.file for f in t.scan().plan_files() if "/d1/results/" in f.file.file_path]
    with t.transaction() as tx, tx.update_snapshot().overwrite() as producer:
        for f in gone:
            producer.delete_data_file(f)  # the owner removes d1's rows
    with pytest.raises(CommitError, match=r"stops at snapshot \d+, whose parent .*was expired.*holds none of") as e:
        publish(d1, tables)
    assert "main was rolled back" not in str(e.value)
    assert catalog.load_table("lake.triage").scan().to_arrow().num_rows == 60


KILLED_AFTER = KILLER.replace(
    "def die(self, *a, **k):\n",
    "real = SqlCatalog.commit_table\ndef die(self, *a, **k):\n    real(self, *a, **k)  # the commit goes in\n",
)


@pytest.mark.reliability
@pytest.mark.parametrize("older_provider", [False, True])
def test_a_publish_killed_after_the_commit_then_maintained_never_commits_twice(
    tmp_path, lake, fake_engine_factory, older_provider
):
    """Publish killed just after the catalog took its commit (a real SIGKILL), then compaction and expiry before the
    retry. The table property of the commit says it is in; a commit without one (an older provider's, or the
    property removed) is still refused when main's history since publish began its commit (_PUBLISHING.json) was
    expired, since nothing then tells whether it went in."""
    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.core.records import COMMITTED_PROPERTY as COMMITTED

    assert KILLED_AFTER != KILLER
    catalog, tables = lake
    publish(run(tmp_path, lake, fake_engine_factory, name="d0"), tables)
    spec = run(tmp_path, lake, fake_engine_factory)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER, str(tmp_path), spec.model_dump_json()],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    t = catalog.load_table("lake.triage")
    assert t.scan().to_arrow().num_rows == 60 and (tmp_path / "run" / "_PUBLISHING.json").exists()
    if older_provider:
        with t.transaction() as tx:
            tx.remove_properties(*[k for k in t.properties if k.startswith(COMMITTED)])
    t = catalog.load_table("lake.triage")
    t.overwrite(t.scan().to_arrow())  # compaction
    _expire_all_but_current(catalog)
    why = "began its commit at .* history since then was expired" if older_provider else "was committed to it"
    with pytest.raises(CommitError, match=why):
        publish(spec, tables)
    t = catalog.load_table("lake.triage")
    assert len(t.snapshots()) == 1 and t.scan().to_arrow().num_rows == 60


def test_a_run_rolled_back_past_is_told_apart_from_one_beyond_an_expired_snapshot(tmp_path, lake, fake_engine_factory):
    """main rolled back past the run's snapshot, then an older snapshot expired (the walk back from main stops
    short): the run's snapshot is newer than where the walk stops (sequence numbers), so it surely left main's
    history. Publish says it was rolled back past, not that it cannot tell, and adds nothing."""
    from airflow_provider_vllm.core.errors import CommitError

    catalog, tables = lake
    a = publish(run(tmp_path, lake, fake_engine_factory, name="d1"), tables)
    b = publish(run(tmp_path, lake, fake_engine_factory, name="d2"), tables)
    d3 = run(tmp_path, lake, fake_engine_factory, name="d3")
    c = publish(d3, tables)
    catalog.load_table("lake.triage").manage_snapshots().rollback_to_snapshot(b.snapshot_id).commit()
    catalog.load_table("lake.triage").maintenance.expire_snapshots().by_id(a.snapshot_id).commit()
    with pytest.raises(CommitError, match=rf"snapshot {c.snapshot_id} committed run .*d3.*main was rolled back"):
        publish(d3, tables)
    assert catalog.load_table("lake.triage").scan().to_arrow().num_rows == 60


def test_changes_from_the_table_fail_when_the_walk_back_stops_at_an_expired_snapshot(
    tmp_path, lake, fake_engine_factory
):
    """changes.previous_table walks main's history back to the last snapshot a run of this deployment committed. When
    maintenance expired that far (another writer's snapshots since, then an expiry), the walk stops at a snapshot whose
    parent is gone: the plan said "nothing to compare", which dropped the change set and the churn check of a table
    that has a published run. It now fails naming the expired snapshot and the setting that names the run instead; a
    table whose history is whole and holds no run still has nothing to compare."""
    from airflow_provider_vllm.steps.plan.planner import plan_job

    catalog, tables = lake
    publish(run(tmp_path, lake, fake_engine_factory, "a"), tables)
    t = catalog.load_table("lake.triage")
    t.append(t.scan().to_arrow().slice(0, 1))  # another writer's snapshot after the run's
    t = catalog.load_table("lake.triage")
    keep = t.current_snapshot().snapshot_id
    t.maintenance.expire_snapshots().by_ids([s.snapshot_id for s in t.snapshots() if s.snapshot_id != keep]).commit()
    nxt = table_spec(str(tmp_path / "b"), out_table={"identifier": "lake.triage"})
    nxt = nxt.model_validate({**nxt.model_dump(mode="json"), "changes": {"previous_table": True}})
    with pytest.raises(
        SpecError,
        match=r"changes\.previous_table: .*lake\.triage.*whose parent .*was expired.*"
        r"changes\.previous_table false and changes\.previous_uri",
    ) as e:
        plan_job(nxt, tables=tables)
    assert "Traceback" not in str(e.value)


def test_a_run_merged_again_after_its_snapshot_expired_is_not_taken_for_the_committed_one(
    tmp_path, lake, fake_engine_factory
):
    """The run's snapshot was expired (nightly maintenance) and publish died before _SUCCESS.json. Merge's refusal
    said to delete _PUBLISHING.json and merge again when no snapshot names the run; a shard rerun then merged parts
    with other bytes under the same paths. The current snapshot holding those paths stood for the run and publish
    reported it published, though the table describes the bytes of the first merge. The commit's table property
    names the results manifest committed: publish now fails naming the merge again, and merge's advice names the
    property too."""
    from airflow_provider_vllm.core.errors import CommitError
    from tests.support.data import merge

    catalog, tables = lake
    first = run(tmp_path, lake, fake_engine_factory, name="d1")
    a = publish(first, tables)
    publish(run(tmp_path, lake, fake_engine_factory, name="d2"), tables)
    catalog.load_table("lake.triage").maintenance.expire_snapshots().by_id(a.snapshot_id).commit()
    _rerun_first_shard(first, fake_engine_factory)
    with pytest.raises(CommitError, match=r"vllm-batch\.committed\.[0-9a-f]{32}"):
        merge(first)
    (tmp_path / "d1" / "_PUBLISHING.json").unlink()
    merge(first)
    with pytest.raises(
        CommitError,
        match=rf"run .*d1 was committed to it in snapshot {a.snapshot_id} with results manifest .*merged again",
    ):
        publish(first, tables)


@pytest.mark.reliability
def test_a_format_1_tables_history_cut_by_expiry_after_a_full_rewrite_is_not_taken_for_whole(
    tmp_path, lake, fake_engine_factory
):
    """A format 1 table has no sequence numbers: after a compaction that rewrote every data file and an expiry by
    pyiceberg (which clears the parent id), the current snapshot lists only manifests of its own and looks like the
    table's first. The walk back took main's history for whole: changes.previous_table had "nothing to compare",
    and a run committed without its table property (an older provider) was committed again, every row twice. In a
    format 1 table a snapshot without a parent now counts as one whose parent may have been expired."""
    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.core.records import COMMITTED_PROPERTY as COMMITTED
    from airflow_provider_vllm.steps.tables.commit import resolve_changes_from

    catalog, tables = lake
    d1 = run(tmp_path, lake, fake_engine_factory, name="d1")
    fields = [f.remove_metadata() for f in _results_schema(d1)]
    catalog.create_table("lake.triage", schema=pa.schema(fields), properties={"format-version": "1"})
    publish(d1, tables)  # the commit is in; the task dies before _SUCCESS.json
    t = catalog.load_table("lake.triage")
    with t.transaction() as tx:  # as an older provider committed it: no property
        tx.remove_properties(*[k for k in t.properties if k.startswith(COMMITTED)])
    t = catalog.load_table("lake.triage")
    t.overwrite(t.scan().to_arrow())  # compaction: the same rows in new data files
    _expire_all_but_current(catalog)
    assert catalog.load_table("lake.triage").metadata.format_version == 1
    with pytest.raises(CommitError, match=r"began its commit at .* history since then was expired"):
        publish(d1, tables)
    assert catalog.load_table("lake.triage").scan().to_arrow().num_rows == 30
    nxt = table_spec(str(tmp_path / "d2"), out_table={"identifier": "lake.triage"})
    nxt = nxt.model_validate({**nxt.model_dump(mode="json"), "changes": {"previous_table": True}})
    with pytest.raises(SpecError, match=r"changes\.previous_table: .*lake\.triage.*format 1"):
        resolve_changes_from(nxt, tables)


@pytest.mark.reliability
def test_a_published_run_cleared_again_after_expiry_and_compaction_is_a_no_op(tmp_path, lake, fake_engine_factory):
    """A run published in full (_SUCCESS.json sealed, naming its snapshot), then nightly compaction and expiry, then
    its publish task cleared again (a DAG run cleared with its downstream tasks). The commit property says the run
    is in and the sealed _SUCCESS.json names the same snapshot: publish is the no-op it is while the snapshot is
    there. It failed (CommitError) and asked a person to count rows, for a run it had itself published."""
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.steps.merge.merger import SUCCESS
    from airflow_provider_vllm.steps.publish import success_bytes

    catalog, tables = lake
    d1 = run(tmp_path, lake, fake_engine_factory, name="d1")
    a = publish(d1, tables)
    body = success_bytes({"table": a.event()}, Keyring.from_env(), d1.io.output_uri)
    Storage(d1.io.output_uri).write_atomic(SUCCESS, body)
    publish(run(tmp_path, lake, fake_engine_factory, name="d2"), tables)
    t = catalog.load_table("lake.triage")
    t.overwrite(t.scan().to_arrow())  # compaction
    _expire_all_but_current(catalog)
    again = publish(d1, tables)
    assert again.already and again.snapshot_id == a.snapshot_id and again.rows == a.rows
    t = catalog.load_table("lake.triage")
    assert len(t.snapshots()) == 1 and t.scan().to_arrow().num_rows == 60
