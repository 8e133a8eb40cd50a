"""The operator's path through the Airflow UI, in headless Chromium against a real Airflow.

One ``airflow standalone`` (api-server, scheduler, dag-processor, triggerer; LocalExecutor,
SQLite) runs the DAG templates with the local runner, real vLLM CPU and SmolLM2-135M-Instruct:
(a) a re-run from the trigger form, (b) a backfill of the nightly DAG from the UI (its second night answered
from the result cache), (c) the QA
report opened through the QA task's extra link, and the human gate: a QA 'warn' waits for
a person; approve -> published, reject -> run failed and nothing published.
The two review runs start with (a) so that their engines overlap its engines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.parse
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.task_groups.batch_job import TEMPLATE_FILTERS

pytestmark = [pytest.mark.ui, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

RERUN, NIGHTLY = "vllm_batch_rerun", "vllm_nightly_reclassification"
FORM_RUN = "ui_form_run"
DAYS = ("2026-11-20", "2026-11-21")


def q(run_id: str) -> str:
    return urllib.parse.quote(run_id, safe="")


def states(server, dag_id: str, run_id: str) -> dict[tuple[str, int], str]:
    """Task states of a local-runner run, less the Kubernetes shard task its runner branch skipped."""
    st = {(t["task_id"].split(".")[-1], t["map_index"]): t["state"] for t in server.task_instances(dag_id, run_id)}
    assert st.pop(("shard_kubernetes", -1), "skipped") == "skipped"
    return st


def rows_out(out: Path) -> list[str]:
    ids = []
    for name in ("results", "errors"):
        ids += pq.read_table(out / name, columns=["id"]).column("id").to_pylist()
    return ids


def idle(page) -> None:
    """Leave the Airflow UI before a long wait through REST: its pages poll the API every few seconds (auto-refresh),
    which costs Chromium and the api-server CPU that the task processes and their vLLM engines need."""
    page.goto("about:blank")


def review_conf(ui_data) -> dict:
    return {"input_uri": str(ui_data / "review"), "output_uri": str(ui_data / "reruns" / "review_out") + "/"}


@pytest.fixture(scope="module")
def review_run(airflow_ui, ui_data):
    """A re-run over 20 tickets, one of them empty (QA 'warn'), triggered through REST."""
    airflow_ui.trigger(RERUN, review_conf(ui_data), "review_rejected")
    return "review_rejected"


def test_a_run_triggered_from_the_form_succeeds_with_named_shards(airflow_ui, ui_data, page, shots, review_run):
    page.goto(f"{airflow_ui.url}/dags/{RERUN}")
    page.get_by_test_id("trigger-dag-button").click()
    form = page.get_by_role("dialog")
    form.locator("#element_input_uri").fill(str(ui_data / "adhoc"))
    form.get_by_role("spinbutton", name="Rows per shard").fill("20")
    form.get_by_role("spinbutton", name="Max output tokens").fill("32")
    page.set_viewport_size({"width": 1400, "height": 1500})  # the whole form in one picture
    form.get_by_text("Run Parameters").scroll_into_view_if_needed()
    shots(page, "trigger-form")
    page.set_viewport_size({"width": 1400, "height": 900})
    form.get_by_role("button", name="Advanced Options").click()
    form.locator("input[name=dagRunId]").fill(FORM_RUN)
    form.get_by_test_id("trigger-dag-submit").click()
    page.wait_for_url(re.compile(f"/dags/{RERUN}/runs/{FORM_RUN}"))

    idle(page)
    run = airflow_ui.wait_run(RERUN, FORM_RUN, timeout=900)
    assert run["state"] == "success", states(airflow_ui, RERUN, FORM_RUN)
    assert run["conf"]["input_uri"] == str(ui_data / "adhoc") and run["conf"]["shard_rows"] == 20
    assert set(states(airflow_ui, RERUN, FORM_RUN).values()) == {"success"}
    names = sorted(
        t["rendered_map_index"] for t in airflow_ui.task_instances(RERUN, FORM_RUN) if t["task_id"] == "rerun.shard"
    )
    assert names == ["shard 0/2 rows 0-19", "shard 1/2 rows 20-39"]
    out = ui_data / "reruns" / TEMPLATE_FILTERS["path_safe"](FORM_RUN)
    success = json.loads((out / "_SUCCESS.json").read_text())
    assert success["rows"] == 40 and success["airflow"]["run_id"] == FORM_RUN
    given = pq.read_table(ui_data / "adhoc" / "tickets.parquet", columns=["id"]).column("id").to_pylist()
    assert sorted(rows_out(out)) == sorted(given)  # every row once, in results or errors

    # The grid with the job's group open, and the mapped shards by name.
    page.goto(f"{airflow_ui.url}/dags/{RERUN}/runs/{FORM_RUN}/tasks/rerun.shard/mapped")
    page.get_by_text("shard 1/2 rows 20-39").first.wait_for()
    expand = page.get_by_role("button", name=re.compile("expand all", re.I))
    if expand.count():  # open the job's group in the grid, for the picture
        expand.first.click()
        page.get_by_text("merge", exact=True).first.wait_for(timeout=15_000)
    shots(page, "grid-mapped-shards")


def _is_backfill_post(response) -> bool:
    return response.request.method == "POST" and urllib.parse.urlparse(response.url).path.endswith("/api/v2/backfills")


def test_a_backfill_started_from_the_ui_runs_every_date(airflow_ui, ui_data, page, shots):
    # Airflow 3.3.2 answers 503 when SQLite is locked at that moment ("Backfill creation is not supported on SQLite
    # under concurrent access"; it removes what it made, so that the user can retry): a person clicks again, and
    # so does this test, on that answer only, at most three times.
    for attempt in range(3):
        page.goto(f"{airflow_ui.url}/dags/{NIGHTLY}")
        page.get_by_test_id("trigger-dag-button").click()
        form = page.get_by_role("dialog").first
        form.get_by_text("Backfill", exact=True).click()
        # The nightly run of day D has logical date D 02:00: this range holds two of them.
        for i, (day, hm) in enumerate([("2026/11/20", "00:00"), ("2026/11/21", "03:00")]):
            page.get_by_test_id("datetime-input").nth(i).click()
            picker = page.locator("[data-scope=popover][data-part=content][data-state=open]")
            picker.get_by_placeholder("YYYY/MM/DD").fill(day)
            picker.get_by_placeholder("HH:mm").fill(hm)
            page.keyboard.press("Escape")
        form.locator("input[name=max_active_runs]").fill("1")  # night 2 after night 1, whose answers it reuses
        form.get_by_text("2 runs will be triggered").wait_for()
        if attempt == 0:
            shots(page, "backfill-form")
        with page.expect_response(_is_backfill_post) as answer:
            form.get_by_role("button", name="Run Backfill").click()
        if answer.value.status != 503:
            break
        airflow_ui.ensure_scheduler()  # the same lock error can take the scheduler down (standalone.py)
    assert answer.value.status == 200, (answer.value.status, answer.value.text()[:500])
    page.get_by_text("Backfill in progress").first.wait_for()

    idle(page)
    runs = []
    for _ in range(60):
        runs = [r for r in airflow_ui.runs(NIGHTLY) if r["run_type"] == "backfill"]
        if len(runs) == 2:
            break
        page.wait_for_timeout(2000)
    assert sorted(r["logical_date"][:10] for r in runs) == list(DAYS)
    for r in runs:
        done = airflow_ui.wait_run(NIGHTLY, r["dag_run_id"], timeout=900)
        assert done["state"] == "success", states(airflow_ui, NIGHTLY, r["dag_run_id"])
    for day in DAYS:
        success = json.loads((ui_data / "reclassification" / f"dt={day}" / "_SUCCESS.json").read_text())
        assert success["rows"] == 20 and success["qa"]["status"] == "pass"
    # night 1 ran a shard of its tickets and one of the golden rows; night 2, the same tickets, only the golden rows'
    # (every ticket answered from the cache night 1 filled)
    shards = {
        r["logical_date"][:10]: sorted(k[1] for k in states(airflow_ui, NIGHTLY, r["dag_run_id"]) if k[0] == "shard")
        for r in runs
    }
    assert shards == {DAYS[0]: [0, 1], DAYS[1]: [0]}, shards
    page.goto(f"{airflow_ui.url}/dags/{NIGHTLY}/backfills")
    page.get_by_text("2026-11-20").first.wait_for()
    shots(page, "backfill-runs")


def test_the_nightly_qa_report_shows_quality_against_the_golden_rows(airflow_ui, ui_data, page, shots):
    """The backfilled nightly runs carried golden rows (vllm_batch_golden_uri): their report page shows the
    accuracy card, the per-class table, the confusion matrix, the reliability diagram and the least
    confident answers, with the numbers of the published golden files."""
    import pyarrow.parquet as pq

    (run,) = [r for r in airflow_ui.runs(NIGHTLY) if r["run_type"] == "backfill" and r["logical_date"][:10] == DAYS[1]]
    out = ui_data / "reclassification" / f"dt={DAYS[1]}"
    truth = pq.read_table(ui_data / "golden.parquet", columns=["id", "label"]).to_pydict()
    known = {f"_vllm_golden:{i}": lab for i, lab in zip(truth["id"], truth["label"])}
    res = pq.read_table(out / "golden" / "results.parquet", columns=["id", "label"]).to_pylist()
    right = sum(r["label"] == known[r["id"]] for r in res)
    assert len(known) == 60 and len(res) + pq.read_metadata(out / "golden" / "errors.parquet").num_rows == 60
    assert not any(i.startswith("_vllm_golden:") for i in rows_out(out))  # never published

    page.set_viewport_size({"width": 1200, "height": 900})
    page.goto(
        f"{airflow_ui.url}/vllm-batch/report?dag_id={NIGHTLY}&run_id={q(run['dag_run_id'])}&task_id=reclassify.qa"
    )
    quality = page.locator('section[data-section="quality"]')
    quality.wait_for()
    card = page.locator(".card", has_text="Accuracy").first
    assert card.locator(".v").inner_text() == f"{100 * right / 60:.1f}%"
    assert "60 labelled" in card.inner_text()
    assert quality.locator('table[data-table="per-class"] tbody tr').count() >= 2
    cells = quality.locator('table[data-chart="confusion"] td[data-true] b')
    assert sum(int(c.inner_text()) for c in cells.all()) == 60
    confidence = page.locator('section[data-section="confidence"]')
    assert confidence.locator('svg[data-chart="reliability"] rect.bar').count() >= 1
    least = page.locator('section[data-section="least-confident"] tbody tr')
    assert least.count() >= 1
    top = page.locator("header").bounding_box()["y"]
    box = quality.bounding_box()
    shots(
        page,
        "qa-report-quality",
        full_page=True,
        clip={"x": 0, "y": top, "width": 1200, "height": box["y"] + box["height"] - top + 16},
    )
    for name, section in (("qa-report-confidence", "confidence"), ("qa-report-least-confident", "least-confident")):
        b = page.locator(f'section[data-section="{section}"]').bounding_box()
        shots(page, name, full_page=True, clip={"x": 0, "y": b["y"] - 8, "width": 1200, "height": b["height"] + 16})


def test_the_qa_report_opens_from_the_qa_tasks_extra_link(airflow_ui, page, shots):
    # The task's Details tab lists its extra links; a same-origin link opens in the same tab.
    page.goto(f"{airflow_ui.url}/dags/{RERUN}/runs/{FORM_RUN}/tasks/rerun.qa/details")
    link = page.get_by_role("link", name="QA report")
    shots(page, "qa-task-extra-link")
    link.click()
    page.wait_for_url(re.compile(r"/vllm-batch/report\?"))
    assert f"run_id={FORM_RUN}" in page.url and "task_id=rerun.qa" in page.url
    text = page.locator("body").inner_text()
    assert "QA" in text and "PASS" in text.upper()
    shots(page, "qa-report", full_page=True)

    # The endpoint serves only a QA task's own report, and only to a logged-in user.
    base = f"/vllm-batch/report?dag_id={RERUN}&run_id={FORM_RUN}"
    status, body, headers = airflow_ui.status_of(base + "&task_id=rerun.qa")
    assert status == 200 and b"<svg" in body and "default-src 'none'" in headers["content-security-policy"]
    assert airflow_ui.status_of(base + "&task_id=rerun.qa", auth=False)[0] == 401
    assert airflow_ui.status_of(base + "&task_id=rerun.plan")[0] == 404  # no QA summary there
    assert airflow_ui.status_of(f"/vllm-batch/report?dag_id={RERUN}&run_id=nope&task_id=rerun.qa")[0] == 404
    status, body, _ = airflow_ui.status_of(base.replace("/report?", "/report.json?") + "&task_id=rerun.qa")
    assert status == 200 and json.loads(body)["status"] == "pass"


def test_a_qa_warning_waits_for_a_person_reject_fails_approve_publishes(airflow_ui, ui_data, page, shots, review_run):
    out = ui_data / "reruns" / "review_out"
    hitl = "taskInstances/rerun.review/-1/hitlDetails"
    airflow_ui.wait_task(RERUN, review_run, "rerun.review", ("awaiting_input",), timeout=900)
    airflow_ui.wait_parked(RERUN, review_run, "rerun.review")
    detail = airflow_ui.get(f"/api/v2/dags/{RERUN}/dagRuns/{review_run}/{hitl}")
    assert detail["options"] == ["Approve", "Reject"] and "QA WARN" in detail["body"]
    assert "| error_rate | 0.05 |" in detail["body"] and "/vllm-batch/report?" in detail["body"]
    assert not (out / "_SUCCESS.json").exists()

    # Reject (REST): the run fails, nothing is published, the QA report stays for the post-mortem.
    airflow_ui.request("PATCH", f"/api/v2/dags/{RERUN}/dagRuns/{review_run}/{hitl}", {"chosen_options": ["Reject"]})
    rejected = airflow_ui.wait_run(RERUN, review_run, timeout=300)
    st = states(airflow_ui, RERUN, review_run)
    assert rejected["state"] == "failed"
    assert st[("review", -1)] == "failed" and st[("publish", -1)] == "upstream_failed"
    assert not (out / "_SUCCESS.json").exists() and (out / "qa" / "report.html").exists()
    # the rejection is sealed on record in the folder, naming who, the verdict and the DAG run: publish takes none
    decision = json.loads((out / "qa" / "_REVIEW.json").read_text())
    assert decision["approved"] is False and decision["answer"]["chosen_options"] == ["Reject"]
    assert decision["dag_run"] == {"dag_id": RERUN, "run_id": review_run}

    # Re-run the same input into the same prefix (committed shards are reused) and approve in the UI.
    airflow_ui.trigger(RERUN, review_conf(ui_data), "review_approved")
    airflow_ui.wait_task(RERUN, "review_approved", "rerun.review", ("awaiting_input",), timeout=600)
    airflow_ui.wait_parked(RERUN, "review_approved", "rerun.review")
    page.goto(f"{airflow_ui.url}/dags/{RERUN}/runs/review_approved/tasks/rerun.review/required_actions")
    page.get_by_text("QA WARN").first.wait_for()
    shots(page, "hitl-approval")
    page.get_by_role("button", name="Approve").click()
    approved = airflow_ui.wait_run(RERUN, "review_approved", timeout=300)
    assert approved["state"] == "success", states(airflow_ui, RERUN, "review_approved")
    success = json.loads((out / "_SUCCESS.json").read_text())
    assert success["qa"]["status"] == "warn" and success["error_rows"] == 1 and success["rows"] == 20
    assert success["airflow"]["run_id"] == "review_approved"
    # publish decided from the review's sealed decision of this run, on this run's QA verdict
    decision = json.loads((out / "qa" / "_REVIEW.json").read_text())
    verdict = json.loads((out / "qa" / "_QA.json").read_text())
    assert decision["dag_run"] == verdict["dag_run"] == {"dag_id": RERUN, "run_id": "review_approved"}
    assert decision["approved"] is True and decision["answer"]["responded_by"] == "admin"
    assert decision["qa_record_mac"] == verdict["seal"]["mac"] and success["review"]["by"] == "admin"
    response = airflow_ui.get(f"/api/v2/dags/{RERUN}/dagRuns/review_approved/{hitl}")
    assert response["chosen_options"] == ["Approve"] and response["responded_by_user"]["name"] == "admin"


def test_a_scheduler_that_exits_is_replaced_and_runs_go_on(airflow_ui, ui_data):
    """The harness's own guard (``Standalone.ensure_scheduler``), last of the module: after the standalone's scheduler
    dies (here SIGKILL; in Airflow 3.3.2 on SQLite, a ``StaleDataError`` out of its loop), a run triggered through
    REST is still scheduled and its tasks run, on a scheduler started in its place; a live one is never doubled.
    The run's input does not exist, so its plan fails at once (no engine starts for this check)."""
    from tests.ui.standalone import _alive

    old = airflow_ui._find_scheduler()
    assert old is not None and old == airflow_ui._scheduler
    assert airflow_ui.ensure_scheduler() is False  # alive: left alone
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(old) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert airflow_ui.ensure_scheduler() is True and airflow_ui._scheduler not in (None, old)
    run_id = "after_scheduler_restart"
    conf = {"input_uri": str(ui_data / "no-such-input"), "output_uri": str(ui_data / "reruns" / "no_such_out") + "/"}
    airflow_ui.trigger(RERUN, conf, run_id)
    assert airflow_ui.wait_run(RERUN, run_id, timeout=300)["state"] == "failed"
    plan = [t for t in airflow_ui.task_instances(RERUN, run_id) if t["task_id"].split(".")[-1] == "plan"]
    assert [t["state"] for t in plan] == ["failed"]  # it ran (and found no input) under the new scheduler
    assert len(airflow_ui.replacements) == 1 and airflow_ui._find_scheduler() == airflow_ui._scheduler
    assert f"the scheduler (pid {old}) exited: starting another" in airflow_ui.log_tail(10**8)
