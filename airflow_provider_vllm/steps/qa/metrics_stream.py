"""QA metrics over merged outputs too large to hold: the numbers of ``metrics.compute_metrics``,
from DuckDB aggregates over views of the files (``tally``), never the rows themselves.

Two parallel scans of ``r`` give every count: one aggregate with ``FILTER`` clauses for the
row flags (invalid, truncated, expects text, empty) and one ``GROUP BY GROUPING SETS`` for the
value counts (label x finish reason x model x revision x shard, token counts); token sums and integer
statistics come from the token value
counts, so they are exact and equal the in-memory ones. Empty outputs are decided as Arrow's
``utf8_is_space`` decides them (``SPACE_CLASS``). Float statistics (latency) fetch only the
finite values as float32 (4 bytes a row, the column's own type), batch by batch into one
buffer, and take the same order statistics and histogram bins; the mean is summed per batch,
so it may differ from the in-memory mean in the last bits. Past ``KEEP_LATENCIES`` rows (512 MiB of
float32) the latencies are not kept: the same exact statistics come from passes over the column
(``Radix``: the quantiles' values found 16 bits of their order-preserving keys a pass, then the
histogram's bins), so the latencies no longer cost QA 4 bytes a row.
"""

from __future__ import annotations

import math
import mmap
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from airflow_provider_vllm.steps.qa.metrics import (
    _MAX_DISTINCT_EXACT,
    _hist_plan,
    _histogram,
    assemble_metrics,
    int_stats_from_counts,
    models_list,
    sort_counts,
)

# The code points Arrow's utf8_is_space counts as space (tests check it against Arrow over all code points).
SPACE_CLASS = (
    r"[\x{9}-\x{d}\x{1c}-\x{20}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}"
    r"\x{205f}\x{3000}]"
)
# the rows up to which the latencies are kept in memory (512 MiB as float32); past it, exact statistics in passes
KEEP_LATENCIES = 1 << 27
_FINITE_LATENCIES = "SELECT latency_ms FROM r WHERE latency_ms IS NOT NULL AND isfinite(latency_ms)"
_QUANTILES = (0.5, 0.9, 0.99)  # the p50, p90 and p99 of a float column's statistics
_COUNTED = ("finish_reason", "label", "shard_id", "prompt_tokens", "completion_tokens")
_KEYS = ("label", "finish_reason", "model", "model_revision", "shard_id")  # few distinct values: one grouping set
# output null, '' or only space; the first branch (an ASCII letter, digit or sign first) decides most rows cheaply
_BLANK = (
    f"CASE WHEN output >= '!' AND output < chr(127) THEN false WHEN output IS NULL OR output = '' THEN true "
    f"ELSE regexp_full_match(output, '{SPACE_CLASS}+') END"
)


