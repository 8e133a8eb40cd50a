"""Publishing a run to an Iceberg table (``io.output_table``): one snapshot adding the merged result parts by
reference, once.

``commit_results`` builds one Iceberg ``DataFile`` per part from its Parquet footer (statistics, no rewrite), read
from a local copy checked against the sealed results manifest in the same read (a part replaced since publish
checked it fails the commit, naming it), and commits them in one transaction as one snapshot: ``append`` (fast
append) or ``overwrite`` (the run date's partition replaced in the same snapshot). The snapshot's summary carries
``vllm-batch.run-id`` (the run's output prefix: one run) and the caller's properties (the Airflow run, the results
manifest's sha256). A snapshot of the table that already carries the run id makes the call a no-op returning it: a
retried publish, or one killed after the catalog took the commit; it must have committed the same results manifest
(CommitError otherwise: the folder was merged again) and still be in the history of the table's current snapshot
(CommitError when rolled back past). A run whose snapshot was expired counts as committed when the current snapshot
holds all its parts. The catalog's compare-and-swap makes the commit all or nothing; a commit that lost a race is
not retried by pyiceberg but decided again here (the run may be what won). Before its first commit it writes
``_PUBLISHING.json`` into the run folder, sealed: merge then never changes the parts the table references (an
unsealed one is not this pipeline's and is ignored). See docs/adr/0009-iceberg-tables.md.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.allow_list import canonical_uri, check_uri
from airflow_provider_vllm.core.errors import CommitError, SpecError, TransientError
from airflow_provider_vllm.core.plan import ChangesFrom
from airflow_provider_vllm.core.records import SHA256_HEX, PartEntry, PublishingRecord
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec, TableOutput
from airflow_provider_vllm.core.storage import FileSystems, Storage, copies_folder
from airflow_provider_vllm.steps.merge.merger import (
    MERGED,
    PUBLISHING,
    RESULTS,
    manifest_rel,
    read_merged,
    read_publishing,
    verified_manifest,
)
from airflow_provider_vllm.steps.tables.access import Tables, summary_of

if TYPE_CHECKING:
    from pyiceberg.table import Table

RUN_ID = "vllm-batch.run-id"
PREFIX = "vllm-batch."
MANIFEST_SHA = "vllm-batch.results-manifest-sha256"  # the caller's ``results-manifest-sha256`` property
RERUN_PUBLISH = "clear the merge task (it writes and seals the parts again), then QA and publish"
COMMIT_ATTEMPTS = 5  # commits that lost a race to another writer of the table, each decided again

log = logging.getLogger(__name__)


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


def committed_snapshot(table: Table, run_id: str, uris: Sequence[str]) -> Any:
    """The snapshot of ``table`` that committed run ``run_id``: its summary carries the run id and it added exactly
    the run's parts (``uris``) as data files, and no delete file; or None. Whoever may commit to the catalog can
    write any summary: a snapshot that carries the run id but added other files is not the run's (a warning names
    it), and publish never takes it for the run's commit."""
    want = set(uris)
    for snap in table.metadata.snapshots:
        if summary_of(snap).get(RUN_ID) != run_id:
            continue
        added, other = _added_files(table, snap)
        if added == want and not other:
            return snap
        log.warning(
            "table %s: snapshot %s carries run %s but added %d data file(s)%s, not the run's %d parts (e.g. %s): "
            "not this deployment's commit of the run (another writer of the catalog?); ignored",
            table.name(),
            snap.snapshot_id,
            run_id,
            len(added),
            " and delete files" if other else "",
            len(want),
            sorted(added - want)[:1] or sorted(want - added)[:1],
        )
    return None


def _added_files(table: Table, snap: Any) -> tuple[set[str], bool]:
    """(the data files ``snap`` added, whether it added a delete file): from its own manifests' entries."""
    from pyiceberg.manifest import DataFileContent, ManifestEntryStatus

    added: set[str] = set()
    deletes = False
    for manifest in snap.manifests(table.io):
        if manifest.added_snapshot_id != snap.snapshot_id:  # carried over from an earlier snapshot
            continue
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            if entry.status != ManifestEntryStatus.ADDED or entry.snapshot_id != snap.snapshot_id:
                continue
            if entry.data_file.content == DataFileContent.DATA:
                added.add(entry.data_file.file_path)
            else:
                deletes = True
    return added, deletes


