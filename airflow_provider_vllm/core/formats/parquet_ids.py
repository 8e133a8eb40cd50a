"""A streaming proof that a Parquet input's ids are present, non-blank and distinct, for ordered ids.

Most large inputs carry ids in order (``row-000000001``..., database keys, timestamps). Then one
pass over the id column proves the ids distinct without a hash table: within each file every id
is greater than the one before (bytewise for strings, as UTF-8 orders code points), and the files'
[first, last] ranges do not overlap. Blank ids are ruled out with no regular expression for an id
whose first byte is printable ASCII other than a space (no whitespace character is encoded with
such a byte); only the other ids are matched against ``BLANK_ID_PATTERN`` (RE2, as DuckDB uses).

``ids_proven`` returns False as soon as it finds anything it cannot prove (a null, a candidate
blank id, an id not above the one before, an id that is not valid UTF-8, overlapping files, an id column of
another type): the
exact check (``parquet._check_ids``'s DuckDB statement) then decides and names the row. The pass
holds one batch of ids per file at a time; files are read by ``PROOF_THREADS`` threads (pyarrow and
numpy release the GIL).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from airflow_provider_vllm.core.formats.base import BLANK_ID_PATTERN
from airflow_provider_vllm.core.storage import Storage

PROOF_THREADS = 2
BATCH_ROWS = 1 << 20


class _Unproven(Exception):
    """Something the ordered-ids proof cannot vouch for: the exact check decides."""


def ids_proven(root: Storage, names: list[str], idc: str, threads: int = PROOF_THREADS) -> bool:
    """True when every id of every file is non-null, non-blank and distinct, proven by order; False: not proven."""
    stop = threading.Event()

    def one(name: str) -> tuple[Any, Any] | None:
        try:
            return _file_range(root, name, idc, stop)
        except _Unproven:
            stop.set()
            raise

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
            ranges = [r for r in pool.map(one, names) if r is not None]
    except _Unproven:
        return False
    ranges.sort(key=lambda r: r[0])
    return all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))


def _file_range(root: Storage, name: str, idc: str, stop: threading.Event) -> tuple[Any, Any] | None:
    """(first id, last id) of a file whose ids strictly increase (None: no rows); _Unproven otherwise."""
    first = last = None
    with root.open(name) as f:
        pf = pq.ParquetFile(f)
        kind = _kind(pf.schema_arrow.field(idc).type)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[idc], use_threads=False):
            if stop.is_set():
                raise _Unproven
            col = batch.column(0)
            if len(col) == 0:
                continue
            if col.null_count:
                raise _Unproven
            lo, hi = _check_batch(col, kind)
            if last is not None and not last < lo:
                raise _Unproven
            first = lo if first is None else first
            last = hi
    return None if first is None else (first, last)


def _kind(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str"
    raise _Unproven  # the scan refuses other types before; never vouch for one here


def _check_batch(col: pa.Array, kind: str) -> tuple[Any, Any]:
    """(first, last) of a batch whose values strictly increase and hold no blank id; _Unproven otherwise."""
    if kind == "int":
        v = col.to_numpy(zero_copy_only=False)
        if len(v) > 1 and not bool(np.all(v[1:] > v[:-1])):
            raise _Unproven
        return int(v[0]), int(v[-1])
    if len(col) > 1 and not pc.all(pc.less(col[:-1], col[1:])).as_py():
        raise _Unproven
    try:  # Parquet's reader does not check that strings are UTF-8; the exact check names the file (DatasetError)
        col.validate(full=True)
    except pa.ArrowInvalid:
        raise _Unproven from None
    _check_not_blank(col)
    return col[0].as_py().encode(), col[-1].as_py().encode()


def _check_not_blank(col: pa.Array) -> None:
    """_Unproven when an id may be blank: empty, or its first byte is not printable ASCII and the pattern matches."""
    off_type = np.int64 if pa.types.is_large_string(col.type) else np.int32
    bufs = col.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_type)[col.offset : col.offset + len(col) + 1]
    if bool(np.any(offsets[1:] == offsets[:-1])):
        raise _Unproven  # an empty id
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    head = data[offsets[:-1]]
    maybe = (head < 0x21) | (head > 0x7E)
    if bool(np.any(maybe)):
        cand = col.filter(pa.array(maybe))
        if pc.any(pc.match_substring_regex(cand, BLANK_ID_PATTERN)).as_py():
            raise _Unproven
