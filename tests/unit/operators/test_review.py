"""The human gate after QA (operator level; the real approve/reject path runs in tests/ui).

The review reads QA's sealed verdict and its report from the run's folder: the runs here are merged and QA-checked
in this process (the fake engine), as the publish tests' are."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.operators.merge import VllmMergeOperator
from airflow_provider_vllm.operators.qa import VllmQAFailed, VllmQAOperator
from tests.support.data import plan_xcom
from tests.support.ledger import record_malicious
from tests.support.task_context import committed_job, context

SUMMARY = {
    "status": "warn",
    "summary": "QA WARN: rows=40 ok=39 errors=1 error_rate=0.025(warn)",
    "checks": [
        {"name": "error_rate", "value": 0.025, "warn": 0.01, "fail": 0.05, "status": "warn"},
        {"name": "label_drift", "value": None, "warn": 0.1, "fail": 0.3, "status": "skip"},
    ],
    "report_html": "/data/out/qa/report.html",
    "report_json": "/data/out/qa/report.json",
}


def review(spec=None, **kw):
    from airflow_provider_vllm.operators.review import VllmQAReviewOperator

    return VllmQAReviewOperator(task_id="review", qa_task_id="job.qa", spec=spec or {}, **kw)


def qa_checked(tmp_path, factory, empty=()) -> tuple[dict, dict]:
    """A 60-row run merged and QA-checked: (the spec as the plan task pushes it, the QA task's result)."""
    spec, _ = committed_job(tmp_path, factory, n=60, empty=empty)
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    return spec, VllmQAOperator(task_id="qa", spec=spec).execute(context())


@pytest.fixture
def warned(tmp_path, fake_engine_factory):
    """A run QA warned about (1 of 60 rows an error: error_rate above 1 %)."""
    spec, qa = qa_checked(tmp_path, fake_engine_factory, empty=(0,))
    assert qa["status"] == "warn"
    return spec, qa


class _TI(SimpleNamespace):
    """The review task's instance: its XComs kept by (task, key, map index), as the metadata database keeps them."""

    def xcom_push(self, key, value):
        self.xcoms[(self.task_id, key, self.map_index)] = value

    def xcom_pull(self, task_ids, key, map_indexes):
        return self.xcoms.get((task_ids, key, map_indexes))


def ctx(xcoms=None):
    c = context()
    c["ti"] = _TI(
        dag_id="d",
        run_id="r1",
        task_id="job.review",
        map_index=-1,
        id="ti-1",
        try_number=1,
        xcoms={} if xcoms is None else xcoms,
    )
    c["task_instance"] = c["ti"]
    return c


@pytest.fixture
def asked(monkeypatch):
    """The approval requests made (Airflow's HITL detail, kept here instead of the metadata database)."""
    import airflow.providers.standard.operators.hitl as hitl

    requests: list = []
    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **kw: requests.append(kw))
    return requests


def sealed_decision(spec) -> dict:
    """The review's decision as it sealed it into the run's folder (``qa/_REVIEW.json``), checked."""
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.qa.store import read_review

    return read_review(Storage(spec["io"]["output_uri"]), Keyring.from_env()).dump()


def test_pass_publishes_without_asking_and_review_is_never_retried(tmp_path, fake_engine_factory):
    spec, qa = qa_checked(tmp_path, fake_engine_factory)
    assert qa["status"] == "pass"
    op = review(spec, qa_result=qa)
    assert op.retries == 0
    got = op.execute(ctx())
    decision = sealed_decision(spec)
    assert got == {
        "approved": True,
        "asked": False,
        "qa_status": "pass",
        "record_mac": qa["record_mac"],
        "review_mac": decision["seal"]["mac"],
    }
    assert decision["dag_run"] == {"dag_id": "d", "run_id": "r1"} and decision["qa_record_mac"] == qa["record_mac"]
    assert (decision["qa_status"], decision["asked"], decision["approved"], decision.get("answer")) == (
        "pass",
        False,
        True,
        None,
    )


