"""QA stage: metrics, threshold checks and a deterministic sample over a run's merged output.

Pure computation over Arrow tables (DuckDB does the scans); no Airflow, no vLLM. The QA task
calls ``run_qa`` on the merged ``results`` / ``errors`` tables, ``write_qa`` to store the
report (json + html + sample parquet), and raises ``QAFailed`` (or asks a human) according to
``QAReport.status``.

Definitions (denominators are stored with every rate in ``metrics["rates"]``):

* ``error_rate``: error rows / (ok rows + error rows).
* ``empty_rate``: ok rows whose output is null, empty or whitespace-only / ok rows that are
  expected to carry text (rows with an ``embedding`` or ``scores`` are not).
* ``invalid_rate``: ok rows with ``valid == false`` / ok rows (only when ``structured``).
* ``truncation_rate``: ok rows whose prompt was cut (``truncated``) / ok rows. Outputs that
  hit ``max_tokens`` (``finish_reason == 'length'``) are reported as ``length_finish_rate``.
* ``label_drift``: total variation distance between this run's label fractions and the
  previous report's (``0.5 * sum |p - q|`` over the union of labels).

The sample is stratified (by label, else by shard id) and ranked inside each stratum by
``md5(f"{seed}:{id}")``: the same inputs and seed give the same sample in any process, with
any DuckDB version.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import posixpath
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from airflow_provider_vllm.core.errors import VllmBatchError
from airflow_provider_vllm.core.rows import ROW_SCHEMA
from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.core.storage import FileSystems, Storage

REPORT_FORMAT = "airflow-provider-vllm/qa-report"
REPORT_VERSION = 1

CHECKS = ("error_rate", "empty_rate", "invalid_rate", "truncation_rate", "label_drift")
STATUS_ORDER = {"skip": -1, "pass": 0, "warn": 1, "fail": 2}

ERROR_SAMPLE_FRACTION = 0.10  # at most this share of the sample comes from error rows
HIST_BINS = 30  # target number of histogram bins
NULL_KEY = "(none)"  # JSON key for a null label / finish reason / error code

_CHECK_TEXT = {
    "error_rate": "rows that failed (error rows / all rows)",
    "empty_rate": "ok rows with null or whitespace-only output",
    "invalid_rate": "structured outputs that do not parse / match",
    "truncation_rate": "ok rows whose prompt was truncated",
    "label_drift": "total variation distance of the label distribution vs the previous run",
}


# ---- the report ------------------------------------------------------------------------


@dataclass
class QAReport:
    """The outcome of ``run_qa``. ``to_dict()`` is JSON-serialisable; ``sample`` is not part of it."""

    status: str
    checks: list[dict[str, Any]]
    metrics: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    run_info: dict[str, Any] = field(default_factory=dict)
    sample: pa.Table = field(default_factory=lambda: pa.table({}), repr=False, compare=False)

    @property
    def failing_checks(self) -> list[dict[str, Any]]:
        return [c for c in self.checks if c["status"] == "fail"]

    @property
    def warning_checks(self) -> list[dict[str, Any]]:
        return [c for c in self.checks if c["status"] == "warn"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "status": self.status,
            "summary": self.summary_line(),
            "run": dict(self.run_info),
            "checks": [dict(c) for c in self.checks],
            "metrics": self.metrics,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QAReport:
        """Back from ``to_dict()`` (e.g. a stored report.json); the sample is empty."""
        return cls(
            status=d["status"],
            checks=list(d.get("checks", [])),
            metrics=dict(d.get("metrics", {})),
            notes=list(d.get("notes", [])),
            run_info=dict(d.get("run", {})),
        )

    def summary_line(self) -> str:
        m = self.metrics
        parts = [f"QA {self.status.upper()}: rows={m.get('total', 0)} ok={m.get('ok', 0)} errors={m.get('errors', 0)}"]
        if m.get("duplicates") is not None:
            parts.append(f"duplicates={m['duplicates']['ids']}")
        for c in self.checks:
            if c["status"] == "skip":
                continue
            v = c["value"]
            val = f"{v:.4f}" if c["name"] == "label_drift" else f"{100 * v:.2f}%"
            parts.append(f"{c['name']}={val}({c['status']})")
        s = m.get("sample", {})
        parts.append(f"sample={s.get('rows', 0)}")
        return " ".join(parts)

    def raise_on_fail(self) -> None:
        """Raise ``QAFailed`` when any check failed."""
        if self.status == "fail":
            raise QAFailed(self.to_dict(), self.failing_checks)


class QAFailed(VllmBatchError):
    """The QA stage crossed a fail threshold; carries the report dict and the failing checks."""

    def __init__(self, report: dict[str, Any], failing: list[dict[str, Any]] | None = None):
        if failing is None:
            failing = [c for c in report.get("checks", []) if c.get("status") == "fail"]
        self.report = report
        self.failing = list(failing)
        listed = "; ".join(f"{c['name']}={_fmt_check_value(c)} > fail {c['fail']}" for c in self.failing)
        super().__init__(f"QA failed {len(self.failing)} check(s): {listed or '(none listed)'}")

    def __reduce__(self):  # picklable with its payload (Airflow may pickle exceptions)
        return (type(self), (self.report, self.failing))


def _fmt_check_value(c: dict[str, Any]) -> str:
    v = c.get("value")
    if v is None:
        return "n/a"
    return f"{v:.4f}" if c.get("name") == "label_drift" else f"{v:.4%}"


# ---- entry point -----------------------------------------------------------------------


def run_qa(
    results: pa.Table,
    errors: pa.Table,
    *,
    spec: QASpec,
    labels: list[str] | None,
    structured: bool,
    shard_stats: list[dict] | None = None,
    previous: dict | None = None,
    run_info: dict[str, Any] | None = None,
    duplicates: dict[str, Any] | None = None,
) -> QAReport:
    """Metrics, threshold checks and a deterministic stratified sample (pure computation).

    ``results`` has RESULT_COLUMNS (extra columns such as ``input_excerpt`` are kept in the
    sample), ``errors`` has ERROR_COLUMNS; either may be empty. ``previous`` is an earlier
    report dict (``QAReport.to_dict()``) for label drift. ``run_info`` (optional, small,
    JSON-serialisable) is copied into the report header (run id, job name ...). ``duplicates``
    is merge's count of ids committed more than once, taken before its dedupe (``_MERGED.json``).
    """
    results = _conform(results, _RESULT_NEEDS)
    errors = _conform(errors, _ERROR_NEEDS)
    notes: list[str] = []
    con = duckdb.connect()
    try:
        con.register("r", results)
        con.register("e", errors)
        metrics = _metrics(results, errors, labels=labels, structured=structured, notes=notes)
        metrics["throughput"] = _throughput(shard_stats)
        metrics["duplicates"] = _duplicates(duplicates, notes)
        _drift(metrics, previous, notes)
        ld = metrics["label_distribution"] or {}
        label_sizes = None
        if ld.get("labelled"):  # stratify by label, reusing the counts
            label_sizes = {k: n for k, n in ld["counts"].items() if n}
            if ld["unlabelled"]:
                label_sizes[None] = ld["unlabelled"]
        sample, sample_info = _sample(con, results, errors, spec=spec, label_sizes=label_sizes)
        metrics["sample"] = sample_info
    finally:
        con.close()

    checks = _checks(metrics, spec, structured=structured)
    status = max((c["status"] for c in checks), key=STATUS_ORDER.__getitem__, default="pass")
    if status == "skip":
        status = "pass"
    return QAReport(
        status=status,
        checks=checks,
        metrics=metrics,
        notes=notes,
        run_info=_jsonable(run_info or {}),
        sample=sample,
    )


def _duplicates(dup: dict[str, Any] | None, notes: list[str]) -> dict[str, Any] | None:
    """Merge's duplicate count (before its dedupe), or None when the caller has none."""
    if dup is None:
        return None
    out = {"ids": int(dup.get("ids") or 0), "rows_dropped": int(dup.get("rows_dropped") or 0),
           "examples": [str(x) for x in (dup.get("examples") or [])][:10]}
    if out["ids"]:
        notes.append(f"{out['ids']} id(s) were committed more than once with identical content; merge kept one "
                     f"row each and dropped {out['rows_dropped']} (e.g. {', '.join(out['examples'][:5])})")
    return out


