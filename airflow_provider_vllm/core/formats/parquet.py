"""Parquet inputs: a file or a folder of files, any number of row groups.

Planned from footers plus the id column (checked by DuckDB, never loaded into Python); the
text columns are read only when exact per-row sizes are asked for. The worker reads only
the row groups that hold its segment, in batches, and stops after the segment's last row.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from airflow_provider_vllm.core.errors import DatasetError
from airflow_provider_vllm.core.formats.base import (
    BLANK_ID_PATTERN,
    InputFormat,
    NanoTimestamp,
    RowBatch,
    RowGroups,
    RowRuns,
    Scan,
    raise_duplicates,
    row_columns,
)
from airflow_provider_vllm.core.rows import INVALID_ROW, duck_name_key
from airflow_provider_vllm.core.storage import Storage

if TYPE_CHECKING:
    from airflow_provider_vllm.core.plan import Segment
    from airflow_provider_vllm.core.spec import JobSpec

# Rows are read in batches of about this many decoded bytes, as the footer states the columns' uncompressed sizes
# (``_batch_rows``): a row group (pyarrow writes 1Mi rows by default) is never decoded whole at once.
BATCH_BYTES = 16 << 20
# At most this many rows a batch: pyarrow's default batch size.
BATCH_ROWS = 65536
# The worker's batches hold at most this many rows, or the segment's rows when more: a footer can understate what
# its rows decode to (text stored once in a dictionary and repeated, or a forged size), and a smaller batch costs
# more per row (about 50 us a batch).
SEGMENT_BATCH_ROWS = 1024


class ParquetFormat(InputFormat):
    name = "parquet"

    def scan(self, root: Storage, names: list[str], spec: JobSpec, per_row: bool) -> Scan:
        """Schema checks and row counts from footers; ids are checked by DuckDB, never loaded here."""
        idc = spec.prompt.id_column
        texts = spec.prompt.texts
        needed = [idc] + [c for c in row_columns(spec) if c != idc]
        runs, file_rows, group_rows = [], [], []
        first_schema = None
        seen: dict[str, tuple[str, pa.DataType]] = {}  # template column -> the first file giving it a type, that type
        for name in names:
            md = parquet_metadata(root, name)
            schema = md.schema.to_arrow_schema()
            missing = [c for c in needed if c not in schema.names]
            if missing:
                raise DatasetError(f"input file {name}: missing column(s) {missing}; it has {schema.names[:20]}")
            id_type = schema.field(idc).type
            if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type) or pa.types.is_integer(id_type)):
                raise DatasetError(
                    f"input file {name}: id column {idc!r} has type {id_type}; expected string or integer"
                )
            for c in texts:
                t = schema.field(c).type
                if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)):
                    raise DatasetError(f"input file {name}: text column {c!r} has type {t}; expected string")
            for c in row_columns(spec):
                if c not in texts and c != idc and not renders(schema.field(c).type):
                    raise DatasetError(_unrendered(name, c, schema.field(c).type, c == spec.model.adapter_column))
            _check_column_types(name, schema, [c for c in row_columns(spec) if c != idc], seen)
            if first_schema is None:
                first_schema = schema
            elif _id_kind(id_type) != _id_kind(first_schema.field(idc).type):
                raise DatasetError(
                    f"input file {name}: id column type {id_type} differs from "
                    f"{names[0]}'s {first_schema.field(idc).type}"
                )
            file_rows.append(md.num_rows)
            group_rows.append([md.row_group(g).num_rows for g in range(md.num_row_groups)])
            if not per_row:
                runs.append(_chars_from_footer(md, texts))
        if sum(file_rows):
            assert first_schema is not None
            _check_ids(root, names, idc, strings=not pa.types.is_integer(first_schema.field(idc).type))
        if not per_row:  # one estimate per row group: runs, never a per-row array
            cat = lambda k: np.concatenate([r[k] for r in runs]) if runs else np.zeros(0, np.int64)  # noqa: E731
            return Scan(runs=RowRuns(values=cat(0), counts=cat(1)), file_rows=file_rows)
        return Scan(groups=_row_groups(root, names, texts, group_rows), file_rows=file_rows)

    def read_rows(
        self, root: Storage, name: str, segment: Segment, spec: JobSpec, passthrough: list[str] | None = None
    ) -> RowBatch:
        idc = spec.prompt.id_column
        columns = [c for c in row_columns(spec) if c != idc]
        carried = list(passthrough or [])
        read = list(dict.fromkeys([idc, *columns, *carried]))
        # INT96 template columns as DuckDB reads them; one also carried is published with the input's type instead
        us = [c for c in columns if c not in carried]
        table = read_parquet_range(root, name, segment.start, segment.count, read, int96_us=us)
        batch = parquet_batch(table, idc, columns)
        batch.chars = _text_chars(table, spec.prompt.texts).tolist()
        if carried:
            batch.passthrough = _checked_passthrough(table.select(carried), batch.faults, name)
        return batch

    def file_ids(self, root: Storage, name: str, spec: JobSpec) -> list[str]:
        with root.open(name) as f:
            ids = pq.read_table(f, columns=[spec.prompt.id_column]).column(0)
        return ids.cast(pa.string()).to_pylist()


def renders(t: pa.DataType) -> bool:
    """Whether the worker renders a template value of Arrow type ``t`` (``worker/prompts.py`` ``template_text``):
    text, booleans, integers, 32- and 64-bit floats, decimals, dates, times, timestamps (any unit, with or without a
    time zone), the null type; a dictionary of one of these. Not binary, lists, structs, maps, unions, durations,
    intervals, half floats or extension types (UUID): pyarrow gives values the worker has no text for."""
    if pa.types.is_dictionary(t):
        return renders(t.value_type)
    return any(
        is_(t)
        for is_ in (
            pa.types.is_null,
            pa.types.is_boolean,
            pa.types.is_integer,
            pa.types.is_float32,
            pa.types.is_float64,
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_string_view,
            pa.types.is_decimal,
            pa.types.is_date,
            pa.types.is_time,
            pa.types.is_timestamp,
        )
    )


def _unrendered(name: str, column: str, t: pa.DataType, adapter: bool) -> str:
    """The plan's refusal of a column the worker cannot render (``renders``), naming the file, column and type."""
    what = f"model.adapter_column {column!r}" if adapter else f"template column {column!r}"
    return (
        f"input file {name}: {what} has type {t}, which the worker cannot render into a prompt (it renders text, "
        "numbers, booleans, decimals, dates, times and timestamps; every row would fail); cast the column to one of "
        "those in the input (e.g. binary to a hex or base64 string, a list or struct to a JSON string), or leave it "
        "out of prompt.template and name it in io.passthrough to carry it to the output without showing it to the "
        "model"
    )


