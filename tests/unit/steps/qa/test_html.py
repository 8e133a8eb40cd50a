"""report.html of a real small run (fake engine for the data), opened in headless Chromium.

Two runs over the same input: the second compares its labels with the first's report. The
page must show every chart with visible bars (one bar per label, error code and shard), the
sample table, and render an injected '<script>' label as text without running it. The
screenshot is kept under ``$VLLM_BATCH_TEST_ARTIFACTS`` (default ``test-artifacts/``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from airflow_provider_vllm.core.engine_identity import local_engine_identity
from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from airflow_provider_vllm.steps.qa.html import render_report_html
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.worker.shard import run_shard
from tests.support import ROOT  # noqa: E402
from tests.support.data import PINNED_REVISION, make_spec, merge, shard_task, vouch_cache, write_parquet
from tests.support.ledger import record_malicious
from tests.support.qa_rows import err_row, ok_row, split

CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
EVIL = "<script>window.__pwned=1</script>"
EVIL_IMG = "<img src=x onerror=window.__pwned=2>"
LABELS = ["billing", "bug", "feature_request", "account", "other"]  # labels with markup are refused by the spec


def artifacts() -> Path:
    d = Path(os.environ.get("VLLM_BATCH_TEST_ARTIFACTS", ROOT / "test-artifacts"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def run_pipeline(tmp_path: Path, name: str, template: str, previous: str | None):
    spec = make_spec(
        tmp_path / "in",
        tmp_path / name,
        prompt={"template": template},
        sampling={"structured": {"choice": LABELS}},
        sharding={"target_rows": 80, "chunk_rows": 16},
        qa={"sample_size": 24, "previous_report_uri": previous, "warn_error_rate": 0.001},
    )
    from tests.support.fakes import FakeEngine

    for shard in plan_job(spec).shards:
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=FakeEngine)
    merge(spec)
    report, paths = qa_run(spec)
    return spec, report, tmp_path / name / paths["report_html"]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian package 'chromium')")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        yield b
        b.close()


def bars(page, chart: str, series: int | None = None):
    sel = f'svg[data-chart="{chart}"] rect.bar' + ("" if series is None else f'[data-series="{series}"]')
    return page.locator(sel)


@pytest.fixture(scope="module")
def report_page(tmp_path_factory, browser):
    """(report, page) of the second of two runs, the page loaded in Chromium; requests it tried."""
    tmp_path = tmp_path_factory.mktemp("report")
    n = 240
    texts = [f"my invoice {i} was charged twice" if i % 3 else f"the app crashes on page {i}" for i in range(n)]
    # markup in the data (a ticket can hold anything): it must reach the page as text
    texts = [f"{EVIL} {t}" if i % 4 == 1 else f"{EVIL_IMG} {t}" if i % 4 == 2 else t for i, t in enumerate(texts)]
    texts[4] = ""  # EMPTY_INPUT
    texts[50] = "   "  # EMPTY_INPUT
    texts[77] = "word " * 2000  # PROMPT_TOO_LONG (max_model_len 1024)
    write_parquet(tmp_path / "in" / "part-0.parquet", [f"t{i:04d}" for i in range(n)], texts)
    run_pipeline(tmp_path, "run1", "Ticket: {text}", None)
    _, report, html_path = run_pipeline(
        tmp_path, "run2", "Support ticket: {text}", str(tmp_path / "run1" / "qa" / "report.json")
    )
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    requested = []
    page.on("request", lambda r: None if r.url.startswith(("file:", "data:")) else requested.append(r.url))
    page.goto(html_path.as_uri())
    page.wait_for_load_state("load")
    yield report, page, requested
    page.close()


def test_report_page_charts_and_sample(report_page):
    report, page, _ = report_page
    m = report.metrics
    ld = m["label_distribution"]
    assert m["label_drift"] is not None
    shards = m["throughput"]["shards"]
    assert len(shards) == 3 and all(s["seconds"] and s["peak_rss_mb"] for s in shards)  # from the markers
    shot = artifacts() / "qa-report.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    (artifacts() / "qa-report.json").write_text(json.dumps(report.to_dict(), indent=1))

    labels = list(dict.fromkeys(list(ld["counts"]) + list(m["label_drift"]["previous_fractions"])))
    for series in (0, 1):  # this run, previous run: one bar per label each
        got = bars(page, "labels", series)
        assert got.count() == len(labels)
        assert [got.nth(i).get_attribute("data-label") for i in range(got.count())] == labels
    for i, lab in enumerate(labels):
        box = bars(page, "labels", 0).nth(i).bounding_box()
        assert box["height"] > 5 and (box["width"] > 1) == (ld["counts"].get(lab, 0) > 0)
    assert bars(page, "errors").count() == len(m["errors_by_code"]) == 2
    for chart in ("latency", "prompt_tokens", "completion_tokens"):
        hist = m[{"latency": "latency_ms"}.get(chart, chart)]["histogram"]
        hb = bars(page, chart)
        assert hb.count() == len(hist["counts"]) + (1 if hist["overflow"] else 0)
        svg_box = page.locator(f'svg[data-chart="{chart}"]').bounding_box()
        assert svg_box["width"] > 200 and svg_box["height"] > 100
        assert sum(1 for i in range(hb.count()) if hb.nth(i).bounding_box()["height"] > 0) >= 1
    for chart in ("throughput", "duration", "memory"):
        b = bars(page, chart)
        assert b.count() == len(shards)
        assert all(b.nth(i).bounding_box()["width"] > 1 for i in range(b.count()))
        assert page.locator(f'svg[data-chart="{chart}"]').is_visible()

    rows = page.locator("section.sample tbody tr")
    # the 24 drawn rows, then the least confident answers the draw did not take
    assert rows.count() == m["sample"]["rows"] == 24 + m["sample"]["least_confident"]
    head = [h.inner_text().strip() for h in page.locator("section.sample thead th").all()]
    assert head == ["#", "id", "status", "label", "input", "output / error"]
    inputs = [rows.nth(i).locator("td").nth(4).inner_text() for i in range(rows.count())]
    assert sum(("invoice" in t or "crashes" in t) for t in inputs) >= 20


@pytest.mark.reliability
def test_injected_markup_stays_text(report_page):
    report, page, requested = report_page
    main = page.locator("main").inner_text()
    pwned = page.evaluate("window.__pwned")
    scripts, imgs = page.locator("script").count(), page.locator("main img").count()
    neutralised = (EVIL in main and pwned is None and scripts == 0) + (EVIL_IMG in main and imgs == 0 and not requested)
    record_malicious("report_html_markup_injection", 2, neutralised)
    assert pwned is None and scripts == 0 and imgs == 0 and not requested
    assert EVIL in main and EVIL_IMG in main


def test_html_escapes_and_is_self_contained():
    evil = "<script>alert('x')</script>"
    recs = [ok_row(i, label="positive", output=evil + " & more") for i in range(20)]
    recs.append(ok_row(99, label="<b>neg</b>"))
    recs.append(err_row(1) | {"error_message": evil})
    results, errors = split(recs)
    rep = evaluate(
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


def test_the_header_names_the_model_once_unless_the_shards_ran_another_revision():
    def header(run_model, models):
        page = render_report_html({"status": "pass", "run": {"model": run_model}, "metrics": {"models": models}}, [])
        return re.findall(r"<b>model</b>: ([^<]*)</span>", page)

    assert header("org/m", [{"model": "org/m"}]) == ["org/m"]
    assert header("org/m", [{"model": "org/m", "revision": "0123456789abcdef"}]) == ["org/m", "org/m@0123456789ab"]
    assert header("org/m", [{"model": "org/m"}, {"model": "org/n"}]) == ["org/m", "org/m, org/n"]


def test_the_changes_section_escapes_labels_and_shows_the_matrix():
    evil = "<script>alert('x')</script>"
    recs = [ok_row(i, label="positive") for i in range(5)]
    results, errors = split(recs)
    changes = {
        "previous_uri": "/data/dt=<u>1</u>",
        "previous_state": "complete",
        "compared": "label",
        "in_both": 9,
        "churn_rate": 2 / 9,
        "counts": {"added": 1, "removed": 1, "changed": 2, "unchanged": 7, "error": 0, "recovered": 0},
        "matrix": [
            {"old": "positive", "new": "positive", "count": 7},
            {"old": evil, "new": "positive", "count": 2},
            {"old": None, "new": "positive", "count": 1},
            {"old": "<b>neg</b>", "new": None, "count": 1},
        ],
        "matrix_cells": 4,
        "notes": [],
    }
    rep = evaluate(
        results,
        errors,
        spec=QASpec(sample_size=3),
        labels=["positive"],
        structured=True,
        changes=changes,
        cache={"rows": 10, "hits": 9, "misses": 1, "hit_rate": 0.9},
    )
    html = render_report_html(rep.to_dict(), rep.sample.to_pylist())
    assert "<script" not in html.lower() and "<b>neg</b>" not in html and "<u>" not in html
    assert "&lt;script&gt;" in html and "/data/dt=&lt;u&gt;1&lt;/u&gt;" in html
    assert "What changed since the last run" in html and 'data-chart="churn"' in html
    assert "90.0%" in html and "Cache hits" in html  # the hit rate card
    assert "(new id)" in html and "(removed)" in html
    assert re.search(r'data-old="positive" data-new="positive">7<', html)  # the diagonal: did not move


@pytest.fixture(scope="module")
def changes_page(tmp_path_factory, browser):
    """A nightly-like second day: 6% of tickets edited, 10 new, 5 gone; the page of its QA report."""
    from airflow_provider_vllm.core.plan import Plan
    from tests.support.fakes import FakeEngine

    tmp_path = tmp_path_factory.mktemp("changes")
    n = 200
    topics = [
        "my invoice {} was charged twice",
        "the app crashes on page {}",
        "please add dark mode {}",
        "I cannot log in to account {}",
        "question {} about your office hours",
    ]
    day1 = {f"t{i:04d}": topics[i % 5].format(i) for i in range(n)}
    day2 = {
        k: v + (" - still broken, please help" if j % 16 == 3 else "")
        for j, (k, v) in enumerate(day1.items())
        if j >= 5
    }
    day2.update({f"t{n + i:04d}": topics[i % 5].format(n + i) for i in range(10)})
    # the result cache, once it exists (a hub model name must be pinned to a revision for it)
    cache = {"uri": str(tmp_path / "_cache")} if "cache" in Plan.model_fields else {}
    reports = []
    for day, texts in (("d1", day1), ("d2", day2)):
        write_parquet(tmp_path / day / "in" / "part-0.parquet", list(texts), list(texts.values()))
        spec = make_spec(
            tmp_path / day / "in",
            tmp_path / day / "out",
            name="nightly_reclassification",
            sampling={"structured": {"choice": LABELS}},
            sharding={"target_rows": 80, "chunk_rows": 16},
            qa={"sample_size": 12, "warn_churn_rate": 0.05, "fail_churn_rate": 0.5},
            cache=cache,
            model={"revision": PINNED_REVISION} if cache else {},
            changes={"previous_uri": str(tmp_path / "d1" / "out") if day == "d2" else None},
        )
        plan = plan_job(spec, **({"engine_identity": local_engine_identity()} if cache else {}))  # the cache key's
        for shard in plan.shards:
            run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=FakeEngine)
        merge(spec)
        reports.append(qa_run(spec))
        if cache:
            vouch_cache(spec)  # published: its entry serves the next day
    report, paths = reports[-1]
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto((tmp_path / "d2" / "out" / paths["report_html"]).as_uri())
    page.wait_for_load_state("load")
    yield report, page
    page.close()


def test_report_page_shows_what_changed_and_the_cache(changes_page):
    """The screenshot in docs/operations.md ('What changed since the last run'): header cards + the churn matrix."""
    report, page = changes_page
    ch = report.metrics["changes"]
    assert ch["counts"]["added"] == 10 and ch["counts"]["removed"] == 5 and 0 < ch["counts"]["changed"] < 20
    section = page.locator('section[data-section="changes"]')
    assert section.is_visible()
    for kind, n in ch["counts"].items():
        assert section.locator(f'[data-change="{kind}"] .v').inner_text() == f"{n:,}"
    moved = [c for c in ch["matrix"] if c["old"] != c["new"] and c["old"] and c["new"]]
    for c in moved:  # every moved cell is in the table with its count
        cell = section.locator(f'td[data-old="{c["old"]}"][data-new="{c["new"]}"]')
        assert cell.inner_text() == str(c["count"]) and cell.bounding_box()["width"] > 20
    if report.metrics.get("cache"):  # day 2: every unedited ticket of day 1 is a hit
        assert report.metrics["cache"]["hits"] == 200 - 5 - sum(1 for j in range(5, 200) if j % 16 == 3)
        assert page.get_by_text("Cache hits").is_visible()
    box = section.bounding_box()
    shot = artifacts() / "qa-report-changes.png"
    page.screenshot(
        path=str(shot), full_page=True, clip={"x": 0, "y": 0, "width": 1200, "height": box["y"] + box["height"] + 24}
    )
    assert shot.stat().st_size > 20_000
    if os.environ.get("VLLM_BATCH_UI_SCREENSHOTS") == "docs":  # how the committed picture is made
        shutil.copyfile(shot, ROOT / "docs" / "img" / shot.name)