def approve_event(option="Approve"):
    return {
        "chosen_options": [option],
        "params_input": {},
        "responded_at": datetime.now(UTC),
        "responded_by_user": {"id": "admin", "name": "admin"},
    }


def test_an_approval_names_the_verdict_the_person_was_shown(warned, asked):
    """The task waits for a person; meanwhile QA runs again alone and writes another verdict. On resume Airflow
    renders ``qa_result`` again (the new verdict), but the approval is of the one the person was shown: publish
    compares it with the verdict it publishes."""
    import airflow.providers.standard.operators.hitl as hitl

    spec, qa = warned
    xcoms: dict = {}
    with pytest.raises(hitl.TaskAwaitingInput) as waiting:
        review(spec, qa_result=qa).execute(ctx(xcoms))
    resumed = review(spec, qa_result={**qa, "record_mac": "qa-run-again"})  # re-rendered on resume
    # Airflow resumes the task with the arguments it waited with (next_kwargs), the person's answer added
    got = resumed.execute_complete(ctx(xcoms), approve_event(), **waiting.value.kwargs)
    assert got["record_mac"] == qa["record_mac"]
    assert review(spec, qa_result=qa, ask="false").execute(ctx())["record_mac"] == qa["record_mac"]


def test_an_approval_never_names_a_verdict_written_into_the_waiting_tasks_xcom(warned, asked):
    """Whoever may write XCom rewrote the waiting review task's own XComs (the seal it kept of the verdict shown) to
    name another verdict (a later QA's, one of another run): the approval named it, and publish took it as approved.
    The seal shown now waits with the task (its resume arguments, in the metadata database): XCom is not read."""
    import airflow.providers.standard.operators.hitl as hitl

    from airflow_provider_vllm.operators.review import REVIEWED

    spec, qa = warned
    xcoms: dict = {}
    with pytest.raises(hitl.TaskAwaitingInput) as waiting:
        review(spec, qa_result=qa).execute(ctx(xcoms))
    assert waiting.value.method_name == "execute_complete" and waiting.value.kwargs == {REVIEWED: qa["record_mac"]}
    forged = {("job.review", REVIEWED, -1): "f" * 64, ("job.review", "return_value", -1): {"record_mac": "f" * 64}}
    xcoms.update(forged)
    got = review(spec, qa_result=qa).execute_complete(ctx(xcoms), approve_event(), **waiting.value.kwargs)
    assert got["record_mac"] == qa["record_mac"] and got["chosen_options"] == ["Approve"]
    # an answer to a request that kept no seal (made before an upgrade) approves nothing: the task is asked again
    with pytest.raises(AirflowFailException, match="names no QA verdict the person was shown.*clear this task"):
        review(spec, qa_result=qa).execute_complete(ctx(forged), approve_event())
    record_malicious("review_approval_of_a_verdict_written_into_xcom", 2, 2)


def test_warn_with_review_off_is_approved_unasked_and_bad_flags_fail(warned):
    spec, qa = warned
    assert review(spec, qa_result=qa, ask="false").execute(ctx())["asked"] is False
    decision = sealed_decision(spec)
    assert (decision["qa_status"], decision["ask"], decision["asked"], decision["approved"]) == (
        "warn",
        False,
        False,
        True,
    )
    with pytest.raises(AirflowFailException, match="ask='maybe'"):
        review(spec, qa_result=qa, ask="maybe").execute(ctx())


def test_a_sealed_fail_verdict_is_never_approved(tmp_path, fake_engine_factory):
    """QA failed the run (10 of 60 rows errors); were the review ever reached (a trigger rule), it fails too."""
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=60, empty=range(10))
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    with pytest.raises(VllmQAFailed):
        VllmQAOperator(task_id="qa", spec=spec).execute(context())
    mac = json.loads((tmp_path / "out" / "qa" / "_QA.json").read_text())["seal"]["mac"]
    with pytest.raises(AirflowFailException, match="QA status is 'fail'"):
        review(spec, qa_result={"status": "fail", "record_mac": mac}).execute(ctx())


