"""The report endpoint's access rule: only a run's own qa/report.*, under the deployment's allow-list,
located by XComs the metadata DB ties to the run's own plan and QA task instances.

Pure checks (``report_access``); the page itself, with hostile XComs against real servers on
loopback, is tested in tests/airflow/test_report_page_access.py.
"""

from datetime import UTC, datetime, timedelta

import pytest

from airflow_provider_vllm.plugins.report_access import (
    CLOCK_SKEW,
    ReportAccessError,
    ReportLocation,
    ReportPolicy,
    RunRecords,
    TaskRecord,
    XComRecord,
    check_local_file,
    parse_roots,
    plan_task_id,
    resolve_report,
    tie_to_tasks,
    under_roots,
)
from tests.support.ledger import record_malicious

ALLOW = ReportPolicy(allowed=("s3://bucket/out", "/data"))


def spec(out, **io):
    return {"io": {"input_uri": "/in", "output_uri": out, **io}}


def qa(report):
    return {"status": "warn", "report_html": report}


def test_a_runs_own_report_resolves_to_its_canonical_prefix_and_nothing_else():
    loc = resolve_report(
        qa("s3://bucket/out/dt=1/qa/report.html"),
        spec("s3://bucket/out/dt=1/", storage_options={"endpoint_url": "http://127.0.0.1:1"}),
        ALLOW,
    )
    assert loc == ReportLocation(output_uri="s3://bucket/out/dt=1")  # no storage_options from XCom
    assert loc.rel("html") == "qa/report.html" and loc.rel("json") == "qa/report.json"
    assert resolve_report(qa("/data/r/qa/report.html"), spec("file:///data/r"), ALLOW).output_uri == "/data/r"
    assert resolve_report(qa("file:///data/r/qa/report.html"), spec("/data/r/"), ALLOW).output_uri == "/data/r"


def test_plan_task_follows_the_builder_names():
    assert plan_task_id("reclassify.qa") == "reclassify.plan" and plan_task_id("qa") == "plan"
    assert plan_task_id("a.b.qa") == "a.b.plan"


def test_missing_xcoms_are_404():
    for q, s in [
        (None, spec("/o")),
        ({"status": "pass"}, spec("/o")),
        (qa("/o/qa/report.html"), None),
        (qa("/o/qa/report.html"), {"io": {}}),
    ]:
        with pytest.raises(ReportAccessError) as e:
            resolve_report(q, s, ALLOW)
        assert e.value.status == 404


@pytest.mark.reliability
def test_paths_outside_the_runs_output_or_the_allowed_prefixes_are_refused():
    roots = ReportPolicy(allowed=ALLOW.allowed, roots=("/data/out",))
    attempts = [
        (qa("/etc/passwd"), spec("/data/out"), ALLOW),
        (qa("/data/out/../../etc/qa/report.html"), spec("/data/out"), ALLOW),
        (qa("/data/other/qa/report.html"), spec("/data/out"), ALLOW),
        (qa("/data/outside/qa/report.html"), spec("/data/outside"), roots),  # a sibling, not below
        (qa("/data/out/../x/qa/report.html"), spec("/data/out/../x"), roots),
        (qa("s3://evil/qa/report.html"), spec("s3://evil"), ALLOW),
        (qa("s3://bucket/out-other/qa/report.html"), spec("s3://bucket/out-other"), ALLOW),
        (qa("/srv/x/qa/report.html"), spec("/srv/x"), ALLOW),
        (qa("http://127.0.0.1:8080/qa/report.html"), spec("http://127.0.0.1:8080/"), ALLOW),
        (qa("s3://k:s@bucket/out/qa/report.html"), spec("s3://k:s@bucket/out"), ALLOW),
        (qa("s3://bucket/out/r/qa/report.html"), spec("s3://bucket/out/r"), ReportPolicy()),  # no allow-list
    ]
    rejected = 0
    for q, s, policy in attempts:
        with pytest.raises(ReportAccessError) as e:
            resolve_report(q, s, policy)
        assert e.value.status == 403
        rejected += 1
    record_malicious("qa report path", len(attempts), rejected)
    assert rejected == len(attempts)


def test_the_policy_comes_from_the_settings_and_fails_closed():
    p = ReportPolicy.from_settings('["s3://bucket/out/", "/data"]', False, "/data/reports\n/data/x")
    assert p.allowed == ("s3://bucket/out", "/data") and p.roots == ("/data/reports", "/data/x")
    with pytest.raises(ReportAccessError, match=r"\[vllm_batch\] allowed_uri_prefixes"):
        resolve_report(qa("/data/r/qa/report.html"), spec("/data/r"), ReportPolicy.from_settings("", False, ""))
    anywhere = ReportPolicy.from_settings("", True, "")
    assert resolve_report(qa("/data/r/qa/report.html"), spec("/data/r"), anywhere).output_uri == "/data/r"
    with pytest.raises(ReportAccessError) as e:  # allow_any keeps the URI rules
        resolve_report(qa("http://h/qa/report.html"), spec("http://h/"), anywhere)
    assert e.value.status == 403
    for bad in ("http://127.0.0.1/", "s3://bucket/../x", '["unterminated'):
        with pytest.raises(ReportAccessError, match="is malformed"):
            ReportPolicy.from_settings(bad, False, "")