class ResultTally:
    """Everything ``compute_metrics`` needs, as counts from DuckDB (memory: distinct values + latencies)."""

    def __init__(self, capacity: int = 0) -> None:
        """``capacity``: the expected result rows (footers), so the latency buffer is allocated once."""
        self.ok = self.n_err = self.invalid = self.truncated = self.length_finish = 0
        self.text_rows = self.empty = self.label_nulls = self.valid_nulls = 0
        self.prompt_total = self.completion_total = 0
        self.latency_sum = 0.0
        self.counts: dict[str, Counter] = {k: Counter() for k in (*_COUNTED, "error_code", "pairs")}
        # finite latencies (float64 once a batch needs it); past KEEP_LATENCIES rows none are kept: the statistics
        # come from passes over the column instead (``_latency_in_passes``)
        self._passes = capacity > KEEP_LATENCIES
        self._lat = _fresh(0 if self._passes else capacity, np.float32)
        self._n_lat = 0
        self._radix: Radix | None = None
        self._passed: dict[str, Any] | None = None

    def tally(
        self,
        con,
        batch_rows: int = 1 << 20,
        vectors: bool | None = None,
        also: tuple[str, Callable[[np.ndarray], None]] | None = None,
    ) -> None:
        """Count the rows of the DuckDB relations ``r`` (results) and ``e`` (errors) of ``con``.

        ``vectors``: whether rows may carry an embedding or scores; False (a chat or generate job, whose
        rows never do) skips the two scans that find out. ``also``: (a float column of ``r``, a function)
        that the latency fetch passes that column of every row, batch by batch (nulls as NaN): one scan
        for both (``confidence.ConfidenceTally``)."""
        self._count_results(con, vectors)
        if also is not None and not _any_value(con, also[0]):  # a run without confidence: the latencies alone
            also = None
        for code, n in con.execute("SELECT error_code, count(*) FROM e GROUP BY ALL").fetchall():
            self.counts["error_code"][code] += n
            self.n_err += n
        self._fetch_latency(con, batch_rows, also)
        if self._passes:
            self._passed = self._latency_in_passes(con, batch_rows)

    def _count_results(self, con, vectors: bool | None = None) -> None:
        # Rows with vectors: two scans that DuckDB answers from the row groups' null counts where all are
        # null (the usual text run), so that the flags below need not decode the list columns.
        if vectors is None:
            vectors = bool(
                sum(
                    con.execute(f"SELECT count(*) FROM r WHERE {c} IS NOT NULL").fetchall()[0][0]
                    for c in ("embedding", "scores")
                )
            )
        text = "(embedding IS NULL AND scores IS NULL)" if vectors else "true"
        out = "CAST(output AS VARCHAR)"
        (
            (
                self.ok,
                self.valid_nulls,
                self.invalid,
                self.truncated,
                self.text_rows,
                self.empty,
            ),
        ) = con.execute(
            f"SELECT count(*), count(*) FILTER (WHERE valid IS NULL), count(*) FILTER (WHERE NOT valid), "
            f"count(*) FILTER (WHERE truncated), count(*) FILTER (WHERE {text}), "
            f"count(*) FILTER (WHERE {text} AND {_BLANK.replace('output', out)}) FROM r"
        ).fetchall()
        # The answers' confidence is not a grouping set here (that made this query twice as long): it comes
        # with the latencies (``also``), fetched only when some row has one (``_any_value``).
        cols = [*_KEYS, "prompt_tokens", "completion_tokens"]
        rows = con.execute(
            f"SELECT grouping({', '.join(cols)}), {', '.join(cols)}, count(*) FROM r "
            f"GROUP BY GROUPING SETS (({', '.join(_KEYS)}), (prompt_tokens), (completion_tokens))"
        ).fetchall()
        for g, *values, n in rows:
            v = dict(zip(cols, values))
            if g & 1 == 0:  # grouped by completion_tokens (grouping(): bit set = not grouped by that column)
                self.counts["completion_tokens"][v["completion_tokens"]] += n
            elif g & 2 == 0:
                self.counts["prompt_tokens"][v["prompt_tokens"]] += n
            else:
                for c in ("label", "finish_reason", "shard_id"):
                    self.counts[c][v[c]] += n
                self.counts["pairs"][(v["model"], v["model_revision"])] += n
        self.length_finish = self.counts["finish_reason"].get("length", 0)
        self.label_nulls = self.counts["label"].get(None, 0)
        for name, total in (("prompt_tokens", "prompt_total"), ("completion_tokens", "completion_total")):
            setattr(self, total, sum(int(v) * n for v, n in self.counts[name].items() if v is not None))

    def _fetch_latency(self, con, batch_rows: int, also: tuple[str, Callable[[np.ndarray], None]] | None) -> None:
        if also is None:
            sql = _FINITE_LATENCIES
        else:  # every row, for the other column; the latencies are filtered here as the WHERE above does
            sql = f'SELECT latency_ms, "{also[0]}" FROM r'
        for batch in con.sql(sql).to_arrow_reader(batch_rows):
            if also is not None and batch.num_rows:
                also[1](_floats(batch.column(1)))
            x = _latencies(batch.column(0))
            if x is None:  # no latency at all (the WHERE above: no rows)
                continue
            if also is not None:
                finite = np.isfinite(x)  # null (NaN here), NaN and infinities are dropped, as the WHERE drops them
                if not finite.all():
                    x = x[finite]
            if not len(x):
                continue
            self.latency_sum += float(x.sum(dtype=np.float64))
            if self._passes:
                if self._radix is None:
                    self._radix = Radix(x.dtype)
                self._radix.add(x)
            else:
                self._keep_latency(x, exact32=x.dtype == np.float32)

    def _latency_in_passes(self, con, batch_rows: int) -> dict[str, Any] | None:
        """``_float_stats`` of the finite latencies without keeping them: the fetch above counted them and the top
        16 bits of their keys; each further pass over the column takes the quantiles' next 16 bits (one pass for
        float32, three for float64), then one pass counts the histogram's bins."""
        radix = self._radix
        if radix is None or not radix.n:
            return None

        def scan():
            for batch in con.sql(_FINITE_LATENCIES).to_arrow_reader(batch_rows):
                x = _latencies(batch.column(0))
                if x is not None and len(x):
                    yield x

        n = radix.n
        at = radix.select(sorted({r for q in _QUANTILES for r in _ranks(q, n)}), scan)

        def bins(lo: float, w: float, nb: int) -> np.ndarray:
            counted = _bin_counts(scan(), lo, w, nb)
            if int(counted.sum()) != n:
                raise ValueError(f"QA: the histogram's pass over the latencies saw {int(counted.sum())} of {n} values")
            return counted

        return _assemble_float_stats(n, radix.mn, radix.mx, self.latency_sum, at, bins)

    def _keep_latency(self, x: np.ndarray, exact32: bool) -> None:
        need = self._n_lat + len(x)
        dtype = self._lat.dtype if exact32 else np.dtype(np.float64)
        if need > len(self._lat) or dtype != self._lat.dtype:
            grown = _fresh(max(need, 2 * len(self._lat)) if need > len(self._lat) else len(self._lat), dtype)
            grown[: self._n_lat] = self._lat[: self._n_lat]
            self._lat = grown
        self._lat[self._n_lat : need] = x
        self._n_lat = need

    def value_counts(self, name: str) -> dict[Any, int]:
        """As ``metrics.value_counts`` of the whole column."""
        return sort_counts(self.counts[name].items())

    def metrics(self, *, labels, structured, notes) -> dict[str, Any]:
        if self.ok + self.n_err == 0:
            notes.append("no rows in results or errors: all rates are 0 and nothing was sampled")
        labelled = self.ok - self.label_nulls
        pairs = self.counts["pairs"]
        by_model: Counter = Counter()
        by_rev: Counter = Counter()
        for (m, r), n in pairs.items():
            by_model[m] += n
            by_rev[r] += n
        return assemble_metrics(
            ok=self.ok,
            n_err=self.n_err,
            invalid=self.invalid,
            truncated=self.truncated,
            length_finish=self.length_finish,
            text_rows=self.text_rows,
            empty=self.empty,
            labelled=labelled,
            no_valid_flag=self.ok > 0 and self.valid_nulls == self.ok,
            code_counts=self.value_counts("error_code"),
            finish_counts=self.value_counts("finish_reason"),
            label_counts=self.value_counts("label") if labelled else {},
            prompt_total=self.prompt_total,
            completion_total=self.completion_total,
            prompt_stats=self._int_stats("prompt_tokens"),
            completion_stats=self._int_stats("completion_tokens"),
            latency_stats=self._latency_stats(),
            models=models_list(
                sort_counts(by_model.items()),
                sort_counts(by_rev.items()),
                self.ok,
                lambda: [(m, r, n) for (m, r), n in pairs.items()],
            ),
            labels=labels,
            structured=structured,
            notes=notes,
        )

    def _latency_stats(self) -> dict[str, Any] | None:
        if self._passes:
            return self._passed
        x, self._lat = self._lat[: self._n_lat], np.empty(0, np.float32)  # partitioned in place
        return _float_stats(x, self.latency_sum)

    def _int_stats(self, name: str) -> dict[str, Any] | None:
        vc = sorted((v, n) for v, n in self.counts[name].items() if v is not None)
        if not vc:
            return None
        if len(vc) > _MAX_DISTINCT_EXACT:  # as in memory: float stats of the values
            values = np.repeat(np.array([v for v, _ in vc], np.float64), [n for _, n in vc])
            return _float_stats(values, float(pa.compute.sum(pa.array(values)).as_py()), integer=True)
        return int_stats_from_counts([v for v, _ in vc], [n for _, n in vc])


