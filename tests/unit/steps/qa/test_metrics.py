"""QA metrics: rates, label distribution, numeric statistics and histograms, drift, throughput."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from tests.support.qa_rows import LABELS, check, err_row, labelled_tables, ok_row, split


def hand_made():
    recs = []
    for i in range(80):  # 80 ok rows: 40 positive, 30 negative, 10 neutral
        label = "positive" if i < 40 else "negative" if i < 70 else "neutral"
        recs.append(ok_row(i, label=label))
    recs[0]["output"] = None  # 2 empty outputs
    recs[1]["output"] = " \n\t\u00a0"
    recs[2]["valid"] = False  # 1 invalid
    recs[3]["truncated"] = True  # 4 truncated
    recs[4]["truncated"] = True
    recs[5]["truncated"] = True
    recs[6]["truncated"] = True
    recs[7]["finish_reason"] = "length"
    # rows with an embedding / scores never count as empty
    recs.append(ok_row(80, output=None, label=None, embedding=[0.1, 0.2]) | {"output": None})
    recs.append(ok_row(81, output=None, label=None, scores=[0.3, 0.7]) | {"output": None})
    for i in range(18):
        recs.append(err_row(i, "ENGINE_ERROR" if i < 12 else "PROMPT_TOO_LONG"))
    return split(recs)


def test_rates_on_hand_made_case():
    results, errors = hand_made()
    rep = evaluate(results, errors, spec=QASpec(sample_size=20), labels=LABELS, structured=True)
    m = rep.metrics
    assert (m["total"], m["ok"], m["errors"]) == (100, 82, 18)
    assert m["rates"]["error_rate"] == {"value": 0.18, "count": 18, "of": 100}
    assert m["rates"]["empty_rate"] == {"value": 2 / 80, "count": 2, "of": 80}
    assert m["rates"]["invalid_rate"]["count"] == 1 and m["rates"]["invalid_rate"]["of"] == 82
    assert m["rates"]["truncation_rate"]["value"] == pytest.approx(4 / 82)
    assert m["rates"]["length_finish_rate"]["count"] == 1
    assert m["errors_by_code"]["ENGINE_ERROR"]["count"] == 12
    assert m["errors_by_code"]["PROMPT_TOO_LONG"]["rate"] == pytest.approx(0.06)
    ld = m["label_distribution"]
    assert ld["counts"] == {"positive": 40, "negative": 30, "neutral": 10}
    assert ld["fractions"]["neutral"] == pytest.approx(0.125)
    assert ld["labelled"] == 80 and ld["unlabelled"] == 2
    assert m["finish_reasons"]["stop"] == 81 and m["finish_reasons"]["length"] == 1
    pt = m["prompt_tokens"]
    assert pt["max"] == 16 and pt["count"] == 82 and pt["p50"] == pytest.approx(13.0)
    assert sum(pt["histogram"]["counts"]) + pt["histogram"]["overflow"] == 82
    assert sum(m["latency_ms"]["histogram"]["counts"]) + m["latency_ms"]["histogram"]["overflow"] == 82
    assert rep.status == "fail"
    assert check(rep, "error_rate")["status"] == "fail"
    assert check(rep, "label_drift")["status"] == "skip"
    json.dumps(rep.to_dict(), allow_nan=False)


def test_labels_with_zero_count_and_unexpected():
    results, errors = split([ok_row(i, label="positive") for i in range(5)] + [ok_row(9, label="weird")])
    rep = evaluate(results, errors, spec=QASpec(), labels=LABELS, structured=True)
    ld = rep.metrics["label_distribution"]
    assert list(ld["counts"]) == ["positive", "negative", "neutral", "weird"]
    assert ld["counts"]["negative"] == 0 and ld["unexpected"] == ["weird"]
    assert any("outside the label set" in n for n in rep.notes)


def test_not_structured_skips_invalid_and_nan_latency():
    recs = [ok_row(i, valid=None) for i in range(10)]
    recs[0]["latency_ms"] = float("nan")
    results, errors = split(recs)
    rep = evaluate(results, errors, spec=QASpec(), labels=None, structured=False)
    assert check(rep, "invalid_rate")["status"] == "skip"
    assert rep.metrics["rates"]["invalid_rate"] is None
    assert rep.metrics["label_distribution"] is None
    assert rep.metrics["latency_ms"]["count"] == 9
    assert (
        sum(rep.metrics["latency_ms"]["histogram"]["counts"]) + rep.metrics["latency_ms"]["histogram"]["overflow"] == 9
    )
    assert rep.status == "pass"
    json.dumps(rep.to_dict(), allow_nan=False)


def test_numeric_stats_match_arrow_quantiles():
    rnd = random.Random(5)
    recs = [
        ok_row(i, prompt_tokens=rnd.choice([None, rnd.randint(1, 5000)]), latency_ms=rnd.expovariate(0.01))
        for i in range(3000)
    ]
    results, errors = split(recs)
    m = evaluate(results, errors, spec=QASpec(sample_size=0), labels=None, structured=False).metrics
    for name in ("prompt_tokens", "latency_ms"):
        col = pa.compute.drop_null(results[name]).cast(pa.float64())
        q = pa.compute.quantile(col, q=[0.5, 0.9, 0.99]).to_pylist()
        st_ = m[name]
        assert [st_["p50"], st_["p90"], st_["p99"]] == pytest.approx(q, rel=1e-6)
        assert st_["mean"] == pytest.approx(pa.compute.mean(col).as_py(), rel=1e-6)
        assert st_["count"] == len(col) and st_["max"] == pytest.approx(pa.compute.max(col).as_py())
        h = st_["histogram"]
        assert sum(h["counts"]) + h["overflow"] == len(col)
        assert len(h["edges"]) == len(h["counts"]) + 1 and h["edges"] == sorted(h["edges"])
        assert h["edges"][0] <= st_["min"]
        assert len(h["counts"]) <= 40


def test_drift_against_previous():
    prev_recs = [ok_row(i, label="positive" if i < 50 else "negative") for i in range(100)]
    r0, e0 = split(prev_recs)
    prev = evaluate(r0, e0, spec=QASpec(), labels=LABELS, structured=True).to_dict()
    prev = json.loads(json.dumps(prev))  # as read back from report.json

    same = evaluate(r0, e0, spec=QASpec(), labels=LABELS, structured=True, previous=prev)
    assert same.metrics["label_drift"]["tvd"] == pytest.approx(0.0)
    assert check(same, "label_drift")["status"] == "pass"

    # 70/20/10 vs 50/50/0: TVD = 0.5 * (0.2 + 0.3 + 0.1) = 0.3
    recs = [ok_row(i, label="positive" if i < 70 else "negative" if i < 90 else "neutral") for i in range(100)]
    r1, e1 = split(recs)
    rep = evaluate(
        r1, e1, spec=QASpec(warn_label_drift=0.1, fail_label_drift=0.25), labels=LABELS, structured=True, previous=prev
    )
    d = rep.metrics["label_drift"]
    assert d["tvd"] == pytest.approx(0.3)
    assert d["delta"] == pytest.approx({"positive": 0.2, "negative": -0.3, "neutral": 0.1})
    assert check(rep, "label_drift")["status"] == "fail"
    assert rep.metrics["previous"]["total"] == 100

    # previous without a label distribution: skipped with a note
    rep2 = evaluate(r1, e1, spec=QASpec(), labels=LABELS, structured=True, previous={"status": "pass", "metrics": {}})
    assert check(rep2, "label_drift")["status"] == "skip" and any("drift" in n for n in rep2.notes)


def test_shard_stats_and_throughput():
    results, errors = labelled_tables(10)
    stats = [
        {"shard_id": "s1", "rows": 100, "seconds": 10.0, "rows_per_s": 10.0, "tokens_per_s": 500.0, "peak_mem_mb": 12},
        {"shard_id": "s0", "rows": 300, "seconds": 10.0},
        {"shard_id": "s2"},  # tolerate missing keys
    ]
    rep = evaluate(results, errors, spec=QASpec(), labels=LABELS, structured=True, shard_stats=stats)
    t = rep.metrics["throughput"]
    assert [s["shard_id"] for s in t["shards"]] == ["s0", "s1", "s2"]
    assert t["shards"][0]["rows_per_s"] == 30.0 and t["shards"][1]["peak_mem_mb"] == 12
    assert t["rows_per_s"] == 20.0 and t["slowest_shard"] == "s1"
    assert t["tokens_per_s"] is None  # s0 has no token count
    assert evaluate(results, errors, spec=QASpec(), labels=LABELS, structured=True).metrics["throughput"] is None
