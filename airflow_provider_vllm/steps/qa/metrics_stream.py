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
so it may differ from the in-memory mean in the last bits.
"""

from __future__ import annotations

import math
import mmap
from collections import Counter
from collections.abc import Callable
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
        self._lat = _fresh(capacity, np.float32)  # finite latencies; float64 once a batch needs it
        self._n_lat = 0

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
            sql = "SELECT latency_ms FROM r WHERE latency_ms IS NOT NULL AND isfinite(latency_ms)"
        else:  # every row, for the other column; the latencies are filtered here as the WHERE above does
            sql = f'SELECT latency_ms, "{also[0]}" FROM r'
        for batch in con.sql(sql).to_arrow_reader(batch_rows):
            if also is not None and batch.num_rows:
                also[1](_floats(batch.column(1)))
            col = batch.column(0)
            if pa.types.is_null(col.type):  # no latency at all (the WHERE above: no rows)
                continue
            exact32 = pa.types.is_float32(col.type)
            x = col.to_numpy(zero_copy_only=False).astype(np.float32 if exact32 else np.float64, copy=False)
            if also is not None:
                finite = np.isfinite(x)  # null (NaN here), NaN and infinities are dropped, as the WHERE drops them
                if not finite.all():
                    x = x[finite]
            if not len(x):
                continue
            self.latency_sum += float(x.sum(dtype=np.float64))
            self._keep_latency(x, exact32=exact32)

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
    mn, mx = float(x.min()), float(x.max())
    at = _order_stats(x, {q: _ranks(q, n) for q in (0.5, 0.9, 0.99)})

    def quantile(q: float) -> float:  # Arrow's 'linear': fraction * higher + (1 - fraction) * lower
        pos = q * (n - 1)
        lo = math.floor(pos)
        a, b = at[lo], at[min(lo + 1, n - 1)]
        f = pos - lo
        return f * b + (1 - f) * a

    p50, p90, p99 = quantile(0.5), quantile(0.9), quantile(0.99)
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
    bins = np.zeros(nb + 1, np.int64)  # the last: overflow
    t = np.empty(min(n, _CHUNK), np.float64)  # one buffer that stays in cache (no fresh temporaries per step)
    for i in range(0, n, _CHUNK):  # floor((x - lo) / w) in float64, as metrics.bin_counts; x >= lo
        k = t[: min(_CHUNK, n - i)]
        np.subtract(x[i : i + _CHUNK], lo, out=k, dtype=np.float64)  # x in float64, as astype(float64) - lo
        np.divide(k, w, out=k)
        np.floor(k, out=k)
        np.minimum(k, nb, out=k)
        bins += np.bincount(k.astype(np.int64), minlength=nb + 1)
    stats["histogram"] = _histogram(lo, w, nb, enumerate(bins.tolist()), integer)
    return stats


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