def _fresh(n: int, dtype) -> np.ndarray:
    """An uninitialised array of ``n`` values in an anonymous mapping of its own. numpy asks the kernel for huge
    pages for arrays of 4 MiB or more (madvise), and where memory is fragmented the kernel then compacts memory
    on the first touch: filling 400 MB took 0.7-1.3 CPU-s that way, 0.2-0.35 in plain pages."""
    dtype = np.dtype(dtype)
    if n * dtype.itemsize < 1 << 22:
        return np.empty(n, dtype)
    return np.frombuffer(mmap.mmap(-1, n * dtype.itemsize), dtype, n)


def _any_value(con, column: str) -> bool:
    """Whether some row of ``r`` has a value in ``column`` (the scan stops at the first)."""
    return bool(
        con.execute(f'SELECT count(*) FROM (SELECT 1 FROM r WHERE "{column}" IS NOT NULL LIMIT 1)').fetchall()[0][0]
    )


def _floats(col: pa.Array) -> np.ndarray:
    """A numeric column as numpy, nulls as NaN (a column of only nulls: NaN of float64)."""
    if pa.types.is_null(col.type):
        return np.full(len(col), np.nan)
    return col.to_numpy(zero_copy_only=False)


def _float_stats(x: np.ndarray, total: float, integer: bool = False) -> dict[str, Any] | None:
    """``metrics._float_stats`` of the finite values ``x`` (maybe reordered); ``total``: their sum."""
    if len(x) == 0:
        return None
    n = len(x)
    at = _order_stats(x, {q: _ranks(q, n) for q in _QUANTILES})
    bins = partial(_bin_counts, (x,))
    return _assemble_float_stats(n, float(x.min()), float(x.max()), total, at, bins, integer)


