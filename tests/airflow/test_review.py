"""The human gate after QA (operator level; the real approve/reject path runs in tests/ui)."""

from __future__ import annotations

from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from tests.airflow.test_operators import context

SUMMARY = {
    "status": "warn",
    "summary": "QA WARN: rows=40 ok=39 errors=1 error_rate=0.025(warn)",
    "checks": [{"name": "error_rate", "value": 0.025, "warn": 0.01, "fail": 0.05, "status": "warn"},
               {"name": "label_drift", "value": None, "warn": 0.1, "fail": 0.3, "status": "skip"}],
    "report_html": "/data/out/qa/report.html",
    "report_json": "/data/out/qa/report.json",
}


def review(**kw):
    from airflow_provider_vllm.operators.review import VllmQAReviewOperator

    return VllmQAReviewOperator(task_id="review", qa_task_id="job.qa", **kw)


def ctx():
    c = context()
    c["ti"] = SimpleNamespace(dag_id="d", run_id="manual__1", task_id="job.review", map_index=-1, id="ti-1",
                              try_number=1)
    c["task_instance"] = c["ti"]
    return c


def test_pass_publishes_without_asking_and_review_is_never_retried():
    op = review(qa_result={**SUMMARY, "status": "pass"})
    assert op.retries == 0
    assert op.execute(ctx()) == {"approved": True, "asked": False, "qa_status": "pass"}


def test_warn_with_review_off_is_approved_unasked_and_bad_flags_fail():
    from airflow.sdk.exceptions import AirflowFailException

    assert review(qa_result=SUMMARY, ask="false").execute(ctx())["asked"] is False
    with pytest.raises(AirflowFailException, match="ask='maybe'"):
        review(qa_result=SUMMARY, ask="maybe").execute(ctx())
    with pytest.raises(AirflowFailException, match="'fail'"):
        review(qa_result={**SUMMARY, "status": "fail"}).execute(ctx())


def test_warn_writes_the_qa_summary_as_the_request_and_waits(monkeypatch):
    import airflow.providers.standard.operators.hitl as hitl

    requests = []
    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **kw: requests.append(kw))
    op = review(qa_result=SUMMARY)
    with pytest.raises(hitl.TaskAwaitingInput):
        op.execute(ctx())
    (req,) = requests
    assert req["options"] == ["Approve", "Reject"] and req["multiple"] is False
    body = req["body"]
    assert SUMMARY["summary"] in body and "| error_rate | 0.025 | 0.01 | 0.05 | **warn** |" in body
    assert "label_drift" not in body  # skipped checks are not shown
    assert "/vllm-batch/report?dag_id=d&run_id=manual__1&task_id=job.qa" in body


def test_approve_returns_the_response_and_reject_fails_the_task():
    from airflow.sdk.exceptions import AirflowFailException

    def event(option):
        return {"chosen_options": [option], "params_input": {}, "responded_at": datetime.now(timezone.utc),
                "responded_by_user": {"id": "admin", "name": "admin"}}

    assert review(qa_result=SUMMARY).execute_complete(ctx(), event("Approve"))["chosen_options"] == ["Approve"]
    with pytest.raises(AirflowFailException, match="rejected by admin; nothing is published"):
        review(qa_result=SUMMARY).execute_complete(ctx(), event("Reject"))


def test_qa_report_link_points_at_the_plugin_with_ids_only():
    from airflow_provider_vllm.operators import VllmQAOperator
    from airflow_provider_vllm.ui.links import VllmQAReportLink

    key = SimpleNamespace(dag_id="d", run_id="scheduled__2026-01-01T02:00:00+00:00", task_id="job.qa", map_index=-1)
    link = VllmQAReportLink().get_link(VllmQAOperator(task_id="qa", spec={}), ti_key=key)
    assert link == "/vllm-batch/report?dag_id=d&run_id=scheduled__2026-01-01T02%3A00%3A00%2B00%3A00&task_id=job.qa"
    on_review = VllmQAReportLink().get_link(review(qa_result=SUMMARY),
                                            ti_key=SimpleNamespace(dag_id="d", run_id="r", task_id="job.review"))
    assert on_review.endswith("task_id=job.qa")
