"""Iceberg tables for tests: pyiceberg's SQL catalog on SQLite, with a local or an S3 (moto) warehouse, and a whole
table job run in process (plan -> shards with the fake engine -> merge -> the publish commit)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pyarrow as pa

from airflow_provider_vllm.core.plan import load_plan
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import RESULTS, manifest_rel, verified_parts
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.tables.access import Tables
from airflow_provider_vllm.steps.tables.commit import TableCommit, commit_results
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task

SOURCE_SCHEMA = pa.schema([pa.field("id", pa.string()), pa.field("text", pa.string()), pa.field("lang", pa.string())])


def sql_catalog(tmp: Path, warehouse: str | None = None, **props: Any) -> Any:
    """A SQL catalog on SQLite under ``tmp`` (warehouse: a folder under ``tmp``, or the URI given)."""
    from pyiceberg.catalog.sql import SqlCatalog

    wh = warehouse or f"file://{tmp / 'warehouse'}"
    if warehouse is None:
        (tmp / "warehouse").mkdir(parents=True, exist_ok=True)
    catalog = SqlCatalog("test", uri=f"sqlite:///{tmp / 'catalog.db'}", warehouse=wh, **props)
    catalog.create_namespace_if_not_exists("lake")
    return catalog


def rows(n: int, start: int = 0, langs: tuple[str, ...] = ("en", "fr")) -> pa.Table:
    ids = [f"t{i:05d}" for i in range(start, start + n)]
    return pa.table(
        {
            "id": ids,
            "text": [f"ticket {i}" for i in range(start, start + n)],
            "lang": [langs[i % len(langs)] for i in range(n)],
        },
        schema=SOURCE_SCHEMA,
    )


def source_table(catalog: Any, name: str = "lake.tickets", partition_by_lang: bool = False, n: int = 30) -> Any:
    """A table of ``n`` tickets (two appends: two data files, or one per language when partitioned)."""
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.transforms import IdentityTransform

    table = catalog.create_table(name, schema=SOURCE_SCHEMA)
    if partition_by_lang:
        with table.update_spec() as spec:
            spec.add_field("lang", IdentityTransform(), "lang")
        table = catalog.load_table(name)
    _ = (PartitionField, PartitionSpec)
    table.append(rows(n // 2))
    table.append(rows(n - n // 2, start=n // 2))
    return catalog.load_table(name)


def append_equality_deletes(table: Any, folder: Path) -> None:
    """Commit an equality delete file (of id ``t00001``, written under ``folder``) to ``table``: pyiceberg writes
    none itself, and plans no scan of a table that has one."""
    import pyarrow.parquet as pq
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    path = folder / "eq-deletes.parquet"
    pq.write_table(pa.table({"id": ["t00001"]}), path)
    deletes = DataFile.from_args(
        content=DataFileContent.EQUALITY_DELETES,
        file_path=f"file://{path}",
        file_format=FileFormat.PARQUET,
        partition=Record(),
        record_count=1,
        file_size_in_bytes=path.stat().st_size,
        equality_ids=[table.schema().find_field("id").field_id],
        spec_id=0,
        sort_order_id=None,
        key_metadata=None,
    )
    with table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        append.append_data_file(deletes)


def table_spec(
    output_uri: str,
    identifier: str = "lake.tickets",
    out_table: dict | None = None,
    io: dict | None = None,
    **table: Any,
):
    """A job reading table ``identifier`` (``table``: more of ``io.input_table``; ``io``: more of ``io``)."""
    return make_spec(
        "/unused",
        output_uri,
        io={
            "input_uri": None,
            "input_table": {"identifier": identifier, **table},
            "output_uri": output_uri,
            **({"output_table": out_table} if out_table else {}),
            **(io or {}),
        },
        sharding={"target_rows": 10, "chunk_rows": 4},
    )


def run_job(spec: Any, tables: Tables, factory: Any, filesystems: Any = None) -> Any:
    """plan -> every shard (fake engine) -> merge; returns the plan."""
    plan = plan_job(spec, filesystems=filesystems, tables=tables)
    for s in plan.shards:
        assert run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)["status"] == "committed"
    merge(spec, filesystems=filesystems)
    return plan


def publish(
    spec: Any,
    tables: Tables,
    run_date: dt.date = dt.date(2026, 12, 1),
    filesystems: Any = None,
    manifest_sha256: str | None = None,
    record_manifest: bool = True,
    record_report: bool = True,
    before_commit: Any = None,
) -> TableCommit:
    """The publish task's table commit, as the operator makes it (steps only). ``manifest_sha256``: the results
    manifest's sha256 to record (default: the one the sealed merge names); ``record_manifest=False``: none, as a
    snapshot committed by another tool or an older provider. The sha256 of the QA report the run's sealed verdict
    names goes into ``_PUBLISHING.json`` (none without a QA, or with ``record_report=False``: an older provider).
    ``before_commit``: called with the part paths publish checked, before the commit (a bucket writer's move)."""
    from airflow_provider_vllm.core.allow_list import canonical_uri
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.steps.merge.merger import read_merged
    from airflow_provider_vllm.steps.qa.store import QA_RECORD, read_qa

    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    report = None
    if record_report and out.exists(QA_RECORD):
        report = read_qa(out, Keyring.from_env()).files["report_json"].sha256
    merged = read_merged(out)
    parts = verified_parts(out, RESULTS, merged)
    plan = load_plan(spec, filesystems)
    if before_commit is not None:
        before_commit(parts)
    return commit_results(
        spec.io.output_table,
        tables,
        out,
        parts,
        plan.result_schema(),
        run_id=canonical_uri(spec.io.output_uri, "io.output_uri", resolve=False),
        run_date=run_date,
        report_sha256=report,
        properties={
            "airflow-run": "dag/run",
            **(
                {"results-manifest-sha256": manifest_sha256 or merged.checksums[manifest_rel(RESULTS)]}
                if record_manifest
                else {}
            ),
        },
    )
