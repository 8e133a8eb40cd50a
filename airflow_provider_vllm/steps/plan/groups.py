"""Per-row token estimates by groups of consecutive rows, for cutting by tokens in bounded memory.

Sizing by tokens (``sharding.target_tokens``) and splitting long rows off (``long_row_tokens``) weigh
rows one by one. Instead of one array over every row (8 bytes a row, and more for the cut's index
arrays), ``GroupTokens`` reads the rows group by group (Parquet row groups) once and keeps, per group
and per bucket (all rows; short rows; long rows), the row count, the token sum and the first and last
row. A cut then needs one group's per-row estimates only where a shard boundary falls inside it: the
group is read again (``RowGroups.chars``), a few at a time (``CACHED_GROUPS``). The cuts are the ones
a per-row array gives (``tests/unit/steps/plan/test_groups.py`` compares them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from airflow_provider_vllm.core.formats.base import RowGroups
from airflow_provider_vllm.core.plan import estimate_tokens

CACHED_GROUPS = 4  # groups' per-row estimates kept for the cut's boundary lookups
SCAN_THREADS = 2  # files read at once in the first pass (pyarrow releases the GIL)
ALL, SHORT, LONG = "all", "short", "long"


class _Bucket:
    """One bucket's rows (all, short or long) through the per-group aggregates."""

    def __init__(self, owner: GroupTokens, name: str, cnt: np.ndarray, wsum: np.ndarray, first, last) -> None:
        self.owner, self.name = owner, name
        self.cnt, self.first, self.last = cnt, first, last
        self.ccum = np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64)
        self.wcum = np.concatenate([[0], np.cumsum(wsum)]).astype(np.int64)
        self.rows, self.total = int(self.ccum[-1]), int(self.wcum[-1])

    def _local(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(global rows, tokens) of this bucket's rows in group ``g``."""
        tok = self.owner.tokens(g)
        start = int(self.owner.starts[g])
        if self.name == ALL:
            return np.arange(start, start + len(tok), dtype=np.int64), tok
        mask = tok > self.owner.long_row_tokens if self.name == LONG else tok <= self.owner.long_row_tokens
        return start + np.nonzero(mask)[0].astype(np.int64), tok[mask]

    def _group(self, p: int) -> int:
        """The group holding bucket position ``p`` (0 <= p < rows)."""
        return int(np.searchsorted(self.ccum, p, side="right")) - 1

    def row_at(self, p: int) -> int:
        """The global row of bucket position ``p``."""
        g = self._group(p)
        if p == self.ccum[g]:
            return int(self.first[g])
        if p == self.ccum[g + 1] - 1:
            return int(self.last[g])
        return int(self._local(g)[0][p - int(self.ccum[g])])

    def prefix(self, p: int) -> int:
        """Tokens of bucket positions [0, p)."""
        if p >= self.rows:
            return self.total
        g = self._group(p)
        k = p - int(self.ccum[g])
        return int(self.wcum[g]) + (int(self._local(g)[1][:k].sum()) if k else 0)

    def token_cuts(self, k: int) -> np.ndarray:
        """``searchsorted(cumsum(w), total * j / k, 'left') + 1`` for j in 1..k-1, as over a per-row array."""
        out = []
        for thr in np.float64(self.total) * np.arange(1, k) / k:
            g = int(np.searchsorted(self.wcum[1:], thr, side="left"))
            if g >= len(self.cnt):
                pos = self.rows
            elif self.cnt[g] == 0:
                pos = int(self.ccum[g])
            else:
                cum = int(self.wcum[g]) + np.cumsum(self._local(g)[1], dtype=np.int64)
                pos = int(self.ccum[g]) + int(np.searchsorted(cum, thr, side="left"))
            out.append(pos + 1)
        return np.asarray(out, np.int64)

    def file_ranges(self, a: int, b: int) -> Iterator[tuple[int, int, int]]:
        """(file, first global row, last global row + 1) of the bucket positions [a, b), per file in order."""
        fc = self.owner.file_ccum(self)
        first = int(np.searchsorted(fc, a, side="right")) - 1
        for f in range(max(0, first), len(fc) - 1):
            lo, hi = max(a, int(fc[f])), min(b, int(fc[f + 1]))
            if lo >= b:
                break
            if hi > lo:
                yield f, self.row_at(lo), self.row_at(hi - 1) + 1


class GroupTokens:
    """Per-row token estimates of ``RowGroups``, read once; totals per group and per bucket, rows on demand."""

    def __init__(
        self, groups: RowGroups, chars_per_token: float, long_row_tokens: int | None, threads: int = SCAN_THREADS
    ) -> None:
        self.groups, self.chars_per_token, self.long_row_tokens = groups, chars_per_token, long_row_tokens
        self.counts = np.asarray(groups.counts, np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.file_of = np.zeros(len(self.counts), np.int64)
        for f, gs in enumerate(groups.files):
            self.file_of[gs] = f
        ng = len(self.counts)
        # per bucket (all, short, long): count, token sum, first and last global row, per group
        self._agg = {
            b: (np.zeros(ng, np.int64), np.zeros(ng, np.int64), np.zeros(ng, np.int64), np.zeros(ng, np.int64))
            for b in (ALL, SHORT, LONG)
        }
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._file_ccum: dict[str, np.ndarray] = {}
        self._buckets: dict[str, _Bucket] = {}

        def scan_file(f: int) -> None:
            for g, chars in groups.chars_of_file(f):
                self._record(g, self._estimate(g, chars))

        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(groups.files)))) as pool:
            list(pool.map(scan_file, range(len(groups.files))))
        self.total = int(self._agg[ALL][1].sum())

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _estimate(self, g: int, chars: np.ndarray) -> np.ndarray:
        if len(chars) != self.counts[g]:
            raise ValueError(f"row group {g}: {len(chars)} rows read, {self.counts[g]} in the footer")
        return estimate_tokens(chars, self.chars_per_token) if len(chars) else np.zeros(0, np.int64)

    def _record(self, g: int, tok: np.ndarray) -> None:
        start = int(self.starts[g])
        masks: dict[str, np.ndarray | None] = {ALL: None}
        if self.long_row_tokens is not None:
            long = tok > self.long_row_tokens
            masks.update({SHORT: ~long, LONG: long})
        for b, m in masks.items():
            cnt, wsum, first, last = self._agg[b]
            idx = np.nonzero(m)[0] if m is not None else None
            n = len(tok) if idx is None else len(idx)
            cnt[g] = n
            wsum[g] = int(tok.sum()) if idx is None else int(tok[idx].sum())
            if n:
                first[g] = start + (0 if idx is None else int(idx[0]))
                last[g] = start + (n - 1 if idx is None else int(idx[-1]))

    def tokens(self, g: int) -> np.ndarray:
        """Per-row estimates of group ``g`` (read again; the last few kept)."""
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        tok = self._estimate(g, np.asarray(self.groups.chars(g), np.int64))
        self._cache[g] = tok
        while len(self._cache) > CACHED_GROUPS:
            self._cache.popitem(last=False)
        return tok

    def bucket(self, name: str) -> _Bucket:
        if name != ALL and self.long_row_tokens is None:
            raise ValueError("short / long buckets need long_row_tokens")
        if name not in self._buckets:
            self._buckets[name] = _Bucket(self, name, *self._agg[name])
        return self._buckets[name]

    def file_ccum(self, bucket: _Bucket) -> np.ndarray:
        """Bucket positions where each file's rows begin (and the end)."""
        if bucket.name not in self._file_ccum:
            per_file = np.bincount(self.file_of, weights=bucket.cnt, minlength=len(self.groups.files))
            self._file_ccum[bucket.name] = np.concatenate([[0], np.cumsum(per_file.astype(np.int64))])
        return self._file_ccum[bucket.name]

    def range_sum(self, a: int, b: int) -> int:
        """Tokens of the global rows [a, b)."""
        every = self.bucket(ALL)
        return every.prefix(b) - every.prefix(a)
