"""QA metrics over a result set: input conformance, rates, label distribution and drift,
token / latency statistics with histograms, per-shard throughput, merge's duplicate count.

Pure Arrow computation (no DuckDB, no I/O). Definitions (denominators are stored with every
rate in ``metrics["rates"]``):

* ``error_rate``: error rows / (ok rows + error rows).
* ``empty_rate``: ok rows whose output is null, empty or whitespace-only / ok rows that are
  expected to carry text (rows with an ``embedding`` or ``scores`` are not).
* ``invalid_rate``: ok rows with ``valid == false`` / ok rows (only when ``structured``).
* ``truncation_rate``: ok rows whose prompt was cut (``truncated``) / ok rows. Outputs that
  hit ``max_tokens`` (``finish_reason == 'length'``) are reported as ``length_finish_rate``.
* ``label_drift``: total variation distance between this run's label fractions and the
  previous report's (``0.5 * sum |p - q|`` over the union of labels).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from airflow_provider_vllm.core.rows import ROW_SCHEMA
from airflow_provider_vllm.steps.qa.report import previous_refusal

HIST_BINS = 30  # target number of histogram bins
NULL_KEY = "(none)"  # JSON key for a null label / finish reason / error code

# ---- input conformance ------------------------------------------------------------------

RESULT_NEEDS = (
    "id",
    "output",
    "label",
    "parsed_json",  # a json_schema job's answer: what its consistency compares (changes.compared_column)
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
    "confidence",
    "prompt_hash",
)
ERROR_NEEDS = ("id", "error_code", "error_message", "shard_id")


def conform(table: pa.Table, needs: Iterable[str]) -> pa.Table:
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


def value_counts(col: pa.ChunkedArray) -> dict[Any, int]:
    """value -> count (None for nulls), largest first, ties by value."""
    if len(col) == 0:
        return {}
    if col.null_count == len(col):
        return {None: len(col)}
    vc = pc.value_counts(col)
    return sort_counts(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))


def sort_counts(pairs: Iterable[tuple[Any, int]]) -> dict[Any, int]:
    """(value, count) pairs as ``value_counts`` orders them: largest first, ties by value, None last."""
    return {v: int(n) for v, n in sorted(pairs, key=lambda p: (-p[1], p[0] is None, str(p[0])))}


def compute_metrics(results: pa.Table, errors: pa.Table, *, labels, structured, notes) -> dict[str, Any]:
    """Counts, rates, errors by code, finish reasons, label distribution, token / latency stats
    and models of conformed ``results`` / ``errors``; appends what it notices to ``notes``."""
    # Plain counts are bitmap operations on Arrow columns; group-bys use Arrow's hash kernels.
    ok, n_err = results.num_rows, errors.num_rows
    total = ok + n_err
    if total == 0:
        notes.append("no rows in results or errors: all rates are 0 and nothing was sampled")

    col = results.column
    expects_text = pc.and_(pc.is_null(col("embedding")), pc.is_null(col("scores")))
    labelled = ok - col("label").null_count
    return assemble_metrics(
        ok=ok,
        n_err=n_err,
        invalid=_count(pc.equal(col("valid"), False)),
        truncated=_count(col("truncated")),
        length_finish=_count(pc.equal(col("finish_reason"), "length")),
        text_rows=_count(expects_text),
        empty=_count_empty(col("output"), expects_text),
        labelled=labelled,
        no_valid_flag=ok > 0 and col("valid").null_count == ok,
        code_counts=value_counts(errors.column("error_code")),
        finish_counts=value_counts(col("finish_reason")),
        label_counts=value_counts(col("label")) if labelled else {},
        prompt_total=int(pc.sum(col("prompt_tokens")).as_py() or 0) if ok else 0,
        completion_total=int(pc.sum(col("completion_tokens")).as_py() or 0) if ok else 0,
        prompt_stats=_int_stats(col("prompt_tokens")),
        completion_stats=_int_stats(col("completion_tokens")),
        latency_stats=_float_stats(col("latency_ms")),
        models=_models(results),
        labels=labels,
        structured=structured,
        notes=notes,
    )


def assemble_metrics(
    *,
    ok: int,
    n_err: int,
    invalid: int,
    truncated: int,
    length_finish: int,
    text_rows: int,
    empty: int,
    labelled: int,
    no_valid_flag: bool,
    code_counts: dict,
    finish_counts: dict,
    label_counts: dict,
    prompt_total: int,
    completion_total: int,
    prompt_stats,
    completion_stats,
    latency_stats,
    models: list[dict[str, Any]],
    labels,
    structured,
    notes,
) -> dict[str, Any]:
    """The metrics dict from counts (in memory: ``compute_metrics``; streamed: ``metrics_stream``)."""
    total = ok + n_err
    by_code = {json_key(k): n for k, n in code_counts.items()}
    finish = {json_key(k): n for k, n in finish_counts.items()}
    rates = {
        "error_rate": _rate(n_err, total),
        "empty_rate": _rate(empty, text_rows),
        "invalid_rate": _rate(invalid, ok) if structured else None,
        "truncation_rate": _rate(truncated, ok),
        "length_finish_rate": _rate(length_finish, ok),
    }
    if structured and no_valid_flag:
        notes.append("structured output requested but no row carries a 'valid' flag")

    label_counts = dict(label_counts)
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
        "tokens": {"prompt_total": int(prompt_total), "completion_total": int(completion_total)},
        "prompt_tokens": prompt_stats,
        "completion_tokens": completion_stats,
        "latency_ms": latency_stats,
        "models": models,
    }


def _models(results: pa.Table) -> list[dict[str, Any]]:
    """(model, revision, rows); one cheap pass per column unless both vary."""

    def pairs() -> list[tuple[Any, Any, int]]:
        g = (
            results.select(["model", "model_revision"])
            .group_by(["model", "model_revision"])
            .aggregate([([], "count_all")])
        )
        return list(zip(g["model"].to_pylist(), g["model_revision"].to_pylist(), g["count_all"].to_pylist()))

    return models_list(
        value_counts(results.column("model")), value_counts(results.column("model_revision")), results.num_rows, pairs
    )


def models_list(
    models: dict[Any, int], revs: dict[Any, int], n_rows: int, pairs: Callable[[], list[tuple[Any, Any, int]]]
) -> list[dict[str, Any]]:
    """``_models`` from the value counts of both columns; ``pairs()`` (model, revision, rows) only when both vary."""
    if len(models) <= 1 or len(revs) <= 1:
        rev = next(iter(revs), None) if len(revs) == 1 else None
        if len(models) <= 1:
            m = next(iter(models), None)
            found = [(m, r, n) for r, n in revs.items()] if len(revs) > 1 else ([(m, rev, n_rows)] if n_rows else [])
        else:
            found = [(m, rev, n) for m, n in models.items()]
    else:
        found = sorted(pairs(), key=lambda p: (-p[2], str(p[0]), str(p[1])))
    return [{"model": m, "revision": r, "rows": int(n)} for m, r, n in found[:20]]


def _count_empty(output: pa.ChunkedArray, expects_text: pa.ChunkedArray) -> int:
    """Rows expected to carry text whose output is null, '' or whitespace-only (Unicode)."""
    if len(output) == 0:
        return 0
    if not (pa.types.is_string(output.type) or pa.types.is_large_string(output.type)):
        output = pc.cast(output, pa.large_string())
    blank = pc.or_kleene(pc.equal(output, ""), pc.utf8_is_space(output))
    blank = pc.fill_null(blank, True)  # null output counts as empty
    return _count(pc.and_(blank, expects_text))


def json_key(k: Any) -> str:
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
    return int_stats_from_counts(vc["v"].to_pylist(), vc["count_all"].to_pylist())


def int_stats_from_counts(values: list[int], counts: list[int]) -> dict[str, Any]:
    """``_int_stats`` from (ascending distinct values, their counts); shared by the streamed path."""
    n = sum(counts)
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

    stats: dict[str, Any] = {
        "count": n,
        "min": int(values[0]),
        "p50": quantile(0.5),
        "p90": quantile(0.9),
        "p99": quantile(0.99),
        "max": int(values[-1]),
        "mean": sum(v * c for v, c in zip(values, counts)) / n,
    }
    lo, w, nb, _ = _hist_plan(float(values[0]), float(values[-1]), stats["p99"], True)
    bin_counts = ((int(math.floor((v - lo) / w)), c) for v, c in zip(values, counts))
    stats["histogram"] = _histogram(lo, w, nb, bin_counts, True)
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
    stats["histogram"] = _histogram(lo, w, nb, bin_counts(x, lo, w), integer)
    return stats


def bin_counts(x: pa.Array | pa.ChunkedArray, lo: float, w: float) -> Iterable[tuple[int, int]]:
    """(bin index, count) of float64 values: floor((x - lo) / w)."""
    b = pc.cast(pc.floor(pc.divide(pc.subtract(x, lo), w)), pa.int64())
    g = pa.table({"b": b}).group_by("b").aggregate([([], "count_all")])
    return zip(g["b"].to_pylist(), g["count_all"].to_pylist())


# ---- histograms -------------------------------------------------------------------------


def _histogram(lo: float, w: float, nb: int, bin_counts: Iterable[tuple[int, int]], integer: bool) -> dict[str, Any]:
    """Sum (bin index, count) pairs into ``nb`` bins; indexes past the last go to the overflow bin."""
    bins = [0] * nb
    overflow = 0
    for k, c in bin_counts:
        if k >= nb:
            overflow += c
        else:
            bins[max(k, 0)] += c
    return _hist_dict(lo, w, bins, overflow, integer)


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


# ---- throughput, drift, duplicates ------------------------------------------------------


def throughput_metrics(shard_stats: list[dict] | None) -> dict[str, Any] | None:
    """Per-shard and overall rows/s and tokens/s from the shards' stats; None when there are none."""
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
            if (
                k not in row
                and isinstance(v, (str, int, float, bool))
                and not (isinstance(v, float) and not math.isfinite(v))
            ):
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