# ---- input conformance ------------------------------------------------------------------

_RESULT_NEEDS = (
    "id",
    "output",
    "label",
    "valid",
    "embedding",
    "scores",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "truncated",
    "latency_ms",
    "model",
    "model_revision",
    "shard_id",
)
_ERROR_NEEDS = ("id", "error_code", "error_message", "shard_id")


def _conform(table: pa.Table, needs: Iterable[str]) -> pa.Table:
    """Add missing columns as nulls (ROW_SCHEMA types) and decode dictionary columns we read."""
    for name in needs:
        typ = ROW_SCHEMA.field(name).type
        if name not in table.column_names:
            table = table.append_column(pa.field(name, typ), pa.nulls(table.num_rows, typ))
        else:
            col = table.column(name)
            if pa.types.is_dictionary(col.type):
                i = table.column_names.index(name)
                decoded = pa.chunked_array([c.dictionary_decode() for c in col.chunks], col.type.value_type)
                table = table.set_column(i, pa.field(name, col.type.value_type), decoded)
    return table


# ---- metrics ----------------------------------------------------------------------------


def _rate(count: int, of: int) -> dict[str, Any]:
    return {"value": (count / of) if of else 0.0, "count": int(count), "of": int(of)}


def _count(mask: pa.ChunkedArray | pa.Array) -> int:
    """True values of a boolean column (nulls count as false)."""
    return int(pc.sum(mask).as_py() or 0) if len(mask) else 0


