"""Publishing a run to an Iceberg table (``io.output_table``): one snapshot adding the merged result parts by
reference, once.

``commit_results`` builds one Iceberg ``DataFile`` per part from its Parquet footer (statistics, no rewrite)
and commits them in one transaction as one snapshot: ``append`` (fast append) or ``overwrite`` (the run
date's partition replaced in the same snapshot). The snapshot's summary carries ``vllm-batch.run-id`` (the
run's output prefix: one run) and the caller's properties (the Airflow run, the results manifest's sha256).
A snapshot of the table that already carries the run id makes the call a no-op returning it: a retried
publish, or one killed after the catalog took the commit. The catalog's compare-and-swap makes the commit
all or nothing. See docs/adr/0009-iceberg-tables.md.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core.allow_list import canonical_uri, check_uri
from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.plan import ChangesFrom
from airflow_provider_vllm.core.spec import JobSpec, TableOutput
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.tables.access import Tables, summary_of

if TYPE_CHECKING:
    from pyiceberg.table import Table

RUN_ID = "vllm-batch.run-id"
PREFIX = "vllm-batch."


@dataclass(frozen=True)
class TableCommit:
    """What publish committed (or found committed): the table, its location and the snapshot."""

    identifier: str
    location: str
    snapshot_id: int
    files: int
    rows: int
    already: bool  # True: an earlier publish of this run committed it; nothing was written now

    def event(self) -> dict[str, Any]:
        return {
            "identifier": self.identifier,
            "location": self.location,
            "snapshot_id": self.snapshot_id,
            "files": self.files,
            "rows": self.rows,
        }


def committed_snapshot(table: Table, run_id: str) -> Any:
    """The snapshot of ``table`` whose summary carries ``run_id``, or None."""
    for snap in table.metadata.snapshots:
        if summary_of(snap).get(RUN_ID) == run_id:
            return snap
    return None


def commit_results(
    target: TableOutput,
    tables: Tables,
    out: Storage,
    parts: Sequence[str],
    schema: pa.Schema,
    run_id: str,
    run_date: dt.date,
    properties: Mapping[str, str] = {},
) -> TableCommit:
    """Commit the parts (paths under ``out``) to ``target``'s table as one snapshot; a no-op if committed.

    ``schema``: the parts' Arrow schema (``Plan.result_schema()``), which the table must accept (created from it
    with ``target.create``). ``run_date``: the date partition's value (``target.date_column``). Raises SpecError
    for a table that is missing (without ``create``), partitioned otherwise, or whose schema the parts do not
    fit; CommitError when the catalog refuses the commit (the table is then unchanged).
    """
    from pyiceberg.exceptions import CommitFailedException, NoSuchTableError

    what = "io.output_table.identifier"
    tables.check(target.identifier, what)
    assert tables.catalog is not None
    try:
        table = tables.catalog.load_table(target.identifier)
    except NoSuchTableError:
        if not target.create:
            raise SpecError(
                f"{what}={target.identifier!r}: no such table in the catalog of {tables.describe()}; create it, or "
                "set io.output_table.create to create it on the first publish"
            ) from None
        table = _create(tables, target, schema)
    found = committed_snapshot(table, run_id)
    if found is not None:
        return _done(target, table, found, already=True)
    _check_table(table, target, schema)
    uris = [out.uri(p) for p in parts]
    data_files = [_data_file(table, out, rel, uri, target, run_date) for rel, uri in zip(parts, uris)]
    props = {RUN_ID: run_id, **{k if k.startswith(PREFIX) else PREFIX + k: str(v) for k, v in properties.items()}}
    tx = table.transaction()
    if table.metadata.name_mapping() is None:  # parts carry no field ids: readers map them by name
        from pyiceberg.table import TableProperties

        mapping: dict[str, Any] = {TableProperties.DEFAULT_NAME_MAPPING: table.schema().name_mapping.model_dump_json()}
        tx.set_properties(mapping)
    if target.mode == "overwrite":
        old = _partition_files(table, target, run_date)
        with tx.update_snapshot(snapshot_properties=props).overwrite() as producer:
            for f in old:
                producer.delete_data_file(f)
            for f in data_files:
                producer.append_data_file(f)
    else:
        with tx.update_snapshot(snapshot_properties=props).fast_append() as producer:
            for f in data_files:
                producer.append_data_file(f)
    try:
        tx.commit_transaction()
    except CommitFailedException as e:
        table = table.refresh()
        found = committed_snapshot(table, run_id)
        if found is not None:  # a concurrent publish of this run won
            return _done(target, table, found, already=True)
        raise CommitError(f"table {target.identifier}: the catalog refused the commit of run {run_id}: {e}") from e
    table = table.refresh()
    found = committed_snapshot(table, run_id)
    if found is None:
        raise CommitError(f"table {target.identifier}: committed, but no snapshot carries run {run_id}")
    return _done(target, table, found, already=False)


def _done(target: TableOutput, table: Table, snap: Any, already: bool) -> TableCommit:
    s = summary_of(snap)
    return TableCommit(
        identifier=target.identifier,
        location=table.location(),
        snapshot_id=snap.snapshot_id,
        files=int(s.get("added-data-files", 0)),
        rows=int(s.get("added-records", 0)),
        already=already,
    )


def _create(tables: Tables, target: TableOutput, schema: pa.Schema) -> Table:
    """A new table of the parts' schema (plus the date column, identity-partitioned)."""
    from pyiceberg.exceptions import TableAlreadyExistsError
    from pyiceberg.transforms import IdentityTransform

    assert tables.catalog is not None
    fields = [f.remove_metadata() for f in schema]
    if target.date_column is not None:
        if target.date_column in schema.names:
            raise SpecError(f"io.output_table.date_column {target.date_column!r} is a column of the results")
        fields.append(pa.field(target.date_column, pa.date32()))
    try:
        tx = tables.catalog.create_table_transaction(target.identifier, schema=pa.schema(fields))
        if target.date_column is not None:
            with tx.update_spec() as spec:
                spec.add_field(target.date_column, IdentityTransform(), target.date_column)
        tx.commit_transaction()
    except TableAlreadyExistsError:  # another publish created it meanwhile
        pass
    return tables.catalog.load_table(target.identifier)