# A DECIMAL of more digits DuckDB reads as DOUBLE (the cache's key and the dedupe read the input with DuckDB): distinct
# values would share one key and one prompt.
_DUCK_DECIMAL_DIGITS = 38


def _check_column_types(
    name: str, schema: pa.Schema, columns: list[str], seen: dict[str, tuple[str, pa.DataType]]
) -> None:
    """DatasetError for a template column (or model.adapter_column) of ``name`` whose type renders other text than
    the type an earlier file gave it (``_render_kind``), or a DECIMAL of more than 38 digits. With the result cache or
    the dedupe the plan reads the files with DuckDB (``union_by_name``), which widens a column to one type (an int
    and a bool file: ``1`` for ``True``; int and double: ``1.0``; two decimal scales: ``1.50``; a naive timestamp
    beside an aware one gains ``+00:00``), and a DECIMAL over 38 digits to DOUBLE; a plain run renders each file's
    own values. Refused always, so that a prompt never depends on those settings. A column of the null type (all
    empty in that file) agrees with every type. ``seen``: column -> the first file giving it a type other than
    null, and that type; updated here."""
    for c in columns:
        t = schema.field(c).type
        base = t.value_type if pa.types.is_dictionary(t) else t
        if pa.types.is_decimal(base) and base.precision > _DUCK_DECIMAL_DIGITS:
            raise DatasetError(
                f"input file {name}: template column {c!r} has type {t}, more than {_DUCK_DECIMAL_DIGITS} digits: the "
                "result cache and the dedupe read it as a double, so distinct values would share one prompt; cast "
                "the column to a string in the input"
            )
        if pa.types.is_null(base):
            continue
        if c not in seen:
            seen[c] = (name, t)
        elif _render_kind(seen[c][1]) != _render_kind(t):
            first, ft = seen[c]
            raise DatasetError(
                f"template column {c!r} has type {ft} in input file {first} and {t} in input file {name}; files "
                "whose types differ render other prompt text with the result cache or the dedupe (which read the "
                "files as one type) than without; cast the column to one type in every file"
            )