def commit_results(
    target: TableOutput,
    tables: Tables,
    out: Storage,
    parts: Sequence[str],
    schema: pa.Schema,
    run_id: str,
    run_date: dt.date,
    properties: Mapping[str, str] = {},
    keyring: Keyring | None = None,
    report_sha256: str | None = None,
) -> TableCommit:
    """Commit the parts (paths under ``out``) to ``target``'s table as one snapshot; a no-op if committed.

    ``schema``: the parts' Arrow schema (``Plan.result_schema()``), which the table must accept (created from it
    with ``target.create``). ``run_date``: the date partition's value (``target.date_column``). ``keyring``: seals
    ``_PUBLISHING.json`` (default ``VLLM_BATCH_SIGNING_KEY``), which names ``report_sha256`` (the sha256 of the
    ``qa/report.json`` publish gated on) for a later run's ``qa.previous_published``. Raises SpecError
    for a table that is missing (without ``create``), partitioned otherwise, or whose schema the parts do not
    fit; CommitError when the catalog refuses the commit (the table is then unchanged).
    """
    from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, ValidationException

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
    props = {RUN_ID: run_id, **{k if k.startswith(PREFIX) else PREFIX + k: str(v) for k, v in properties.items()}}
    uris = [out.uri(p) for p in parts]
    footers: list[tuple[str, int, Any]] | None = None  # (uri, size, footer) of each part's checked copy
    for attempt in range(COMMIT_ATTEMPTS):
        # Whether this run is in the table is decided again before every attempt: pyiceberg's own retry of a
        # commit that lost a race would add the run's files again on top of a concurrent publish of the same run.
        found = _this_runs_snapshot(table, target, run_id, props.get(MANIFEST_SHA), uris, run_date)
        if found is not None:
            # published again (a retry after a crash before _SUCCESS.json, or after QA ran again): the record must
            # name the report of the verdict this publish gated on, as _SUCCESS.json will; the first one's report
            # may be gone (QA rewrote it), and a later run's qa.previous_published would then fail on it forever
            _keep_publishing(out, keyring or Keyring.from_env(), target, run_id, props.get(MANIFEST_SHA), report_sha256)
            return _done(target, table, found, already=True)
        # the table as it is now, before every attempt: a commit that beat this one may have changed its schema or
        # partitioning, and the parts are described under the current schema's field ids and default spec
        _check_table(table, target, schema)
        if footers is None:
            sealed = _sealed_parts(out, keyring or Keyring.from_env(), parts, props.get(MANIFEST_SHA), target)
            footers = _checked_footers(out, sealed, uris, target)
            # from here on the table may reference the parts by path: a later merge of the folder must not change
            # them (merge refuses while this sealed file or _SUCCESS.json exists)
            _write_publishing(
                out, keyring or Keyring.from_env(), target, run_id, props.get(MANIFEST_SHA), report_sha256
            )
        data_files = [_data_file(table, md, size, uri, target, run_date) for uri, size, md in footers]
        try:
            _transaction(table, target, data_files, props, run_date).commit_transaction()
        except (CommitFailedException, ValidationException) as e:  # the table moved under this attempt
            last: Exception = e
            time.sleep(min(0.1 * 2**attempt, 2.0))
            table = table.refresh()
            continue
        table = table.refresh()
        found = committed_snapshot(table, run_id, uris)
        if found is None:
            raise CommitError(f"table {target.identifier}: committed, but no snapshot added run {run_id}'s parts")
        return _done(target, table, found, already=False)
    raise TransientError(
        f"table {target.identifier}: the catalog refused the commit of run {run_id} {COMMIT_ATTEMPTS} times "
        f"(concurrent commits to the table): {last}"
    )