def _assemble_float_stats(
    n: int,
    mn: float,
    mx: float,
    total: float,
    at: dict[int, float],
    bins: Callable[[float, float, int], np.ndarray],
    integer: bool = False,
) -> dict[str, Any]:
    """The statistics of ``n`` finite values from their min, max, sum, the values at the quantiles' ranks
    (``_ranks``) and ``bins(lo, width, bins)``: the values per bin, the overflow last (``_bin_counts``)."""

    def quantile(q: float) -> float:  # Arrow's 'linear': fraction * higher + (1 - fraction) * lower
        pos = q * (n - 1)
        lo = math.floor(pos)
        a, b = at[lo], at[min(lo + 1, n - 1)]
        f = pos - lo
        return f * b + (1 - f) * a

    p50, p90, p99 = (quantile(q) for q in _QUANTILES)
    stats: dict[str, Any] = {
        "count": n,
        "min": int(mn) if integer else mn,
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": int(mx) if integer else mx,
        "mean": total / n,
    }
    lo, w, nb, _ = _hist_plan(mn, mx, p99, integer)
    stats["histogram"] = _histogram(lo, w, nb, enumerate(bins(lo, w, nb).tolist()), integer)
    return stats


def _bin_counts(arrays: Iterable[np.ndarray], lo: float, w: float, nb: int) -> np.ndarray:
    """The values of ``arrays`` (all >= lo) per bin floor((x - lo) / w) in float64, as ``metrics.bin_counts``;
    ``nb`` bins and the overflow last."""
    bins = np.zeros(nb + 1, np.int64)
    t = np.empty(_CHUNK, np.float64)  # one buffer that stays in cache (no fresh temporaries per step)
    for x in arrays:
        for i in range(0, len(x), _CHUNK):
            k = t[: min(_CHUNK, len(x) - i)]
            np.subtract(x[i : i + _CHUNK], lo, out=k, dtype=np.float64)  # x in float64, as astype(float64) - lo
            np.divide(k, w, out=k)
            np.floor(k, out=k)
            np.minimum(k, nb, out=k)
            bins += np.bincount(k.astype(np.int64), minlength=nb + 1)
    return bins