def _check_table(table: Table, target: TableOutput, schema: pa.Schema) -> None:
    """SpecError unless the table takes the parts as they are: its partitioning and its schema."""
    from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible
    from pyiceberg.transforms import IdentityTransform
    from pyiceberg.types import DateType

    where = f"table {target.identifier}"
    spec = table.spec()
    if target.date_column is None:
        if spec.fields:
            raise SpecError(
                f"{where} is partitioned ({spec}); the results carry no partition columns: set "
                "io.output_table.date_column to the table's identity-partitioned date column, or use an "
                "unpartitioned table"
            )
    else:
        try:
            field = table.schema().find_field(target.date_column)
        except ValueError:
            raise SpecError(f"{where} has no column {target.date_column!r} (io.output_table.date_column)") from None
        ok = (
            len(spec.fields) == 1
            and spec.fields[0].source_id == field.field_id
            and isinstance(spec.fields[0].transform, IdentityTransform)
        )
        if not ok or not isinstance(field.field_type, DateType):
            raise SpecError(
                f"{where} must be partitioned by identity({target.date_column}) of type date alone, for "
                f"io.output_table.date_column; it is {spec} with {target.date_column} {field.field_type}"
            )
        if target.date_column in schema.names:
            raise SpecError(f"io.output_table.date_column {target.date_column!r} is a column of the results")
    try:
        _check_pyarrow_schema_compatible(table.schema(), schema, format_version=table.metadata.format_version)
    except ValueError as e:
        raise SpecError(f"{where} does not take the results' schema: {e}") from None


def _data_file(table: Table, out: Storage, rel: str, uri: str, target: TableOutput, run_date: dt.date) -> Any:
    """The part's DataFile: statistics from its footer; the date partition's value when partitioned by it."""
    from pyiceberg.io.pyarrow import (
        compute_statistics_plan,
        data_file_statistics_from_parquet_metadata,
        parquet_path_to_id_mapping,
    )
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    schema = table.schema()
    with out.open(rel) as f:
        md = pq.ParquetFile(f).metadata
    stats = data_file_statistics_from_parquet_metadata(
        parquet_metadata=md,
        stats_columns=compute_statistics_plan(schema, table.metadata.properties),
        parquet_column_mapping=parquet_path_to_id_mapping(schema),
    )
    if target.date_column is None:
        partition = Record()
    else:
        partition = Record((run_date - dt.date(1970, 1, 1)).days)  # a date's partition value: days since epoch
    return DataFile.from_args(
        content=DataFileContent.DATA,
        file_path=uri,
        file_format=FileFormat.PARQUET,
        partition=partition,
        file_size_in_bytes=out.size(rel),
        sort_order_id=None,
        spec_id=table.metadata.default_spec_id,
        equality_ids=None,
        key_metadata=None,
        **stats.to_serialized_dict(),
    )


def _partition_files(table: Table, target: TableOutput, run_date: dt.date) -> list[Any]:
    """The data files of the run date's partition in the current snapshot (the ones ``overwrite`` replaces)."""
    from pyiceberg.expressions import EqualTo

    assert target.date_column is not None
    if table.current_snapshot() is None:
        return []
    # pyiceberg types EqualTo as its pydantic fields (term, value); its __init__ takes (term, literal)
    scan = table.scan(row_filter=EqualTo(target.date_column, run_date.isoformat()))  # type: ignore[call-arg]
    files = []
    for task in scan.plan_files():
        if task.delete_files:
            raise SpecError(
                f"table {target.identifier}: partition {target.date_column}={run_date} has delete files; "
                "overwrite replaces whole data files only"
            )
        files.append(task.file)
    return files


def resolve_changes_from(spec: JobSpec, tables: Tables) -> ChangesFrom:
    """``changes.previous_table``: the run whose snapshot ``io.output_table`` holds last (walking the current
    snapshot's ancestry to the first one a run committed, this run's own excepted). Its output prefix must lie
    inside ``tables.uri_prefixes`` (SpecError naming the table and snapshot); a missing table or no such
    snapshot: nothing to compare (``previous_uri`` None)."""
    from pyiceberg.exceptions import NoSuchTableError

    target = spec.io.output_table
    assert target is not None
    tables.check(target.identifier, "io.output_table.identifier")
    assert tables.catalog is not None
    own = canonical_uri(spec.io.output_uri, "io.output_uri", resolve=False)
    try:
        table = tables.catalog.load_table(target.identifier)
    except NoSuchTableError:
        return ChangesFrom(identifier=target.identifier, snapshot_id=None, previous_uri=None)
    snap = table.current_snapshot()
    while snap is not None:
        run = summary_of(snap).get(RUN_ID)
        if run is not None and run != own:
            try:
                check_uri(run, tables.uri_prefixes, "changes.previous_table")
            except SpecError as e:
                raise SpecError(
                    f"table {target.identifier} snapshot {snap.snapshot_id} names run {run!r}: {e}"
                ) from None
            return ChangesFrom(identifier=target.identifier, snapshot_id=snap.snapshot_id, previous_uri=run)
        snap = table.snapshot_by_id(snap.parent_snapshot_id) if snap.parent_snapshot_id is not None else None
    return ChangesFrom(identifier=target.identifier, snapshot_id=None, previous_uri=None)
