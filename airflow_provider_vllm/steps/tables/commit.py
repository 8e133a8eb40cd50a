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
(CommitError when rolled back past; beyond an expired snapshot, where that cannot be told, it stands when the current
snapshot holds all its parts). A run whose snapshot was expired counts as committed when the current snapshot holds
all its parts. The commit sets a table property naming the run in the same transaction (``committed_property``):
after expiry and compaction erased the snapshot and the parts' paths, it makes a retry fail closed instead of
committing every row again (a no-op when the run's sealed ``_SUCCESS.json`` names that commit: published in
full); without it (an older commit), so does main's history being expired since an earlier publish began its
commit (``_PUBLISHING.json``'s ``started``). The catalog's compare-and-swap makes the commit all or nothing; a
commit that lost a race is not retried by pyiceberg but decided again here (the run may be what won).
A table with equality deletes, which pyiceberg cannot scan, fails with a SpecError naming it. Before its first
commit it writes ``_PUBLISHING.json`` into the run folder, sealed: merge then never changes the parts the table
references (an unsealed one is not this pipeline's and is ignored). See docs/adr/0009-iceberg-tables.md.
"""

from __future__ import annotations

import calendar
import datetime as dt
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.allow_list import canonical_uri, check_uri
from airflow_provider_vllm.core.errors import CommitError, SpecError, TransientError
from airflow_provider_vllm.core.plan import ChangesFrom
from airflow_provider_vllm.core.records import (
    COMMITTED_PROPERTY,
    SHA256_HEX,
    PartEntry,
    PublishingRecord,
    committed_key,
)
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec, TableOutput
from airflow_provider_vllm.core.storage import FileSystems, Storage, copies_folder
from airflow_provider_vllm.steps.merge.merger import (
    MERGED,
    PUBLISHING,
    RESULTS,
    SUCCESS,
    manifest_rel,
    read_merged,
    read_publishing,
    success_doc,
    verified_manifest,
)
from airflow_provider_vllm.steps.tables.access import (
    Tables,
    expired_parent,
    history_cut_since,
    in_history,
    summary_of,
    walk_back,
)

if TYPE_CHECKING:
    from pyiceberg.table import Table

RUN_ID = "vllm-batch.run-id"
PREFIX = "vllm-batch."
MANIFEST_SHA = "vllm-batch.results-manifest-sha256"  # the caller's ``results-manifest-sha256`` property
RERUN_PUBLISH = "clear the merge task (it writes and seals the parts again), then QA and publish"
COMMIT_ATTEMPTS = 5  # commits that lost a race to another writer of the table, each decided again
CLOCK_SKEW_S = 3600  # between the clock that stamped _PUBLISHING.json and the one that stamps a snapshot
STARTED = "%Y-%m-%dT%H:%M:%SZ"

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


class CommittedRun(BaseModel):
    """The value of a run's ``vllm-batch.committed.*`` table property (``committed_property``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    run_id: str = Field(description="the run id (vllm-batch.run-id) the commit added")
    snapshot_id: int = Field(description="the snapshot that commit made")
    results_manifest_sha256: str | None = Field(None, description="sha256 of the results manifest it committed")


def committed_property(run_id: str, snapshot_id: int, manifest_sha: str | None) -> tuple[str, str]:
    """The table property (key, value) that the commit of run ``run_id`` sets in its own transaction: the catalog
    takes it with the snapshot or not at all, and the table's maintenance (snapshot expiry, compaction, orphan
    cleanup) never removes a property, so it outlives the snapshot's summary and the parts' paths."""
    key = committed_key(run_id)
    value = CommittedRun(run_id=run_id, snapshot_id=snapshot_id, results_manifest_sha256=manifest_sha)
    return key, value.model_dump_json()


def _committed_claim(table: Table, run_id: str) -> tuple[str, str, str | None] | None:
    """(the property's key, the snapshot it names, the results manifest sha256 it names) when the table's
    properties say run ``run_id`` was committed; None otherwise. A value that does not parse, or names another run,
    still claims the run (fail closed): only a commit of the run sets that key, and whoever else set it must be
    asked."""
    key = committed_key(run_id)
    raw = table.properties.get(key)
    if raw is None:
        return None
    try:
        rec = CommittedRun.model_validate_json(raw)
    except ValueError:
        return key, f"? (its value {raw[:80]!r} is not a commit record)", None
    if rec.run_id != run_id:
        return key, f"? (it names run {rec.run_id!r})", None
    return key, str(rec.snapshot_id), rec.results_manifest_sha256


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
    manifest_sha = props.get(MANIFEST_SHA)
    keyring = keyring or Keyring.from_env()
    uris = [out.uri(p) for p in parts]
    footers: list[tuple[str, int, Any]] | None = None  # (uri, size, footer) of each part's checked copy
    # an earlier publish of this run began a commit then: it may have gone in (the task killed before it heard back)
    since = _began_before(out, keyring, target, run_id)
    published = _published_commit(out, keyring, target)
    for attempt in range(COMMIT_ATTEMPTS):
        # Whether this run is in the table is decided again before every attempt: pyiceberg's own retry of a
        # commit that lost a race would add the run's files again on top of a concurrent publish of the same run.
        found = _this_runs_snapshot(table, target, run_id, manifest_sha, uris, run_date, since, published)
        if found is not None:
            # published again (a retry after a crash before _SUCCESS.json, or after QA ran again): the record must
            # name the report of the verdict this publish gated on, as _SUCCESS.json will; the first one's report
            # may be gone (QA rewrote it), and a later run's qa.previous_published would then fail on it forever
            _keep_publishing(out, keyring, target, run_id, manifest_sha, report_sha256)
            # a TableCommit: the commit the run's sealed _SUCCESS.json and its table property both name
            return found if isinstance(found, TableCommit) else _done(target, table, found, already=True)
        # the table as it is now, before every attempt: a commit that beat this one may have changed its schema or
        # partitioning, and the parts are described under the current schema's field ids and default spec
        _check_table(table, target, schema)
        if footers is None:
            sealed = _sealed_parts(out, keyring, parts, manifest_sha, target)
            footers = _checked_footers(out, sealed, uris, target)
            # from here on the table may reference the parts by path: a later merge of the folder must not change
            # them (merge refuses while this sealed file or _SUCCESS.json exists)
            _write_publishing(out, keyring, target, run_id, manifest_sha, report_sha256, since)
        data_files = [_data_file(table, md, size, uri, target, run_date) for uri, size, md in footers]
        try:
            _transaction(table, target, data_files, props, run_date, run_id).commit_transaction()
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
    started: str | None = None,
) -> None:
    """The sealed ``_PUBLISHING.json`` (``records.PublishingRecord``): merge honours no other. ``started``: when
    the first publish of the run began its commit (default: now), kept by every later one."""
    record = PublishingRecord(
        table=target.identifier,
        run_id=run_id,
        results_manifest_sha256=manifest_sha,
        **({"report_sha256": report_sha256} if report_sha256 is not None else {}),
        started=started or time.strftime(STARTED, time.gmtime()),
    )
    record = seals.seal_record(keyring, seals.PUBLISHING, seals.scope_of(out.uri()), record)
    out.write_atomic(PUBLISHING, seals.record_bytes(record))


def _began_before(out: Storage, keyring: Keyring, target: TableOutput, run_id: str) -> str | None:
    """``started`` of the sealed ``_PUBLISHING.json`` of an earlier publish of this run to this table (it wrote it
    before its commit, which may then have gone in), or None: none began a commit."""
    try:
        rec = read_publishing(out, keyring)
    except (FileNotFoundError, ValueError, CommitError):  # none, not a record, not sealed by this deployment
        return None
    return rec.started if (rec.table, rec.run_id) == (target.identifier, run_id) else None


def _published_commit(out: Storage, keyring: Keyring, target: TableOutput) -> TableCommit | None:
    """The table commit the run's ``_SUCCESS.json`` names (sealed by this deployment's publish for this run folder,
    after the catalog took that commit), as an ``already`` TableCommit; None without one for ``target``'s table."""
    try:
        doc = success_doc(out, out.read_bytes(SUCCESS), keyring)
        event = doc["table"]
        if event["identifier"] != target.identifier:
            return None
        return TableCommit(
            identifier=event["identifier"],
            location=str(event["location"]),
            snapshot_id=int(event["snapshot_id"]),
            files=int(event["files"]),
            rows=int(event["rows"]),
            already=True,
        )
    except (FileNotFoundError, ValueError, CommitError, KeyError, TypeError):  # none, not sealed, no table commit
        return None


def _check_history_since(table: Table, where: str, run_id: str, since: str) -> None:
    """CommitError when ``main``'s history since ``since`` (less ``CLOCK_SKEW_S``) was cut by an expiry: a commit of
    the run that began then may be in the table with nothing left that names it (a commit by a provider from before
    ``committed_property``, or the property removed), so committing again could put every row in twice."""
    try:
        since_ms = (calendar.timegm(time.strptime(since, STARTED)) - CLOCK_SKEW_S) * 1000
    except ValueError:
        since_ms = 0  # the whole history
    cut = history_cut_since(table, since_ms)
    if cut is not None:
        raise CommitError(
            f"{where}: an earlier publish of run {run_id} began its commit at {since} ({PUBLISHING}), and main's "
            f"history since then was expired (it stops at {expired_parent(cut)}); no snapshot naming the run, none "
            f"of its parts and no {COMMITTED_PROPERTY}* property of its commit are there, so whether that commit "
            "went in cannot be told: not committing (it could put every row in twice). See docs/operations.md: check "
            "whether the table holds the run's rows"
        )


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
    table: Table,
    target: TableOutput,
    run_id: str,
    manifest_sha: str | None,
    uris: list[str],
    run_date: dt.date,
    since: str | None = None,
    published: TableCommit | None = None,
) -> Any:
    """The snapshot that committed this run, or None when the table does not hold it.

    CommitError when that snapshot committed another results manifest of the run (the run folder was merged again
    since: the table's file sizes and statistics would not describe the files at those paths), or when the
    current snapshot holds some of the run's parts but not all; when the run's snapshot was expired but the current
    snapshot holds all its parts, that snapshot stands for it (nothing is added twice). With neither the snapshot
    nor a part: CommitError when the run's ``committed_property`` is set, or when an earlier publish began a commit
    at ``since`` and main's history since then was expired (nothing can tell whether that commit went in); but
    ``published`` (the commit the run's sealed ``_SUCCESS.json`` names) is returned when the property names its
    snapshot and the run's results manifest: the run was published in full, and clearing publish again is a no-op."""
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
        in_main, cut = in_history(table, found.snapshot_id)
        if not in_main and cut is not None:
            return _beyond_expired(table, target, run_id, uris, run_date, found, cut)
        if not in_main:
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
    claim = _committed_claim(table, run_id)
    if not held and claim is not None:
        if published is not None and claim[1] == str(published.snapshot_id) and claim[2] == manifest_sha:
            log.warning(
                "%s: run %s's snapshot %s is gone (expired) and none of its parts is a current file (compaction?), "
                "but its sealed %s and table property %s name that commit: published already, not adding it again",
                where,
                run_id,
                claim[1],
                SUCCESS,
                claim[0],
            )
            return published
        # the run's snapshot was expired and its parts are not among the current files: compacted into other files
        # (its rows are in the table), or deleted, overwritten or rolled back past (they are not). Which, only the
        # rows tell; committing again would put every row in twice in the first case
        raise CommitError(
            f"{where}: run {run_id} was committed to it in snapshot {claim[1]} (table property {claim[0]}), which "
            "the table no longer holds (expired), and the current snapshot holds none of the run's "
            f"{len(uris)} result parts (rewritten by compaction, or deleted, overwritten or rolled back): not "
            "committing it again. See docs/operations.md: check whether the table holds the run's rows"
        )
    if not held:
        if since is not None:
            _check_history_since(table, where, run_id, since)
        return None
    if claim is not None and None not in (manifest_sha, claim[2]) and claim[2] != manifest_sha:
        # the paths are the run's but the snapshot that said which bytes were committed is gone: the property says
        raise CommitError(
            f"{where}: run {run_id} was committed to it in snapshot {claim[1]} with results manifest "
            f"{str(claim[2])[:12]}... (table property {claim[0]}), the run's is now "
            f"{str(manifest_sha)[:12]}... (merged again since): the table's sizes and statistics do not describe the "
            "files at those paths; not taking it for published. Publish the run under a new output prefix"
        )
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