def _render_kind(t: pa.DataType) -> Any:
    """A template column's type as the files of one input must share it: the types whose values render the same
    text however DuckDB widens them are one (text of any width and a dictionary of it; integers of any width and
    sign but uint64, widened exactly to BIGINT; timestamps with a time zone, in any zone, rendered in UTC)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_integer(t) and not pa.types.is_uint64(t):  # with uint64 DuckDB widens to HUGEINT
        return "integer"
    if pa.types.is_timestamp(t) and t.tz is not None:
        return pa.timestamp(t.unit, "UTC")
    return t


def _id_kind(t: pa.DataType) -> pa.DataType:
    """An id column's type as the files of one input must share it: ``string`` and ``large_string`` are one (their
    values are the same text to Arrow and DuckDB; pandas and polars write one or the other); integers keep their
    width (DuckDB reads a folder's column as its first file's type)."""
    return pa.string() if pa.types.is_large_string(t) else t


def _text_chars(table: pa.Table, texts: list[str]) -> np.ndarray:
    """Per row: the characters of its text columns (null, and a column of type null: 0).

    A dictionary-encoded column (as the plan reads it) is measured once per dictionary value."""
    total = np.zeros(table.num_rows, dtype=np.int64)
    for c in texts:
        col = table.column(c)
        if pa.types.is_dictionary(col.type):
            parts = [pc.utf8_length(ch.dictionary).take(ch.indices) for ch in col.chunks]
            col = pa.chunked_array(parts, pa.int32() if pa.types.is_string(col.type.value_type) else pa.int64())
            total += pc.fill_null(col, 0).to_numpy()
        elif not pa.types.is_null(col.type):  # utf8_length has no kernel for it
            total += pc.fill_null(pc.utf8_length(col), 0).to_numpy()
    return total


def _row_groups(root: Storage, names: list[str], texts: list[str], group_rows: list[list[int]]) -> RowGroups:
    """The files' row groups as ``RowGroups``: per-row characters read one row group at a time. Text columns that
    a row group stores dictionary-encoded are read so (each distinct text measured once); others are read plain
    (building a dictionary of distinct texts would cost more than measuring each)."""
    where: list[tuple[int, int]] = [(f, g) for f, rows in enumerate(group_rows) for g in range(len(rows))]
    files, first = [], 0
    for rows in group_rows:
        files.append(list(range(first, first + len(rows))))
        first += len(rows)

    def read(fh, pf: pq.ParquetFile, g: int) -> np.ndarray:
        cols = [c for c in texts if not pa.types.is_null(pf.schema_arrow.field(c).type)]
        rg = pf.metadata.row_group(g)
        total = np.zeros(rg.num_rows, np.int64)
        if not cols:
            return total
        paths = [rg.column(i).path_in_schema for i in range(rg.num_columns)]
        # read whole as a dictionary: small in that form (its dictionary plus an index a row). A larger column
        # chunk with a dictionary page may hold pages the writer stored plain (the dictionary grew past its limit):
        # read as a dictionary it would build one of all its texts, so it is read plain, in batches, like the rest
        encoded = [
            c
            for c in cols
            if c in paths
            and rg.column(paths.index(c)).has_dictionary_page
            and rg.column(paths.index(c)).total_uncompressed_size <= BATCH_BYTES
        ]
        if encoded:
            reader = pq.ParquetFile(fh, read_dictionary=encoded, metadata=pf.metadata)
            total += _text_chars(reader.read_row_group(g, columns=encoded, use_threads=False), encoded)
        plain = [c for c in cols if c not in encoded]
        if plain:
            size = _batch_rows(pf.metadata, [g], plain, BATCH_ROWS)
            batches = pf.iter_batches(batch_size=size, row_groups=[g], columns=plain, use_threads=False)
            parts = [_text_chars(pa.Table.from_batches([b]), plain) for b in batches]
            total += np.concatenate(parts) if parts else 0
        return total

    def chars(i: int) -> np.ndarray:
        f, g = where[i]
        with root.open(names[f]) as fh:
            return read(fh, pq.ParquetFile(fh), g)

    def chars_of_file(f: int):
        with root.open(names[f]) as fh:
            pf = pq.ParquetFile(fh)
            for i in files[f]:
                yield i, read(fh, pf, where[i][1])

    counts = np.asarray([n for rows in group_rows for n in rows], np.int64)
    return RowGroups(counts, files, chars, chars_of_file)


def _check_ids(root: Storage, names: list[str], idc: str, strings: bool = True) -> None:
    """DatasetError for null, blank or duplicate ids, naming the first file and row of each.

    Ordered ids are proven valid by ``parquet_ids.ids_proven``; anything else (unordered ids, or a fault) is
    checked by one DuckDB statement, which also finds the row to name (``strings``: False for integer ids, which
    cannot be blank: no pattern is matched)."""
    import duckdb

    from airflow_provider_vllm.core import duck
    from airflow_provider_vllm.core.formats.parquet_ids import ids_proven

    if ids_proven(root, names, idc):  # ordered ids: proven in one streaming pass, no hash table
        return
    con = duck.connect(root)
    try:
        src = f"read_parquet({duck.file_list(root, names)}, filename = '{duck.FILENAME}', file_row_number = true)"
        col = '"' + idc.replace('"', '""') + '"'
        # distinct hashes == rows proves distinct ids; a shortfall pays for the exact count
        blank = f"regexp_matches(CAST({col} AS VARCHAR), '{BLANK_ID_PATTERN}')" if strings else "false"
        n, nulls, distinct, empty = con.execute(
            f"SELECT count(*), count(*) - count({col}), count(DISTINCT hash({col})), "
            f"count(*) FILTER (WHERE {blank}) FROM {src}"
        ).fetchall()[0]
        if not nulls and distinct != n:
            distinct = con.execute(f"SELECT count(DISTINCT {col}) FROM {src}").fetchall()[0][0]
        if nulls:
            fname, row = con.execute(
                f"SELECT {duck.FILENAME}, file_row_number FROM {src} WHERE {col} IS NULL LIMIT 1"
            ).fetchall()[0]
            raise DatasetError(f"{nulls} row(s) have a null id; first at {fname.rsplit('/', 1)[-1]} row {row}")
        if empty:
            fname, row = con.execute(
                f"SELECT {duck.FILENAME}, file_row_number FROM {src} WHERE {blank} LIMIT 1"
            ).fetchall()[0]
            raise DatasetError(
                f"{empty} row(s) have an empty id (empty or only whitespace) in column {idc!r}; "
                f"first at {fname.rsplit('/', 1)[-1]} row {row}"
            )
        if distinct != n:
            dups = con.execute(
                f"SELECT {col}, count(*) AS k FROM {src} GROUP BY {col} HAVING k > 1 ORDER BY k DESC, {col} LIMIT 5"
            ).fetchall()
            at = con.execute(
                f"SELECT {duck.FILENAME}, file_row_number FROM {src} WHERE {col} = ? "
                f"ORDER BY {duck.FILENAME}, file_row_number LIMIT 2",
                [dups[0][0]],
            ).fetchall()
            raise_duplicates(n, distinct, dups, [f"{f.rsplit('/', 1)[-1]} row {r}" for f, r in at])
    except duckdb.InvalidInputException as e:  # the data itself (invalid UTF-8); I/O errors stay transient
        raise DatasetError(f"the id column {idc!r} of the input cannot be read: {e}") from None
    finally:
        con.close()


def _chars_from_footer(md: pq.FileMetaData, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row character estimate from row-group column sizes (no data read), as runs:
    (estimate, rows) per row group."""
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    values, counts = [], []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        size = sum(rg.column(names.index(c)).total_uncompressed_size for c in texts if c in names)
        k = rg.num_rows
        # uncompressed plain strings carry a 4-byte length prefix per value
        values.append(max(0, size // k - 4 * len(texts)) if k else 0)
        counts.append(k)
    return np.asarray(values, np.int64), np.asarray(counts, np.int64)


def parquet_metadata(storage: Storage, name: str) -> pq.FileMetaData:
    """An input file's footer; DatasetError when it is not Parquet or its column names are ambiguous
    (``check_column_names``)."""
    try:
        with storage.open(name) as f:
            md = pq.ParquetFile(f).metadata
    except pa.ArrowInvalid as e:  # storage errors (OSError) stay transient
        raise DatasetError(f"input file {name} is not a readable Parquet file: {e}") from None
    check_column_names(name, md.schema.to_arrow_schema().names)
    return md


def check_column_names(name: str, columns: list[str]) -> None:
    """DatasetError naming the file and both columns when two top-level column names are equal as DuckDB compares
    names (``duck_name_key``: ignoring the case of ASCII letters), or naming the column when it is named like one
    that DuckDB's scan adds (``file_row_number``, ``duck.FILENAME``).

    Every column counts, not only the ones the job reads: DuckDB binds names case-insensitively and reads
    ``ID`` and ``id`` as ``ID`` and ``id_1``, so a query of ``id`` (the plan's id check, the merge's input ids,
    the dedupe's keys) would read the other column, and Arrow cannot pick one of two equal names. Names that
    differ in the case of other letters (``Имя``, ``имя``) are distinct to DuckDB and Arrow alike: allowed."""
    from airflow_provider_vllm.core import duck

    # read_parquet(..., file_row_number = true) cannot rename its column (duckdb 2.0.1)
    added = next((c for c in columns if duck_name_key(c) in ("file_row_number", duck.FILENAME)), None)
    if added is not None:
        raise DatasetError(
            f"input file {name}: column {added!r} has the name of a column DuckDB's Parquet scan adds (row "
            "positions, file names), which the plan and the merge read: rename it"
        )
    seen: dict[str, str] = {}
    for c in columns:
        key = duck_name_key(c)
        other = seen.get(key)
        if other is None:
            seen[key] = c
            continue
        what = (
            f"column {c!r} appears twice"
            if other == c
            else f"columns {other!r} and {c!r} have names equal ignoring the case of ASCII letters"
        )
        raise DatasetError(
            f"input file {name}: {what}; every column name must differ from the others ignoring the case of "
            "ASCII letters (DuckDB reads names so): rename one"
        )


def _int96_columns(md: pq.FileMetaData) -> set[str]:
    """The top-level columns stored as Parquet's deprecated INT96 timestamp (Spark, Hive and Impala write it), which
    pyarrow reads in nanoseconds and DuckDB in microseconds."""
    col = md.schema.column
    return {col(i).path for i in range(md.num_columns) if col(i).physical_type == "INT96" and "." not in col(i).path}


def _floor_to_us(col: pa.ChunkedArray) -> pa.Array:
    """A nanosecond timestamp column in microseconds, floored (toward the past), as DuckDB reads an INT96 value."""
    return pa.array([None if n is None else n // 1000 for n in col.cast(pa.int64()).to_pylist()], pa.timestamp("us"))


def read_parquet_range(
    storage: Storage, name: str, start: int, count: int, columns: list[str], int96_us: Sequence[str] = ()
) -> pa.Table:
    """Rows [start, start+count) of one Parquet file, reading only the row groups that hold them.

    ``int96_us``: those of these columns that the file stores as INT96 timestamps are read in microseconds, floored,
    as DuckDB reads them (pyarrow reads nanoseconds): the result cache's key and the dedupe's read the input with
    DuckDB, and the worker renders from a file DuckDB wrote when either applies, so a template column must render
    the same without them.

    The row groups are read in batches (``_batch_rows``, at most ``max(count, SEGMENT_BATCH_ROWS)`` rows), from the
    first row of the first of them up to the batch that holds the segment's last row; only the rows of the segment
    are kept (slices of their batches). So a segment of 10 rows of a row group of a million decodes at most the
    rows up to its own and holds a few batches, not the row group whole."""
    with storage.open(name) as f:
        pf = pq.ParquetFile(f)
        md = pf.metadata
        groups, first_row, pos = [], None, 0
        for i in range(md.num_row_groups):
            n = md.row_group(i).num_rows
            if pos + n > start and pos < start + count:
                groups.append(i)
                if first_row is None:
                    first_row = pos
            pos += n
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise DatasetError(f"{name}: missing columns {missing}")
        if not groups or first_row is None:
            return pf.schema_arrow.empty_table().select(columns)
        size = _batch_rows(md, groups, columns, min(max(count, SEGMENT_BATCH_ROWS), BATCH_ROWS))
        end, pos, kept, schema = start + count, first_row, [], None
        batches = pf.iter_batches(batch_size=size, row_groups=groups, columns=columns)
        try:
            for batch in batches:
                schema = batch.schema
                if pos + batch.num_rows > start:
                    lo = max(start - pos, 0)
                    kept.append(batch.slice(lo, min(end - pos, batch.num_rows) - lo))
                pos += batch.num_rows
                if pos >= end:
                    break
        finally:
            batches.close()  # stops the reader before the rest of the row groups
    if schema is None:
        return pf.schema_arrow.empty_table().select(columns)
    table = pa.Table.from_batches(kept, schema=schema)
    for c in _int96_columns(md) & set(int96_us) & set(columns):
        i = table.schema.get_field_index(c)
        table = table.set_column(i, table.schema.field(i).with_type(pa.timestamp("us")), _floor_to_us(table.column(i)))
    return table


def _batch_rows(md: pq.FileMetaData, groups: list[int], columns: list[str], most: int) -> int:
    """Rows a batch when reading ``columns`` of row groups ``groups``: ``BATCH_BYTES`` over the most uncompressed
    bytes a row of any of the groups holds in those columns (the footer's sizes), between 1 and ``most``."""
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    per_row = 0
    for g in groups:
        rg = md.row_group(g)
        if rg.num_rows:
            # a nested column is stored as several leaf columns: "c.x", "c.list.element"
            size = sum(
                rg.column(i).total_uncompressed_size
                for i, path in enumerate(names)
                if any(path == c or path.startswith(c + ".") for c in columns)
            )
            per_row = max(per_row, size // rg.num_rows)
    return max(1, min(most, BATCH_BYTES // max(per_row, 1)))


def parquet_batch(table: pa.Table, id_column: str, columns: list[str]) -> RowBatch:
    ids_col = table.column(id_column)
    if not pa.types.is_string(ids_col.type) and not pa.types.is_large_string(ids_col.type):
        ids_col = ids_col.cast(pa.string())
    ids = ids_col.to_pylist()
    faults: list[tuple[str, str] | None] = [None] * len(ids)
    values = {c: _values(table.column(c), c, faults) for c in columns if c != id_column}
    if id_column in columns:
        values[id_column] = table.column(id_column).to_pylist()
    return RowBatch(ids=ids, values=values, faults=faults, lines=[None] * len(ids))


def _checked_passthrough(table: pa.Table, faults: list[tuple[str, str] | None], name: str) -> pa.Table:
    """``table`` (the passthrough columns), where a string that is not UTF-8 (Parquet's reader does not check) is
    null and its row an INVALID_ROW fault naming the column: published as it was, no reader could read the part.
    DatasetError for such bytes inside a nested column (no row to name cheaply)."""
    for k, col in enumerate(table.columns):
        try:
            col.validate(full=True)
            continue
        except pa.ArrowInvalid as e:
            field = table.schema.field(k)
            plain = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
            if not (pa.types.is_string(plain) or pa.types.is_large_string(plain)):
                raise DatasetError(
                    f"input file {name}: passthrough column {field.name!r} cannot be read: {e}"
                ) from None
        values = _values(col.cast(plain) if plain != field.type else col, field.name, faults)
        table = table.set_column(k, field, pa.array(values, field.type))
    return table


_EPOCH = dt.datetime(1970, 1, 1)


def _nano_timestamps(col: pa.ChunkedArray) -> list[NanoTimestamp | None]:
    """A nanosecond timestamp column's values with every nanosecond, without pandas: what pyarrow makes of them
    depends on whether pandas is installed (``NanoTimestamp``), and the worker's prompt must not."""
    zoned = col.type.tz is not None
    epoch = _EPOCH.replace(tzinfo=dt.UTC) if zoned else _EPOCH
    out: list[NanoTimestamp | None] = []
    for n in col.cast(pa.int64()).to_pylist():  # since the epoch: UTC for a zoned column, the wall clock otherwise
        out.append(None if n is None else NanoTimestamp(epoch + dt.timedelta(microseconds=n // 1000), n % 1000))
    return out


def _dates_in_range(col: pa.ChunkedArray, name: str, faults: list[tuple[str, str] | None]) -> list[Any]:
    """A date or timestamp column that holds a value Python's dates cannot hold (before year 1 or after 9999, which
    Parquet, DuckDB and the plan accept): that value is None and its row an INVALID_ROW fault naming the column; the
    other rows are read as they are (``to_pylist`` raises OverflowError for the whole batch: every retry of the shard
    failed)."""
    out: list[Any] = []
    for i, v in enumerate(col):
        try:
            out.append(v.as_py())
        except (OverflowError, ValueError) as e:
            out.append(None)
            faults[i] = faults[i] or (
                INVALID_ROW,
                f"column {name!r} holds a {col.type} value outside the years 1-9999 that the worker can render ({e})",
            )
    return out


def _values(col: pa.ChunkedArray, name: str, faults: list[tuple[str, str] | None]) -> list[Any]:
    """``col`` as Python values. Parquet's reader does not check that strings are UTF-8: a value that is not is
    None, and its row an INVALID_ROW fault naming the column (the other rows are read as they are). A nanosecond
    timestamp is a ``NanoTimestamp`` (``_nano_timestamps``)."""
    if pa.types.is_timestamp(col.type) and col.type.unit == "ns":
        return _nano_timestamps(col)
    try:
        return col.to_pylist()
    except UnicodeDecodeError as e:  # before ValueError: a UnicodeDecodeError is one
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):  # inside a list or struct
            raise DatasetError(f"column {name!r} holds a string that is not UTF-8 ({e}); no row to name") from None
    except (OverflowError, ValueError):
        plain = col.type.value_type if pa.types.is_dictionary(col.type) else col.type
        if not (pa.types.is_date(plain) or pa.types.is_timestamp(plain)):
            raise
        return _dates_in_range(col, name, faults)
    out: list[Any] = []
    for i, raw in enumerate(col.cast(pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary())):
        b = raw.as_py()
        try:
            out.append(None if b is None else b.decode("utf-8"))
        except UnicodeDecodeError as e:
            out.append(None)
            faults[i] = faults[i] or (INVALID_ROW, f"column {name!r} is not valid UTF-8 text (byte {e.start})")
    return out
