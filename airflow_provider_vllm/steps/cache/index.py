"""The cache entries' keys in memory, for the plan's lookups: sorted, each key once (the newest answer wins).

A row's key is the 32-byte sha256 of its key message (``key.key_sql``). Entries of this version store it as a
32-byte binary column, rows sorted by key; entries of the previous version as its 64 lower-case hex characters,
rows in source-id order. Both are read (``key_matrix``); keys that are not one sorted run are sorted here.

``KeyIndex.lookup`` finds each query key's entry row by the keys' first 8 bytes (a big-endian uint64, binary
search) and then compares all 32 bytes: a row is a hit only when its key equals an entry's key byte for byte.
Memory: 48 bytes per entry row (the key, its first word, its row number). No Airflow.
"""

from __future__ import annotations

import binascii
import logging
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core import duck

log = logging.getLogger(__name__)

KEY_BYTES = 32


def key_matrix(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The keys as an (n, 32) uint8 array: 32-byte binary values, or the previous format's 64 hex characters.
    ValueError for a NULL or any other value (another length, a character that is not hex).
    """
    arr = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    if str(arr.type) in ("string_view", "binary_view"):  # what a DuckDB set to produce views hands over
        arr = arr.cast(pa.large_string() if str(arr.type) == "string_view" else pa.large_binary())
    n = len(arr)
    if arr.null_count:
        raise ValueError(f"{arr.null_count} cache key(s) are NULL")
    t = arr.type
    if pa.types.is_fixed_size_binary(t):
        if t.byte_width != KEY_BYTES:
            raise ValueError(f"cache keys are {t.byte_width} bytes, not {KEY_BYTES}")
        data = np.frombuffer(arr.buffers()[1], np.uint8)
        return data[arr.offset * KEY_BYTES : (arr.offset + n) * KEY_BYTES].reshape(n, KEY_BYTES)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return _fixed(arr, KEY_BYTES, "bytes")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        # decoded from Arrow's buffer in place: a copy of the text first cost about as much as the decoding
        chars = np.ascontiguousarray(_fixed(arr, 2 * KEY_BYTES, "characters")).reshape(-1).data
        try:
            return np.frombuffer(binascii.a2b_hex(chars), np.uint8).reshape(n, KEY_BYTES)
        except binascii.Error as e:
            raise ValueError(f"cache keys in text are not hex: {e}") from None
    raise ValueError(f"cache keys of type {t}, neither binary nor hex text")


def _fixed(arr: pa.Array, width: int, unit: str) -> np.ndarray:
    """An (n, width) view of a binary or string array whose every value is ``width`` bytes long."""
    n = len(arr)
    if n == 0:
        return np.zeros((0, width), np.uint8)
    wide = pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
    offsets = np.frombuffer(arr.buffers()[1], np.int64 if wide else np.int32)[arr.offset : arr.offset + n + 1]
    start = int(offsets[0])
    if not np.array_equal(offsets, start + width * np.arange(n + 1)):
        raise ValueError(f"cache keys are not all {width} {unit} long")
    return np.frombuffer(arr.buffers()[2], np.uint8)[start : start + n * width].reshape(n, width)


def first_words(keys: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each key as a uint64, big-endian: sorting them sorts the keys by their first bytes."""
    return np.ascontiguousarray(keys).view(">u8")[:, 0].astype(np.uint64)


class KeyIndex:
    """The live keys of the entries read, each once, for ``lookup``.

    ``rows``: the entry row (over the entry files in order, counted from 0) that answers each live key, in the
    order of ``first``; ``None`` when that is simply ``0..n-1`` (one entry, sorted, each key once).
    """

    def __init__(self, keys: np.ndarray, first: np.ndarray, rows: np.ndarray | None, collisions: bool) -> None:
        self.words = keys.view(np.uint64)  # (n, 4): for equality only
        self.first, self.rows, self.collisions = first, rows, collisions

    def __len__(self) -> int:
        return len(self.first)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The entry row of each key of ``keys`` ((m, 32) uint8), or -1 where no entry holds it."""
        out = np.full(len(keys), -1, np.int64)
        if not len(self.first) or not len(keys):
            return out
        q = np.ascontiguousarray(keys)
        qf = first_words(q)
        # searched in sorted order: each search starts where the last ended (random order is memory-bound)
        order = np.argsort(qf)
        qf, qw = qf[order], np.take(q.view(np.uint64), order, axis=0)
        pos = np.minimum(np.searchsorted(self.first, qf), len(self.first) - 1)
        rows = pos if self.rows is None else self.rows[pos]
        same = self.first[pos] == qf
        hit = same & (np.take(self.words, rows, axis=0) == qw).all(axis=1)
        out[order[hit]] = rows[hit]
        if self.collisions:  # live keys that share their first 8 bytes: the query may be any of them
            for i in np.flatnonzero(same & ~hit):
                p = int(pos[i]) + 1
                while p < len(self.first) and self.first[p] == qf[i]:
                    r = p if self.rows is None else int(self.rows[p])
                    if (self.words[r] == qw[i]).all():
                        out[order[i]] = r
                        break
                    p += 1
        return out


# (file index, row in that file) of entry rows -> their (computed_at, source_id), for rows that share a key
Newest = Callable[[np.ndarray, np.ndarray], tuple[list[str | None], list[str | None]]]


def build_index(keys: Sequence[np.ndarray], newest: Newest) -> KeyIndex:
    """The index over the entries' keys (one (n_i, 32) array per entry file, in order).

    A key held by several rows (entries committed by runs that computed it at the same time, or an entry of
    another version) keeps the row whose answer was computed last: ``newest(files, rows)`` gives those rows'
    ``computed_at`` and ``source_id`` (inside the sealed bytes); the latest ``computed_at`` wins, then the
    smallest ``source_id`` (NULLs lose).
    """
    sizes = [len(k) for k in keys]
    allkeys = np.ascontiguousarray(np.concatenate(keys)) if len(keys) != 1 else np.ascontiguousarray(keys[0])
    first = first_words(allkeys)
    rows: np.ndarray | None = None
    if len(first) > 1 and not bool((first[1:] >= first[:-1]).all()):
        rows = np.argsort(first, kind="stable")  # runs that are each sorted merge fast
        first = first[rows]
    tied = np.flatnonzero(first[1:] == first[:-1]) if len(first) > 1 else np.zeros(0, np.int64)
    if len(tied):
        pos = np.union1d(tied, tied + 1)  # positions (in ``first``) of rows that share a first word with another
        at = pos if rows is None else rows[pos]
        w = allkeys.view(np.uint64)[at]
        order = np.lexsort(w.T[::-1])
        same = (w[order][1:] == w[order][:-1]).all(axis=1)
        if same.any():
            group = np.concatenate([[0], np.cumsum(~same)])
            in_dup = np.zeros(len(order), bool)
            in_dup[1:] |= same
            in_dup[:-1] |= same
            cand = order[in_dup]  # indices into pos of rows whose whole key another row holds too
            starts = np.concatenate([[0], np.cumsum(sizes)])
            g_rows = at[cand]
            file_of = np.searchsorted(starts, g_rows, side="right") - 1
            computed, source = newest(file_of, g_rows - starts[file_of])
            # latest computed_at first, then the smallest source_id; NULLs last
            ca_rank, sid_rank = _ranks(computed, null_first=True), _ranks(source, null_first=False)
            g = group[in_dup]
            rank = np.lexsort((sid_rank, -ca_rank, g))
            winner = np.ones(len(rank), bool)
            winner[1:] = g[rank][1:] != g[rank][:-1]
            drop = np.sort(pos[cand[rank[~winner]]])
            if rows is None:
                rows = np.arange(len(first), dtype=np.int64)
            keep = np.ones(len(first), bool)
            keep[drop] = False
            first, rows = first[keep], rows[keep]
            log.info("cache: %d rows hold a key another entry row holds too; the newest answers kept", len(drop))
    collisions = len(first) > 1 and bool((first[1:] == first[:-1]).any())
    return KeyIndex(allkeys, first, rows, collisions)


def _ranks(values: list[str | None], null_first: bool) -> np.ndarray:
    """Each value's rank among ``values`` in text order; NULL below (``null_first``) or above every text."""
    texts = sorted({v for v in values if v is not None})
    rank = {v: i + 1 for i, v in enumerate(texts)}
    null = 0 if null_first else len(texts) + 1
    return np.array([rank[v] if v is not None else null for v in values], np.int64)


def read_keys(path: str) -> np.ndarray:
    """The ``key`` column of a local entry part as an (n, 32) array (ValueError: not keys of either format)."""
    con = duck.connect()
    try:  # DuckDB reads a binary column several times faster than pyarrow here
        chunks = con.sql(f"SELECT key FROM read_parquet({duck.local_list([path])})").to_arrow_table().column(0).chunks
    finally:
        con.close()
    return np.concatenate([key_matrix(c) for c in chunks]) if chunks else np.zeros((0, KEY_BYTES), np.uint8)


def entry_meta(paths: Sequence[str]) -> Newest:
    """``newest`` for ``build_index`` over these local entry parts (a part without ``computed_at``: NULL)."""

    def newest(files: np.ndarray, rows: np.ndarray) -> tuple[list[str | None], list[str | None]]:
        computed: list[str | None] = [None] * len(rows)
        source: list[str | None] = [None] * len(rows)
        for f in np.unique(files):
            at = np.flatnonzero(files == f)
            pf = pq.ParquetFile(paths[int(f)])
            cols = [c for c in ("computed_at", "source_id") if c in pf.schema_arrow.names]
            t = pf.read(columns=cols).take(pa.array(rows[at]))
            ca = t.column("computed_at").to_pylist() if "computed_at" in cols else [None] * len(at)
            sid = t.column("source_id").to_pylist() if "source_id" in cols else [None] * len(at)
            for j, i in enumerate(at):
                computed[i], source[i] = ca[j], sid[j]
        return computed, source

    return newest
