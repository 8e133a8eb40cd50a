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
