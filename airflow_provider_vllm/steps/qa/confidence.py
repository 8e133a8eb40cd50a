"""The engine's confidence over every answer, and the run's consistency, in DuckDB over ``r``.

* ``confidence_metrics``: of the ok rows with a ``confidence`` (structured choice: the chosen
  label's probability, from the engine's logprobs; classify: the top class's probability), the
  low-confidence rate (``confidence < qa.low_confidence``), the mean, the rows per bucket of
  width 0.1, and the ids of the ``qa.least_confident`` least confident rows (ties by id), which
  the review sample takes.
* ``consistency_metrics``: rows with the same ``prompt_hash`` (the same engine request: token
  ids of the rendered prompt and per-row sampling settings) should get the same answer. Of the
  prompts sent more than once in this run, the share answered differently
  (``inconsistency_rate``), with the rows involved and a few examples. Greedy decoding can
  still differ through batch-dependent numerics; ``engine.batch_invariant`` asks vLLM for
  batch-invariant kernels where it has them.

Each is one scan of the columns it needs: the confidence per bucket (with the ``least``-th smallest
confidence, below which the least confident rows are then read: a filter on the confidence column, so
the other rows' ids are never compared), and one GROUP BY of the prompt hashes (which also counts the
rows with one). The streamed QA path counts the buckets from the confidences it fetches with the
latencies (``ConfidenceTally``) instead, and where rows ride along the sample's ranking scan, that scan
finds the least confident ids too (``sample.Ride.least``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

BUCKETS = 10
EXAMPLES = 10
EXAMPLE_IDS = 6  # ids listed per example prompt (the smallest)
EXAMPLE_ANSWERS = 10  # distinct answers listed per example prompt (the first in sorted order)
EXAMPLE_CHARS = 300  # an example's answer is cut to this many characters ('…' last); distinct by its whole value
# A confidence that is a probability (NaN, infinities and values outside [0, 1] are none), and its bucket.
_IS_PROBABILITY = "confidence BETWEEN 0 AND 1"
# the rows among which the least confident are, given the least-th smallest confidence ($least_cut)
LEAST_SQL = f"{_IS_PROBABILITY} AND confidence <= $least_cut"
_BUCKET = f"CASE WHEN confidence >= 1 THEN {BUCKETS - 1} ELSE CAST(floor(confidence * {BUCKETS}) AS INTEGER) END"


def answer_stats(
    con,
    *,
    low: float,
    least: int,
    counted: tuple[int, int | None] | None = None,
    tallied: ConfidenceTally | None = None,
    find_least: bool = True,
) -> dict[str, Any]:
    """The confidence of the rows of ``r`` (rows with one, below ``low``, mean, rows per bucket), the rows with
    a prompt hash (for ``consistency_metrics``), and the ids of the ``least`` least confident rows (ties by
    id). A confidence outside [0, 1] (NaN, infinite, not a probability) counts as none. ``counted``: the rows
    of ``r`` and those with a prompt hash when a scan already counted them (the streamed QA path's tally:
    ``metrics_stream.ResultTally``, which leaves the latter, None, to ``consistency_counts``); else one more
    aggregate here. ``tallied``: the buckets, counted from
    every row's confidence by that scan (same ``low`` and ``least``); else one aggregate of ``r`` here.
    ``find_least``: False leaves the least confident ids (``least``: None) to a scan that reads ``r`` anyway
    (``sample.Ride``): the rows ``LEAST_SQL`` selects with ``$least_cut`` = ``least_cut``, as ``least_ids``
    reads them."""
    if tallied is not None:
        if (tallied.low_threshold, tallied.least) != (float(low), int(least)):
            raise ValueError("answer_stats: the tallied confidence was counted with another low or least")
        found = tallied.found()
    else:
        smallest = f"min(confidence, {int(least)})" if least > 0 else "NULL"
        found = con.execute(
            f"SELECT {_BUCKET}, count(*), sum(confidence), count(*) FILTER (WHERE confidence < $low), {smallest} "
            f"FROM r WHERE {_IS_PROBABILITY} GROUP BY 1",
            {"low": float(low)},
        ).fetchall()
    rows, hashed = counted or con.execute("SELECT count(*), count(prompt_hash) FROM r").fetchall()[0]
    n = sum(int(k) for _, k, _, _, _ in found)
    # the least-th smallest confidence (each bucket kept its least smallest): no row above it is among the least
    kept = sorted(v for *_, smallest_in_bucket in found for v in smallest_in_bucket or [])
    cut = kept[:least][-1:] if least > 0 else []
    ids = least_ids(con, cut[0], least) if cut and find_least else None if cut else []
    return {
        "n": n,
        "low": sum(int(lo) for *_, lo, _ in found),
        "mean": sum(float(s or 0.0) for _, _, s, _, _ in found) / n if n else None,
        "rows": int(rows),
        "hashed": None if hashed is None else int(hashed),
        "buckets": {int(b): int(k) for b, k, _, _, _ in found},
        "least": ids,
        "least_cut": cut[0] if cut else None,
        "threshold": float(low),
    }


def least_ids(con, cut: float, least: int) -> list[str]:
    """The ids of the ``least`` least confident rows of ``r`` (ties by id), all of which have a confidence of at
    most ``cut`` (the ``least``-th smallest)."""
    return [
        i
        for (i,) in con.execute(
            f"SELECT id FROM r WHERE {LEAST_SQL} ORDER BY confidence, id LIMIT {int(least)}", {"least_cut": cut}
        ).fetchall()
    ]


class ConfidenceTally:
    """``answer_stats``'s aggregate of ``r`` over confidences fetched batch by batch (``add``), as the
    streamed QA path fetches them with the latencies: the rows per bucket, and of all of them the sum
    (float64), the rows below ``low_threshold`` and the ``least`` smallest; the same figures as the SQL (a
    value outside [0, 1], NaN or null counts as none; the bucket is ``floor(confidence * 10)`` in the
    column's own float type, as DuckDB computes it; the comparison with the threshold in float64, as DuckDB
    compares a FLOAT with a DOUBLE)."""

    def __init__(self, low: float, least: int) -> None:
        self.low_threshold, self.least = float(low), int(least)
        self._n = np.zeros(BUCKETS + 1, np.int64)  # + 1: a product that rounds up to 10 (the SQL's bucket too)
        self._low = 0
        self._sum = 0.0
        self._smallest = np.empty(0, np.float64)

    def add(self, confidence: np.ndarray) -> None:
        """Count one batch of the ``confidence`` column (its float type, nulls as NaN)."""
        if confidence.dtype.kind != "f":
            confidence = confidence.astype(np.float64)  # what DuckDB's arithmetic on a non-float column gives
        probability = (confidence >= 0) & (confidence <= 1)  # NaN compares false
        c = confidence if probability.all() else confidence[probability]  # the usual batch: no copy
        if not len(c):
            return
        # floor(confidence * 10) in the column's own float type (a truncation: the product is not negative);
        # a confidence of 1 (its product is exactly 10) goes to the last bucket, as the SQL's CASE puts it
        n = np.bincount((c * c.dtype.type(BUCKETS)).astype(np.intp), minlength=BUCKETS + 1)
        ones = int(np.count_nonzero(c == 1))
        n[BUCKETS - 1] += ones
        n[BUCKETS] -= ones
        self._n += n
        wide = c.astype(np.float64, copy=False)
        self._sum += float(wide.sum())
        self._low += int(np.count_nonzero(wide < self.low_threshold))
        if self.least > 0:
            kept = self._smallest
            new = c if len(kept) < self.least else c[c <= kept.max()]  # only what can still be among the least
            if len(new):
                v = np.concatenate([kept, new]) if len(kept) else new
                self._smallest = np.partition(v, self.least - 1)[: self.least] if len(v) > self.least else v.copy()

    def found(self) -> list[tuple[int, int, float, int, list[float] | None]]:
        """Rows as ``answer_stats``'s aggregate gives them, one per bucket with rows: (bucket, rows, sum, rows
        below the threshold, the least smallest); the sum, the rows below and the least smallest of all rows
        go with the first bucket (0.0, 0 and None with the others: ``answer_stats`` adds them up)."""
        smallest = sorted(float(v) for v in self._smallest) if self.least > 0 else None
        total, low = self._sum, self._low
        out = []
        for b in range(BUCKETS + 1):
            if self._n[b]:
                out.append((b, int(self._n[b]), total, low, smallest))
                total, low, smallest = 0.0, 0, None
        return out


def confidence_metrics(stats: dict[str, Any], *, notes: list[str]) -> dict[str, Any] | None:
    """Confidence of the ok rows of ``r`` from ``answer_stats``; None when no row has one."""
    n, ok = stats["n"], stats["rows"]
    if not n:
        return None
    if n < ok:
        notes.append(
            f"confidence: {ok - n} of {ok} ok row(s) have none (rows served by the result cache from a run "
            "that did not record it, or a job with qa.confidence off)"
        )
    return {
        "rows": n,
        "missing": ok - n,
        "low_threshold": stats["threshold"],
        "low_rate": {"value": stats["low"] / n, "count": stats["low"], "of": n},
        "mean": float(stats["mean"]),
        "buckets": [
            {"low": b / BUCKETS, "high": (b + 1) / BUCKETS, "rows": stats["buckets"].get(b, 0)} for b in range(BUCKETS)
        ],
        "least_confident_ids": stats["least"],
    }


def consistency_metrics(con, *, value: str, hashed: int | None) -> dict[str, Any] | None:
    """Prompts of ``r`` sent more than once and how many of them got more than one answer (``value``:
    the compared column, e.g. ``label``), with examples; None when no row carries a ``prompt_hash``
    (``hashed``: the rows that do, from ``answer_stats``)."""
    found = consistency_counts(con, value=value, hashed=hashed)
    if found is None:
        return None
    metrics, picked = found
    metrics["examples"] = consistency_examples(con, "r", value=value, picked=picked)
    return metrics


def consistency_counts(con, *, value: str, hashed: int | None = None) -> tuple[dict[str, Any], list[int]] | None:
    """``consistency_metrics`` without its examples, and the prompt hashes to take them from (the most
    repeated of the prompts answered differently): one GROUP BY of ``r``, which also counts the rows with a
    prompt hash (``hashed``: that count when a scan already made it; 0 skips the GROUP BY).

    Answers are compared by DuckDB's 64-bit hash of their value (no answer is an answer of its own: the hash
    of NULL is a constant of its own): the aggregate keeps two integers per prompt, not two strings (an output
    can be long). Two different answers of one prompt with equal hashes would count as one answer: a chance
    of about 2^-64 per pair."""
    if hashed is not None and not hashed:
        return None
    v = f"hash({value})"
    # the examples' prompts: the EXAMPLES smallest (-rows, prompt hash), i.e. most rows first, ties by hash
    ((counted, groups, rows, bad_groups, bad_rows, top),) = con.execute(
        f"WITH g AS (SELECT prompt_hash, count(*) AS n, min({v}) <> max({v}) AS differ FROM r "
        "WHERE prompt_hash IS NOT NULL GROUP BY 1) "
        "SELECT coalesce(sum(n), 0), count(*) FILTER (WHERE n > 1), coalesce(sum(n) FILTER (WHERE n > 1), 0), "
        "count(*) FILTER (WHERE n > 1 AND differ), coalesce(sum(n) FILTER (WHERE n > 1 AND differ), 0), "
        f"min(struct_pack(m := -n, h := prompt_hash), {EXAMPLES}) FILTER (WHERE n > 1 AND differ) FROM g"
    ).fetchall()
    if not counted:
        return None
    picked = [int(t["h"]) for t in top or []]
    metrics = {
        "rows_hashed": int(counted),
        "repeated_prompts": int(groups),
        "repeated_rows": int(rows),
        "inconsistent_prompts": int(bad_groups),
        "inconsistent_rows": int(bad_rows),
        "inconsistency_rate": {
            "value": bad_groups / groups if groups else 0.0,
            "count": int(bad_groups),
            "of": int(groups),
        },
        "compared": value,
        "examples": [],
    }
    return metrics, picked


def consistency_examples(con, relation: str, *, value: str, picked: list[int]) -> list[dict[str, Any]]:
    """The examples of the prompt hashes in ``picked`` (``examples_from``), from ``relation`` (``r``, or a table
    that holds at least those rows of it): one GROUP BY per (prompt, answer), so what the query keeps is bounded by
    the distinct answers, not by the rows (a prompt sent 30M times no longer costs 30M rows of memory)."""
    if not picked:
        return []
    # a constant IN list of a few integers
    answer = f"CAST({value} AS VARCHAR)"
    found = con.execute(
        f"SELECT prompt_hash, {EXAMPLE_GROUP_SQL.format(value=value, where='true')}, hash({answer}) FROM {relation} "
        f"WHERE prompt_hash IN ({', '.join(str(int(h)) for h in picked)}) "
        f"GROUP BY prompt_hash, hash({answer})"
    ).fetchall()
    return examples_from(found)


# per (prompt, answer): the smallest ids and the answer, cut to EXAMPLE_CHARS (the rows of one group share it; an
# output can be a long text, and the report lists up to 100 of them); ``where``: the rows counted
_CUT = "CAST({value} AS VARCHAR)"
EXAMPLE_GROUP_SQL = (
    f"min(CAST(id AS VARCHAR), {EXAMPLE_IDS}) FILTER (WHERE {{where}}) AS ex_ids, "
    f"any_value(CASE WHEN length({_CUT}) > {EXAMPLE_CHARS} THEN left({_CUT}, {EXAMPLE_CHARS - 1}) || '…' "
    f"ELSE {_CUT} END) FILTER (WHERE {{where}}) AS ex_answer"
)


def examples_from(groups) -> list[dict[str, Any]]:
    """The consistency examples from (prompt hash, ids, answer, answer hash) per group of rows sharing a prompt and
    an answer (a prompt's groups may come from several scans' groups, e.g. per stratum): per prompt hash,
    ascending, its ``EXAMPLE_IDS`` smallest ids, its distinct answers (sorted, the first ``EXAMPLE_ANSWERS``, each
    cut to ``EXAMPLE_CHARS``; no answer is not listed) and ``answers_total``, how many distinct answers it got
    (by their whole values' hashes: two long answers that differ after the cut count, and are listed, twice)."""
    ids: dict[int, set[str]] = {}
    answers: dict[int, dict[int, str]] = {}  # prompt hash -> answer hash -> the answer, cut
    for h, some_ids, answer, answer_hash in groups:
        if h is None:
            continue
        ids.setdefault(int(h), set()).update(some_ids or [])
        if answer is not None:
            answers.setdefault(int(h), {})[int(answer_hash)] = answer
    out = []
    for h in sorted(ids):
        a = sorted(answers.get(h, {}).values())
        out.append({"ids": sorted(ids[h])[:EXAMPLE_IDS], "answers": a[:EXAMPLE_ANSWERS], "answers_total": len(a)})
    return out