def _beyond_expired(
    table: Table, target: TableOutput, run_id: str, uris: list[str], run_date: dt.date, found: Any, cut: Any
) -> Any:
    """The run's snapshot ``found`` exists but the walk back from ``main`` stopped at ``cut``, whose parent was
    expired: whether ``found`` is in main's history cannot be told. The current snapshot holding every part of the
    run stands for it, as for an expired run snapshot; otherwise CommitError naming the expired snapshot."""
    live = _live_files(table, target, run_date)
    held = sum(u in live for u in uris)
    where = f"table {target.identifier}: snapshot {found.snapshot_id} committed run {run_id}"
    gap = f"the walk back from main's current snapshot stops at {expired_parent(cut)}"
    if held == len(uris):
        log.warning("%s; %s, and the current snapshot holds all the run's parts: not adding them again", where, gap)
        return found
    raise CommitError(
        f"{where}; whether main's history holds it cannot be told ({gap}), and the current snapshot holds "
        f"{'none' if not held else held} of the run's {len(uris)} result parts (deleted, overwritten, rolled back or "
        "rewritten by compaction since): not committing it again. See docs/operations.md: check whether the table "
        "holds the run's rows"
    )


def _live_files(table: Table, target: TableOutput, run_date: dt.date) -> set[str]:
    """The data file paths of the current snapshot (of the run date's partition when partitioned by it): metadata
    only, no data file is read."""
    if table.current_snapshot() is None:
        return set()
    if target.date_column is None:
        return {t.file.file_path for t in _plan_files(table.scan(), target)}
    return {f.file_path for f in _partition_files(table, target, run_date, allow_deletes=True)}


