"""The plan's side of the result cache: the input's keys looked up in the entries, then the hits and misses files.

* One DuckDB pass over the input computes each row's key (``key.key_sql``: 32 bytes), its place, its id as
  text, its token estimate and its passthrough columns; each batch of keys is looked up in the ``KeyIndex``
  of the verified entry parts (``index.py``). A hit keeps its id, passthrough values and entry row; a miss
  its place and key.
* The hits file is written in one sequential pass over the entry parts: each row group's hit rows are taken
  from it in the entries' order (rows sharing an entry row in input order), so no answer is fetched at random
  and the answer columns never go through a join.
* The misses file is written by DuckDB from the input's own columns (the worker renders prompts from exactly
  these typed values, which the key encodes), in input order, with each row's key computed again from the values
  written beside it: it must be the key the first pass found at that place (``InputChangedError`` otherwise: the
  input changed between the two reads).

No Airflow.
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core import duck
from airflow_provider_vllm.core.errors import CommitError, InputChangedError
from airflow_provider_vllm.core.formats.files import Input
from airflow_provider_vllm.core.plan import Passthrough
from airflow_provider_vllm.core.rows import RESULT_COLUMNS
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.cache.index import KEY_BYTES, KeyIndex, key_matrix
from airflow_provider_vllm.steps.cache.key import key_columns, key_sql, key_text_sql

log = logging.getLogger(__name__)

KEY_COLUMN = "_vllm_cache_key"  # the key in the misses file (beside the input's own columns)
CACHED_FROM = "cached_from"
ANSWER_COLUMNS = [c for c in RESULT_COLUMNS if c not in ("id", CACHED_FROM)]
PASS_BATCH_ROWS = 1 << 20  # rows per batch of the keys pass
MISSES_ROW_GROUP = 4096  # the worker reads the row groups that hold its segment
# rows the hits file's writer takes per step (pyarrow's default: 1,024): the same pages and bytes, but each step
# updates every column's statistics and page state, about a sixth of the encoding's CPU at the default
HITS_WRITE_BATCH = 1 << 16
_CHANGED = "vllm-batch: the key of a miss row changed between the two reads of the input by the plan"


def _q(col: str) -> str:
    return '"' + col.replace('"', '""') + '"'


def needed_columns(spec: JobSpec, passthrough: Passthrough | None) -> list[str]:
    """The input columns of the misses file: the id, the key's columns, then the passthrough columns."""
    idc = spec.prompt.id_column
    cols = [idc] + [c for c in key_columns(spec) if c != idc]
    return cols + [c for c in (passthrough.columns if passthrough else []) if c not in cols]


@dataclass
class Matched:
    """What the keys pass found: counts, and what the hits and misses files are written from."""

    rows: int = 0
    hits: int = 0
    hit_tokens: int = 0
    hit_entry_rows: list[np.ndarray] = field(default_factory=list)  # per batch: the entry row of each hit
    hit_places: list[np.ndarray] = field(default_factory=list)  # per batch: the input place of each hit
    hit_values: list[pa.RecordBatch] = field(default_factory=list)  # per batch: id (text) + passthrough, hits only
    miss_places: list[np.ndarray] = field(default_factory=list)
    miss_keys: list[np.ndarray] = field(default_factory=list)  # (n, 32) uint8


class Source:
    """The input files as one DuckDB scan, each row with its place: (file index << 40) + row in the file, so that
    places sort in input order."""

    def __init__(self, found: Input) -> None:
        self.files = duck.file_list(found.root, found.names)
        self.scan = (
            f"read_parquet({self.files}, filename = '{duck.FILENAME}', file_row_number = true, union_by_name = true)"
        )
        self.place = f"(CAST(list_position({self.files}, {duck.FILENAME}) AS BIGINT) << 40) + file_row_number"


