"""QA stage: metrics, checks, deterministic stratified sample, report files and HTML."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_vllm.core.errors import VllmBatchError
from airflow_provider_vllm.core.rows import ERROR_COLUMNS, RESULT_COLUMNS, rows_table
from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.qa.evaluate import (
    QAFailed,
    QAReport,
    allocate,
    load_report,
    run_qa,
    sample_key,
    write_qa,
)
from airflow_provider_vllm.steps.qa.html import render_report_html

LABELS = ["positive", "negative", "neutral"]


def ok_row(i, label=None, output=None, **kw):
    r = {
        "id": f"r{i}",
        "status": "ok",
        "output": output if output is not None else (label or f"text {i}"),
        "label": label,
        "valid": True,
        "finish_reason": "stop",
        "prompt_tokens": 10 + i % 7,
        "completion_tokens": 1 + i % 3,
        "truncated": False,
        "latency_ms": 50.0 + i % 11,
        "model": "m",
        "shard_id": f"s{i % 3}",
        "attempt_id": "a",
    }
    r.update(kw)
    return r


def err_row(i, code="ENGINE_ERROR", **kw):
    r = {"id": f"e{i}", "status": "error", "error_code": code, "error_message": f"bad {i}", "shard_id": "s0"}
    r.update(kw)
    return r


def split(records):
    t = rows_table(records)
    return (
        t.filter(pa.compute.equal(t["status"], "ok")).select(RESULT_COLUMNS),
        t.filter(pa.compute.equal(t["status"], "error")).select(ERROR_COLUMNS),
    )


def empty_tables():
    return split([])


def check(report, name):
    return next(c for c in report.checks if c["name"] == name)


# ---- metrics ----------------------------------------------------------------------------


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
    rep = run_qa(results, errors, spec=QASpec(sample_size=20), labels=LABELS, structured=True)
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
    rep = run_qa(results, errors, spec=QASpec(), labels=LABELS, structured=True)
    ld = rep.metrics["label_distribution"]
    assert list(ld["counts"]) == ["positive", "negative", "neutral", "weird"]
    assert ld["counts"]["negative"] == 0 and ld["unexpected"] == ["weird"]
    assert any("outside the label set" in n for n in rep.notes)


def test_not_structured_skips_invalid_and_nan_latency():
    recs = [ok_row(i, valid=None) for i in range(10)]
    recs[0]["latency_ms"] = float("nan")
    results, errors = split(recs)
    rep = run_qa(results, errors, spec=QASpec(), labels=None, structured=False)
    assert check(rep, "invalid_rate")["status"] == "skip"
    assert rep.metrics["rates"]["invalid_rate"] is None
    assert rep.metrics["label_distribution"] is None
    assert rep.metrics["latency_ms"]["count"] == 9
    assert sum(rep.metrics["latency_ms"]["histogram"]["counts"]) + rep.metrics["latency_ms"]["histogram"]["overflow"] == 9
    assert rep.status == "pass"
    json.dumps(rep.to_dict(), allow_nan=False)


def test_numeric_stats_match_arrow_quantiles():
    rnd = random.Random(5)
    recs = [
        ok_row(i, prompt_tokens=rnd.choice([None, rnd.randint(1, 5000)]), latency_ms=rnd.expovariate(0.01))
        for i in range(3000)
    ]
    results, errors = split(recs)
    m = run_qa(results, errors, spec=QASpec(sample_size=0), labels=None, structured=False).metrics
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


@pytest.mark.parametrize(
    "n_err, expected",
    [(0, "pass"), (1, "pass"), (2, "warn"), (5, "warn"), (6, "fail")],
)
def test_threshold_status(n_err, expected):
    recs = [ok_row(i) for i in range(100 - n_err)] + [err_row(i) for i in range(n_err)]
    results, errors = split(recs)
    spec = QASpec(warn_error_rate=0.01, fail_error_rate=0.05)
    rep = run_qa(results, errors, spec=spec, labels=None, structured=False)
    assert check(rep, "error_rate")["status"] == expected
    assert rep.status == expected
    c = check(rep, "error_rate")
    assert set(c) >= {"name", "value", "warn", "fail", "status"}


def test_overall_status_is_worst_and_qafailed():
    recs = [ok_row(i, truncated=i < 10) for i in range(90)] + [err_row(i) for i in range(10)]
    results, errors = split(recs)
    rep = run_qa(results, errors, spec=QASpec(), labels=None, structured=False)
    assert check(rep, "truncation_rate")["status"] == "warn"  # 10/90 > 5%
    assert check(rep, "error_rate")["status"] == "fail"  # 10%
    assert rep.status == "fail"
    assert [c["name"] for c in rep.failing_checks] == ["error_rate"]
    with pytest.raises(QAFailed) as ei:
        rep.raise_on_fail()
    e = ei.value
    assert isinstance(e, VllmBatchError)
    assert "error_rate" in str(e) and "truncation_rate" not in str(e)
    assert e.report["status"] == "fail" and e.failing[0]["name"] == "error_rate"
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) and e2.failing == e.failing
    assert "FAIL" in rep.summary_line() and "\n" not in rep.summary_line()


def test_drift_against_previous():
    prev_recs = [ok_row(i, label="positive" if i < 50 else "negative") for i in range(100)]
    r0, e0 = split(prev_recs)
    prev = run_qa(r0, e0, spec=QASpec(), labels=LABELS, structured=True).to_dict()
    prev = json.loads(json.dumps(prev))  # as read back from report.json

    same = run_qa(r0, e0, spec=QASpec(), labels=LABELS, structured=True, previous=prev)
    assert same.metrics["label_drift"]["tvd"] == pytest.approx(0.0)
    assert check(same, "label_drift")["status"] == "pass"

    # 70/20/10 vs 50/50/0: TVD = 0.5 * (0.2 + 0.3 + 0.1) = 0.3
    recs = [ok_row(i, label="positive" if i < 70 else "negative" if i < 90 else "neutral") for i in range(100)]
    r1, e1 = split(recs)
    rep = run_qa(r1, e1, spec=QASpec(warn_label_drift=0.1, fail_label_drift=0.25), labels=LABELS, structured=True, previous=prev)
    d = rep.metrics["label_drift"]
    assert d["tvd"] == pytest.approx(0.3)
    assert d["delta"] == pytest.approx({"positive": 0.2, "negative": -0.3, "neutral": 0.1})
    assert check(rep, "label_drift")["status"] == "fail"
    assert rep.metrics["previous"]["total"] == 100

    # previous without a label distribution: skipped with a note
    rep2 = run_qa(r1, e1, spec=QASpec(), labels=LABELS, structured=True, previous={"status": "pass", "metrics": {}})
    assert check(rep2, "label_drift")["status"] == "skip" and any("drift" in n for n in rep2.notes)


# ---- sample -----------------------------------------------------------------------------


def labelled_tables(n, n_err=0, labels=LABELS, seed=0):
    rnd = random.Random(seed)
    recs = [ok_row(i, label=rnd.choice(labels)) for i in range(n)]
    recs += [err_row(i, rnd.choice(["ENGINE_ERROR", "EMPTY_INPUT"])) for i in range(n_err)]
    return split(recs)


def sample_ids(rep):
    return rep.sample.column("id").to_pylist()


def test_sample_deterministic_and_seeded():
    results, errors = labelled_tables(500, 40)
    a = run_qa(results, errors, spec=QASpec(sample_size=50, seed=1), labels=LABELS, structured=True)
    b = run_qa(results, errors, spec=QASpec(sample_size=50, seed=1), labels=LABELS, structured=True)
    c = run_qa(results, errors, spec=QASpec(sample_size=50, seed=2), labels=LABELS, structured=True)
    assert sample_ids(a) == sample_ids(b)
    assert set(sample_ids(a)) != set(sample_ids(c))
    assert a.sample.num_rows == 50
    # order of the input does not matter
    rev = run_qa(results.take(pa.array(range(499, -1, -1))), errors, spec=QASpec(sample_size=50, seed=1), labels=LABELS, structured=True)
    assert sample_ids(rev) == sample_ids(a)
    # errors are in the sample, about 10%
    st_ = a.sample.column("status").to_pylist()
    assert st_.count("error") == 5 and st_.count("ok") == 45
    assert a.metrics["sample"]["ids"] == sample_ids(a)


def test_sample_stable_across_processes(tmp_path):
    results, errors = labelled_tables(300, 10)
    pq.write_table(results, tmp_path / "r.parquet")
    pq.write_table(errors, tmp_path / "e.parquet")
    rep = run_qa(results, errors, spec=QASpec(sample_size=30, seed=7), labels=LABELS, structured=True)
    code = textwrap.dedent(
        f"""
        import json, sys
        import pyarrow.parquet as pq
        from airflow_provider_vllm.steps.qa.evaluate import run_qa
        from airflow_provider_vllm.core.spec import QASpec
        r = pq.read_table({str(tmp_path / "r.parquet")!r})
        e = pq.read_table({str(tmp_path / "e.parquet")!r})
        rep = run_qa(r, e, spec=QASpec(sample_size=30, seed=7), labels={LABELS!r}, structured=True)
        print(json.dumps(rep.sample.column("id").to_pylist()))
        """
    )
    env = {"PYTHONHASHSEED": "123", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout) == sample_ids(rep)


def test_sample_keys_are_md5_of_seed_and_id():
    results, errors = labelled_tables(200)
    rep = run_qa(results, errors, spec=QASpec(sample_size=10, seed=3), labels=LABELS, structured=True)
    ids = sample_ids(rep)
    assert rep.sample.column("qa_sample_key").to_pylist() == [sample_key(3, i) for i in ids]
    # within each stratum the chosen ids are those with the smallest keys
    all_ids = results.column("id").to_pylist()
    all_labels = results.column("label").to_pylist()
    for lab in LABELS:
        chosen = [i for i, s in zip(ids, rep.sample.column("qa_stratum").to_pylist()) if s == lab]
        pool = sorted((sample_key(3, i) for i, lb in zip(all_ids, all_labels) if lb == lab))
        assert sorted(sample_key(3, i) for i in chosen) == pool[: len(chosen)]


def test_sample_stratified_every_label_present():
    # a very skewed distribution: the rare labels still show up
    recs = [ok_row(i, label="positive") for i in range(1000)]
    recs += [ok_row(1000 + i, label="negative") for i in range(3)]
    recs += [ok_row(2000, label="neutral")]
    results, errors = split(recs)
    rep = run_qa(results, errors, spec=QASpec(sample_size=3), labels=LABELS, structured=True)
    assert sorted(rep.sample.column("label").to_pylist()) == sorted(LABELS)
    rep = run_qa(results, errors, spec=QASpec(sample_size=40), labels=LABELS, structured=True)
    assert set(rep.sample.column("label").to_pylist()) == set(LABELS)
    assert rep.metrics["sample"]["stratified_by"] == "label"


def test_sample_by_shard_without_labels():
    results, errors = split([ok_row(i, shard_id=f"s{i % 4}") for i in range(400)])
    rep = run_qa(results, errors, spec=QASpec(sample_size=8), labels=None, structured=False)
    assert rep.metrics["sample"]["stratified_by"] == "shard_id"
    assert rep.metrics["sample"]["allocation"] == {"s0": 2, "s1": 2, "s2": 2, "s3": 2}


def test_sample_larger_than_rows():
    results, errors = labelled_tables(7, 3)
    rep = run_qa(results, errors, spec=QASpec(sample_size=500), labels=LABELS, structured=True)
    assert rep.sample.num_rows == 10
    assert sorted(sample_ids(rep)) == sorted([f"r{i}" for i in range(7)] + [f"e{i}" for i in range(3)])


def test_sample_size_zero_and_only_errors():
    results, errors = labelled_tables(20, 5)
    assert run_qa(results, errors, spec=QASpec(sample_size=0), labels=LABELS, structured=True).sample.num_rows == 0
    r0, _ = empty_tables()
    rep = run_qa(r0, errors, spec=QASpec(sample_size=3), labels=LABELS, structured=True)
    assert rep.sample.num_rows == 3 and set(rep.sample.column("status").to_pylist()) == {"error"}
    assert rep.metrics["rates"]["error_rate"]["value"] == 1.0 and rep.status == "fail"


def test_allocate():
    assert allocate({"a": 90, "b": 9, "c": 1}, 10) == {"a": 8, "b": 1, "c": 1}
    assert allocate({"a": 50, "b": 50}, 3) in ({"a": 2, "b": 1}, {"a": 1, "b": 2})
    assert allocate({"a": 5, "b": 1, "c": 0}, 2) == {"a": 1, "b": 1, "c": 0}
    assert allocate({"a": 5, "b": 3, "c": 1}, 1) == {"a": 1, "b": 0, "c": 0}
    assert allocate({"a": 2, "b": 2}, 100) == {"a": 2, "b": 2}
    assert sum(allocate({i: i + 1 for i in range(50)}, 200).values()) == 200


def test_empty_inputs():
    results, errors = empty_tables()
    rep = run_qa(results, errors, spec=QASpec(), labels=LABELS, structured=True, previous=None)
    assert rep.status == "pass"
    assert rep.metrics["total"] == 0
    assert all(c["value"] in (0.0, None) for c in rep.checks)
    assert rep.sample.num_rows == 0
    assert any("no rows" in n for n in rep.notes)
    assert rep.metrics["latency_ms"] is None
    html = render_report_html(rep.to_dict(), [])
    assert "<svg" in html
    json.dumps(rep.to_dict(), allow_nan=False)


def test_missing_optional_columns_and_extra_columns():
    results = pa.table({"id": ["a", "b", "c"], "output": ["x", "", "y"], "input_excerpt": ["in a", "in b", "in c"]})
    errors = pa.table({"id": pa.array([], pa.string()), "error_code": pa.array([], pa.string())})
    rep = run_qa(results, errors, spec=QASpec(sample_size=2), labels=None, structured=False)
    assert rep.metrics["rates"]["empty_rate"]["count"] == 1
    assert rep.sample.num_rows == 2 and "input_excerpt" in rep.sample.column_names


# ---- shard stats ------------------------------------------------------------------------


def test_shard_stats_and_throughput():
    results, errors = labelled_tables(10)
    stats = [
        {"shard_id": "s1", "rows": 100, "seconds": 10.0, "rows_per_s": 10.0, "tokens_per_s": 500.0, "peak_mem_mb": 12},
        {"shard_id": "s0", "rows": 300, "seconds": 10.0},
        {"shard_id": "s2"},  # tolerate missing keys
    ]
    rep = run_qa(results, errors, spec=QASpec(), labels=LABELS, structured=True, shard_stats=stats)
    t = rep.metrics["throughput"]
    assert [s["shard_id"] for s in t["shards"]] == ["s0", "s1", "s2"]
    assert t["shards"][0]["rows_per_s"] == 30.0 and t["shards"][1]["peak_mem_mb"] == 12
    assert t["rows_per_s"] == 20.0 and t["slowest_shard"] == "s1"
    assert t["tokens_per_s"] is None  # s0 has no token count
    assert run_qa(results, errors, spec=QASpec(), labels=LABELS, structured=True).metrics["throughput"] is None


# ---- HTML and files ---------------------------------------------------------------------


def test_html_escapes_and_is_self_contained():
    evil = "<script>alert('x')</script>"
    recs = [ok_row(i, label="positive", output=evil + " & more") for i in range(20)]
    recs.append(ok_row(99, label="<b>neg</b>"))
    recs.append(err_row(1) | {"error_message": evil})
    results, errors = split(recs)
    rep = run_qa(
        results,
        errors,
        spec=QASpec(sample_size=30),
        labels=["positive", "<b>neg</b>"],
        structured=True,
        shard_stats=[{"shard_id": "<i>s0</i>", "rows": 21, "seconds": 2.0}],
        run_info={"job": "<img src=x onerror=alert(1)>", "run_id": "manual__1"},
    )
    html = render_report_html(rep.to_dict(), rep.sample.to_pylist())
    assert "<script" not in html.lower()
    assert "&lt;script&gt;" in html
    assert "<b>neg</b>" not in html and "<img" not in html and "<i>s0</i>" not in html
    assert "<svg" in html and "<rect" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert "@import" not in html and "url(" not in html


def test_write_qa_roundtrip(tmp_path):
    results, errors = labelled_tables(200, 10)
    prev = run_qa(results, errors, spec=QASpec(), labels=LABELS, structured=True).to_dict()
    rep = run_qa(results, errors, spec=QASpec(sample_size=25), labels=LABELS, structured=True, previous=prev)
    st_ = Storage(str(tmp_path))
    paths = write_qa(rep, st_)
    assert paths == {"sample": "qa/sample.parquet", "report_html": "qa/report.html", "report_json": "qa/report.json"}
    for p in paths.values():
        assert (tmp_path / p).is_file()
    d = json.loads((tmp_path / "qa/report.json").read_text())
    assert d == json.loads(json.dumps(rep.to_dict()))
    assert QAReport.from_dict(d).to_dict() == d
    assert load_report(str(tmp_path / "qa/report.json")) == d
    assert load_report(str(tmp_path / "nope.json")) is None
    sample = pq.read_table(tmp_path / "qa/sample.parquet")
    assert sample.column("id").to_pylist() == sample_ids(rep)
    html = (tmp_path / "qa/report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "previous run" in html
    assert not list(tmp_path.rglob("*.tmp-*"))


# ---- property ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    labels=st.lists(st.sampled_from(["a", "b", "c", "d", None]), min_size=0, max_size=60),
    n_err=st.integers(0, 15),
    sample_size=st.integers(0, 80),
    seed=st.integers(-5, 10**6),
)
def test_property_sample_size_unique_from_input(labels, n_err, sample_size, seed):
    recs = [ok_row(i, label=lab) for i, lab in enumerate(labels)]
    recs += [err_row(i, ["ENGINE_ERROR", "INVALID_ROW", "EMPTY_INPUT"][i % 3]) for i in range(n_err)]
    results, errors = split(recs)
    rep = run_qa(results, errors, spec=QASpec(sample_size=sample_size, seed=seed), labels=None, structured=True)
    ids = sample_ids(rep)
    n = len(labels) + n_err
    assert len(ids) == min(sample_size, n)
    assert len(set(ids)) == len(ids)
    assert set(ids) <= {r["id"] for r in recs}
    present = set(labels)
    if any(lab is not None for lab in labels) and sample_size - min(n_err, max(1, round(0.1 * sample_size)) if sample_size >= 2 and n_err else 0) >= len(present):
        assert set(rep.sample.filter(pa.compute.equal(rep.sample["status"], "ok"))["qa_stratum"].to_pylist()) == present