def _value_counts(col: pa.ChunkedArray) -> dict[Any, int]:
    """value -> count (None for nulls), largest first, ties by value."""
    if len(col) == 0:
        return {}
    if col.null_count == len(col):
        return {None: len(col)}
    vc = pc.value_counts(col)
    pairs = list(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
    pairs.sort(key=lambda p: (-p[1], p[0] is None, str(p[0])))
    return {v: int(n) for v, n in pairs}


def _metrics(results: pa.Table, errors: pa.Table, *, labels, structured, notes) -> dict[str, Any]:
    # Plain counts are bitmap operations on Arrow columns; group-bys use Arrow's hash kernels.
    ok, n_err = results.num_rows, errors.num_rows
    total = ok + n_err
    if total == 0:
        notes.append("no rows in results or errors: all rates are 0 and nothing was sampled")

    col = results.column
    invalid = _count(pc.equal(col("valid"), False))
    truncated = _count(col("truncated"))
    length_finish = _count(pc.equal(col("finish_reason"), "length"))
    expects_text = pc.and_(pc.is_null(col("embedding")), pc.is_null(col("scores")))
    text_rows = _count(expects_text)
    empty = _count_empty(col("output"), expects_text)
    labelled = ok - col("label").null_count

    by_code = {_key(k): n for k, n in _value_counts(errors.column("error_code")).items()}
    finish = {_key(k): n for k, n in _value_counts(col("finish_reason")).items()}

    rates = {
        "error_rate": _rate(n_err, total),
        "empty_rate": _rate(empty, text_rows),
        "invalid_rate": _rate(invalid, ok) if structured else None,
        "truncation_rate": _rate(truncated, ok),
        "length_finish_rate": _rate(length_finish, ok),
    }
    if structured and ok and col("valid").null_count == ok:
        notes.append("structured output requested but no row carries a 'valid' flag")

    label_counts = _value_counts(col("label")) if labelled else {}
    label_counts.pop(None, None)
    label_dist = _label_distribution(label_counts, labels, labelled, ok, notes)

    return {
        "total": int(total),
        "ok": int(ok),
        "errors": int(n_err),
        "rates": rates,
        "errors_by_code": {k: {"count": n, "rate": n / total if total else 0.0} for k, n in by_code.items()},
        "finish_reasons": finish,
        "label_distribution": label_dist,
        "tokens": {
            "prompt_total": int(pc.sum(col("prompt_tokens")).as_py() or 0) if ok else 0,
            "completion_total": int(pc.sum(col("completion_tokens")).as_py() or 0) if ok else 0,
        },
        "prompt_tokens": _int_stats(col("prompt_tokens")),
        "completion_tokens": _int_stats(col("completion_tokens")),
        "latency_ms": _float_stats(col("latency_ms")),
        "models": _models(results),
    }


def _models(results: pa.Table) -> list[dict[str, Any]]:
    """(model, revision, rows); one cheap pass per column unless both vary."""
    models = _value_counts(results.column("model"))
    revs = _value_counts(results.column("model_revision"))
    if len(models) <= 1 or len(revs) <= 1:
        rev = next(iter(revs), None) if len(revs) == 1 else None
        if len(models) <= 1:
            m = next(iter(models), None)
            pairs = [(m, r, n) for r, n in revs.items()] if len(revs) > 1 else ([(m, rev, results.num_rows)] if results.num_rows else [])
        else:
            pairs = [(m, rev, n) for m, n in models.items()]
    else:
        g = results.select(["model", "model_revision"]).group_by(["model", "model_revision"]).aggregate([([], "count_all")])
        pairs = sorted(
            zip(g["model"].to_pylist(), g["model_revision"].to_pylist(), g["count_all"].to_pylist()),
            key=lambda p: (-p[2], str(p[0]), str(p[1])),
        )
    return [{"model": m, "revision": r, "rows": int(n)} for m, r, n in pairs[:20]]


def _count_empty(output: pa.ChunkedArray, expects_text: pa.ChunkedArray) -> int:
    """Rows expected to carry text whose output is null, '' or whitespace-only (Unicode)."""
    if len(output) == 0:
        return 0
    if not (pa.types.is_string(output.type) or pa.types.is_large_string(output.type)):
        output = pc.cast(output, pa.large_string())
    blank = pc.or_kleene(pc.equal(output, ""), pc.utf8_is_space(output))
    blank = pc.fill_null(blank, True)  # null output counts as empty
    return _count(pc.and_(blank, expects_text))


def _key(k: Any) -> str:
    return NULL_KEY if k is None else str(k)


def _label_distribution(observed: dict[str, int], labels, labelled, ok, notes) -> dict[str, Any] | None:
    if not observed and not labels:
        return None
    order: list[str] = list(labels or [])
    unexpected = sorted(k for k in observed if labels is not None and k not in set(labels))
    if labels is None:
        order = list(observed)  # largest first
    else:
        order += unexpected
        if unexpected:
            shown = ", ".join(repr(u) for u in unexpected[:10])
            notes.append(f"{len(unexpected)} label(s) outside the label set: {shown}")
    counts = {k: int(observed.get(k, 0)) for k in order}
    fractions = {k: (n / labelled if labelled else 0.0) for k, n in counts.items()}
    if ok and labelled < ok:
        notes.append(f"{ok - labelled} ok row(s) have no label")
    return {
        "counts": counts,
        "fractions": fractions,
        "labelled": int(labelled),
        "unlabelled": int(ok - labelled),
        "unexpected": unexpected,
    }


_MAX_DISTINCT_EXACT = 200_000


def _int_stats(col: pa.ChunkedArray) -> dict[str, Any] | None:
    """Exact stats of an integer column (token counts) from its value counts: one hash pass."""
    n = len(col) - col.null_count
    if n == 0:
        return None
    if not pa.types.is_integer(col.type):
        return _float_stats(col)
    vc = pa.table({"v": col}).group_by("v").aggregate([([], "count_all")])
    vc = vc.filter(pc.is_valid(vc["v"]))
    if vc.num_rows > _MAX_DISTINCT_EXACT:
        return _float_stats(col, integer=True)
    vc = vc.sort_by("v")
    values, counts = vc["v"].to_pylist(), vc["count_all"].to_pylist()
    cum, acc = [], 0
    for c in counts:
        acc += c
        cum.append(acc)

    def at(i: int) -> int:  # the value at 0-based position i of the sorted column
        return values[bisect.bisect_right(cum, i)]

    def quantile(q: float) -> float:  # linear interpolation, as numpy / DuckDB quantile_cont
        pos = q * (n - 1)
        lo = math.floor(pos)
        a, b = at(lo), at(min(lo + 1, n - 1))
        return float(a + (b - a) * (pos - lo))

    stats = {
        "count": n,
        "min": int(values[0]),
        "p50": quantile(0.5),
        "p90": quantile(0.9),
        "p99": quantile(0.99),
        "max": int(values[-1]),
        "mean": sum(v * c for v, c in zip(values, counts)) / n,
    }
    lo, w, nb, _ = _hist_plan(float(values[0]), float(values[-1]), stats["p99"], True)
    bins = [0] * nb
    overflow = 0
    for v, c in zip(values, counts):
        b = int(math.floor((v - lo) / w))
        if b >= nb:
            overflow += c
        else:
            bins[max(b, 0)] += c
    stats["histogram"] = _hist_dict(lo, w, bins, overflow, True)
    return stats


def _float_stats(col: pa.ChunkedArray, integer: bool = False) -> dict[str, Any] | None:
    """Exact stats of a numeric column over its finite values (NaN / inf / null skipped)."""
    x = pc.cast(col, pa.float64())
    x = pc.drop_null(x)
    x = x.filter(pc.is_finite(x)) if x.null_count == 0 and len(x) else x
    n = len(x)
    if n == 0:
        return None
    mm = pc.min_max(x)
    mn, mx = mm["min"].as_py(), mm["max"].as_py()
    p50, p90, p99 = pc.quantile(x, q=[0.5, 0.9, 0.99], interpolation="linear").to_pylist()
    stats = {
        "count": n,
        "min": int(mn) if integer else mn,
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": int(mx) if integer else mx,
        "mean": pc.mean(x).as_py(),
    }
    lo, w, nb, _ = _hist_plan(mn, mx, p99, integer)
    b = pc.cast(pc.floor(pc.divide(pc.subtract(x, lo), w)), pa.int64())
    g = pa.table({"b": b}).group_by("b").aggregate([([], "count_all")])
    bins = [0] * nb
    overflow = 0
    for k, c in zip(g["b"].to_pylist(), g["count_all"].to_pylist()):
        if k >= nb:
            overflow += c
        else:
            bins[max(k, 0)] += c
    stats["histogram"] = _hist_dict(lo, w, bins, overflow, integer)
    return stats


def _hist_dict(lo: float, w: float, counts: list[int], overflow: int, integer: bool) -> dict[str, Any]:
    edges = [_round_edge(lo + i * w, integer) for i in range(len(counts) + 1)]
    return {"edges": edges, "counts": [int(c) for c in counts], "overflow": int(overflow), "integer": integer}


def _nice(x: float) -> float:
    """The smallest of 1, 2, 5 x 10^k that is >= x."""
    if x <= 0 or not math.isfinite(x):
        return 1.0
    e = math.floor(math.log10(x))
    f = x / 10**e
    nf = 1 if f <= 1 else 2 if f <= 2 else 5 if f <= 5 else 10
    return float(nf * 10**e)


def _round_edge(x: float, integer: bool) -> int | float:
    return int(round(x)) if integer else float(f"{x:.12g}")


def _hist_plan(mn: float, mx: float, p99: float, integer: bool) -> tuple[float, float, int, bool]:
    """(lo, width, bins, integer): equal-width 'nice' bins over [min, max]; a heavy tail beyond
    p99 goes to an overflow bin so that the body of the distribution stays readable."""
    hi = mx
    if p99 > mn and (mx - mn) > 2 * (p99 - mn):
        hi = p99
    w = _nice((hi - mn) / HIST_BINS) if hi > mn else 1.0
    if integer:
        w = max(1.0, float(math.ceil(w)))
    lo = math.floor(mn / w) * w
    nb = max(1, int(math.floor((hi - lo) / w)) + 1)
    if hi == mx and lo + (nb - 1) * w > mx:  # float slack
        nb -= 1
    return float(lo), float(w), nb, integer


def _throughput(shard_stats: list[dict] | None) -> dict[str, Any] | None:
    if not shard_stats:
        return None
    shards = []
    for i, s in enumerate(shard_stats):
        s = s or {}
        row: dict[str, Any] = {"shard_id": str(s.get("shard_id", f"#{i}"))}
        for k in ("rows", "seconds", "rows_per_s", "tokens_per_s", "tokens"):
            row[k] = _opt_float(s.get(k))
        if row["seconds"] is None:  # commit-marker stats: wall_s is the attempt's duration
            row["seconds"] = _opt_float(s.get("wall_s"))
        if row["tokens"] is None and s.get("prompt_tokens") is not None:
            row["tokens"] = _opt_float((s.get("prompt_tokens") or 0) + (s.get("completion_tokens") or 0))
        if row["rows_per_s"] is None and row["rows"] is not None and row["seconds"]:
            row["rows_per_s"] = row["rows"] / row["seconds"]
        for k, v in s.items():  # keep other scalar stats (peak memory, retries ...)
            if k not in row and isinstance(v, (str, int, float, bool)) and not (isinstance(v, float) and not math.isfinite(v)):
                row[k] = v
        if row["rows"] is not None and float(row["rows"]).is_integer():
            row["rows"] = int(row["rows"])
        shards.append(row)
    shards.sort(key=lambda r: r["shard_id"])
    timed = [r for r in shards if r["rows"] is not None and r["seconds"] is not None]
    rows_sum = sum(r["rows"] for r in timed)
    sec_sum = sum(r["seconds"] for r in timed)
    tok = [
        r["tokens"] if r["tokens"] is not None else (r["tokens_per_s"] * r["seconds"])
        for r in timed
        if r["tokens"] is not None or r["tokens_per_s"] is not None
    ]
    rps = [r["rows_per_s"] for r in shards if r["rows_per_s"] is not None]
    return {
        "shards": shards,
        "n_shards": len(shards),
        "rows": sum(r["rows"] for r in shards if r["rows"] is not None),
        "shard_seconds": sec_sum,
        "rows_per_s": (rows_sum / sec_sum) if sec_sum > 0 else None,
        "tokens_per_s": (sum(tok) / sec_sum) if sec_sum > 0 and len(tok) == len(timed) and tok else None,
        "slowest_shard": min((r for r in shards if r["rows_per_s"] is not None), key=lambda r: r["rows_per_s"])[
            "shard_id"
        ]
        if rps
        else None,
        "min_rows_per_s": min(rps) if rps else None,
        "max_rows_per_s": max(rps) if rps else None,
    }


def _opt_float(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _drift(metrics: dict[str, Any], previous: dict | None, notes: list[str]) -> None:
    metrics["label_drift"] = None
    metrics["previous"] = None
    if previous is None:
        return
    prev_m = previous.get("metrics", previous) if isinstance(previous, dict) else {}
    prev_rates = prev_m.get("rates") or {}
    metrics["previous"] = {
        "status": previous.get("status"),
        "run": previous.get("run") or {},
        "total": prev_m.get("total"),
        "rates": {k: (v or {}).get("value") for k, v in prev_rates.items()},
    }
    cur = metrics["label_distribution"]
    prev = (prev_m.get("label_distribution") or {}) if isinstance(prev_m, dict) else {}
    pf = prev.get("fractions") or {}
    if cur is None or not cur["labelled"]:
        if pf:
            notes.append("previous run has labels but this one has none: label drift not checked")
        return
    if not any(float(v or 0) > 0 for v in pf.values()):
        notes.append("previous report has no label distribution: label drift not checked")
        return
    cf = cur["fractions"]
    keys = list(cf) + [k for k in pf if k not in cf]
    delta = {k: float(cf.get(k, 0.0)) - float(pf.get(k, 0.0)) for k in keys}
    tvd = 0.5 * sum(abs(d) for d in delta.values())
    metrics["label_drift"] = {
        "tvd": min(1.0, tvd),
        "delta": delta,
        "previous_fractions": {k: float(pf.get(k, 0.0)) for k in keys},
        "previous_labelled": prev.get("labelled"),
    }


# ---- checks -----------------------------------------------------------------------------


def _checks(metrics: dict[str, Any], spec: QASpec, *, structured: bool) -> list[dict[str, Any]]:
    out = []
    for name in CHECKS:
        warn, fail = getattr(spec, f"warn_{name}"), getattr(spec, f"fail_{name}")
        if name == "label_drift":
            d = metrics.get("label_drift")
            value = None if d is None else d["tvd"]
            detail = "no previous run to compare" if d is None else "vs previous run"
        else:
            r = metrics["rates"].get(name)
            value = None if r is None else r["value"]
            detail = "not a structured-output job" if r is None else f"{r['count']} / {r['of']}"
        if value is None:
            status = "skip"
        elif value > fail:
            status = "fail"
        elif value > warn:
            status = "warn"
        else:
            status = "pass"
        out.append(
            {
                "name": name,
                "value": value,
                "warn": warn,
                "fail": fail,
                "status": status,
                "detail": detail,
                "description": _CHECK_TEXT[name],
            }
        )
    return out


# ---- sample -----------------------------------------------------------------------------


def sample_key(seed: int, row_id: str) -> str:
    """The sample's ranking key of a row: md5 hex of ``f"{seed}:{id}"`` (same as DuckDB md5)."""
    return hashlib.md5(f"{seed}:{row_id}".encode()).hexdigest()


def allocate(sizes: dict[Hashable, int], k: int) -> dict[Hashable, int]:
    """Split k draws over strata proportionally to their sizes (largest remainder), with at
    least one per non-empty stratum when k allows it; never more than a stratum holds. When k
    is smaller than the number of strata the k largest strata get one each."""
    alloc = {s: 0 for s in sizes}
    total = sum(max(0, n) for n in sizes.values())
    k = min(max(0, k), total)
    if k == 0:
        return alloc
    nonempty = sorted((s for s, n in sizes.items() if n > 0), key=lambda s: (-sizes[s], str(s)))
    if k < len(nonempty):
        for s in nonempty[:k]:
            alloc[s] = 1
        return alloc
    quota = {s: k * sizes[s] / total for s in nonempty}
    for s in nonempty:
        alloc[s] = min(sizes[s], max(1, math.floor(quota[s])))
    diff = k - sum(alloc.values())
    while diff > 0:
        room = sorted((s for s in nonempty if alloc[s] < sizes[s]), key=lambda s: (alloc[s] - quota[s], -sizes[s], str(s)))
        for s in room[:diff]:
            alloc[s] += 1
        diff = k - sum(alloc.values())
    while diff < 0:
        over = sorted((s for s in nonempty if alloc[s] > 1), key=lambda s: (quota[s] - alloc[s], sizes[s], str(s)))
        for s in over[:-diff]:
            alloc[s] -= 1
        diff = k - sum(alloc.values())
    return alloc


def _top_by_stratum(con, table: str, stratum: str | None, seed: int, kmax: int) -> dict[Any, list[str]]:
    """Per stratum, the kmax ids with the smallest md5(seed:id), in rank order."""
    if kmax <= 0:
        return {}
    skey = stratum or "NULL"
    rows = con.execute(
        f"""
        SELECT s, min_by(id, h, {int(kmax)}) FROM (
            SELECT {skey} AS s, id, md5($seed || ':' || id) AS h FROM {table} WHERE id IS NOT NULL
        ) GROUP BY s
        """,
        {"seed": str(seed)},
    ).fetchall()
    return {s: ids for s, ids in rows}


def _pick(con, table: str, stratum: str | None, sizes: dict[Any, int], k: int, seed: int) -> list[tuple[Any, str]]:
    alloc = allocate(sizes, k)
    kmax = max(alloc.values(), default=0)
    tops = _top_by_stratum(con, table, stratum, seed, kmax)
    picked: list[tuple[Any, str]] = []
    for s in sorted(alloc, key=lambda s: (s is None, str(s))):
        ids = sorted(tops.get(s) or [], key=lambda i: (sample_key(seed, i), i))
        picked += [(s, i) for i in ids[: alloc[s]]]
    return picked


def _sample(
    con, results: pa.Table, errors: pa.Table, *, spec: QASpec, label_sizes: dict[Any, int] | None
) -> tuple[pa.Table, dict]:
    seed, k = spec.seed, spec.sample_size
    n_ok, n_err = results.num_rows, errors.num_rows
    stratum = "label" if label_sizes else ("shard_id" if results.column("shard_id").null_count < n_ok else None)

    err_quota = max(1, round(ERROR_SAMPLE_FRACTION * k)) if k >= 2 and n_err else 0
    k_err = min(n_err, err_quota)
    k_ok = min(n_ok, k - k_err)
    k_err = min(n_err, k - k_ok)  # few ok rows: fill up with errors

    ok_sizes: dict[Any, int] = {}
    if k_ok:
        if stratum == "label":
            ok_sizes = dict(label_sizes or {})
        elif stratum:
            ok_sizes = _value_counts(results.column(stratum))
        else:
            ok_sizes = {None: n_ok}
    err_sizes = _value_counts(errors.column("error_code")) if k_err else {}
    ok_pick = _pick(con, "r", stratum, ok_sizes, k_ok, seed) if k_ok else []
    err_pick = _pick(con, "e", "error_code", err_sizes, k_err, seed) if k_err else []

    ok_part = _take(results, ok_pick, "ok", seed)
    err_part = _take(errors, err_pick, "error", seed)
    sample = pa.concat_tables([ok_part, err_part], promote_options="permissive")
    info = {
        "requested": k,
        "seed": seed,
        "rows": sample.num_rows,
        "ok_rows": ok_part.num_rows,
        "error_rows": err_part.num_rows,
        "stratified_by": stratum,
        "allocation": {_key(s): n for s, n in allocate(ok_sizes, k_ok).items() if n} if k_ok else {},
        "error_allocation": {_key(s): n for s, n in allocate(err_sizes, k_err).items() if n} if k_err else {},
        "ids": [i for _, i in ok_pick] + [i for _, i in err_pick],
    }
    return sample, info


_SAMPLE_SCHEMA = ROW_SCHEMA.append(pa.field("qa_stratum", pa.string())).append(pa.field("qa_sample_key", pa.string()))


def _take(table: pa.Table, picked: list[tuple[Any, str]], status: str, seed: int) -> pa.Table:
    """The picked rows in pick order, conformed to ROW_SCHEMA (+ extra columns, + qa columns)."""
    ids = [i for _, i in picked]
    if ids:
        value_set = pa.array(ids, pa.string())
        idcol = table.column("id")
        if idcol.type != pa.string():
            idcol = pc.cast(idcol, pa.string())
        mask = pc.is_in(idcol, value_set=value_set)
        sub = table.filter(mask)
        pos = pc.index_in(pc.cast(sub.column("id"), pa.string()), value_set=value_set).to_pylist()
        seen: set[int] = set()
        order = []
        for row, p in sorted(enumerate(pos), key=lambda t: (t[1], t[0])):
            if p not in seen:  # ids are unique after merge; keep the first if not
                seen.add(p)
                order.append(row)
        sub = sub.take(pa.array(order, pa.int64()))
        strata = [picked[p][0] for p in sorted(seen)]
    else:
        sub = table.slice(0, 0)
        strata = []
    n = sub.num_rows
    cols, fields = [], []
    names = set(sub.column_names)
    for f in ROW_SCHEMA:
        if f.name == "status":
            cols.append(pa.array([status] * n, pa.string()))
        elif f.name in names:
            col = sub.column(f.name)
            if col.type != f.type:
                try:
                    col = pc.cast(col, f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    f = pa.field(f.name, col.type)
            cols.append(col)
        else:
            cols.append(pa.nulls(n, f.type))
        fields.append(pa.field(f.name, cols[-1].type, nullable=f.nullable or cols[-1].null_count > 0))
    for name in sub.column_names:  # extra columns (input_excerpt ...)
        if name not in ROW_SCHEMA.names and name not in ("qa_stratum", "qa_sample_key"):
            cols.append(sub.column(name))
            fields.append(pa.field(name, sub.column(name).type))
    cols.append(pa.array([None if s is None else str(s) for s in strata], pa.string()))
    fields.append(pa.field("qa_stratum", pa.string()))
    cols.append(pa.array([sample_key(seed, i) for i in sub.column("id").to_pylist()], pa.string()))
    fields.append(pa.field("qa_sample_key", pa.string()))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


# ---- writing / reading ------------------------------------------------------------------

SAMPLE_HTML_COLUMNS = (
    "id",
    "status",
    "input_excerpt",
    "output",
    "label",
    "parsed_json",
    "valid",
    "finish_reason",
    "error_code",
    "error_message",
    "shard_id",
    "qa_stratum",
)


def write_qa(report: QAReport, storage: Storage, prefix: str = "qa") -> dict[str, str]:
    """Write ``{prefix}/sample.parquet``, ``report.html`` and, last, ``report.json`` atomically.

    Returns the relative paths under ``storage``: keys ``report_json``, ``report_html``, ``sample``.
    """
    from airflow_provider_vllm.steps.qa.html import render_report_html

    prefix = prefix.strip("/")
    paths = {
        "sample": posixpath.join(prefix, "sample.parquet") if prefix else "sample.parquet",
        "report_html": posixpath.join(prefix, "report.html") if prefix else "report.html",
        "report_json": posixpath.join(prefix, "report.json") if prefix else "report.json",
    }
    d = report.to_dict()
    sample = report.sample
    storage.write_parquet_atomic(
        paths["sample"], sample, metadata={"qa_seed": str(d["metrics"].get("sample", {}).get("seed", ""))}
    )
    cols = [c for c in SAMPLE_HTML_COLUMNS if c in sample.column_names]
    rows = sample.select(cols).to_pylist() if cols else []
    for row in rows:  # bound the page size: outputs can be long
        for c in ("output", "input_excerpt", "parsed_json", "error_message"):
            if isinstance(row.get(c), str) and len(row[c]) > 1000:
                row[c] = row[c][:1000]
    storage.write_atomic(paths["report_html"], render_report_html(d, rows).encode("utf-8"))
    storage.write_atomic(paths["report_json"], dumps_report(d).encode("utf-8"))
    return paths


def dumps_report(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def load_report(uri: str | None, storage_options: dict[str, Any] | None = None,
                filesystems: FileSystems | None = None) -> dict[str, Any] | None:
    """A stored report.json (e.g. ``QASpec.previous_report_uri``) as a dict; None if absent."""
    if not uri:
        return None
    parent, name = posixpath.split(uri.rstrip("/"))
    if parent.endswith(":/"):  # 'memory://report.json' and the like
        parent += "/"
    st = Storage(parent or ".", storage_options or {}, filesystems)
    try:
        raw = st.read_bytes(name)
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise VllmBatchError(f"cannot parse QA report {uri}: {e}") from None
    if not isinstance(d, dict):
        raise VllmBatchError(f"QA report {uri} is not a JSON object")
    return d


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))
