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

from airflow_provider_vllm.steps.qa.metrics_stream import CONF, CONF_BUCKET, CONF_BUCKET_SQL, CONF_VALUE

BUCKETS = 10
EXAMPLES = 10


def answer_stats(
    con,
    *,
    low: float,
    least: int,
    counted: tuple[dict[int | None, tuple[int, float, int]], int] | None = None,
) -> dict[str, Any]:
    """The confidence of the rows of ``r`` per bucket (rows, sum, rows below ``low``; bucket None: no
    confidence), the rows with a prompt hash (for ``consistency_metrics``), and the ids of the ``least``
    least confident rows (ties by id). A confidence outside [0, 1] (NaN, infinite, not a probability)
    counts as none. ``counted``: (the buckets, the hashed rows) when a scan already counted them (the
    streamed QA path's tally: ``metrics_stream.ResultTally``); else two queries here."""
    if counted is None:
        found = con.execute(
            f"SELECT {CONF_BUCKET}, count(*), sum({CONF}), count(*) FILTER (WHERE {CONF} < $low) "
            f"FROM (SELECT {CONF_VALUE} AS {CONF}, {CONF_BUCKET_SQL} AS {CONF_BUCKET} FROM r) GROUP BY 1",
            {"low": float(low)},
        ).fetchall()
        buckets = {None if b is None else int(b): (int(k), float(sm or 0.0), int(lo)) for b, k, sm, lo in found}
        (hashed,) = con.execute("SELECT count(prompt_hash) FROM r").fetchall()[0]
    else:
        buckets, hashed = counted
    per = {b: x for b, x in buckets.items() if b is not None}
    n = sum(k for k, _, _ in per.values())
    ids = (
        [
            i
            for (i,) in con.execute(
                f"SELECT id FROM r WHERE confidence BETWEEN 0 AND 1 ORDER BY confidence, id LIMIT {int(least)}"
            ).fetchall()
        ]
        if least > 0 and n
        else []
    )
    return {
        "n": n,
        "low": sum(lo for _, _, lo in per.values()),
        "mean": sum(sm for _, sm, _ in per.values()) / n if n else None,
        "rows": sum(k for k, _, _ in buckets.values()),
        "hashed": int(hashed),
        "buckets": {b: k for b, (k, _, _) in per.items()},
        "least": ids,
        "threshold": float(low),
    }


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


def consistency_metrics(con, *, value: str, hashed: int) -> dict[str, Any] | None:
    """Prompts of ``r`` sent more than once and how many of them got more than one answer (``value``:
    the compared column, e.g. ``label``), with examples; None when no row carries a ``prompt_hash``
    (``hashed``: the rows that do, from ``answer_stats``)."""
    found = consistency_counts(con, value=value, hashed=hashed)
    if found is None:
        return None
    metrics, picked = found
    metrics["examples"] = consistency_examples(con, "r", value=value, picked=picked)
    return metrics


def consistency_counts(con, *, value: str, hashed: int) -> tuple[dict[str, Any], list[int]] | None:
    """``consistency_metrics`` without its examples, and the prompt hashes to take them from (the most
    repeated of the prompts answered differently): one GROUP BY of ``r``."""
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
    picked = [
        int(h)
        for (h,) in con.execute(
            f"SELECT prompt_hash FROM qa_repeats WHERE differ ORDER BY n DESC, prompt_hash LIMIT {EXAMPLES}"
        ).fetchall()
    ]
    con.execute("DROP TABLE qa_repeats")
    metrics = {
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
        "examples": [],
    }
    return metrics, picked


def consistency_examples(con, relation: str, *, value: str, picked: list[int]) -> list[dict[str, Any]]:
    """The ids (up to 6) and the answers of each prompt hash in ``picked``, from ``relation`` (``r``, or a
    table that holds at least those rows of it)."""
    if not picked:
        return []
    # a constant IN list of a few integers
    found = con.execute(
        f"SELECT prompt_hash, list(id ORDER BY id)[:6], list(DISTINCT CAST({value} AS VARCHAR)) FROM {relation} "
        f"WHERE prompt_hash IN ({', '.join(str(h) for h in picked)}) GROUP BY 1 ORDER BY 1"
    ).fetchall()
    return [{"ids": ids, "answers": sorted(a for a in answers if a is not None)} for _, ids, answers in found]
