"""The report endpoint's access rule: only a run's own qa/report.*, optionally under allowed roots."""

import pytest

from airflow_provider_vllm.ui.report_access import (
    ReportAccessError,
    parse_roots,
    plan_task_id,
    resolve_report,
    under_roots,
)
from tests.ledger import record_malicious


def spec(out, **io):
    return {"io": {"input_uri": "/in", "output_uri": out, **io}}


def qa(report):
    return {"status": "warn", "report_html": report}


def test_a_runs_own_report_resolves_with_its_storage_options():
    loc = resolve_report(qa("s3://b/out/dt=1/qa/report.html"), spec("s3://b/out/dt=1/", storage_options={"anon": True}),
                         ["s3://b/out"])
    assert loc.output_uri == "s3://b/out/dt=1/" and loc.storage_options == {"anon": True}
    assert loc.rel("html") == "qa/report.html" and loc.rel("json") == "qa/report.json"
    assert resolve_report(qa("/data/r/qa/report.html"), spec("file:///data/r")).output_uri == "file:///data/r"


def test_plan_task_follows_the_builder_names():
    assert plan_task_id("reclassify.qa") == "reclassify.plan" and plan_task_id("qa") == "plan"
    assert plan_task_id("a.b.qa") == "a.b.plan"


def test_missing_xcoms_are_404():
    for q, s in [(None, spec("/o")), ({"status": "pass"}, spec("/o")), (qa("/o/qa/report.html"), None),
                 (qa("/o/qa/report.html"), {"io": {}})]:
        with pytest.raises(ReportAccessError) as e:
            resolve_report(q, s)
        assert e.value.status == 404


@pytest.mark.reliability
def test_paths_outside_the_runs_output_or_the_allowed_roots_are_refused():
    attempts = [
        (qa("/etc/passwd"), spec("/data/out"), []),
        (qa("/data/out/../../etc/qa/report.html"), spec("/data/out"), []),
        (qa("/data/other/qa/report.html"), spec("/data/out"), []),
        (qa("/data/out/qa/report.html"), spec("/data/out"), ["/srv/reports"]),
        (qa("/data/outside/qa/report.html"), spec("/data/outside"), ["/data/out"]),  # a sibling, not below
        (qa("/data/out/../x/qa/report.html"), spec("/data/out/../x"), ["/data/out"]),
        (qa("s3://evil/qa/report.html"), spec("s3://evil"), ["s3://bucket"]),
    ]
    rejected = 0
    for q, s, roots in attempts:
        with pytest.raises(ReportAccessError) as e:
            resolve_report(q, s, roots)
        assert e.value.status == 403
        rejected += 1
    record_malicious("qa report path", len(attempts), rejected)
    assert rejected == len(attempts)


def test_roots_parsing_and_matching():
    assert parse_roots(" /a, s3://b/c\n/d ") == ["/a", "s3://b/c", "/d"] and parse_roots(None) == []
    assert under_roots("/a/b", ["/a"]) and under_roots("/a", ["/a/"]) and not under_roots("/ab", ["/a"])
    assert under_roots("file:///a/b/", ["/a"]) and under_roots("s3://b/c/d", ["s3://b/c"])
    assert not under_roots("s3://b/cd", ["s3://b/c"]) and not under_roots("gs://b/c", ["s3://b/c"])