def _transaction(
    table: Table, target: TableOutput, data_files: list[Any], props: dict[str, str], run_date: dt.date, run_id: str
) -> Any:
    """One transaction committing ``data_files`` as one snapshot and the run's ``committed_property``, that fails
    (CommitFailedException) rather than being retried by pyiceberg when the table moved (``commit_results`` decides
    again whether to commit)."""
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
    # in the same commit as the snapshot: a publish killed after the catalog took it, retried after maintenance
    # expired the snapshot and rewrote the parts into other files (compaction), still finds the run committed
    snapshot_id = tx.table_metadata.current_snapshot_id
    assert snapshot_id is not None
    tx.set_properties(dict([committed_property(run_id, snapshot_id, props.get(MANIFEST_SHA))]))
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
    for task in _plan_files(scan, target):
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


def _plan_files(scan: Any, target: TableOutput) -> list[Any]:
    """``scan.plan_files()``; SpecError naming the table when it holds equality deletes, which pyiceberg cannot
    plan (its bare ValueError named nothing): publish reads the table's files before it writes or commits anything."""
    try:
        return list(scan.plan_files())
    except (ValueError, NotImplementedError) as e:
        if "equality delete" not in str(e):
            raise
        raise SpecError(
            f"table {target.identifier} has equality deletes (merge-on-read), which pyiceberg cannot read, so "
            "publish cannot tell which data files the table holds (nothing was written or committed): compact the "
            "table (rewrite its data files with the deletes applied, e.g. Spark's rewrite_data_files), then clear "
            "publish"
        ) from None


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
    snap, cut = walk_back(table, None, lambda s: summary_of(s).get(RUN_ID) not in (None, own))
    if snap is None and cut is not None:
        # maintenance expired main's history past the last run's snapshot, if there was one: "nothing to compare"
        # would drop the change set and the churn check of a table that may well hold a published run
        raise SpecError(
            f"changes.previous_table: table {target.identifier}'s history back from its current snapshot names no run "
            f"of this deployment before it stops at {expired_parent(cut)}: whether a run was published before that "
            "cannot be told. Name the run to compare with instead: changes.previous_table false and "
            "changes.previous_uri its output folder (or neither, to compare with none)"
        )
    if snap is None:  # a history that is whole back to its first snapshot names no run: nothing to compare
        return ChangesFrom(identifier=target.identifier, snapshot_id=None, previous_uri=None)
    run = summary_of(snap)[RUN_ID]
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
