"""The report page's quality sections (steps/qa/html_quality.py) rendered from a real report: every
number from the report dict, the data escaped, no scripts."""

from __future__ import annotations

import random
import re

import pyarrow as pa

from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from airflow_provider_vllm.steps.qa.html import render_report_html
from tests.support.qa_rows import err_row, ok_row, split

LABELS = ["billing", "bug", "account", "other"]
EVIL = "<script>alert(1)</script>"


def _report(previous=None, n=400, acc=0.6, seed=2, relabel=0):
    """A labelled report; ``relabel``: the known labels of the first that many rows moved to the next label."""
    rnd = random.Random(seed)
    recs, truth = [], {}
    for i in range(n):
        t = rnd.choice(LABELS)
        right = rnd.random() < acc
        recs.append(
            ok_row(
                i,
                label=t if right else rnd.choice(LABELS),
                confidence=rnd.uniform(0.6, 1) if right else rnd.uniform(0.2, 0.8),
                prompt_hash=i % 350,
                output=f"{EVIL} {i}",
            )
        )
        truth[f"r{i}"] = LABELS[(LABELS.index(t) + 1) % len(LABELS)] if i < relabel else t
    recs += [err_row(i) for i in range(5)]
    truth["e0"] = "bug"
    truth["r3"] = EVIL  # a known label outside the label set, with markup
    results, errors = split(recs)
    ref = pa.table({"id": list(truth), "label": list(truth.values())})
    return evaluate(
        results,
        errors,
        spec=QASpec(sample_size=20, least_confident=5),
        labels=LABELS,
        structured=True,
        reference=ref,
        previous=previous,
    )


def test_quality_sections_render_the_reports_numbers():
    before = _report(acc=0.9).to_dict()
    rep = _report(previous=before)
    d = rep.to_dict()
    page = render_report_html(d, rep.sample.to_pylist())
    q = d["metrics"]["quality"]
    assert '<section data-section="quality">' in page and '<section data-section="confidence">' in page
    assert 'data-section="consistency"' in page and 'data-section="least-confident"' in page
    assert f"{100 * q['accuracy']['value']:.1f}%" in page and "Accuracy change" in page and "a real drop" in page
    for c in q["confusion"]:  # every confusion cell, with its count
        if c["true"] in LABELS and c["pred"] in LABELS + ["(none)"]:
            cell = re.search(
                rf'<td data-true="{c["true"]}" data-pred="{re.escape(c["pred"])}"[^>]*><b>([\d,]+)</b>', page
            )
            assert cell and int(cell.group(1).replace(",", "")) == c["count"]
    for label in q["classes"]:
        assert f'<tr data-label="{label}">' in page or "&lt;script&gt;" in label or label == EVIL
    svg = page[page.index('data-chart="reliability"') :]
    svg = svg[: svg.index("</svg>")]
    filled = [b for b in q["reliability"]["buckets"] if b["rows"]]
    assert svg.count('<rect class="bar"') == len(filled)
    for b in filled:
        assert f'data-rows="{b["rows"]}"' in svg
    for i in d["metrics"]["confidence"]["least_confident_ids"]:
        assert f'<td class="id">{i}</td>' in page


def test_the_data_stays_text_and_the_page_has_no_script():
    rep = _report()
    page = render_report_html(rep.to_dict(), rep.sample.to_pylist())
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the known label with markup, as text


def test_accuracy_check_row_shows_a_below_threshold():
    rep = _report(acc=0.3)
    page = render_report_html(rep.to_dict(), [])
    row = page[page.index("<b>accuracy</b>") :]
    row = row[: row.index("</tr>")]
    assert "&lt; 80.0%" in row and "&lt; 50.0%" in row and "FAIL" in row


def test_no_labels_no_quality_section_but_the_confidence_distribution():
    results, errors = split([ok_row(i, label="bug", confidence=i / 100) for i in range(100)])
    rep = evaluate(results, errors, spec=QASpec(), labels=LABELS, structured=True)
    page = render_report_html(rep.to_dict(), rep.sample.to_pylist())
    assert 'data-section="quality"' not in page and 'data-chart="confidence"' in page
    assert 'data-chart="reliability"' not in page and "needs known labels" in page


