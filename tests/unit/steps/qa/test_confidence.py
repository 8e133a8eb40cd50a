"""steps/qa/confidence.py straight over a DuckDB relation ``r``: hostile values (NaN, infinities, nulls,
ids with quotes) neither crash nor count, and the figures equal pandas'."""

from __future__ import annotations

import math

import duckdb
import pandas as pd
import pyarrow as pa
import pytest

from airflow_provider_vllm.steps.qa.confidence import (
    ConfidenceTally,
    answer_stats,
    confidence_metrics,
    consistency_counts,
    consistency_metrics,
)


def _con(confidence, prompt_hash=None, label=None):
    n = len(confidence)
    r = pa.table(
        {
            "id": [f"it's-{i}" for i in range(n)],
            "label": label or ["bug"] * n,
            "confidence": pa.array(confidence, pa.float32()),
            "prompt_hash": pa.array(prompt_hash or [None] * n, pa.int64()),
        }
    )
    con = duckdb.connect()
    con.register("r", r)
    return con, r.to_pandas()


def test_confidence_skips_what_is_not_a_probability_and_equals_pandas():
    values = [0.1, 0.9, None, math.nan, math.inf, 0.45, 0.5, 1.0, 0.0]
    con, df = _con(values)
    notes = []
    c = confidence_metrics(answer_stats(con, low=0.5, least=3), notes=notes)
    finite = df["confidence"].dropna()
    finite = finite[finite.apply(math.isfinite)]
    assert c["rows"] == len(finite) == 6 and c["missing"] == 3 and notes
    assert c["low_rate"]["count"] == int((finite < 0.5).sum()) == 3
    assert math.isclose(c["mean"], float(finite.mean()), rel_tol=1e-6)
    assert c["least_confident_ids"] == ["it's-8", "it's-0", "it's-5"]
    assert sum(b["rows"] for b in c["buckets"]) == 6 and c["buckets"][9]["rows"] == 2  # 0.9 and 1.0


def test_no_answer_is_an_answer_of_its_own():
    # a prompt answered once with nothing and once with the text chr(0) got two different answers
    con, _ = _con([0.5] * 6, [1, 1, 2, 2, 3, 3], [None, chr(0), None, None, "a", "a"])
    c = consistency_metrics(con, value="label", hashed=answer_stats(con, low=0.5, least=0)["hashed"])
    assert c["repeated_prompts"] == 3 and c["inconsistent_prompts"] == 1
    assert [x["ids"] for x in c["examples"]] == [["it's-0", "it's-1"]]


def test_no_confidence_no_metrics():
    con, _ = _con([None, None])
    assert confidence_metrics(answer_stats(con, low=0.5, least=3), notes=[]) is None


def test_consistency_equals_pandas():
    hashes = [1, 1, 1, 2, 2, 3, None, None]
    labels = ["a", "a", "b", "c", "c", "d", "x", "y"]
    con, df = _con([0.5] * 8, hashes, labels)
    c = consistency_metrics(con, value="label", hashed=answer_stats(con, low=0.5, least=0)["hashed"])
    g = df.dropna(subset=["prompt_hash"]).groupby("prompt_hash")["label"].agg(["size", "nunique"])
    rep = g[g["size"] > 1]
    assert c["repeated_prompts"] == len(rep) == 2 and c["inconsistent_prompts"] == int((rep["nunique"] > 1).sum()) == 1
    assert c["repeated_rows"] == 5 and c["inconsistent_rows"] == 3 and c["rows_hashed"] == 6
    assert c["examples"] == [{"ids": ["it's-0", "it's-1", "it's-2"], "answers": ["a", "b"], "answers_total": 2}]
    assert pd.notna(c["inconsistency_rate"]["value"])


def test_a_confidence_that_is_not_a_probability_counts_as_none():
    con, _ = _con([-0.5, 3.0, 0.25, 0.999999, 1.0])
    c = confidence_metrics(answer_stats(con, low=0.5, least=5), notes=[])
    assert c["rows"] == 3 and c["missing"] == 2
    assert [b["rows"] for b in c["buckets"]] == [0, 0, 1, 0, 0, 0, 0, 0, 0, 2]
    assert c["least_confident_ids"] == ["it's-2", "it's-3", "it's-4"]


