"""QA checks: thresholds per check, the overall verdict, QAFailed."""

from __future__ import annotations

import pickle

import pytest

from airflow_provider_vllm.core.errors import VllmBatchError
from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from airflow_provider_vllm.steps.qa.report import QAFailed
from tests.support.qa_rows import check, err_row, ok_row, split


@pytest.mark.parametrize(
    "n_err, expected",
    [(0, "pass"), (1, "pass"), (2, "warn"), (5, "warn"), (6, "fail")],
)
def test_threshold_status(n_err, expected):
    recs = [ok_row(i) for i in range(100 - n_err)] + [err_row(i) for i in range(n_err)]
    results, errors = split(recs)
    spec = QASpec(warn_error_rate=0.01, fail_error_rate=0.05)
    rep = evaluate(results, errors, spec=spec, labels=None, structured=False)
    assert check(rep, "error_rate")["status"] == expected
    assert rep.status == expected
    c = check(rep, "error_rate")
    assert set(c) >= {"name", "value", "warn", "fail", "status"}


def test_overall_status_is_worst_and_qafailed():
    recs = [ok_row(i, truncated=i < 10) for i in range(90)] + [err_row(i) for i in range(10)]
    results, errors = split(recs)
    rep = evaluate(results, errors, spec=QASpec(), labels=None, structured=False)
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


def _changes(changed: int, unchanged: int, state: str = "complete") -> dict:
    both = changed + unchanged
    return {
        "previous_state": state,
        "in_both": both,
        "churn_rate": changed / both if both else None,
        "counts": {"added": 0, "removed": 0, "changed": changed, "unchanged": unchanged, "error": 0, "recovered": 0},
        "notes": ["a note"],
    }


@pytest.mark.parametrize("changed, expected", [(0, "pass"), (5, "pass"), (6, "warn"), (50, "warn"), (51, "fail")])
def test_churn_rate_check(changed, expected):
    results, errors = split([ok_row(i) for i in range(10)])
    spec = QASpec(warn_churn_rate=0.05, fail_churn_rate=0.5)
    rep = evaluate(
        results,
        errors,
        spec=spec,
        labels=None,
        structured=False,
        changes=_changes(changed, 100 - changed),
        cache={"rows": 10, "hits": 7, "misses": 3, "hit_rate": 0.7},
    )
    c = check(rep, "churn_rate")
    assert (c["status"], c["value"], c["detail"]) == (expected, changed / 100, f"{changed} / 100")
    assert rep.status == expected
    assert rep.metrics["cache"]["hit_rate"] == 0.7 and rep.metrics["changes"]["in_both"] == 100
    assert "changes: a note" in rep.notes
    assert ("churn_rate=" in rep.summary_line()) and f"{changed:.2f}%" in rep.summary_line()


@pytest.mark.parametrize(
    "changes, detail",
    [
        (None, "changes.previous_uri not set"),
        (_changes(0, 0, "absent"), "no complete previous run"),
        (_changes(0, 0), "no id answered in both runs"),
    ],
)
def test_churn_rate_skips_without_a_comparison(changes, detail):
    results, errors = split([ok_row(i) for i in range(10)])
    rep = evaluate(
        results,
        errors,
        spec=QASpec(warn_churn_rate=0, fail_churn_rate=0),
        labels=None,
        structured=False,
        changes=changes,
    )
    c = check(rep, "churn_rate")
    assert (c["status"], c["value"], c["detail"]) == ("skip", None, detail)
    assert rep.status == "pass" and "cache" not in rep.metrics