def test_the_changes_section_says_why_answers_moved():
    results, errors = split([ok_row(i, label="bug") for i in range(5)])
    changes = {
        "counts": {"changed": 3, "unchanged": 2},
        "reasons": {"settings": 0, "input": 2, "unified": 1, "engine": 0, "unknown": 0},
        "in_both": 5,
        "churn_rate": 0.6,
    }
    rep = evaluate(results, errors, spec=QASpec(), labels=LABELS, structured=True, changes=changes)
    page = render_report_html(rep.to_dict(), [])
    assert '<span data-reason="input"><b>2</b> the text was edited</span>' in page
    assert 'data-reason="unified"' in page and 'data-reason="engine"' not in page


def test_an_example_with_more_answers_than_listed_says_how_many_more():
    """A prompt answered 13 ways (free text): its example lists 10 answers, escaped, and says 3 more; one that
    lists all its answers says nothing more."""
    recs = [ok_row(i, label=None, output=f"{EVIL} {i % 13:02d}", prompt_hash=1) for i in range(40)]
    recs += [ok_row(100 + i, label=None, output=f"same {i % 2}", prompt_hash=2) for i in range(4)]
    results, errors = split(recs)
    rep = evaluate(results, errors, spec=QASpec(sample_size=5), labels=None, structured=False, compared="output")
    d = rep.to_dict()
    ex = {len(x["ids"]): x for x in d["metrics"]["consistency"]["examples"]}
    assert ex[6]["answers_total"] == 13 and len(ex[6]["answers"]) == 10 and ex[4]["answers_total"] == 2
    section = render_report_html(d, rep.sample.to_pylist())
    section = section[section.index('data-section="consistency"') :]
    section = section[: section.index("</section>")]
    assert section.count("(and 3 more)") == 1 and "more)" not in section.replace("(and 3 more)", "")
    assert EVIL not in section and "&lt;script&gt;alert(1)&lt;/script&gt; 00" in section


def _two_sources(right_own: int, n_own: int, right_ride: int, previous=None):
    own = [ok_row(i, label="bug" if i < right_own else "other") for i in range(n_own)]
    ride = [ok_row(i, label="bug" if i < right_ride else "other", id=f"_vllm_golden:g{i}") for i in range(300)]
    known = pa.table({"id": [f"r{i}" for i in range(n_own)], "label": ["bug"] * n_own})
    golden = pa.table({"id": [f"_vllm_golden:g{i}" for i in range(300)], "label": ["bug"] * 300})
    return evaluate(
        *split(own),
        spec=QASpec(sample_size=5),
        labels=LABELS,
        structured=True,
        reference=known,
        reference_source="input_column",
        ride_along=(*split(ride), golden),
        previous=previous,
    )


def test_the_accuracy_change_cards_are_per_source_when_the_check_is():
    """The golden rows fall 30 points while a ten times larger night of the run's own labelled rows holds: the
    pooled change is within noise, and the cards show each source's change, as the accuracy_drop check judges it."""
    before = _two_sources(1900, 2000, 270).to_dict()
    d = _two_sources(19000, 20000, 180, previous=before).to_dict()
    assert d["metrics"]["quality"]["vs_previous"]["real_drop"] is False
    page = render_report_html(d, [])
    cards = dict(
        re.findall(r'<div class="k">([^<]*)</div><div class="v">[^<]*</div><div class="s">([^<]*)</div>', page)
    )
    assert cards["Accuracy change (ride-along golden rows)"].startswith("a real drop")
    assert cards["Accuracy change (input column)"].startswith("within noise")
    assert cards["Accuracy change (all sources)"].startswith("within noise")  # the pooled change, named so
    assert "Accuracy change" not in cards
    # and the accuracy of each source beside the pooled one (the accuracy check judges each source)
    assert [k for k in cards if k.startswith("Accuracy") and "change" not in k] == [
        "Accuracy",
        "Accuracy (input column)",
        "Accuracy (ride-along golden rows)",
    ]
    assert cards["Accuracy (ride-along golden rows)"].endswith("300 labelled")


def test_the_accuracy_change_card_of_a_changed_golden_set_says_it_is_on_the_shared_ids():
    """A golden set with 100 of its rows relabelled since the previous report: the change shown is the paired one on
    the ids both sets share with the same label (what the accuracy_drop check judges), and says so."""
    before = _report().to_dict()
    d = _report(previous=before, relabel=100).to_dict()
    v = d["metrics"]["quality"]["sources"]["golden_set"]["vs_previous"]
    assert v["method"] == "newcombe-paired" and v["delta"] == 0
    page = render_report_html(d, [])
    cards = dict(
        re.findall(r'<div class="k">([^<]*)</div><div class="v">[^<]*</div><div class="s">([^<]*)</div>', page)
    )
    assert cards["Accuracy change"].endswith(f"on the {v['previous_labelled']} ids both golden sets share")