@pytest.mark.reliability
def test_a_variable_or_trigger_turning_the_review_off_fails_it_the_dag_files_literal_does_not(
    warned, tmp_path, fake_engine_factory, monkeypatch
):
    """Off is looser than on: a QA 'warn' is published without a person. The nightly's ``vllm_batch_human_review``
    Variable may turn it off only where the deployment says Variables may loosen QA; a trigger never may."""
    import airflow.providers.standard.operators.hitl as hitl

    spec, qa = warned

    def rendered(raw, value, run=(spec, qa)):
        op = review(run[0], qa_result=run[1], ask=raw)
        op.ask = value  # as Airflow renders the template
        return op

    variable = "{{ var.value.get('vllm_batch_human_review', 'true') }}"
    with pytest.raises(AirflowFailException, match="is false from Variables.*qa_settings_from_variables") as e:
        rendered(variable, "false").execute(ctx())
    assert "not publishing" in str(e.value)
    for trigger in ("{{ params.review }}", "{{ dag_run.conf.get('review', true) }}"):
        with pytest.raises(AirflowFailException, match="is false from .*trigger"):
            rendered(trigger, "False").execute(ctx())
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES", "True")
    assert rendered(variable, "false").execute(ctx())["asked"] is False
    with pytest.raises(AirflowFailException, match="is false from trigger params"):
        rendered("{{ params.review }}", "false").execute(ctx())  # opt-in or not
    # turning it on, or a pass (nothing to ask about), is never refused; nor the DAG file's literal off
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES")
    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **kw: None)
    with pytest.raises(hitl.TaskAwaitingInput):
        rendered("{{ params.review }}", "true").execute(ctx())
    passed = qa_checked(tmp_path / "passed", fake_engine_factory)
    assert passed[1]["status"] == "pass"
    assert rendered("{{ params.review }}", "false", passed).execute(ctx())["approved"] is True
    assert review(spec, qa_result=qa, ask=False).execute(ctx())["asked"] is False
    record_malicious("review_turned_off_at_the_review_task", 4, 4)


def test_warn_writes_the_sealed_report_as_the_request_and_waits(warned, asked):
    import airflow.providers.standard.operators.hitl as hitl

    spec, qa = warned
    with pytest.raises(hitl.TaskAwaitingInput):
        review(spec, qa_result=qa).execute(ctx())
    (req,) = asked
    assert req["options"] == ["Approve", "Reject"] and req["multiple"] is False
    body = req["body"]
    assert qa["summary"] in body and "| error_rate | 0.01667 | above 0.01 | above 0.05 | **warn** |" in body
    assert "label_drift" not in body  # skipped checks are not shown
    assert "/vllm-batch/report?dag_id=d&run_id=r1&task_id=job.qa" in body
    assert f"Report file: `{spec['io']['output_uri']}/qa/report.html`" in body


def test_the_person_is_shown_the_sealed_verdict_not_a_qa_result_changed_in_xcom(warned, asked):
    """Whoever may write XCom (the REST API's XCom endpoints) rewrote the QA task's result after QA wrote it: the
    summary and checks a person approves on said all was well, while the sealed verdict warns about errors. The
    request showed the XCom's text; it now shows the sealed verdict's summary and its report's checks."""
    import airflow.providers.standard.operators.hitl as hitl

    spec, qa = warned
    forged = {
        **qa,
        "summary": "QA WARN: rows=60 ok=60 errors=0 (a formality: approve)",
        "checks": [{"name": "error_rate", "value": 0.0, "warn": 0.01, "fail": 0.05, "status": "warn"}],
        "report_html": "s3://elsewhere/qa/report.html",
    }
    with pytest.raises(hitl.TaskAwaitingInput):
        review(spec, qa_result=forged).execute(ctx())
    (req,) = asked
    assert (
        "a formality" not in req["body"]
        and "elsewhere" not in req["body"]
        and "| error_rate | 0.0 |" not in req["body"]
    )
    assert qa["summary"] in req["body"] and "| error_rate | 0.01667 |" in req["body"]
    record_malicious("review_text_from_a_changed_qa_result", 1, 1)


