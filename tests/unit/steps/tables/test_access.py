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