def test_the_least_confident_rows_equal_a_full_sort_with_ties_at_the_cut():
    """The ids are read only at or below the least-th smallest confidence: the same rows, in the same order, as
    sorting every row by (confidence, id), for ties across the cut, in several buckets, and for more rows asked
    than there are."""
    values = [0.3, 0.05, 0.3, 0.3, 0.95, 0.3, 1.0, 0.05, math.nan, None, 0.299, 0.3, -1.0, 0.7, 0.05]
    con, df = _con(values)
    df = df[df["confidence"].between(0, 1)]
    for least in (1, 2, 3, 4, 6, 9, 13, 50):
        want = df.sort_values(["confidence", "id"]).head(least)["id"].tolist()
        assert answer_stats(con, low=0.5, least=least)["least"] == want, least
    assert answer_stats(con, low=0.5, least=0)["least"] == []


def test_long_answers_that_differ_at_the_end_are_inconsistent():
    """Answers are compared by a hash of their text: two long outputs with one character apart differ, equal ones
    do not, and no answer differs from an empty one."""
    n = 6
    base = "x" * 5000
    r = pa.table(
        {
            "id": [f"r{i}" for i in range(n)],
            "output": [base + "a", base + "b", base, base, None, ""],
            "prompt_hash": pa.array([1, 1, 2, 2, 3, 3], pa.int64()),
            "confidence": pa.array([None] * n, pa.float32()),
        }
    )
    con = duckdb.connect()
    con.register("r", r)
    c = consistency_metrics(con, value="output", hashed=n)
    assert (c["repeated_prompts"], c["inconsistent_prompts"], c["inconsistent_rows"]) == (3, 2, 4)
    assert [x["ids"] for x in c["examples"]] == [["r0", "r1"], ["r4", "r5"]]


def test_the_examples_prompts_are_the_most_repeated_with_ties_by_hash():
    """``consistency_counts`` counts the hashed rows itself when no scan did (``hashed`` None) and picks the
    EXAMPLES inconsistent prompts with the most rows, ties by prompt hash (negative hashes too), as an ORDER BY
    would; a consistent prompt, a prompt sent once and rows without a hash are never picked."""
    hashes, labels = [], []
    sizes = {-(2**63): 3, 2**63 - 1: 3, -5: 4, 7: 2, 3: 3, -1: 2, 11: 5, 12: 3, 13: 2, 14: 2, 15: 2, 16: 3}
    for h, n in sizes.items():  # each of these answered twice differently
        hashes += [h] * n
        labels += ["a"] * (n - 1) + ["b"]
    hashes += [99] * 9 + [100] + [None] * 4  # consistent, once, no hash
    labels += ["a"] * 9 + ["c"] + ["x", "y", "z", "w"]
    con, df = _con([0.5] * len(hashes), hashes, labels)
    got, picked = consistency_counts(con, value="label")
    want = sorted(sizes, key=lambda h: (-sizes[h], h))[:10]
    assert picked == want and len(sizes) > 10
    assert got["rows_hashed"] == int(df["prompt_hash"].notna().sum()) == len(hashes) - 4
    assert (got["repeated_prompts"], got["inconsistent_prompts"]) == (len(sizes) + 1, len(sizes))
    assert got["inconsistent_rows"] == sum(sizes.values()) and got["repeated_rows"] == sum(sizes.values()) + 9
    assert consistency_counts(con, value="label", hashed=0) is None  # a scan counted none: no GROUP BY
    none, _ = _con([0.5] * 3)  # no row has a prompt hash
    assert consistency_counts(none, value="label") is None


def _same(got, want):
    """Equal figures; the mean within 1e-12 (a float sum in another order may differ in the last bits; DuckDB's
    parallel sum has no fixed order either)."""
    assert {**got, "mean": None} == {**want, "mean": None}
    assert (got["mean"] is None) == (want["mean"] is None)
    assert want["mean"] is None or math.isclose(got["mean"], want["mean"], rel_tol=1e-12)


def _tallied(con, low, least, batch, column_type=pa.float32()):
    """A ConfidenceTally fed ``r``'s confidence in batches of ``batch`` rows, as the latency fetch feeds it."""
    from airflow_provider_vllm.steps.qa.metrics_stream import _floats

    t = ConfidenceTally(low, least)
    col = con.sql("SELECT confidence FROM r").to_arrow_table().column(0)
    col = pa.chunked_array([pa.nulls(len(col))]) if pa.types.is_null(column_type) else col.cast(column_type)
    for i in range(0, len(col), batch):
        t.add(_floats(col.slice(i, batch).combine_chunks()))
    return t