def _write_publishing(
    out: Storage,
    keyring: Keyring,
    target: TableOutput,
    run_id: str,
    manifest_sha: str | None,
    report_sha256: str | None = None,
) -> None:
    """The sealed ``_PUBLISHING.json`` (``records.PublishingRecord``): merge honours no other."""
    record = PublishingRecord(
        table=target.identifier,
        run_id=run_id,
        results_manifest_sha256=manifest_sha,
        **({"report_sha256": report_sha256} if report_sha256 is not None else {}),
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    record = seals.seal_record(keyring, seals.PUBLISHING, seals.scope_of(out.uri()), record)
    out.write_atomic(PUBLISHING, seals.record_bytes(record))


def _keep_publishing(
    out: Storage,
    keyring: Keyring,
    target: TableOutput,
    run_id: str,
    manifest_sha: str | None,
    report_sha256: str | None,
) -> None:
    """The run is in the table already: ``_PUBLISHING.json`` sealed again unless it names this table, run, results
    manifest and report (it is missing, not sealed by this deployment, or names the report of an earlier QA)."""
    try:
        rec: PublishingRecord | None = read_publishing(out, keyring)
    except (FileNotFoundError, ValueError, CommitError):  # none, not a record, not sealed by this deployment
        rec = None
    if rec is not None and (rec.table, rec.run_id, rec.results_manifest_sha256, rec.report_sha256) == (
        target.identifier,
        run_id,
        manifest_sha,
        report_sha256,
    ):
        return
    log.warning(
        "%s %s; this publish gated on report %s (QA ran again since the table commit?): sealing it again",
        out.uri(PUBLISHING),
        "is missing or not sealed by this deployment" if rec is None else f"names report {rec.report_sha256}",
        report_sha256,
    )
    _write_publishing(out, keyring, target, run_id, manifest_sha, report_sha256)


def _this_runs_snapshot(
    table: Table, target: TableOutput, run_id: str, manifest_sha: str | None, uris: list[str], run_date: dt.date
) -> Any:
    """The snapshot that committed this run, or None when the table does not hold it.

    CommitError when that snapshot committed another results manifest of the run (the run folder was merged again
    since: the table's file sizes and statistics would not describe the files at those paths), or when the
    current snapshot holds some of the run's parts but not all; when the run's snapshot was expired but the current
    snapshot holds all its parts, that snapshot stands for it (nothing is added twice)."""
    where = f"table {target.identifier}"
    found = committed_snapshot(table, run_id, uris)
    if found is not None:
        sealed = summary_of(found).get(MANIFEST_SHA)
        if manifest_sha is not None and sealed is not None and sealed != manifest_sha:
            raise CommitError(
                f"{where}: snapshot {found.snapshot_id} committed run {run_id} with results manifest "
                f"{sealed[:12]}..., the run's is now {manifest_sha[:12]}... (merged again since): the table "
                "cannot take the new parts under the same paths; publish the run under a new output prefix"
            )
        if not _in_main(table, found.snapshot_id):
            # rolled back (or main set elsewhere) since: the table no longer holds the run's rows, and publish must
            # not seal this snapshot into _SUCCESS.json as the run's published state, nor add the rows again over
            # the owner's decision
            raise CommitError(
                f"{where}: snapshot {found.snapshot_id} committed run {run_id}, but the table's current state no "
                "longer holds it (main was rolled back or set past it): not committing it again. Set the table back "
                "to that snapshot (manage_snapshots().set_current_snapshot) and publish again, or publish the run "
                "under a new output prefix"
            )
        return found
    live = _live_files(table, target, run_date)
    held = [u for u in uris if u in live]
    if not held:
        return None
    if len(held) != len(uris):
        raise CommitError(
            f"{where}: the current snapshot holds {len(held)} of run {run_id}'s {len(uris)} result parts (e.g. "
            f"{held[0]}) but no snapshot names the run: not adding them again; repair the table by hand"
        )
    snap = table.current_snapshot()
    log.warning(
        "%s: run %s's snapshot is gone (expired), but the current snapshot %s holds all its parts: not adding them "
        "again",
        where,
        run_id,
        snap.snapshot_id if snap is not None else None,
    )
    return snap


def _in_main(table: Table, snapshot_id: int) -> bool:
    """Whether ``snapshot_id`` is the table's current snapshot (of ``main``) or one of its ancestors."""
    from pyiceberg.table.snapshots import ancestors_of

    return any(s.snapshot_id == snapshot_id for s in ancestors_of(table.current_snapshot(), table.metadata))


def _live_files(table: Table, target: TableOutput, run_date: dt.date) -> set[str]:
    """The data file paths of the current snapshot (of the run date's partition when partitioned by it): metadata
    only, no data file is read."""
    if table.current_snapshot() is None:
        return set()
    if target.date_column is None:
        return {t.file.file_path for t in table.scan().plan_files()}
    return {f.file_path for f in _partition_files(table, target, run_date, allow_deletes=True)}


def _transaction(
    table: Table, target: TableOutput, data_files: list[Any], props: dict[str, str], run_date: dt.date
) -> Any:
    """One transaction committing ``data_files`` as one snapshot, that fails (CommitFailedException) rather than
    being retried by pyiceberg when the table moved (``commit_results`` decides again whether to commit)."""
    from pyiceberg.table import Table, TableProperties
    from pyiceberg.table.update import AssertCurrentSchemaId, AssertDefaultSpecId

    # the retry count is read from the loaded table's properties: set in memory only, never committed
    quiet = Table(
        table.name(),
        table.metadata.model_copy(update={"properties": {**table.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}}),
        table.metadata_location,
        table.io,
        table.catalog,
        table.config,
    )
    tx = quiet.transaction()
    # A snapshot commit asserts only that main did not move: a schema or partition change committed meanwhile would
    # not conflict, and the parts (described under this schema's field ids and this spec) would land in a table
    # that no longer takes them. Asserted here, such a change fails the commit, which commit_results decides again.
    # pyiceberg has no public call to add a requirement; _stage validates it and keeps one per kind.
    tx._stage(
        (),
        (
            AssertCurrentSchemaId(current_schema_id=table.metadata.current_schema_id),
            AssertDefaultSpecId(default_spec_id=table.metadata.default_spec_id),
        ),
    )
    if table.metadata.name_mapping() is None:  # parts carry no field ids: readers map them by name
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
    return tx


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


def check_output_table(target: TableOutput, tables: Tables, schema: pa.Schema) -> None:
    """What ``commit_results`` would refuse about the table, checked when the run is planned rather than after its
    shards ran: SpecError when ``target``'s table exists and is partitioned otherwise or does not take the results'
    ``schema`` (``Plan.result_schema()``: passthrough columns included), or is missing, to be created, and Iceberg
    has no type for a column of the results. A missing table without ``create`` is left to publish (it may be
    created meanwhile)."""
    from pyiceberg.exceptions import NoSuchTableError

    tables.check(target.identifier, "io.output_table.identifier")
    assert tables.catalog is not None
    try:
        table = tables.catalog.load_table(target.identifier)
    except NoSuchTableError:
        if target.create:
            _iceberg_fields(target, schema, format_version=2)  # pyiceberg's create_table's default
        return
    _check_table(table, target, schema)


def _iceberg_fields(target: TableOutput, schema: pa.Schema, format_version: int) -> list[pa.Field]:
    """The fields of a table created for the results (plus the date column); SpecError naming the first column
    Iceberg has no type for (a passthrough column: ns or non-UTC timestamps, durations, a null-typed column)."""
    fields = [f.remove_metadata() for f in schema]
    if target.date_column is not None:
        if target.date_column in schema.names:
            raise SpecError(f"io.output_table.date_column {target.date_column!r} is a column of the results")
        fields.append(pa.field(target.date_column, pa.date32()))
    _check_types(target, fields, format_version)
    return fields


def _check_types(target: TableOutput, fields: Sequence[pa.Field], format_version: int) -> None:
    """SpecError naming the first field that has no Iceberg type (in a table of ``format_version``)."""
    from pyiceberg.io.pyarrow import UnsupportedPyArrowTypeException, _pyarrow_to_schema_without_ids

    for f in fields:
        try:
            _pyarrow_to_schema_without_ids(pa.schema([f]), format_version=format_version)  # type: ignore[arg-type]
        except (ValueError, UnsupportedPyArrowTypeException) as e:
            raise SpecError(
                f"io.output_table {target.identifier}: results column {f.name!r} is {f.type}, which an Iceberg table "
                f"cannot hold ({str(e).splitlines()[0][:200]}); a passthrough column (io.passthrough): leave it "
                "out, or store it in the input as another type (timestamps in us, UTC or without a zone)"
            ) from None


def _create(tables: Tables, target: TableOutput, schema: pa.Schema) -> Table:
    """A new table of the parts' schema (plus the date column, identity-partitioned)."""
    from pyiceberg.exceptions import TableAlreadyExistsError
    from pyiceberg.transforms import IdentityTransform

    assert tables.catalog is not None
    fields = _iceberg_fields(target, schema, format_version=2)
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
    _check_types(target, list(schema), table.metadata.format_version)
    try:
        _check_pyarrow_schema_compatible(table.schema(), schema, format_version=table.metadata.format_version)
    except ValueError as e:
        raise SpecError(f"{where} does not take the results' schema: {e}") from None


def _sealed_parts(
    out: Storage, keyring: Keyring, parts: Sequence[str], manifest_sha: str | None, target: TableOutput
) -> list[tuple[str, PartEntry]]:
    """``parts`` with their entries in the results manifest that the sealed ``_MERGED.json`` names (size and
    sha256 of the bytes merge wrote); CommitError unless that manifest is ``manifest_sha`` (the one publish checked)
    and names exactly ``parts``."""
    where = f"table {target.identifier}"
    merged = read_merged(out, keyring)
    sealed_sha = merged.checksums.get(manifest_rel(RESULTS))
    if manifest_sha is not None and sealed_sha != manifest_sha:
        raise CommitError(
            f"{where}: {out.uri(MERGED)} now names results manifest {str(sealed_sha)[:12]}..., not the "
            f"{manifest_sha[:12]}... publish checked (merged again meanwhile); not committing; {RERUN_PUBLISH}"
        )
    entries = {f"{RESULTS}/{p.name}": p for p in verified_manifest(out, RESULTS, merged).parts}
    if sorted(entries) != sorted(parts):
        raise CommitError(
            f"{where}: the parts to commit are not the ones the sealed results manifest names; not committing; "
            f"{RERUN_PUBLISH}"
        )
    return [(rel, entries[rel]) for rel in parts]


def _checked_footers(
    out: Storage, sealed: list[tuple[str, PartEntry]], uris: list[str], target: TableOutput
) -> list[tuple[str, int, Any]]:
    """``(uri, size, Parquet footer)`` of each part, read from a local copy checked against its sealed size and
    sha256 in the same read that copied it (one part at a time): the statistics and size committed are those of the
    bytes merge sealed, and a part replaced in the bucket since publish checked it fails the commit (CommitError
    naming it)."""
    found = []
    with copies_folder("publish-table") as root:
        for (rel, entry), uri in zip(sealed, uris):
            local = os.path.join(root, "part.parquet")
            try:
                out.fetch_verified(rel, entry.bytes, entry.sha256, local)
            except FileNotFoundError:
                raise CommitError(f"table {target.identifier}: {out.uri(rel)} is gone; {RERUN_PUBLISH}") from None
            except CommitError as e:
                raise CommitError(f"table {target.identifier}: not committing: {e}; {RERUN_PUBLISH}") from None
            try:
                found.append((uri, entry.bytes, pq.read_metadata(local)))
            finally:
                os.unlink(local)
    return found


def _data_file(table: Table, md: Any, size: int, uri: str, target: TableOutput, run_date: dt.date) -> Any:
    """The DataFile of the part at ``uri`` (``size`` bytes, footer ``md`` from its checked copy): statistics under
    the table's current schema; the date partition's value when partitioned by it."""
    from pyiceberg.io.pyarrow import (
        compute_statistics_plan,
        data_file_statistics_from_parquet_metadata,
        parquet_path_to_id_mapping,
    )
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    schema = table.schema()
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
        file_size_in_bytes=size,
        sort_order_id=None,
        spec_id=table.metadata.default_spec_id,
        equality_ids=None,
        key_metadata=None,
        **stats.to_serialized_dict(),
    )