def match(
    con: duckdb.DuckDBPyConnection,
    spec: JobSpec,
    found: Input,
    khash: str,
    types: dict[str, str],
    index: KeyIndex,
    passthrough: Passthrough | None,
    keep: bool = True,
) -> Matched:
    """Look every input row's key up in ``index``; ``keep``: also keep what the hits and misses files need."""
    src = Source(found)
    texts = spec.prompt.texts
    chars = " + ".join(f"coalesce(length(CAST({_q(c)} AS VARCHAR)), 0)" for c in texts) or "0"
    pairs = zip(passthrough.columns, passthrough.names) if passthrough is not None else []
    carried = "".join(f", {_q(c)} AS {_q(n)}" for c, n in pairs)
    sql = (
        # the key as hex text: decoding it here (``key_matrix``) costs less than DuckDB's unhex
        f"SELECT {key_text_sql(spec, khash, types)} AS _vllm_key, {src.place} AS _vllm_place, "
        f"CAST(ceil(({chars}) / {float(spec.sharding.chars_per_token)}) AS BIGINT) AS _vllm_tokens"
        + (f", CAST({_q(spec.prompt.id_column)} AS VARCHAR) AS id{carried}" if keep else "")
        + f" FROM {src.scan}"
    )
    m = Matched()
    value_cols = ["id", *(passthrough.names if passthrough is not None else [])]
    for b in con.sql(sql).to_arrow_reader(PASS_BATCH_ROWS):
        if not b.num_rows:
            continue
        keys = key_matrix(b.column("_vllm_key"))
        rows = index.lookup(keys)
        hit = rows >= 0
        n_hit = int(hit.sum())
        m.rows += b.num_rows
        m.hits += n_hit
        m.hit_tokens += int(b.column("_vllm_tokens").to_numpy()[hit].sum())
        if not keep:
            continue
        places = b.column("_vllm_place").to_numpy()
        mask = pa.array(hit)
        if n_hit:
            m.hit_entry_rows.append(rows[hit])
            m.hit_places.append(places[hit])
            m.hit_values.append(pa.RecordBatch.from_arrays([b.column(c) for c in value_cols], value_cols).filter(mask))
        if n_hit < b.num_rows:
            m.miss_places.append(places[~hit])
            m.miss_keys.append(keys[~hit])
    return m


def write_misses(
    con: duckdb.DuckDBPyConnection,
    spec: JobSpec,
    found: Input,
    khash: str,
    types: dict[str, str],
    m: Matched,
    needed: list[str],
    dest: str,
) -> None:
    """The miss rows (the input's ``needed`` columns, then the key) in input order, as DuckDB writes them.

    This is the plan's second read of the input (the keys pass was the first): each row's key is computed again
    from the very values written beside it, and must be the key the keys pass found at that place.
    InputChangedError otherwise: the input changed between the two reads (another writer of its folder), and a
    key of one text beside another text would file that text's answer under the first text's key for every later
    run (an object put back with its old bytes keeps its ETag, so the merge's check that the input is unchanged
    need not see it). Costs a second sha256 of the miss rows only."""
    src = Source(found)
    places = np.concatenate(m.miss_places) if m.miss_places else np.zeros(0, np.int64)
    keys = np.concatenate(m.miss_keys) if m.miss_keys else np.zeros((0, KEY_BYTES), np.uint8)
    blobs = pa.FixedSizeBinaryArray.from_buffers(pa.binary(KEY_BYTES), len(keys), [None, pa.py_buffer(keys.tobytes())])
    con.register("_vllm_misses", pa.table({"_vllm_place": places, "_vllm_key": blobs.cast(pa.binary())}))
    cols = ", ".join(f"j.{_q(c)}" for c in needed)
    # the key over the columns of the joined row (miss rows only: the projection runs after the join)
    again = key_sql(spec, khash, types)
    try:
        con.execute(
            f"COPY (SELECT {cols}, CASE WHEN j._vllm_again = j._vllm_key THEN j._vllm_again "
            f"ELSE error('{_CHANGED}') END AS {KEY_COLUMN} "
            f"FROM (SELECT i.*, m._vllm_key, {again} AS _vllm_again FROM (SELECT "
            f"{', '.join(_q(c) for c in needed)}, {src.place} AS _vllm_place FROM {src.scan}) i "
            f"JOIN _vllm_misses m USING (_vllm_place)) j "
            f"ORDER BY j._vllm_place) TO '{_sql_str(dest)}' "
            f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {MISSES_ROW_GROUP})"
        ).fetchall()
    except duckdb.InvalidInputException as e:  # error() below
        if _CHANGED not in str(e):
            raise
        raise InputChangedError(
            f"the input {found.root.uri()} changed while the plan read it (a row's template values are not the "
            "ones its key was computed from a moment before): another writer of its folder; plan again once it "
            "holds still"
        ) from None
    finally:
        con.unregister("_vllm_misses")
    got = pq.ParquetFile(dest).metadata.num_rows
    if got != len(places):
        raise InputChangedError(
            f"the input {found.root.uri()} changed while the plan read it ({len(places)} rows to infer were found, "
            f"{got} read again); plan again once it holds still"
        )


