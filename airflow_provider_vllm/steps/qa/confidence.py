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
"""

from __future__ import annotations

from typing import Any

BUCKETS = 10
EXAMPLES = 10


def confidence_metrics(con, *, low: float, least: int, notes: list[str]) -> dict[str, Any] | None:
    """Confidence of the ok rows of ``r``; None when no row has one."""
    n, n_low, mean, ok = con.execute(
        "SELECT count(confidence) FILTER (WHERE isfinite(confidence)), "
        "count(*) FILTER (WHERE confidence < $low AND isfinite(confidence)), "
        "avg(confidence) FILTER (WHERE isfinite(confidence)), count(*) FROM r",
        {"low": float(low)},
    ).fetchall()[0]
    if not n:
        return None
    rows = con.execute(
        f"SELECT least(CAST(floor(confidence * {BUCKETS}) AS INTEGER), {BUCKETS - 1}), count(*) FROM r "
        "WHERE confidence IS NOT NULL AND isfinite(confidence) GROUP BY 1"
    ).fetchall()
    per = dict(rows)
    ids = (
        [
            i
            for (i,) in con.execute(
                "SELECT id FROM r WHERE confidence IS NOT NULL AND isfinite(confidence) "
                f"ORDER BY confidence, id LIMIT {int(least)}"
            ).fetchall()
        ]
        if least > 0
        else []
    )
    if n < ok:
        notes.append(
            f"confidence: {ok - n} of {ok} ok row(s) have none (rows served by the result cache from a run "
            "that did not record it, or a job with qa.confidence off)"
        )
    return {
        "rows": int(n),
        "missing": int(ok - n),
        "low_threshold": float(low),
        "low_rate": {"value": n_low / n, "count": int(n_low), "of": int(n)},
        "mean": float(mean),
        "buckets": [
            {"low": b / BUCKETS, "high": (b + 1) / BUCKETS, "rows": int(per.get(b, 0))} for b in range(BUCKETS)
        ],
        "least_confident_ids": ids,
    }


def consistency_metrics(con, *, value: str) -> dict[str, Any] | None:
    """Prompts of ``r`` sent more than once and how many of them got more than one answer (``value``:
    the compared column, e.g. ``label``); None when no row carries a ``prompt_hash``."""
    (hashed,) = con.execute("SELECT count(prompt_hash) FROM r").fetchall()[0]
    if not hashed:
        return None
    v = f"coalesce(CAST({value} AS VARCHAR), chr(0))"  # no answer is an answer of its own
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE qa_repeats AS SELECT prompt_hash, count(*) AS n, min({v}) <> max({v}) AS "
        "differ FROM r WHERE prompt_hash IS NOT NULL GROUP BY 1 HAVING count(*) > 1"
    )
    groups, rows, bad_groups, bad_rows = con.execute(
        "SELECT count(*), coalesce(sum(n), 0), count(*) FILTER (WHERE differ), "
        "coalesce(sum(n) FILTER (WHERE differ), 0) FROM qa_repeats"
    ).fetchall()[0]
    examples = []
    if bad_groups:
        found = con.execute(
            f"SELECT r.prompt_hash, list(r.id ORDER BY r.id)[:6], list(DISTINCT CAST({value} AS VARCHAR)) FROM r "
            "JOIN (SELECT prompt_hash FROM qa_repeats WHERE differ ORDER BY n DESC, prompt_hash "
            f"LIMIT {EXAMPLES}) d ON r.prompt_hash = d.prompt_hash GROUP BY 1 ORDER BY 1"
        ).fetchall()
        examples = [{"ids": ids, "answers": sorted(a for a in answers if a is not None)} for _, ids, answers in found]
    con.execute("DROP TABLE qa_repeats")
    return {
        "rows_hashed": int(hashed),
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
        "examples": examples,
    }