def _partition_files(table: Table, target: TableOutput, run_date: dt.date, allow_deletes: bool = False) -> list[Any]:
    """The data files of the run date's partition in the current snapshot (the ones ``overwrite`` replaces).

    ``allow_deletes`` False (``overwrite``): SpecError for a data file with delete files, or one that may hold rows
    of other dates (written under an earlier partition spec: deleting it would drop them)."""
    from pyiceberg.expressions import AlwaysTrue, EqualTo

    assert target.date_column is not None
    if table.current_snapshot() is None:
        return []
    # pyiceberg types EqualTo as its pydantic fields (term, value); its __init__ takes (term, literal)
    scan = table.scan(row_filter=EqualTo(target.date_column, run_date.isoformat()))  # type: ignore[call-arg]
    files = []
    for task in scan.plan_files():
        if task.delete_files and not allow_deletes:
            raise SpecError(
                f"table {target.identifier}: partition {target.date_column}={run_date} has delete files; "
                "overwrite replaces whole data files only"
            )
        if task.residual != AlwaysTrue() and not allow_deletes:  # its partition does not say all its rows are this date
            raise SpecError(
                f"table {target.identifier}: partition {target.date_column}={run_date}: data file "
                f"{task.file.file_path} holds rows of other dates too (written under an earlier partition spec), and "
                "overwrite replaces whole data files only: rewrite the table's data files under its current spec "
                "first, or publish with mode append"
            )
        files.append(task.file)
    return files