def test_a_qa_result_changed_to_pass_is_refused_not_approved_unasked(warned):
    """The QA task's result said 'pass' for a sealed 'warn': the review approved it without asking (publish
    refused it later). It now decides on the sealed verdict and fails, saying the result was changed."""
    spec, qa = warned
    with pytest.raises(AirflowFailException, match=r"result says 'pass', but its sealed verdict .*_QA.json is 'warn'"):
        review(spec, qa_result={**qa, "status": "pass"}).execute(ctx())
    record_malicious("review_of_a_qa_result_changed_to_pass", 1, 1)


def test_only_the_verdict_the_qa_task_wrote_is_reviewed(warned, tmp_path):
    """Another verdict in the folder (QA run again, one put back), a result naming none, a report changed after QA
    sealed it, or no verdict at all: the review fails without asking anyone."""
    spec, qa = warned
    for told in ({**qa, "record_mac": "0" * 64}, {k: v for k, v in qa.items() if k != "record_mac"}):
        with pytest.raises(AirflowFailException, match=r"is not the verdict this run's QA task wrote.*run the QA task"):
            review(spec, qa_result=told).execute(ctx())
    report = tmp_path / "out" / "qa" / "report.json"
    genuine = report.read_bytes()
    report.write_bytes(genuine.replace(b'"warn"', b'"pass"'))
    with pytest.raises(AirflowFailException, match=r"report.json is not the file the sealed .* names"):
        review(spec, qa_result=qa).execute(ctx())
    report.write_bytes(genuine)
    (tmp_path / "out" / "qa" / "_QA.json").unlink()
    with pytest.raises(AirflowFailException, match=r"no sealed QA verdict \S+_QA.json"):
        review(spec, qa_result=qa).execute(ctx())
    record_malicious("review_of_another_or_changed_verdict", 4, 4)


def test_approve_returns_the_response_and_reject_fails_the_task(warned, asked):
    """Each answer is sealed into ``qa/_REVIEW.json`` (who, when, the option chosen, the verdict, the DAG run) before
    the task returns or fails: publish decides from that record."""
    import airflow.providers.standard.operators.hitl as hitl

    spec, qa = warned
    with pytest.raises(hitl.TaskAwaitingInput) as waiting:
        review(spec, qa_result=qa).execute(ctx())
    got = review(spec, qa_result=qa).execute_complete(ctx(), approve_event("Approve"), **waiting.value.kwargs)
    decision = sealed_decision(spec)
    assert got["chosen_options"] == ["Approve"] and got["record_mac"] == qa["record_mac"]
    assert got["review_mac"] == decision["seal"]["mac"]
    assert decision["approved"] is True and decision["asked"] is True and decision["ask"] is True
    assert decision["answer"]["chosen_options"] == ["Approve"] and decision["answer"]["responded_by"] == "admin"
    assert decision["qa_record_mac"] == qa["record_mac"] and decision["qa_status"] == "warn"
    assert decision["dag_run"] == {"dag_id": "d", "run_id": "r1"}
    with pytest.raises(AirflowFailException, match="rejected by admin; nothing is published"):
        review(spec, qa_result=qa).execute_complete(ctx(), approve_event("Reject"), **waiting.value.kwargs)
    rejected = sealed_decision(spec)  # the rejection replaced the approval: no approval of this run is left
    assert rejected["approved"] is False and rejected["answer"]["chosen_options"] == ["Reject"]


