"""QA metrics over merged outputs too large to hold: the numbers of ``metrics.compute_metrics``,
accumulated over Arrow record batches (DuckDB streams them from the Parquet files).

Counts, value counts, token sums and integer statistics are exact and equal the in-memory
ones (integer statistics come from merged value counts, as in memory). Float statistics
(latency) keep only the finite values as float32 (4 bytes a row, the column's own type) and
take the same order statistics and histogram bins; the mean is summed per batch, so it may
differ from the in-memory mean in the last bits.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from airflow_provider_vllm.steps.qa.metrics import (
    _MAX_DISTINCT_EXACT,
    ERROR_NEEDS,
    RESULT_NEEDS,
    _count,
    _count_empty,
    _hist_plan,
    _histogram,
    assemble_metrics,
    bin_counts,
    conform,
    int_stats_from_counts,
    models_list,
    sort_counts,
)


def _add_counts(counter: Counter, col: pa.ChunkedArray | pa.Array) -> None:
    if len(col) == 0:
        return
    if col.null_count == len(col):
        counter[None] += len(col)
        return
    vc = pc.value_counts(col)
    for v, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
        counter[v] += n


class ResultTally:
    """Everything ``compute_metrics`` needs, added up batch by batch (memory: distinct values + latencies)."""

    def __init__(self, capacity: int = 0) -> None:
        """``capacity``: the expected result rows (footers), so the latency buffer is allocated once."""
        self.ok = self.n_err = self.invalid = self.truncated = self.length_finish = 0
        self.text_rows = self.empty = self.label_nulls = self.valid_nulls = 0
        self.prompt_total = self.completion_total = 0
        self.latency_sum = 0.0
        self.counts: dict[str, Counter] = {k: Counter() for k in (
            "finish_reason", "label", "shard_id", "prompt_tokens", "completion_tokens", "error_code", "pairs")}
        self._lat = np.empty(capacity, np.float32)  # finite latencies; float64 once a batch needs it
        self._n_lat = 0

    def add_results(self, batch: pa.RecordBatch | pa.Table) -> None:
        t = conform(pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch, RESULT_NEEDS)
        col = t.column
        self.ok += t.num_rows
        self.invalid += _count(pc.equal(col("valid"), False))
        self.truncated += _count(col("truncated"))
        self.length_finish += _count(pc.equal(col("finish_reason"), "length"))
        expects_text = pc.and_(pc.is_null(col("embedding")), pc.is_null(col("scores")))
        self.text_rows += _count(expects_text)
        self.empty += _count_empty(col("output"), expects_text)
        self.label_nulls += col("label").null_count
        self.valid_nulls += col("valid").null_count
        for name in ("finish_reason", "label", "shard_id", "prompt_tokens", "completion_tokens"):
            _add_counts(self.counts[name], col(name))
        self.prompt_total += int(pc.sum(col("prompt_tokens")).as_py() or 0)
        self.completion_total += int(pc.sum(col("completion_tokens")).as_py() or 0)
        self._add_model_pairs(t)
        x = pc.drop_null(pc.cast(col("latency_ms"), pa.float64()))
        x = x.filter(pc.is_finite(x)) if len(x) else x
        if len(x):
            self.latency_sum += pc.sum(x).as_py()
            self._keep_latency(x.to_numpy(), exact32=pa.types.is_float32(col("latency_ms").type))

    def _add_model_pairs(self, t: pa.Table) -> None:
        """(model, revision) counts; the two-column group-by only in a batch where both vary."""
        if not t.num_rows:
            return
        models, revs = Counter(), Counter()
        _add_counts(models, t.column("model"))
        _add_counts(revs, t.column("model_revision"))
        pairs = self.counts["pairs"]
        if len(models) == 1:
            m = next(iter(models))
            for r, n in revs.items():
                pairs[(m, r)] += n
        elif len(revs) == 1:
            r = next(iter(revs))
            for m, n in models.items():
                pairs[(m, r)] += n
        else:
            g = t.select(["model", "model_revision"]).group_by(["model", "model_revision"]).aggregate(
                [([], "count_all")])
            for m, r, n in zip(g["model"].to_pylist(), g["model_revision"].to_pylist(), g["count_all"].to_pylist()):
                pairs[(m, r)] += n

    def _keep_latency(self, x: np.ndarray, exact32: bool) -> None:
        if not exact32 and self._lat.dtype != np.float64:
            self._lat = self._lat.astype(np.float64)
        need = self._n_lat + len(x)
        if need > len(self._lat):
            grown = np.empty(max(need, 2 * len(self._lat)), self._lat.dtype)
            grown[:self._n_lat] = self._lat[:self._n_lat]
            self._lat = grown
        self._lat[self._n_lat:need] = x
        self._n_lat = need

    def add_errors(self, batch: pa.RecordBatch | pa.Table) -> None:
        t = conform(pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch, ERROR_NEEDS)
        self.n_err += t.num_rows
        _add_counts(self.counts["error_code"], t.column("error_code"))

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
            ok=self.ok, n_err=self.n_err, invalid=self.invalid, truncated=self.truncated,
            length_finish=self.length_finish, text_rows=self.text_rows, empty=self.empty, labelled=labelled,
            no_valid_flag=self.ok > 0 and self.valid_nulls == self.ok,
            code_counts=self.value_counts("error_code"), finish_counts=self.value_counts("finish_reason"),
            label_counts=self.value_counts("label") if labelled else {},
            prompt_total=self.prompt_total, completion_total=self.completion_total,
            prompt_stats=self._int_stats("prompt_tokens"), completion_stats=self._int_stats("completion_tokens"),
            latency_stats=self._latency_stats(),
            models=models_list(sort_counts(by_model.items()), sort_counts(by_rev.items()), self.ok,
                               lambda: [(m, r, n) for (m, r), n in pairs.items()]),
            labels=labels, structured=structured, notes=notes,
        )

    def _latency_stats(self) -> dict[str, Any] | None:
        x, self._lat = self._lat[:self._n_lat], np.empty(0, np.float32)  # partitioned in place
        return _float_stats(x, self.latency_sum)

    def _int_stats(self, name: str) -> dict[str, Any] | None:
        vc = sorted((v, n) for v, n in self.counts[name].items() if v is not None)
        if not vc:
            return None
        if len(vc) > _MAX_DISTINCT_EXACT:  # as in memory: float stats of the values
            values = np.repeat(np.array([v for v, _ in vc], np.float64), [n for _, n in vc])
            return _float_stats(values, float(pc.sum(pa.array(values)).as_py()), integer=True)
        return int_stats_from_counts([v for v, _ in vc], [n for _, n in vc])


def _float_stats(x: np.ndarray, total: float, integer: bool = False) -> dict[str, Any] | None:
    """``metrics._float_stats`` of the finite values ``x`` (reordered in place); ``total``: their sum."""
    if len(x) == 0:
        return None
    n = len(x)
    mn, mx = float(x.min()), float(x.max())
    ranks = sorted({r for q in (0.5, 0.9, 0.99) for r in _ranks(q, n)})
    x.partition(ranks)

    def quantile(q: float) -> float:  # Arrow's 'linear': fraction * higher + (1 - fraction) * lower
        pos = q * (n - 1)
        lo = math.floor(pos)
        a, b = float(x[lo]), float(x[min(lo + 1, n - 1)])
        f = pos - lo
        return f * b + (1 - f) * a

    p50, p90, p99 = quantile(0.5), quantile(0.9), quantile(0.99)
    stats = {"count": n, "min": int(mn) if integer else mn, "p50": p50, "p90": p90, "p99": p99,
             "max": int(mx) if integer else mx, "mean": total / n}
    lo, w, nb, _ = _hist_plan(mn, mx, p99, integer)
    bins: Counter = Counter()
    step = 1 << 22
    for i in range(0, n, step):
        bins.update(dict(bin_counts(pa.array(x[i:i + step].astype(np.float64)), lo, w)))
    stats["histogram"] = _histogram(lo, w, nb, bins.items(), integer)
    return stats


def _ranks(q: float, n: int) -> tuple[int, int]:
    lo = math.floor(q * (n - 1))
    return lo, min(lo + 1, n - 1)