def resolve_changes_from(
    spec: JobSpec, tables: Tables, *, keyring: Keyring | None = None, filesystems: FileSystems | None = None
) -> ChangesFrom:
    """``changes.previous_table``: the run whose snapshot ``io.output_table`` holds last (walking the current
    snapshot's ancestry to the first one a run committed, this run's own excepted). Its output prefix must lie
    inside ``tables.uri_prefixes`` (SpecError naming the table and snapshot); a missing table or no such
    snapshot: nothing to compare (``previous_uri`` None).

    The catalog has other writers than this deployment's publish: a snapshot's summary is taken only when that
    run's ``_PUBLISHING.json``, sealed by this deployment's publish (``keyring``, default
    ``VLLM_BATCH_SIGNING_KEY``) for that run folder, names the same table, run and results manifest (publish writes
    it only for a run whose QA did not fail). CommitError otherwise: a snapshot forged with a failed run's id
    and manifest would make that run the baseline."""
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
            where = f"table {target.identifier} snapshot {snap.snapshot_id} names run {run!r}"
            try:
                check_uri(run, tables.uri_prefixes, "changes.previous_table")
            except SpecError as e:
                raise SpecError(f"{where}: {e}") from None
            # the catalog, not the run folder, says which merge of the run the table published: a folder merged
            # again, or an older merge put back, is then refused (merge.changes._check_pinned)
            sha = summary_of(snap).get(MANIFEST_SHA)
            if sha is None or not SHA256_HEX.fullmatch(sha):
                raise SpecError(
                    f"{where} but records no results manifest sha256 ({MANIFEST_SHA}: {sha!r}), so which merge of "
                    "that run the table holds is unknown; changes.previous_table compares only with the merge a "
                    "snapshot names. Publish a run with this provider first (without changes.previous_table), or "
                    "set changes.previous_uri to the run to compare with"
                )
            rec = _check_published_by_us(where, target.identifier, run, sha, spec, keyring, filesystems)
            return ChangesFrom(
                identifier=target.identifier,
                snapshot_id=snap.snapshot_id,
                previous_uri=run,
                results_manifest_sha256=sha,
                report_sha256=rec.report_sha256,
            )
        snap = table.snapshot_by_id(snap.parent_snapshot_id) if snap.parent_snapshot_id is not None else None
    return ChangesFrom(identifier=target.identifier, snapshot_id=None, previous_uri=None)