def test_a_review_asked_again_leaves_no_earlier_decision_while_it_waits(warned, asked):
    """The review task cleared after an approval (or a rejection) asks again: while it waits, no decision of the
    earlier attempt is in the folder for publish to take."""
    import airflow.providers.standard.operators.hitl as hitl

    spec, qa = warned
    with pytest.raises(hitl.TaskAwaitingInput) as waiting:
        review(spec, qa_result=qa).execute(ctx())
    review(spec, qa_result=qa).execute_complete(ctx(), approve_event(), **waiting.value.kwargs)
    review_json = Path(spec["io"]["output_uri"]) / "qa" / "_REVIEW.json"
    assert review_json.exists()
    with pytest.raises(hitl.TaskAwaitingInput):
        review(spec, qa_result=qa).execute(ctx())
    assert not review_json.exists()


@pytest.mark.reliability
def test_a_verdict_of_another_dag_run_is_not_reviewed(warned, tmp_path, fake_engine_factory, asked):
    """Whoever may write the plan task's ``spec`` XCom and the QA task's pointed the review at another run's folder
    of this deployment, holding its own genuine sealed verdict (its seal's scope is that folder, so it verified): a
    person was asked to approve, or a 'pass' was approved, for this run on another run's answers. The verdict names
    the DAG run that made it: the review takes only its own run's, and one that names no run (QA of an earlier
    version) is refused too, asking for QA again."""
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.steps.qa.stage import qa_run, qa_summary

    spec, qa = warned
    other, _ = committed_job(tmp_path / "other", fake_engine_factory, n=60)
    VllmMergeOperator(task_id="merge", spec=other, plan=plan_xcom(other)).execute(context())
    theirs = VllmQAOperator(task_id="qa", spec=other).execute(context(run_id="scheduled__older"))
    assert theirs["status"] == "pass"
    with pytest.raises(
        AirflowFailException, match=r"made by DAG run 'd' / 'scheduled__older', not by this DAG run 'd' / 'r1'"
    ):
        review(other, qa_result=theirs).execute(ctx())
    assert not asked and not (Path(other["io"]["output_uri"]) / "qa" / "_REVIEW.json").exists()
    # a verdict sealed before it named its run (QA of the earlier version: the steps without a DAG run)
    report, paths = qa_run(JobSpec.load(spec), keyring=Keyring.from_env())
    older = qa_summary(report, paths, spec["io"]["output_uri"])
    with pytest.raises(AirflowFailException, match=r"names no DAG run .*; run the QA task again"):
        review(spec, qa_result=older).execute(ctx())
    record_malicious("review_of_a_verdict_of_another_dag_run", 2, 2)


def test_qa_report_link_points_at_the_plugin_with_ids_only():
    from airflow_provider_vllm.links.report import VllmQAReportLink
    from airflow_provider_vllm.operators import VllmQAOperator

    key = SimpleNamespace(dag_id="d", run_id="scheduled__2026-01-01T02:00:00+00:00", task_id="job.qa", map_index=-1)
    link = VllmQAReportLink().get_link(VllmQAOperator(task_id="qa", spec={}), ti_key=key)
    assert link == "/vllm-batch/report?dag_id=d&run_id=scheduled__2026-01-01T02%3A00%3A00%2B00%3A00&task_id=job.qa"
    on_review = VllmQAReportLink().get_link(
        review(qa_result=SUMMARY), ti_key=SimpleNamespace(dag_id="d", run_id="r", task_id="job.review")
    )
    assert on_review.endswith("task_id=job.qa")


