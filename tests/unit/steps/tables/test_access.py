"""Which tables a deployment allows: identifiers and namespace.* patterns, failing closed."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.steps.tables.access import Tables, parse_allowed_tables, table_allowed


def test_allowed_tables_parse_from_commas_or_json_and_refuse_anything_else():
    assert parse_allowed_tables(" lake.tickets, triage.* ,") == ["lake.tickets", "triage.*"]
    assert parse_allowed_tables('["a.b.c", "x.*"]') == ["a.b.c", "x.*"]
    assert parse_allowed_tables("") == [] and parse_allowed_tables(None) == []
    for bad in ("*", "lake", "lake..t", "lake.'t'", "lake.t;drop", "../x.y", "lake.*.x", '["a.b", 1]', "[nope"):
        with pytest.raises(SpecError):
            parse_allowed_tables(bad, "[vllm_batch] allowed_tables")


def test_a_namespace_pattern_allows_its_tables_by_whole_segments_only():
    allowed = ["lake.*", "triage.out"]
    assert table_allowed("lake.tickets", allowed) and table_allowed("triage.out", allowed)
    assert not table_allowed("lakehouse.tickets", allowed)  # not a segment prefix
    assert not table_allowed("lake.sub.tickets", allowed)  # a nested namespace is not in lake.*
    assert not table_allowed("triage.out2", allowed) and not table_allowed("triage.other", allowed)


def test_no_allowed_tables_refuses_every_table_naming_the_setting():
    tables = Tables(catalog=None, allowed=[], setting="[vllm_batch] allowed_tables (AIRFLOW__X)")
    with pytest.raises(SpecError, match=r"no tables are allowed: set \[vllm_batch\] allowed_tables"):
        tables.check("lake.tickets", "io.input_table.identifier")
    with pytest.raises(SpecError, match="no tables are allowed"):
        tables.load("lake.tickets", "io.input_table.identifier")  # before any catalog is asked


def test_a_parent_cycle_another_writer_committed_ends_the_walk_back_instead_of_hanging(tmp_path):
    """A catalog checks no parent id: another writer can add two snapshots, each naming the other as its parent,
    and set main to one. The walk back from main went round forever (plan and publish hung until Airflow's timeout).
    It now stops where a parent repeats, counting it as a cut: nothing of main's history is taken as sure."""
    import pyarrow as pa
    from pyiceberg.table.refs import SnapshotRefType
    from pyiceberg.table.update import AddSnapshotUpdate, SetSnapshotRefUpdate

    from airflow_provider_vllm.steps.tables.access import history_cut_since, in_history, walk_back
    from tests.support.iceberg import sql_catalog

    catalog = sql_catalog(tmp_path)
    t = catalog.create_table("lake.t", schema=pa.schema([("a", pa.int64())]))
    t.append(pa.table({"a": [1]}))
    t = catalog.load_table("lake.t")
    base = t.current_snapshot()
    seq = t.metadata.last_sequence_number
    a = base.model_copy(update={"snapshot_id": 101, "parent_snapshot_id": 102, "sequence_number": seq + 1})
    b = base.model_copy(update={"snapshot_id": 102, "parent_snapshot_id": 101, "sequence_number": seq + 2})
    ref = SetSnapshotRefUpdate(ref_name="main", type=SnapshotRefType.BRANCH, snapshot_id=102)
    with t.transaction() as tx:
        tx._apply((AddSnapshotUpdate(snapshot=a), AddSnapshotUpdate(snapshot=b), ref))
    t = catalog.load_table("lake.t")
    assert t.current_snapshot().snapshot_id == 102
    found, cut = walk_back(t, None, lambda s: False)
    assert found is None and cut is not None
    assert in_history(t, base.snapshot_id)[1] is not None
    assert history_cut_since(t, 0) is not None