def write_all_misses(
    con: duckdb.DuckDBPyConnection,
    spec: JobSpec,
    found: Input,
    khash: str,
    types: dict[str, str],
    needed: list[str],
    dest: str,
) -> int:
    """No entry to look in: every row is a miss, written with its key in one pass (input order); the rows."""
    src = Source(found)
    con.execute(
        f"COPY (SELECT {', '.join(_q(c) for c in needed)}, {key_sql(spec, khash, types)} AS {KEY_COLUMN} "
        f"FROM {src.scan}) TO '{_sql_str(dest)}' "
        f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {MISSES_ROW_GROUP})"
    ).fetchall()
    return int(pq.ParquetFile(dest).metadata.num_rows)


def write_hits(m: Matched, entries: Sequence[str], schema: pa.Schema, dest: str, dictionaries: bool = True) -> int:
    """The hits file in ``schema`` (the results schema): one sequential pass over the local entry parts.

    Rows come entry row group by entry row group, in input order within each. An entry part without an answer
    column (written before it existed) gives NULLs, as its rows had none. Entry row groups are read and taken
    from, and their hits' ids taken, in a second thread while this one encodes. Returns the rows written.

    ``dictionaries``: the answers' text columns stay dictionary-encoded from the entry's pages to the file's
    (nothing decoded and hashed again), and the file records ``schema`` as its Arrow schema (``ARROW:schema``,
    as pyarrow's own writer does), so readers see plain text. The file is read back: should it not give
    ``schema`` (a pyarrow that stopped honouring the record), it is written again with plain text columns.
    """
    groups = []  # (part, row group, rows), in the order the index numbered the entry rows
    for path in entries:
        md = pq.ParquetFile(path).metadata
        groups += [(path, g, md.row_group(g).num_rows) for g in range(md.num_row_groups)]
    starts = np.cumsum([0] + [n for _, _, n in groups], dtype=np.int64)
    erows, values, picks, bounds = _by_group(m, starts)
    want = [*ANSWER_COLUMNS, CACHED_FROM]
    text = {c for c in want if dictionaries and c in schema.names and pa.types.is_string(schema.field(c).type)}
    layout = pa.schema(
        [pa.field(f.name, pa.dictionary(pa.int32(), f.type), f.nullable) if f.name in text else f for f in schema]
    )

    def tables() -> Iterator[pa.Table]:
        files: dict[str, pq.ParquetFile] = {}
        for i, (path, g, n) in enumerate(groups):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi == lo:
                continue
            if path not in files:
                names = pq.ParquetFile(path).schema_arrow.names
                files = {path: pq.ParquetFile(path, read_dictionary=[c for c in text if c in names])}
            pf = files[path]
            t = pf.read_row_group(g, columns=[c for c in want if c in pf.schema_arrow.names and c in schema.names])
            local = erows[lo:hi] - starts[i]
            if not (hi - lo == n and bool((local == np.arange(n)).all())):
                t = t.take(pa.array(local))
            assert values is not None
            yield _hits_table(t, values.take(pa.array(picks[lo:hi])), layout)

    # Dictionary pages for the text columns (kept from the entry's) and the passthrough columns, as pyarrow's
    # default; not for the id and the numbers (latencies, confidences, prompt hashes): nearly every value differs,
    # so pyarrow would build each row group's dictionary to its size limit and then write the values plainly anyway
    # (about half of the encoding's CPU at 10M rows, docs/BENCHMARKS.md). The values read back the same.
    plain = {"id"} | {c for c in want if c in schema.names and not pa.types.is_string(schema.field(c).type)}
    written = 0
    with pq.ParquetWriter(
        dest,
        layout,
        compression="zstd",
        store_schema=not text,
        use_dictionary=[c for c in layout.names if c not in plain],
        write_batch_size=HITS_WRITE_BATCH,
    ) as w:
        for t in _prefetched(tables()):
            w.write_table(t)
            written += t.num_rows
        if text:
            w.add_key_value_metadata({"ARROW:schema": base64.b64encode(schema.serialize().to_pybytes()).decode()})
    if pq.read_schema(dest).equals(schema):
        return written
    if text:
        log.warning("cache: the hits file did not read back in the results schema; writing it with plain text")
        taken = values.take(pa.array(picks)) if values is not None else None
        m.hit_entry_rows, m.hit_places, m.hit_values = [erows], [np.arange(len(erows))], _batches(taken)
        return write_hits(m, entries, schema, dest, dictionaries=False)
    raise CommitError(f"{dest}: the hits file does not read back in the results schema (a bug); plan again")