def test_the_request_carries_a_deadline_and_silence_fails_without_publishing(warned, asked):
    """Airflow's scheduler resolves a timed-out request; with no default option (on purpose) it
    resumes the task with a timeout event, which must fail the task, not approve."""
    from datetime import timedelta

    import airflow.providers.standard.operators.hitl as hitl

    spec, qa = warned
    op = review(spec, qa_result=qa, response_timeout=timedelta(hours=2))
    assert op.defaults is None
    before = datetime.now(UTC)
    with pytest.raises(hitl.TaskAwaitingInput):
        op.execute(ctx())
    deadline = datetime.fromisoformat(op.hitl_summary_extra["timeout_datetime"])
    assert timedelta(hours=2) <= deadline - before < timedelta(hours=2, minutes=1)
    # the scheduler's sweep event for "no response, no defaults"
    timeout_event = {
        "error": "The Human-in-the-loop response timeout has passed without a response.",
        "error_type": "timeout",
    }
    with pytest.raises(AirflowFailException, match=r"no decision within 2:00:00; nothing is published"):
        op.execute_complete(ctx(), timeout_event)


def test_the_builder_wires_the_review_deadline_and_notifiers():
    from datetime import timedelta

    from airflow.sdk import DAG, BaseNotifier

    from airflow_provider_vllm.task_groups.batch_job import vllm_batch_job

    class Note(BaseNotifier):
        def notify(self, context):  # pragma: no cover - not called here
            pass

    note = Note()
    spec = {"model": {"name": "m"}, "io": {"input_uri": "/in", "output_uri": "/out"}}
    with DAG("review_wiring", schedule=None) as dag:
        vllm_batch_job(spec, group_id="a")
        vllm_batch_job(spec, group_id="b", review_timeout=timedelta(minutes=30), review_notifiers=[note])
    assert dag.get_task("a.review").response_timeout == timedelta(hours=12)
    # the review reads the run's sealed verdict where publish does: the plan task's spec, the same Connections
    assert dag.get_task("a.review").spec == dag.get_task("a.publish").spec
    b = dag.get_task("b.review")
    assert b.response_timeout == timedelta(minutes=30) and list(b.notifiers) == [note]


@pytest.mark.parametrize(
    "value, flag", [(True, True), ("true", True), (" Yes ", True), ("1", True), (False, False), ("off", False)]
)
def test_ask_takes_the_usual_spellings_of_a_boolean(value, flag):
    from airflow_provider_vllm.operators.review import parse_flag

    assert parse_flag(value, "ask") is flag


def test_a_qa_result_that_is_not_a_mapping_never_publishes(warned):
    spec, _ = warned
    with pytest.raises(AirflowFailException, match="its result names none"):
        review(spec, qa_result="{{ not rendered }}").execute(ctx())


@pytest.mark.parametrize(
    "path",
    [
        "/data/out/x`<https:evil.example/approve-here>`/qa/report.html",
        "/data/out/``x``<a href=https://evil.example>approve</a>/qa/report.html",
        "`/data/out/qa/report.html",
        "/data/out/x\n\n[approve here](https://evil.example)/qa/report.html",
    ],
)
def test_the_approval_request_shows_run_values_as_text_never_as_markdown(path):
    """Whatever the report path holds (the output prefix comes from the trigger form; locations with markup are
    refused by the allow-list, and the body does not rely on it), it stays inside one code span on one line; the
    summary's markup characters are escaped."""
    from airflow_provider_vllm.operators.review import review_body

    body = review_body({**SUMMARY, "summary": "QA WARN <b>[x](https://evil.example)</b>", "report_html": path})
    (line,) = [x for x in body.splitlines() if x.startswith("Report file:")]
    span = line.removeprefix("Report file: ")
    fence = re.match(r"`+", span).group(0)
    assert span.endswith(fence) and fence not in span[len(fence) : -len(fence)]  # one span, nothing closes it
    assert "evil.example" not in body.replace(line, "").replace(r"\[x\](https://evil.example)", "")
    assert r"\<b\>\[x\](https://evil.example)\</b\>" in body
    plain = review_body(SUMMARY)
    assert "Report file: `/data/out/qa/report.html`" in plain