def test_a_symlinked_report_file_may_not_leave_the_prefix(tmp_path):
    run = tmp_path / "run"
    (run / "qa").mkdir(parents=True)
    (tmp_path / "secret").write_text("x")
    (run / "qa" / "report.html").symlink_to(tmp_path / "secret")
    (run / "qa" / "report.json").write_text("{}")
    policy = ReportPolicy(allowed=(str(tmp_path),))
    loc = resolve_report(qa(f"{run}/qa/report.html"), spec(str(run)), policy)
    with pytest.raises(ReportAccessError) as e:
        check_local_file(loc, "html", policy)
    assert e.value.status == 403
    check_local_file(loc, "json", policy)


def test_roots_parsing_and_matching():
    assert parse_roots(" /a, s3://b/c\n/d ") == ["/a", "s3://b/c", "/d"] and parse_roots(None) == []
    assert under_roots("/a/b", ["/a"]) and under_roots("/a", ["/a/"]) and not under_roots("/ab", ["/a"])
    assert under_roots("file:///a/b/", ["/a"]) and under_roots("s3://bb/c/d", ["s3://bb/c"])
    assert not under_roots("s3://bb/cd", ["s3://bb/c"]) and not under_roots("gs://bb/c", ["s3://bb/c"])
    assert not under_roots("/a/../etc", ["/a"])


# ---- the metadata DB ties the report to the run's own task instances -------------------------
T0 = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)


def records(**over) -> RunRecords:
    """A finished run as the DB holds it: plan ran 02:00-02:01 and pushed its spec, QA ran 02:05-02:06."""
    m = timedelta(minutes=1)
    doc = {
        "run_found": True,
        "plan": TaskRecord("job.plan", "success", T0, T0 + m),
        "qa": TaskRecord("job.qa", "success", T0 + 5 * m, T0 + 6 * m),
        "spec": XComRecord(spec("/data/r"), T0 + m - timedelta(seconds=1)),
        "qa_summary": XComRecord(qa("/data/r/qa/report.html"), T0 + 6 * m - timedelta(milliseconds=5)),
    }
    return RunRecords(**{**doc, **over})


def test_a_run_whose_xcoms_its_own_tasks_wrote_is_tied():
    summary, s = tie_to_tasks(records())
    assert s == spec("/data/r") and summary["report_html"] == "/data/r/qa/report.html"
    # QA that failed its gate pushed the report first: still the run's own
    qa_failed = TaskRecord("job.qa", "failed", T0 + timedelta(minutes=5), T0 + timedelta(minutes=6))
    assert tie_to_tasks(records(qa=qa_failed))[1] == s


@pytest.mark.reliability
def test_what_the_db_cannot_tie_to_the_run_is_refused_before_any_read():
    m = timedelta(minutes=1)
    later = T0 + 60 * m  # e.g. PATCH .../xcomEntries/spec through the REST API after the run
    cases = {
        "no such run (or another DAG's run id)": (records(run_found=False), 404, "no such run"),
        "no such task instance": (records(qa=None), 404, "no such task instance"),
        "no plan task in the run": (records(plan=None), 404, "job.plan"),
        "plan failed": (records(plan=TaskRecord("job.plan", "failed", T0, T0 + m)), 404, "failed"),
        "plan never ran": (records(plan=TaskRecord("job.plan", None, None, None)), 404, "not run"),
        "QA still running": (records(qa=TaskRecord("job.qa", "running", T0 + 5 * m, None)), 404, "not finished"),
        "no QA summary": (records(qa_summary=None), 404, "no QA report"),
        "no spec": (records(spec=None), 404, "no validated spec"),
        "spec XCom set after the plan ended": (
            records(spec=XComRecord(spec("s3://bucket/out/other-team"), later)),
            403,
            "not written by task job.plan while it ran",
        ),
        "spec XCom set before the plan started": (
            records(spec=XComRecord(spec("s3://bucket/out/other-team"), T0 - m)),
            403,
            "job.plan",
        ),
        "QA summary set after QA ended": (
            records(qa_summary=XComRecord(qa("s3://bucket/out/other-team/qa/report.html"), later)),
            403,
            "not written by task job.qa",
        ),
        "plan marked success by hand (no run window)": (
            records(plan=TaskRecord("job.plan", "success", None, T0 + m)),
            403,
            "job.plan",
        ),
    }
    for name, (recs, status, words) in cases.items():
        with pytest.raises(ReportAccessError) as e:
            tie_to_tasks(recs)
        assert e.value.status == status and words in str(e.value), (name, e.value.status, str(e.value))
    record_malicious("report page: records the DB cannot tie to the run", len(cases), len(cases))


def test_clock_skew_between_api_servers_is_tolerated_and_no_more():
    end = T0 + timedelta(minutes=1)
    ok = records(spec=XComRecord(spec("/data/r"), end + CLOCK_SKEW))
    assert tie_to_tasks(ok)
    with pytest.raises(ReportAccessError):
        tie_to_tasks(records(spec=XComRecord(spec("/data/r"), end + CLOCK_SKEW + timedelta(milliseconds=1))))