def _latencies(col: pa.Array) -> np.ndarray | None:
    """A batch of the latency column as numpy, float32 as it is and any other type as float64 (nulls as NaN); None
    for a column of only nulls (a query that found no rows)."""
    if pa.types.is_null(col.type):
        return None
    exact32 = pa.types.is_float32(col.type)
    return col.to_numpy(zero_copy_only=False).astype(np.float32 if exact32 else np.float64, copy=False)


_DIGIT = 16  # bits of the keys taken per pass
_DIGITS = 1 << _DIGIT


class Radix:
    """Exact order statistics of finite float32 or float64 values streamed in passes, in bounded memory.

    Each value has an unsigned key of its width whose order is the values' (the sign bit flipped for
    positive values, every bit for negative ones; -0.0 counts as 0.0). ``add`` counts the values of the
    first pass by the top 16 bits of their key; ``select`` then finds the bits of each wanted rank's key 16 at a
    time, one pass over the values per 16 bits (1 more pass for float32, 3 for float64), keeping 65,536 counts
    per rank."""

    def __init__(self, dtype) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"Radix: float32 or float64 values, not {self.dtype}")
        self.bits = self.dtype.itemsize * 8
        self.ukey = np.dtype(np.uint32 if self.bits == 32 else np.uint64)
        self.n = 0
        self.mn, self.mx = math.inf, -math.inf
        self.top = np.zeros(_DIGITS, np.int64)

    def keys(self, x: np.ndarray) -> np.ndarray:
        if x.dtype != self.dtype:
            raise ValueError(f"Radix: a batch of {x.dtype} among {self.dtype} values")
        b = np.add(x, 0, dtype=self.dtype).view(self.ukey)  # + 0: -0.0 becomes 0.0
        sign = self.ukey.type(1 << (self.bits - 1))
        return np.where(b & sign, ~b, b | sign)

    def value(self, key: int) -> float:
        sign = 1 << (self.bits - 1)
        b = key ^ sign if key & sign else ~key & ((1 << self.bits) - 1)
        return float(np.array([b], self.ukey).view(self.dtype)[0])

    def add(self, x: np.ndarray) -> None:
        """Count finite values of the first pass."""
        if not len(x):
            return
        self.n += len(x)
        self.mn, self.mx = min(self.mn, float(x.min())), max(self.mx, float(x.max()))
        top = (self.keys(x) >> self.ukey.type(self.bits - _DIGIT)).astype(np.intp)
        self.top += np.bincount(top, minlength=_DIGITS)

    def select(self, ranks: list[int], scan: Callable[[], Iterator[np.ndarray]]) -> dict[int, float]:
        """The values at the 0-based ``ranks`` of the sorted values; ``scan()`` yields the same values as the
        first pass (any order, any batches) once per call."""
        if any(not 0 <= r < self.n for r in ranks):
            raise ValueError(f"Radix: ranks {ranks} outside 0..{self.n - 1}")
        found = {r: _digit(self.top, r) for r in ranks}  # rank -> (key prefix, rank among the prefix's values)
        expected = {p: int(self.top[p]) for p, _ in found.values()}  # values per prefix, as the last pass counted
        shift = self.bits - _DIGIT
        while shift:
            prefixes = sorted(expected)
            counts = {p: np.zeros(_DIGITS, np.int64) for p in prefixes}
            low_shift, high_shift = self.ukey.type(shift - _DIGIT), self.ukey.type(shift)
            mask = self.ukey.type(_DIGITS - 1)
            for x in scan():
                k = self.keys(x)
                high = k >> high_shift
                for p in prefixes:
                    hit = high == self.ukey.type(p)
                    if hit.any():
                        counts[p] += np.bincount(((k[hit] >> low_shift) & mask).astype(np.intp), minlength=_DIGITS)
            changed = [p for p in prefixes if int(counts[p].sum()) != expected[p]]
            if changed:
                raise ValueError("Radix: a pass over the values saw other values than the first (did they change?)")
            for r, (p, within) in found.items():
                digit, within = _digit(counts[p], within)
                found[r] = ((p << _DIGIT) | digit, within)
            expected = {p: int(counts[p >> _DIGIT][p & (_DIGITS - 1)]) for p, _ in found.values()}
            shift -= _DIGIT
        return {r: self.value(p) for r, (p, _) in found.items()}


