"""The input snapshot of a table job (``io.input_table``): pinned by the plan, handed to the shards as files.

``resolve_table_input`` loads the table through the deployment's catalog, pins the snapshot (the job's
``snapshot_id``, else the table's current one) and plans the scan (row filter, columns). What the shards
then read is an ordinary ``Input`` of Parquet files, so the worker needs neither a catalog nor pyiceberg:

* **reference**: the snapshot's data files themselves, when no file keeps a residual filter (no filter, or
  one on identity partition columns) and every needed column is stored in every file under the table's
  field id. Data files are immutable: every shard and retry reads the same rows.
* **materialized**: otherwise, the plan reads the pinned scan through pyiceberg (residuals applied exactly,
  columns projected by field id) into a local file and writes it under the output prefix,
  ``_table/input-<sha16>.parquet`` (named by content: a killed or repeated plan leaves the same file). The
  output prefix has other writers than the plan, so nothing there is trusted: a file already at that name is
  kept only when it is a regular file whose bytes hash to the sha256 just computed, else the plan writes its
  own over it (over a link, a FIFO or a folder too: never followed, opened or read); the plan itself reads
  only its local copy; ``TablePin`` pins the file's size and sha256 (``input_sha256``, ``input_bytes``). Each
  shard that neither the result cache nor the dedupe gives its own input file gets one here
  (``split_materialized``: its rows, under ``_table/shard-inputs/``, size and sha256 in
  ``ShardPlan.input_file``): the worker fetches and hashes only its own rows. Merge and QA read a local copy of
  the whole file checked against the pin (``Plan.input_storage``). A materialized plan from before the pin (no
  ``input_sha256``) is refused by every reader: plan again.

Refused, naming the table and the snapshot: delete files (merge-on-read), data files that are not Parquet,
data files outside the allowed prefixes, an unknown snapshot, a ``snapshot_id`` outside the history of ``main``
(another branch's, or rolled back past; the job names no branch), a row filter that does not parse or bind,
columns the table does not have. See docs/adr/0009-iceberg-tables.md.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core.allow_list import canonical_uri, check_uri
from airflow_provider_vllm.core.errors import DatasetError, SpecError
from airflow_provider_vllm.core.formats.base import row_columns
from airflow_provider_vllm.core.formats.files import Input, describe_files, fingerprint
from airflow_provider_vllm.core.plan import ShardPlan, TablePin
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage
from airflow_provider_vllm.steps.tables.access import Tables, expired_parent, in_history

if TYPE_CHECKING:
    from pyiceberg.expressions import BooleanExpression
    from pyiceberg.schema import Schema
    from pyiceberg.table import FileScanTask, Table

TABLE_DIR = "_table"
SHARD_INPUTS = f"{TABLE_DIR}/shard-inputs"  # the shards' own input files of a materialized table
FIELD_ID_KEY = b"PARQUET:field_id"
ROW_GROUP_ROWS = 64 * 1024


def needed_columns(spec: JobSpec) -> list[str]:
    """The table columns the job reads: the id, the template's and adapter columns, the listed passthrough
    columns and ``qa.reference.input_column``."""
    cols = [spec.prompt.id_column, *row_columns(spec)]
    if isinstance(spec.io.passthrough, list):
        cols += spec.io.passthrough
    if spec.qa.reference.input_column is not None:
        cols.append(spec.qa.reference.input_column)
    return list(dict.fromkeys(cols))


def parse_row_filter(text: str | None, schema: Schema, where: str) -> BooleanExpression:
    """The row filter bound to ``schema``; SpecError naming ``io.input_table.row_filter`` when it does not
    parse or names a column the table does not have (``where``: the table and snapshot, for the message)."""
    from pyiceberg.expressions import AlwaysTrue
    from pyiceberg.expressions.parser import parse
    from pyiceberg.expressions.visitors import bind

    if text is None:
        return AlwaysTrue()
    try:
        expr = parse(text)
    except Exception as e:  # pyparsing's ParseException and the parser's own ValueErrors
        first = str(e).splitlines()[0][:200]
        raise SpecError(f"io.input_table.row_filter={text[:200]!r} is not an Iceberg row filter: {first}") from None
    try:
        bind(schema, expr, case_sensitive=True)
    except ValueError as e:
        raise SpecError(f"io.input_table.row_filter={text[:200]!r} does not apply to {where}: {e}") from None
    return expr


def resolve_table_input(
    spec: JobSpec,
    tables: Tables,
    out: Storage,
    filesystems: FileSystems | None,
    workdir: str,
) -> tuple[Input, TablePin]:
    """Pin the snapshot and turn it into the shards' input files (see the module docstring).

    Every data file must lie under ``tables.uri_prefixes``. Raises SpecError / DatasetError naming the table
    and snapshot. ``workdir``: a private local folder that outlives the plan's reads: a materialized input is
    read from the copy there (``Input.root``; the caller records ``materialized_root(out)`` as the plan's
    ``input_root``, and cuts the shards' files from it, ``split_materialized``).
    """
    t = spec.io.input_table
    assert t is not None
    table = tables.load(t.identifier, "io.input_table.identifier")
    snapshot = table.snapshot_by_id(t.snapshot_id) if t.snapshot_id is not None else table.current_snapshot()
    if snapshot is None:
        which = f"snapshot {t.snapshot_id}" if t.snapshot_id is not None else "a current snapshot (it is empty)"
        raise SpecError(f"io.input_table: table {t.identifier} has no {which}")
    where = f"table {t.identifier} snapshot {snapshot.snapshot_id}"
    if t.snapshot_id is not None:
        _check_on_main(table, snapshot, where)
    # the current snapshot is read with the table's current schema, as its readers do: a column dropped or renamed
    # since the last commit (which does not make a snapshot) is gone or renamed; an older snapshot_id with its own
    schema = table.schema() if t.snapshot_id is None else _schema_of(table, snapshot.schema_id)
    row_filter = parse_row_filter(t.row_filter, schema, where)
    names = [f.name for f in schema.fields]
    selected = list(t.columns) or names
    unknown = [c for c in selected if c not in names]
    if unknown:
        raise SpecError(f"io.input_table.columns {unknown} are not columns of {where} (it has {names[:20]})")
    missing = [c for c in needed_columns(spec) if c not in selected]
    if missing:
        why = "io.input_table.columns leaves out" if t.columns else f"{where} does not have"
        raise SpecError(f"the job reads column(s) {missing}, which {why}")
    scan = table.scan(
        row_filter=row_filter, selected_fields=tuple(selected), snapshot_id=snapshot.snapshot_id, case_sensitive=True
    )
    try:
        tasks = sorted(scan.plan_files(), key=lambda task: task.file.file_path)
    except (ValueError, NotImplementedError) as e:  # pyiceberg reads no equality deletes
        first = str(e).splitlines()[0][:300]
        fix = ""
        if "equality delete" in first:
            fix = (
                " (merge-on-read equality deletes): compact the table (rewrite data files) or read an earlier snapshot"
            )
        raise DatasetError(f"{where}: its scan cannot be planned: {first}{fix}") from None
    _check_tasks(tasks, where, tables.uri_prefixes)
    pin_args: dict[str, Any] = dict(
        identifier=t.identifier,
        snapshot_id=snapshot.snapshot_id,
        schema_id=schema.schema_id,
        location=table.location(),
        row_filter=t.row_filter,
        columns=selected,
        data_files=len(tasks),
        data_rows=sum(int(task.file.record_count) for task in tasks),
    )
    canon = [canonical_uri(task.file.file_path, "data file", resolve=False) for task in tasks]
    root = _common_root(canon)
    if root is not None:
        src = Storage(root, spec.io.storage_options, filesystems, follow_links=True)
        rels = [c[len(root) + 1 :] for c in canon]
    if root is not None and _by_reference(tasks, schema, selected, src, rels):
        files = describe_files(src, rels)
        found = Input(src, rels, files, fingerprint(files), "parquet", columns=tuple(selected))
        return found, TablePin(read="reference", **pin_args)
    projected = schema.select(*selected, case_sensitive=True)
    found, digest, size = _materialize(table, projected, tasks, row_filter, out, where, workdir)
    pin = TablePin(
        read="materialized",
        input_sha256=digest,
        input_bytes=size,
        shard_inputs_root=out.sub(SHARD_INPUTS).root,
        **pin_args,
    )
    return dataclasses.replace(found, columns=tuple(selected)), pin


def materialized_root(out: Storage) -> str:
    """The folder of the materialized file under the output prefix (the plan's ``input_root``)."""
    return out.sub(TABLE_DIR).root


def split_materialized(out: Storage, found: Input, shards: list[ShardPlan]) -> list[ShardPlan]:
    """Each shard without its own input file (the result cache's and the dedupe's shards have one) gets one: its
    rows of the materialized file (``found``: the plan's checked local copy), under ``_table/shard-inputs/``,
    named by sha256 and pinned in ``ShardPlan.input_file`` (``write_shard_inputs``, as the cache does)."""
    from airflow_provider_vllm.steps.cache.result_cache import write_shard_inputs

    todo = [s for s in shards if s.input_file is None]
    if not todo:
        return shards
    assert found.root.is_local and len(found.names) == 1, "split_materialized reads the plan's local copy"
    done = {s.shard_id: s for s in write_shard_inputs(out, found.root.path(found.names[0]), todo, SHARD_INPUTS)}
    return [done.get(s.shard_id, s) for s in shards]


def _check_on_main(table: Table, snapshot: Any, where: str) -> None:
    """SpecError unless ``snapshot`` is in the history of the table's ``main`` branch: a snapshot staged on another
    branch (write-audit-publish) and never published, or one ``main`` was rolled back past, is not the table's data.
    The job names no branch or tag (the spec has no field for one), so only ``main``'s history is read."""
    found, cut = in_history(table, snapshot.snapshot_id)
    if found:
        return
    refs = sorted(
        f"{ref.snapshot_ref_type.value} {name!r}"
        for name, ref in table.refs().items()
        if name != "main" and in_history(table, snapshot.snapshot_id, table.snapshot_by_id(ref.snapshot_id))[0]
    )
    if cut is not None:
        head = table.current_snapshot()
        raise SpecError(
            f"io.input_table.snapshot_id: {where}: whether it is in the history of branch main cannot be told: the "
            f"walk back from main's current snapshot {head.snapshot_id if head else None} stops at "
            f"{expired_parent(cut)}{'; ' + ', '.join(refs) + ' hold(s) it' if refs else ''}. A job reads only "
            "snapshots of main's retained history (the spec names no branch or tag): read one of those, or the "
            "current one (snapshot_id null)"
        )
    held = (
        f"it is on {', '.join(refs)} only (staged, write-audit-publish, and not published to main?)"
        if refs
        else "no branch or tag holds it (main was rolled back past it, or it was staged and never published)"
    )
    raise SpecError(
        f"io.input_table.snapshot_id: {where} is not in the history of branch main: {held}. A job reads only "
        "snapshots of main: publish the snapshot to main first (fast-forward or cherry-pick), or read one of main's own"
    )


def _schema_of(table: Table, schema_id: int | None) -> Schema:
    if schema_id is None:
        return table.schema()
    return table.schemas().get(schema_id, table.schema())


def _check_tasks(tasks: list[FileScanTask], where: str, allowed: Sequence[str] | None) -> None:
    from pyiceberg.manifest import FileFormat

    for task in tasks:
        path = task.file.file_path
        if task.delete_files:
            raise DatasetError(
                f"{where}: data file {path} has {len(task.delete_files)} delete file(s) (merge-on-read deletes); "
                "reading them is not supported: compact the table (rewrite data files) or read an earlier snapshot"
            )
        if task.file.file_format != FileFormat.PARQUET:
            raise DatasetError(f"{where}: data file {path} is {task.file.file_format.value}; only Parquet is read")
        try:
            check_uri(path, allowed, "data file")
        except SpecError as e:
            raise SpecError(
                f"{where}: {e}; the table's files must lie under [vllm_batch] allowed_uri_prefixes"
            ) from None


def _common_root(canon: list[str]) -> str | None:
    """The deepest folder holding every (canonical) path, at least a bucket or a top folder; None: no files."""
    if not canon:
        return None
    folders = [c.split("/")[:-1] for c in canon]
    common: list[str] = []
    for parts in zip(*folders):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    root = "/".join(common)
    remote = "://" in canon[0]
    if (remote and len(common) < 3) or (not remote and len(common) < 2):  # scheme://bucket, or /top
        return None
    return root


def _by_reference(
    tasks: list[FileScanTask], schema: Schema, selected: list[str], src: Storage, rels: list[str]
) -> bool:
    """Whether every task reads whole files whose stored columns are the table's (by field id, else by name), of
    the table's types."""
    from pyiceberg.expressions import AlwaysTrue

    if any(task.residual != AlwaysTrue() for task in tasks):
        return False
    ids = {name: schema.find_field(name).field_id for name in selected}
    for rel in rels:
        with src.open(rel) as f:
            stored = pq.ParquetFile(f).schema_arrow
        for name in selected:
            idx = stored.get_field_index(name)
            if idx < 0:
                return False  # a partition-projected, renamed or added column: pyiceberg fills it in
            meta = stored.field(idx).metadata or {}
            if FIELD_ID_KEY in meta and int(meta[FIELD_ID_KEY]) != ids[name]:
                return False  # another column under this name (dropped and re-added, renamed over)
            if not _stored_as(stored.field(idx), schema, name):
                return False  # written before a type promotion (int -> long, float -> double, a wider decimal)
    return True


def _stored_as(stored: pa.Field, schema: Schema, name: str) -> bool:
    """Whether a data file stores column ``name`` as the table's type (nested fields included): read by reference,
    the shards get the stored type, and every file must give a column the table's one type."""
    from pyiceberg.io.pyarrow import UnsupportedPyArrowTypeException, pyarrow_to_schema

    try:
        got = pyarrow_to_schema(pa.schema([stored]), name_mapping=schema.name_mapping)
    except (ValueError, TypeError, KeyError, UnsupportedPyArrowTypeException):  # read through pyiceberg instead
        return False
    return bool(got.fields[0].field_type == schema.find_field(name).field_type)


def _materialize(
    table: Table,
    projected: Schema,
    tasks: list[FileScanTask],
    row_filter: BooleanExpression,
    out: Storage,
    where: str,
    workdir: str,
) -> tuple[Input, str, int]:
    """The scan's rows (``projected``: the selected columns of the schema read by), read through pyiceberg into a
    local file under ``workdir`` and written under ``_table/`` (named by content); (the input, read from the local
    copy, its sha256, its size).

    A file already at that name under the output prefix is kept only when it is a regular file of these bytes
    (its sha256 checked); anything else there (another file, a link, a FIFO, a folder) is replaced by the plan's
    own. Only the local copy is read afterwards, here and by the rest of the plan."""
    from pyiceberg.io.pyarrow import ArrowScan

    reader = ArrowScan(table.metadata, table.io, projected, row_filter, case_sensitive=True)
    tmp = tempfile.mkdtemp(prefix="table-", dir=workdir)
    local = os.path.join(tmp, "input.parquet")
    writer: pq.ParquetWriter | None = None
    arrow_schema = None
    try:
        for task in tasks:  # one file at a time: memory bounded by one file's matching rows
            for batch in reader.to_record_batches([task]):
                if writer is None:
                    arrow_schema = batch.schema
                    writer = pq.ParquetWriter(local, arrow_schema, compression="zstd")
                writer.write_table(pa.Table.from_batches([batch], arrow_schema), row_group_size=ROW_GROUP_ROWS)
        if writer is None:  # no row matches: an empty file of the projected schema
            from pyiceberg.io.pyarrow import schema_to_pyarrow

            pq.write_table(schema_to_pyarrow(projected).empty_table(), local, compression="zstd")
    except (OSError, ValueError) as e:
        raise DatasetError(f"{where}: reading the snapshot's rows failed: {e}") from None
    finally:
        if writer is not None:
            writer.close()
    from airflow_provider_vllm.steps.cache.result_cache import put_by_content

    # never trusted as it is: another writer of the prefix may have planted a file (or a link, a FIFO, a folder) at
    # this name, which put_by_content keeps only when it is a regular file of these bytes
    written = put_by_content(out, local, f"{TABLE_DIR}/input", pq.read_metadata(local).num_rows)
    name = written.path.rsplit("/", 1)[1]
    os.rename(local, os.path.join(tmp, name))
    files = describe_files(out.sub(TABLE_DIR), [name])  # size and version as stated: the plan's InputFile record
    return Input(Storage(tmp), [name], files, fingerprint(files), "parquet"), written.sha256, written.bytes