def add_label_drift(metrics: dict[str, Any], previous: dict | None, notes: list[str]) -> None:
    """Set ``metrics["label_drift"]`` (TVD vs ``previous``, a report dict) and ``metrics["previous"]`` (with
    ``refused``: ``{uri, why}`` when ``previous`` stands for a report that was not used)."""
    metrics["label_drift"] = None
    metrics["previous"] = None
    if previous is None:
        return
    refused = previous_refusal(previous)
    if refused is not None:  # no sealed record vouches for it: nothing of it is read (the checks then warn)
        metrics["previous"] = {"status": "not used", "refused": refused}
        notes.append(
            f"previous report {refused['uri']} not used: {refused['why']}; "
            "label drift and the change in accuracy are not judged"
        )
        return
    prev_m = previous.get("metrics", previous) if isinstance(previous, dict) else {}
    prev_rates = prev_m.get("rates") or {}
    metrics["previous"] = {
        "status": previous.get("status"),
        "run": previous.get("run") or {},
        "total": prev_m.get("total"),
        "rates": {k: (v or {}).get("value") for k, v in prev_rates.items()},
        # it scored known labels: a run that has none since warns (``checks._accuracy``), it does not skip
        "accuracy": isinstance(prev_q := prev_m.get("quality"), dict) and bool(prev_q.get("labelled")),
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


def duplicate_metrics(dup: dict[str, Any] | None, notes: list[str]) -> dict[str, Any] | None:
    """Merge's duplicate count (before its dedupe), or None when the caller has none."""
    if dup is None:
        return None
    ids = int(dup.get("ids") or 0)
    rows_dropped = int(dup.get("rows_dropped") or 0)
    examples = [str(x) for x in (dup.get("examples") or [])][:10]
    if ids:
        notes.append(
            f"{ids} id(s) were committed more than once with identical content; merge kept one "
            f"row each and dropped {rows_dropped} (e.g. {', '.join(examples[:5])})"
        )
    return {"ids": ids, "rows_dropped": rows_dropped, "examples": examples}