def _check_published_by_us(
    where: str,
    identifier: str,
    run: str,
    sha: str,
    spec: JobSpec,
    keyring: Keyring | None,
    filesystems: FileSystems | None,
) -> PublishingRecord:
    """``run``'s sealed ``_PUBLISHING.json``; CommitError unless it names ``identifier``, ``run`` and ``sha``."""
    prev = Storage(run, spec.io.storage_options, filesystems)
    fix = (
        "changes.previous_table compares only with a run this deployment's publish committed to the table. Publish "
        "a run with this provider first, or set changes.previous_uri to the run to compare with"
    )
    try:
        rec = read_publishing(prev, keyring or Keyring.from_env())
    except FileNotFoundError:
        raise CommitError(f"{where}, which has no {PUBLISHING} (publish writes it before it commits); {fix}") from None
    except CommitError as e:  # SealError: not this deployment's publish, or sealed for another folder
        raise CommitError(f"{where}: {e}; {fix}") from None
    except ValueError as e:  # not a record (pydantic's ValidationError, bad JSON)
        raise CommitError(f"{where}: {prev.uri(PUBLISHING)} is not a publishing record ({e}); {fix}") from None
    named = (rec.table, rec.run_id, rec.results_manifest_sha256)
    if named != (identifier, run, sha):
        raise CommitError(
            f"{where} with results manifest {sha[:12]}..., but that run's sealed {PUBLISHING} names table "
            f"{rec.table}, run {rec.run_id!r}, manifest {(rec.results_manifest_sha256 or 'none')[:12]}...: not a "
            f"commit of this deployment's publish; {fix}"
        )
    return rec