def _batches(values: pa.Table | None) -> list[pa.RecordBatch]:
    return values.to_batches() if values is not None else []


def _by_group(m: Matched, starts: np.ndarray) -> tuple[np.ndarray, pa.Table | None, np.ndarray, np.ndarray]:
    """The hits' entry rows grouped by the entry row group that holds them (``starts``: each group's first row),
    in input order within a group; their ids and passthrough values (one table, in the order the keys pass found
    them); the row of that table for each entry row, in the same order; each group's bounds in both."""
    erows = np.concatenate(m.hit_entry_rows) if m.hit_entry_rows else np.zeros(0, np.int64)
    places = np.concatenate(m.hit_places) if m.hit_places else np.zeros(0, np.int64)
    n_groups = len(starts) - 1
    # each entry row's group, looked up (2 or 4 bytes a row): a binary search per hit cost several times more
    small = np.uint16 if n_groups <= 1 << 16 else np.int64
    group = np.repeat(np.arange(n_groups, dtype=small), np.diff(starts))[erows]
    if len(places) > 1 and not bool((places[1:] > places[:-1]).all()):  # batches out of input order
        by_place = np.argsort(places, kind="stable")
        group, erows = group[by_place], erows[by_place]
    else:
        by_place = None
    # a stable sort on small integers is a radix sort: linear in the hits
    order = np.argsort(group, kind="stable")
    # one chunk: a take from a chunked table would join its chunks again for every group
    values = pa.Table.from_batches(m.hit_values).combine_chunks() if m.hit_values else None
    m.hit_entry_rows, m.hit_places, m.hit_values = [], [], []  # all of it is in ``erows`` and ``values`` now
    picks = order if by_place is None else by_place[order]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(group, minlength=n_groups))]).astype(np.int64)
    return erows[order], values, picks, bounds


def _hits_table(answers: pa.Table, values: pa.Table, layout: pa.Schema) -> pa.Table:
    cols = []
    for f in layout:
        if f.name in values.column_names:
            col = values.column(f.name)
        elif f.name in answers.column_names:
            col = answers.column(f.name)
        else:
            col = pa.nulls(answers.num_rows, f.type)
        cols.append(col.cast(f.type) if col.type != f.type else col)
    return pa.Table.from_arrays(cols, schema=layout)


_DONE = object()
T = TypeVar("T")


def _prefetched(items: Iterator[T], depth: int = 2) -> Iterator[T]:
    """``items``, produced in another thread up to ``depth`` ahead (DuckDB, pyarrow's reads and takes release the
    GIL); an error there is raised here; stopping early stops the producer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_DONE)
        except BaseException as e:  # handed to the consumer, raised there
            q.put(e)

    th = threading.Thread(target=produce, name="cache-hits-reader", daemon=True)
    th.start()
    try:
        while (item := q.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while th.is_alive():
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
        th.join()


def _sql_str(s: str) -> str:
    return s.replace("'", "''")