# float32 values at and around the bucket edges and the threshold (0.3 is not a float32: which side of it
# does float32(0.3) fall on), hostile values, and enough rows for several batches
_EDGES = [0.1, 0.2, 0.3, 0.7, 0.9, 1.0, 0.0, 0.5, 0.29999998, 0.30000001, 0.6, 0.8, 0.99999994, 1e-30]
_HOSTILE = [None, math.nan, math.inf, -math.inf, -0.0, -1e-30, 1.0000001, 2.0]


def test_the_tallied_confidence_equals_the_aggregate():
    """``answer_stats`` from a ``ConfidenceTally`` (the streamed path: the confidence fetched with the latencies)
    equals the same figures from DuckDB's aggregate of ``r``: buckets, rows below the threshold, mean and the
    least confident ids, for thresholds that are and are not float32 values and batches of any size."""
    values = (_EDGES + _HOSTILE) * 7 + [i / 997 for i in range(997)]
    con, _ = _con(values)
    for low, least in ((0.5, 3), (0.3, 20), (0.7, 0), (0.1, 1000)):
        want = answer_stats(con, low=low, least=least)
        for batch in (1, 5, 64, 10_000):
            _same(answer_stats(con, low=low, least=least, tallied=_tallied(con, low, least, batch)), want)
    # another low or least than the tally counted with: refused, not a silently different figure
    with pytest.raises(ValueError, match="another low or least"):
        answer_stats(con, low=0.4, least=3, tallied=_tallied(con, 0.5, 3, 64))


def test_a_double_confidence_is_bucketed_in_double_as_duckdb_does():
    """A results table whose confidence is a DOUBLE (not the FLOAT the workers write): the bucket is computed in
    float64 there, where float32 would move a value just under an edge (0.3 - 1e-12 is 0.3 as a float32) to the
    bucket above."""
    under = [0.3 - 1e-12, 0.7 - 1e-12, 0.5 - 1e-12]
    values = _EDGES + under + _HOSTILE
    n = len(values)
    r = pa.table(
        {
            "id": [f"r{i}" for i in range(n)],
            "confidence": pa.array(values, pa.float64()),
            "prompt_hash": pa.nulls(n, pa.int64()),
        }
    )
    con = duckdb.connect()
    con.register("r", r)
    want = answer_stats(con, low=0.5, least=4)
    got = answer_stats(con, low=0.5, least=4, tallied=_tallied(con, 0.5, 4, 3, pa.float64()))
    _same(got, want)
    assert sum(want["buckets"].values()) == want["n"]
    assert want["buckets"][2] == 2 + 1  # 0.2, 0.29999998 and 0.3 - 1e-12 (float32 would have put it in bucket 3)


def test_a_column_of_only_nulls_tallies_nothing():
    con, _ = _con([None, None, None])
    t = _tallied(con, 0.5, 3, 2, pa.null())
    assert t.found() == [] and confidence_metrics(answer_stats(con, low=0.5, least=3, tallied=t), notes=[]) is None


@pytest.mark.parametrize("column_type", [pa.float32(), pa.float64()])
def test_a_batch_of_only_probabilities_tallies_as_the_aggregate(column_type):
    """Batches where every value is a probability (the usual batch, counted without a filtered copy), with
    confidences of exactly 1 (their product is exactly 10: the last bucket, as the SQL's CASE puts them) and
    the largest values under 1 and under each edge."""
    values = [1.0, 0.99999994, 1.0 - 1e-12, 0.9, 0.09999999, 0.1, 0.0, 1.0, 0.5, 0.49999997] * 5
    n = len(values)
    r = pa.table({"id": [f"r{i}" for i in range(n)], "confidence": pa.array(values, column_type)})
    con = duckdb.connect()
    con.register("r", r)
    want = answer_stats(con, low=0.5, least=4, counted=(n, 0))
    assert want["buckets"][9] == 5 * 5 and want["n"] == n
    for batch in (1, 10, n):
        _same(
            answer_stats(con, low=0.5, least=4, counted=(n, 0), tallied=_tallied(con, 0.5, 4, batch, column_type)), want
        )
