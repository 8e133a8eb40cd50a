"""Which object stores a local worker gets the Connections' identity for (also tests/airflow/test_connections.py)."""

from __future__ import annotations

from airflow_provider_vllm.hooks.filesystems import spec_schemes
from tests.support.data import make_spec


def test_a_table_jobs_input_scheme_comes_from_its_plan():
    spec = make_spec("/unused", "/out", io={"input_uri": None, "input_table": {"identifier": "lake.t"}})
    assert spec_schemes(spec) == {""}  # the (local) output only: the table's data files are not in the spec
    assert spec_schemes(spec, ["s3://lake/warehouse/lake/t/data"]) == {"", "s3"}
    folder = make_spec("s3://in/x/", "gs://out/y/")
    assert spec_schemes(folder) == {"s3", "gs"}