def _digit(counts: np.ndarray, rank: int) -> tuple[int, int]:
    """The bin of ``counts`` that holds the 0-based ``rank``, and the rank among that bin's values."""
    cum = np.cumsum(counts)
    if rank >= cum[-1]:
        raise ValueError(f"Radix: rank {rank} of {int(cum[-1])} values: a pass saw other values than the first")
    b = int(np.searchsorted(cum, rank, side="right"))
    return b, rank - (int(cum[b - 1]) if b else 0)


_SUBSAMPLE = 1 << 16
_CHUNK = 1 << 16  # values per step of a pass over the latencies (buffers of this many stay in the CPU's cache)


def _order_stats(x: np.ndarray, wanted: dict[float, tuple[int, int]]) -> dict[int, float]:
    """The values at the 0-based ranks ``wanted`` (quantile -> (rank, next rank)) of the sorted ``x``,
    exactly. A sorted random subsample brackets each pair of ranks by two values a <= b; one pass
    counts the values below a and keeps those in [a, b] (about 1 % of x), where the ranks are then
    selected. If a bracket misses (a chance of about 1e-9), that pair is selected from all of x."""
    n = len(x)
    out: dict[int, float] = {}
    if n <= 4 * _SUBSAMPLE:
        ranks = sorted({r for pair in wanted.values() for r in pair})
        x.partition(ranks)
        return {r: float(x[r]) for r in ranks}
    sub = np.sort(x[np.random.default_rng(0).integers(0, n, _SUBSAMPLE)])
    brackets = {}
    for q, (lo, hi) in wanted.items():
        m = int(6 * math.sqrt(q * (1 - q) * _SUBSAMPLE)) + 16  # ~6 standard deviations of the sample's rank
        brackets[q] = (
            sub[max(0, int(lo / n * _SUBSAMPLE) - m)],
            sub[min(_SUBSAMPLE - 1, int(hi / n * _SUBSAMPLE) + m)],
        )
    # one pass over x for every bracket, chunk by chunk into buffers that stay in cache: the values below a
    # and the values in [a, b] (x in its order, as x[(x >= a) & (x <= b)] keeps them)
    counted = {q: 0 for q in wanted}
    kept: dict[float, list[np.ndarray]] = {q: [] for q in wanted}
    buffers = np.empty((3, min(n, _CHUNK)), bool)
    for i in range(0, n, _CHUNK):
        xc = x[i : i + _CHUNK]
        lt, ge, le = buffers[:, : len(xc)]
        for q, (a, b) in brackets.items():
            counted[q] += int(np.count_nonzero(np.less(xc, a, out=lt)))
            np.greater_equal(xc, a, out=ge)
            kept[q].append(xc[np.logical_and(ge, np.less_equal(xc, b, out=le), out=ge)])
    for q, (lo, hi) in wanted.items():
        below, window = counted[q], np.concatenate(kept[q])
        if below <= lo and below + len(window) > hi:
            window.partition(sorted({lo - below, hi - below}))
            out[lo], out[hi] = float(window[lo - below]), float(window[hi - below])
        else:
            x.partition(sorted({lo, hi}))
            out[lo], out[hi] = float(x[lo]), float(x[hi])
    return out


def _ranks(q: float, n: int) -> tuple[int, int]:
    lo = math.floor(q * (n - 1))
    return lo, min(lo + 1, n - 1)
