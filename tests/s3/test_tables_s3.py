"""Iceberg tables with an S3 warehouse on a local S3-compatible server (moto): the plan pins a snapshot whose data
files the shards read from S3, a later append changes no retry, publish adds the S3 parts in one snapshot, once."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import load_plan
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.tables.access import Tables, summary_of
from airflow_provider_vllm.worker.shard import read_shard_rows, shard_input
from tests.support.iceberg import publish, rows, run_job, source_table, sql_catalog, table_spec
from tests.support.s3server import MotoServer


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("lake")
        yield server


def test_table_in_and_out_with_an_s3_warehouse(s3, tmp_path, fake_engine_factory, monkeypatch):
    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    catalog = sql_catalog(
        tmp_path,
        warehouse="s3://lake/warehouse",
        **{
            "s3.endpoint": s3.endpoint,
            "s3.access-key-id": "testing",
            "s3.secret-access-key": "testing",
            "s3.region": "us-east-1",
        },
    )
    tables = Tables(catalog=catalog, allowed=["lake.*"], uri_prefixes=["s3://lake/"])
    table = source_table(catalog)
    spec = table_spec("s3://lake/runs/a", out_table={"identifier": "lake.triage", "create": True})
    plan = plan_job(spec, tables=tables)
    assert plan.table.read == "reference" and plan.input_root.startswith("s3://lake/warehouse/")

    def read_all():
        p = load_plan(spec)
        ids = []
        for s in p.shards:
            with shard_input(spec, p, s) as root:
                ids += read_shard_rows(spec, p, s, root).ids
        return ids

    before = read_all()
    table.append(rows(7, start=500))
    assert plan_job(spec, tables=tables).table == plan.table and read_all() == before
    run_job(spec, tables, fake_engine_factory)
    first = publish(spec, tables)
    again = publish(spec, tables)
    out = catalog.load_table("lake.triage")
    assert again.already and [s.snapshot_id for s in out.snapshots()] == [first.snapshot_id]
    assert summary_of(out.current_snapshot())["vllm-batch.run-id"] == "s3://lake/runs/a"
    files = [t.file.file_path for t in out.scan().plan_files()]
    assert files and all(f.startswith("s3://lake/runs/a/results/part-") for f in files)
    assert sorted(out.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist()) == sorted(before)


def test_a_table_whose_files_lie_in_another_bucket_is_refused(s3, tmp_path, monkeypatch):
    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    catalog = sql_catalog(
        tmp_path,
        warehouse="s3://lake/warehouse",
        **{
            "s3.endpoint": s3.endpoint,
            "s3.access-key-id": "testing",
            "s3.secret-access-key": "testing",
            "s3.region": "us-east-1",
        },
    )
    source_table(catalog, name="lake.other")
    for prefixes in (["s3://lake-runs/", "s3://lake-other/"], [str(tmp_path)]):  # another bucket, another scheme
        tables = Tables(catalog=catalog, allowed=["lake.*"], uri_prefixes=prefixes)
        with pytest.raises(SpecError, match=r"lake.other snapshot \d+: data file=s3://lake/warehouse/.* is outside"):
            plan_job(table_spec("s3://lake/runs/b", identifier="lake.other"), tables=tables)