def test_the_approval_request_says_accuracy_warns_below_its_thresholds_with_its_interval():
    """The person approving a 'warn' reads the thresholds' side: accuracy warns and fails *below* them (the body
    said 'warn above 0.8 / fail above 0.5' for an accuracy of 0.55), the rates above; the accuracy's 95% interval
    is shown beside it."""
    from airflow_provider_vllm.operators.review import review_body

    accuracy = {"name": "accuracy", "value": 0.55, "warn": 0.8, "fail": 0.5, "status": "warn", "direction": "below"}
    body = review_body({**SUMMARY, "checks": [{**accuracy, "interval": [0.45, 0.65]}, *SUMMARY["checks"]]})
    assert "| accuracy | 0.55 (95% interval 0.45 to 0.65) | below 0.8 | below 0.5 | **warn** |" in body
    assert "| error_rate | 0.025 | above 0.01 | above 0.05 | **warn** |" in body
    assert "above 0.8" not in body and "label_drift" not in body  # skipped: not listed


def test_the_approval_request_says_why_each_check_warns_as_text():
    """accuracy_drop warns when the golden set changed and nothing could be paired, naming both sets in its detail,
    "and a person compares them" (docs/operations.md): the request showed only its name, 'None' and 'warn', so the
    person approving could not tell why. Each check's detail is now shown, escaped, cut to ``DETAIL_CHARS``; values
    of other types than a report holds (an interval of text, a value that is a list) are shown as text, never a
    crash nor markup."""
    from airflow_provider_vllm.operators import review as module

    review_body = module.review_body
    why = (
        "golden_set: the golden set changed since the previous report (now s3://b/golden-v2: files sha256 "
        "1f2e…, 9000 rows scored; before s3://b/golden-v1 <img src=x onerror=alert(1)> [x](https://evil.example)): "
        "accuracy not compared"
    )
    drop = {"name": "accuracy_drop", "value": None, "warn": 0.02, "fail": 0.05, "status": "warn", "detail": why}
    body = review_body({**SUMMARY, "checks": [drop]})
    (row,) = [x for x in body.splitlines() if x.startswith("| accuracy_drop")]
    assert row.startswith("| accuracy_drop | n/a | above 0.02 | above 0.05 | **warn** | golden_set: the golden set")
    assert "s3://b/golden-v2" in row and "s3://b/golden-v1" in row and "accuracy not compared |" in row
    assert " <img" not in body and r"\<img src=x onerror=alert(1)\>" in row and r"\[x\](https://evil.example)" in row
    long = review_body({**SUMMARY, "checks": [{**drop, "detail": "a|b\n" * 1000}]})
    (row,) = [x for x in long.splitlines() if x.startswith("| accuracy_drop")]
    assert (
        row.endswith("… |") and len(row) < 2 * getattr(module, "DETAIL_CHARS", 0) and r"a\|b" in row and "\n" not in row
    )
    odd = {"name": "x", "value": [1], "interval": ["low", "high"], "warn": None, "fail": None, "status": "warn"}
    body = review_body({**SUMMARY, "checks": [odd, "not a check", {**odd, "value": 0.5, "detail": 7}]})
    assert "| x | \\[1\\] (95% interval low to high) |" in body and "| x | 0.5 (95% interval low to high) |" in body
    assert "| 7 |" in body


def test_the_request_shows_the_sealed_reports_details(warned, asked):
    import airflow.providers.standard.operators.hitl as hitl

    spec, qa = warned
    with pytest.raises(hitl.TaskAwaitingInput):
        review(spec, qa_result=qa).execute(ctx())
    (req,) = asked
    report = json.loads((Path(spec["io"]["output_uri"]) / "qa" / "report.json").read_text())
    (check,) = [c for c in report["checks"] if c["name"] == "error_rate"]
    assert check["detail"]
    from airflow_provider_vllm.operators.review import md_text

    assert f"| **warn** | {md_text(check['detail'])} |" in req["body"]
