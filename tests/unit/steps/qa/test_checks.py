"""QA checks: thresholds per check, the overall verdict, QAFailed."""

from __future__ import annotations

import pickle

import pyarrow as pa
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
        (None, "no change set (changes.previous_uri not set, or no earlier run published)"),
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


def test_a_churn_gate_turned_on_warns_when_the_previous_run_is_not_sealed_by_this_deployment():
    """changes.previous_uri holds a run whose _MERGED.json does not carry this deployment's seal (forged, moved from
    another folder): nothing of it is read and every id is 'added', so no id is in both runs. A churn gate the job
    turned on then has nothing to judge: a warning naming the fields, not a silent pass (off by default: a skip)."""
    results, errors = split([ok_row(i) for i in range(10)])
    unverified = _changes(0, 0, "unverified")
    kw = dict(labels=None, structured=False, changes=unverified)
    off = evaluate(results, errors, spec=QASpec(), **kw)
    assert check(off, "churn_rate")["status"] == "skip" and off.status == "pass"
    rep = evaluate(results, errors, spec=QASpec(warn_churn_rate=0.05, fail_churn_rate=0.5), **kw)
    c = check(rep, "churn_rate")
    assert c["status"] == "warn" and c["value"] is None, c
    assert "not sealed by this deployment" in c["detail"] and "qa.warn_churn_rate / qa.fail_churn_rate" in c["detail"]
    assert rep.status == "warn"


def test_a_churn_gate_turned_on_warns_when_the_corpus_was_swapped_for_one_with_no_id_in_common():
    """The previous run is complete, yet none of its ids is in this run and every id of this one is new: the input
    is another corpus (what a churn gate is there to catch), not a first run. With the gate on, a warning (a person
    looks before it is published), not a skip that passes; off by default: a skip. A run that shares ids, or a
    previous run of no rows, is judged as before."""
    results, errors = split([ok_row(i) for i in range(10)])
    swapped = _changes(0, 0)
    swapped["counts"].update(added=10, removed=100)
    kw = dict(labels=None, structured=False, changes=swapped)
    off = evaluate(results, errors, spec=QASpec(), **kw)
    assert check(off, "churn_rate")["status"] == "skip" and off.status == "pass"
    on = QASpec(warn_churn_rate=0.05, fail_churn_rate=0.5)
    rep = evaluate(results, errors, spec=on, **kw)
    c = check(rep, "churn_rate")
    assert c["status"] == "warn" and c["value"] is None, c
    assert "100 id(s) of the previous run are not in this one" in c["detail"] and rep.status == "warn"
    empty_before = _changes(0, 0)
    empty_before["counts"].update(added=10)
    assert (
        check(evaluate(results, errors, spec=on, labels=None, structured=False, changes=empty_before), "churn_rate")[
            "status"
        ]
        == "skip"
    )


# ---- accuracy gates ------------------------------------------------------------------------
LAB = ["billing", "bug", "account", "other", "feature_request"]


def _labelled(n, right, **spec):
    """n labelled rows of which ``right`` carry the known label."""
    import pyarrow as pa

    recs = [ok_row(i, label=LAB[i % 5] if i < right else LAB[(i + 1) % 5]) for i in range(n)]
    ref = pa.table({"id": [f"r{i}" for i in range(n)], "label": [LAB[i % 5] for i in range(n)]})
    return split(recs), ref, QASpec(**spec)


@pytest.mark.parametrize(
    "right, expected", [(1000, "pass"), (800, "pass"), (799, "warn"), (500, "warn"), (499, "fail"), (400, "fail")]
)
def test_accuracy_gate_by_default(right, expected):
    (results, errors), ref, spec = _labelled(1000, right)
    rep = evaluate(results, errors, spec=spec, labels=LAB, structured=True, reference=ref)
    c = check(rep, "accuracy")
    assert c["status"] == expected and c["value"] == right / 1000 and c["direction"] == "below"
    assert c["interval"][0] < right / 1000 < c["interval"][1] or right == 1000
    assert rep.status == expected


def test_a_40_percent_accurate_run_fails_and_says_why():
    (results, errors), ref, spec = _labelled(200, 80)
    rep = evaluate(results, errors, spec=spec, labels=LAB, structured=True, reference=ref)
    assert rep.status == "fail" and "accuracy=40.00%(fail)" in rep.summary_line()
    with pytest.raises(QAFailed, match=r"accuracy=40.0000% < fail 0.5"):
        rep.raise_on_fail()


def test_too_few_labelled_rows_warn_instead_of_deciding_on_noise():
    (results, errors), ref, spec = _labelled(10, 10)
    rep = evaluate(results, errors, spec=spec, labels=LAB, structured=True, reference=ref)
    c = check(rep, "accuracy")
    assert c["status"] == "warn" and "fewer than qa.min_labelled 30" in c["detail"]
    (results, errors), ref, spec = _labelled(10, 0, min_labelled=5)
    assert (
        check(evaluate(results, errors, spec=spec, labels=LAB, structured=True, reference=ref), "accuracy")["status"]
        == "fail"
    )


def test_a_reference_that_matches_no_row_warns():
    import pyarrow as pa

    (results, errors), _, spec = _labelled(50, 50)
    ref = pa.table({"id": ["elsewhere"], "label": ["bug"]})
    rep = evaluate(results, errors, spec=spec, labels=LAB, structured=True, reference=ref)
    c = check(rep, "accuracy")
    assert c["status"] == "warn" and c["value"] is None and "none names a row" in c["detail"]
    assert "accuracy=n/a(warn)" in rep.summary_line()


def test_no_reference_skips_the_accuracy_checks():
    (results, errors), _, spec = _labelled(50, 50)
    rep = evaluate(results, errors, spec=spec, labels=LAB, structured=True)
    assert check(rep, "accuracy")["status"] == "skip" and check(rep, "accuracy_drop")["status"] == "skip"


@pytest.mark.parametrize(
    "before, after, expected",
    [
        (900, 900, "pass"),  # no change
        (900, 880, "pass"),  # 2 points on 1000 rows: the interval includes 0
        (900, 860, "warn"),  # 4 points: real, under fail_accuracy_drop 5 points
        (900, 800, "fail"),  # 10 points: real and large
        (800, 900, "pass"),  # a gain
    ],
)
def test_accuracy_drop_gate(before, after, expected):
    (r0, e0), ref, spec = _labelled(1000, before, warn_accuracy_below=0.0, fail_accuracy_below=0.0)
    prev = evaluate(r0, e0, spec=spec, labels=LAB, structured=True, reference=ref).to_dict()
    (r1, e1), ref, _ = _labelled(1000, after)
    rep = evaluate(r1, e1, spec=spec, labels=LAB, structured=True, reference=ref, previous=prev)
    c = check(rep, "accuracy_drop")
    assert c["status"] == expected and c["value"] == pytest.approx((before - after) / 1000)
    assert ("a real drop" in c["detail"]) == (expected != "pass")


def test_a_previous_report_that_was_not_used_makes_drift_and_accuracy_drop_warn():
    """qa.previous_report_uri set, but its report not vouched for by its run's sealed QA record (store.py): the checks
    that needed it warn, naming the URI and why, instead of passing; a run without labels to compare skips them."""
    from airflow_provider_vllm.steps.qa.report import refused_previous

    (results, errors), ref, spec = _labelled(1000, 900, warn_accuracy_below=0.0, fail_accuracy_below=0.0)
    refused = refused_previous("s3://b/day1/qa/report.json", "its seal does not match its content")
    rep = evaluate(results, errors, spec=spec, labels=LAB, structured=True, reference=ref, previous=refused)
    for name in ("label_drift", "accuracy_drop"):
        c = check(rep, name)
        assert c["status"] == "warn" and c["value"] is None
        assert "s3://b/day1/qa/report.json was not used (its seal does not match its content)" in c["detail"]
    assert rep.status == "warn" and rep.metrics["previous"]["refused"]["uri"] == "s3://b/day1/qa/report.json"
    assert [n for n in rep.notes if "s3://b/day1/qa/report.json not used" in n]
    assert not [n for n in rep.notes if "has no accuracy" in n]
    plain, no_errors = split([ok_row(i) for i in range(50)])  # no labels: drift and accuracy_drop judge nothing
    rep = evaluate(plain, no_errors, spec=QASpec(), labels=None, structured=False, previous=refused)
    assert check(rep, "label_drift")["status"] == check(rep, "accuracy_drop")["status"] == "skip"


def test_low_confidence_and_inconsistency_gates_are_off_by_default_and_can_be_set():
    recs = [ok_row(i, label="bug", confidence=0.3 if i < 30 else 0.9, prompt_hash=i % 50) for i in range(100)]
    recs[0]["label"] = "billing"  # prompt 0 answered two ways
    results, errors = split(recs)
    rep = evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True)
    assert check(rep, "low_confidence_rate")["value"] == 0.3 and check(rep, "low_confidence_rate")["status"] == "pass"
    assert check(rep, "inconsistency_rate")["value"] == 1 / 50 and check(rep, "inconsistency_rate")["status"] == "pass"
    strict = QASpec(warn_low_confidence_rate=0.1, fail_low_confidence_rate=0.25, warn_inconsistency_rate=0.01)
    rep = evaluate(results, errors, spec=strict, labels=LAB, structured=True)
    assert (
        check(rep, "low_confidence_rate")["status"] == "fail" and check(rep, "inconsistency_rate")["status"] == "warn"
    )


@pytest.mark.parametrize("gate", ["low_confidence_rate", "inconsistency_rate"])
def test_a_gate_turned_on_warns_when_the_run_has_nothing_to_measure_it_on(gate):
    """Rows without a confidence or a prompt hash (requests that sample at random have none): off by default the
    gate skips; turned on (warn or fail threshold below 1) it warns, naming its fields, instead of passing silently."""
    recs = [ok_row(i, label="bug", confidence=None, prompt_hash=None) for i in range(40)]
    results, errors = split(recs)
    rep = evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True)
    assert check(rep, gate)["status"] == "skip"
    for on in ({f"warn_{gate}": 0.05}, {f"warn_{gate}": 0.5, f"fail_{gate}": 0.5}):
        c = check(evaluate(results, errors, spec=QASpec(**on), labels=LAB, structured=True), gate)
        assert c["status"] == "warn" and c["value"] is None and f"qa.warn_{gate} / qa.fail_{gate}" in c["detail"]
    # measured: the gate judges the value as before
    recs = [ok_row(i, label="bug", confidence=0.9, prompt_hash=i) for i in range(40)]
    c = check(evaluate(*split(recs), spec=QASpec(**{f"warn_{gate}": 0.05}), labels=LAB, structured=True), gate)
    assert c["status"] in ("pass", "skip") and "nothing to judge" not in c["detail"]


def _rows_known(n: int, right: int, prefix: str = "r") -> tuple[list[dict], pa.Table]:
    """n answered rows, the first ``right`` of them with their known label; and the known labels."""
    rows = [
        ok_row(i, label=LAB[i % 5] if i < right else LAB[(i + 1) % 5], id=f"{prefix}{i}", confidence=0.9)
        for i in range(n)
    ]
    return rows, pa.table({"id": [f"{prefix}{i}" for i in range(n)], "label": [LAB[i % 5] for i in range(n)]})


def _ride_along(n: int, right: int) -> tuple[pa.Table, pa.Table, pa.Table]:
    rows, known = _rows_known(n, right, prefix="_vllm_golden:g")
    return (*split(rows), known)


@pytest.mark.parametrize(
    "own, source, riding, expected",
    [
        ((100, 40), "input_column", (1000, 950), "fail"),  # the run's rows at 40 %; pooled with the golden rows: 90 %
        ((2, 0), "golden_set", (60, 54), "warn"),  # 2 of the run's rows scored: too few to gate on
        ((100, 95), "input_column", (1000, 950), "pass"),
        ((100, 95), "input_column", (1000, 400), "fail"),  # and the other way round
    ],
)
def test_each_source_of_known_labels_is_judged_on_its_own_rows(own, source, riding, expected):
    rows, known = _rows_known(*own)
    results, errors = split(rows)
    rep = evaluate(
        results,
        errors,
        spec=QASpec(),
        labels=LAB,
        structured=True,
        reference=known,
        reference_source=source,
        ride_along=_ride_along(*riding),
    )
    c = check(rep, "accuracy")
    assert c["status"] == expected, c
    assert rep.status == expected
    q = rep.metrics["quality"]
    assert q["labelled"] == own[0] + riding[0]  # the report still has the pooled figure
    assert c["value"] == min(own[1] / own[0], riding[1] / riding[0])  # the check shows the worst source's
    assert source in c["detail"] and "ride_along" in c["detail"]


def test_a_golden_set_that_names_no_row_of_the_run_warns_though_golden_rows_ride_along():
    rows, _ = _rows_known(500, 200)  # the run's own rows (40 % right), which the golden set does not name
    results, errors = split(rows)
    elsewhere = pa.table({"id": [f"elsewhere{i}" for i in range(500)], "label": ["bug"] * 500})
    rep = evaluate(
        results,
        errors,
        spec=QASpec(),
        labels=LAB,
        structured=True,
        reference=elsewhere,
        reference_source="golden_set",
        ride_along=_ride_along(300, 285),
    )
    c = check(rep, "accuracy")
    assert c["status"] == "warn" and "none of its 500 known labels names a row of this run" in c["detail"], c
    assert rep.status == "warn"


def _two_sources(own: tuple[int, int], riding: tuple[int, int], previous=None, **spec):
    rows, known = _rows_known(*own)
    return evaluate(
        *split(rows),
        spec=QASpec(**spec),
        labels=LAB,
        structured=True,
        reference=known,
        reference_source="input_column",
        ride_along=_ride_along(*riding),
        previous=previous,
    )


def test_a_fall_of_the_golden_rows_is_not_hidden_by_a_larger_night_of_the_runs_own_labels():
    """The golden rows that ride along fall from 90 % to 60 % while the run's own labelled rows stay at 95 % and
    grow tenfold: pooled, the accuracy moved +0.1 point (no drop), and a job whose accuracy gate sits at 55 %
    passed. Each source is compared with the same source of the previous report: a real 30-point drop fails."""
    spec = dict(warn_accuracy_below=0.55, fail_accuracy_below=0.5)
    before = _two_sources((2000, 1900), (300, 270), **spec).to_dict()
    rep = _two_sources((20000, 19000), (300, 180), previous=before, **spec)
    q = rep.metrics["quality"]
    assert q["vs_previous"]["real_drop"] is False  # the pooled change the report shows: within noise
    ride = q["sources"]["ride_along"]["vs_previous"]
    assert ride["delta"] == pytest.approx(180 / 300 - 270 / 300) and ride["real_drop"]
    assert (ride["previous_correct"], ride["previous_labelled"]) == (270, 300)
    own = q["sources"]["input_column"]["vs_previous"]
    assert own["delta"] == pytest.approx(0.0) and not own["real_drop"]
    c = check(rep, "accuracy_drop")
    assert c["status"] == "fail" and c["source"] == "ride_along" and c["value"] == pytest.approx(0.3)
    assert "ride_along: -30.0 pt vs 90.0% of 300" in c["detail"] and "input_column: +0.0 pt" in c["detail"]
    assert check(rep, "accuracy")["status"] == "pass" and rep.status == "fail"
    # the same two sources that did not move pass; a source the previous report did not score is not compared
    assert check(_two_sources((20000, 19000), (300, 270), previous=before, **spec), "accuracy_drop")["status"] == "pass"
    rows, known = _rows_known(300, 180)
    alone = evaluate(
        *split(rows),
        spec=QASpec(**spec),
        labels=LAB,
        structured=True,
        reference=known,
        reference_source="golden_set",
        previous=before,
    )
    c = check(alone, "accuracy_drop")
    assert c["status"] == "skip" and "both in this run and in the previous report" in c["detail"]
    # a source added since: the other is compared, and the detail names both
    riding = evaluate(
        *split([]), spec=QASpec(**spec), labels=LAB, structured=True, ride_along=_ride_along(300, 270)
    ).to_dict()
    c = check(_two_sources((300, 180), (300, 270), previous=riding, **spec), "accuracy_drop")
    assert c["status"] == "pass" and c["source"] == "ride_along" and c["detail"].startswith("ride_along: +0.0 pt")
    assert "input_column: not scored in both reports" in c["detail"]


def test_with_the_same_sources_in_both_reports_their_pooled_drop_is_judged_too():
    """Both sources fall 8 points on 150 rows each: neither interval alone excludes 0, the pooled one (300 rows)
    does; the check still sees the drop. A source added since: no pooled comparison (other rows, other measure)."""
    before = _two_sources((150, 120), (150, 120)).to_dict()
    rep = _two_sources((150, 108), (150, 108), previous=before)
    q = rep.metrics["quality"]
    assert not any(v["vs_previous"]["real_drop"] for v in q["sources"].values()) and q["vs_previous"]["real_drop"]
    c = check(rep, "accuracy_drop")
    assert c["status"] == "fail" and c["source"] == "all sources" and c["value"] == pytest.approx(0.08)
    assert "all sources: -8.0 pt vs 80.0% of 300" in c["detail"]
    riding = evaluate(*split([]), spec=QASpec(), labels=LAB, structured=True, ride_along=_ride_along(150, 120))
    assert _two_sources((150, 108), (150, 108), previous=riding.to_dict()).metrics["quality"]["vs_previous"] is None


def test_known_labels_of_one_class_cannot_pass_a_run():
    """A golden set of 50 tickets all labelled 'bug' (picked from the bug queue) and a broken model that answers
    'bug' to each of 1000 tickets of five classes (20 % right): 50 / 50 on the golden set, and QA passed. Known
    labels of one class cannot tell that model from a good one: the accuracy check warns (a person looks)."""
    truth = [LAB[i % 5] for i in range(1000)]
    results, errors = split([ok_row(i, label="bug") for i in range(1000)])
    gold = [i for i in range(1000) if truth[i] == "bug"][:50]
    ref = pa.table({"id": [f"r{i}" for i in gold], "label": ["bug"] * 50})
    rep = evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True, reference=ref)
    c = check(rep, "accuracy")
    assert (c["status"], c["value"], rep.status) == ("warn", 1.0, "warn")
    assert "every scored row's known label is 'bug'" in c["detail"]
    assert (
        rep.metrics["quality"]["only_label"] == rep.metrics["quality"]["sources"]["golden_set"]["only_label"] == "bug"
    )
    # judged per source too: the run's own rows of one class beside golden rows that ride along
    rows, _ = _rows_known(100, 100)
    one = pa.table({"id": [f"r{i}" for i in range(0, 100, 5)], "label": [LAB[0]] * 20})
    rep = evaluate(
        *split(rows),
        spec=QASpec(min_labelled=10),
        labels=LAB,
        structured=True,
        reference=one,
        ride_along=_ride_along(60, 60),
    )
    c = check(rep, "accuracy")
    assert c["status"] == "warn" and c["source"] == "golden_set" and "known label is 'billing'" in c["detail"], c
    # two classes known, 50 of 51 'bug': answering 'bug' to every row scores 98 % too (the majority baseline)
    two = pa.table({"id": [f"r{i}" for i in gold] + ["r0"], "label": ["bug"] * 50 + [LAB[0]]})
    c = check(evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True, reference=two), "accuracy")
    assert c["status"] == "warn" and "98.0 % of the scored rows' known labels are 'bug'" in c["detail"], c
    # a fail stays a fail, a job of one label, and the gate turned off: as before
    wrong = pa.table({"id": [f"r{i}" for i in range(0, 1000, 5)], "label": ["billing"] * 200})
    assert (
        check(evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True, reference=wrong), "accuracy")[
            "status"
        ]
        == "fail"
    )
    assert (
        check(evaluate(results, errors, spec=QASpec(), labels=["bug"], structured=True, reference=ref), "accuracy")[
            "status"
        ]
        == "pass"
    )
    off = QASpec(warn_accuracy_below=0, fail_accuracy_below=0)
    assert (
        check(evaluate(results, errors, spec=off, labels=LAB, structured=True, reference=ref), "accuracy")["status"]
        == "pass"
    )


def test_an_accuracy_no_better_than_answering_the_most_common_known_label_does_not_pass():
    """A golden set of 400 tickets, 85 % 'bug' (as a queue's tickets often are), and a broken model answering 'bug'
    to every ticket: 85 % right, over a warn line of 0.8, and QA passed. Its interval reaches down to what answering
    'bug' to every row scores: a warning naming the label. A model clearly better than that on the same set, and a
    good one on a balanced set, pass; a per-source judgement names the source."""
    truth = ["bug"] * 340 + ["billing"] * 30 + ["account"] * 30
    ref = pa.table({"id": [f"r{i}" for i in range(400)], "label": truth})
    always = split([ok_row(i, label="bug") for i in range(400)])
    rep = evaluate(*always, spec=QASpec(), labels=LAB, structured=True, reference=ref)
    c = check(rep, "accuracy")
    assert (c["status"], c["value"], rep.status) == ("warn", 0.85, "warn"), c
    assert "85.0 % of the scored rows' known labels are 'bug'" in c["detail"] and "from 81." in c["detail"], c
    assert rep.metrics["quality"]["majority"] == {"label": "bug", "count": 340}
    # 392 of 400 right (98 %, interval from 96.1 %): clearly above 85 %
    good = [ok_row(i, label=truth[i] if i >= 8 else "other") for i in range(400)]
    c = check(evaluate(*split(good), spec=QASpec(), labels=LAB, structured=True, reference=ref), "accuracy")
    assert c["status"] == "pass" and c["value"] == pytest.approx(0.98), c
    # a balanced set, 90 % right: its majority (20 %) is far below
    balanced = [LAB[i % 5] for i in range(400)]
    ref5 = pa.table({"id": [f"r{i}" for i in range(400)], "label": balanced})
    rows = [ok_row(i, label=balanced[i] if i % 10 else balanced[(i + 1) % 400]) for i in range(400)]
    c = check(evaluate(*split(rows), spec=QASpec(), labels=LAB, structured=True, reference=ref5), "accuracy")
    assert (c["status"], c["value"]) == ("pass", 0.9), c
    # the gate turned off: as before
    off = QASpec(warn_accuracy_below=0, fail_accuracy_below=0)
    assert (
        check(evaluate(*always, spec=off, labels=LAB, structured=True, reference=ref), "accuracy")["status"] == "pass"
    )


def test_a_reference_whose_labels_are_all_blank_warns_and_says_so():
    """A golden set whose every label is null or blank scores nothing: a warning that names the empty reference,
    not one that sends the reader looking for ids that do not match."""
    rows, known = _rows_known(100, 100)
    blank = known.set_column(1, "label", pa.array([None, " ", ""] * 33 + [None], pa.string()))
    rep = evaluate(*split(rows), spec=QASpec(), labels=LAB, structured=True, reference=blank)
    c = check(rep, "accuracy")
    assert c["status"] == "warn" and "holds no known label (every label null or blank)" in c["detail"], c
    assert "names a row" not in c["detail"]
    rep = evaluate(
        *split(rows), spec=QASpec(), labels=LAB, structured=True, reference=blank, ride_along=_ride_along(60, 60)
    )
    c = check(rep, "accuracy")
    assert c["status"] == "warn" and "golden_set: it holds no known label" in c["detail"], c


def test_too_few_rows_to_gate_on_fail_when_even_the_top_of_the_interval_is_below_the_fail_line():
    for n, right, expected in ((29, 0, "fail"), (29, 14, "warn"), (5, 0, "fail"), (3, 0, "warn"), (1, 0, "warn")):
        rows, known = _rows_known(n, right)
        results, errors = split(rows)
        c = check(evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True, reference=known), "accuracy")
        assert c["status"] == expected, (n, right, c)
        assert (c["interval"][1] < QASpec().fail_accuracy_below) == (expected == "fail")


def test_accuracy_thresholds_the_job_set_warn_when_no_known_label_reaches_qa():
    rows, _ = _rows_known(100, 40)
    results, errors = split(rows)
    for qa, expected in (
        ({"warn_accuracy_below": 0.95, "fail_accuracy_below": 0.9, "reference": {"golden_uri": ""}}, "warn"),
        ({"fail_accuracy_below": 0.6}, "warn"),
        ({"warn_accuracy_below": 0.0, "fail_accuracy_below": 0.0}, "skip"),  # the gate turned off
        ({"warn_accuracy_below": 0.3, "fail_accuracy_below": 0.0}, "warn"),
        ({}, "skip"),  # a job that never asked for accuracy
        # the defaults, as the plan task hands the spec on (a whole dump: every field set): not a request
        (QASpec().model_dump(mode="json"), "skip"),
    ):
        spec = QASpec.model_validate(qa)
        c = check(evaluate(results, errors, spec=spec, labels=LAB, structured=True), "accuracy")
        assert c["status"] == expected, (qa, c)


def test_a_run_that_lost_the_known_labels_its_previous_report_had_warns():
    rows, known = _rows_known(500, 450)
    results, errors = split(rows)
    before = evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True, reference=known).to_dict()
    rows, _ = _rows_known(500, 200)
    results, errors = split(rows)
    rep = evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True, previous=before)
    c = check(rep, "accuracy")
    assert c["status"] == "warn" and "previous report measured accuracy" in c["detail"], c
    assert rep.status == "warn"
    # a previous report without known labels: nothing was lost
    unlabelled = evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True).to_dict()
    again = evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True, previous=unlabelled)
    assert check(again, "accuracy")["status"] == "skip"


def test_the_report_of_another_job_is_no_baseline():
    rows, known = _rows_known(1000, 500)  # the same golden ids and labels: only the job differs
    results, errors = split(rows)
    spec = QASpec(previous_report_uri="s3://bucket/other/qa/report.json")
    other = evaluate(
        results, errors, spec=QASpec(), labels=LAB, structured=True, reference=known, run_info={"job": "other"}
    ).to_dict()
    rows, known = _rows_known(1000, 550)
    results, errors = split(rows)
    for info, drop in (({"job": "tickets"}, "warn"), ({"job": "other"}, "pass")):
        rep = evaluate(
            results, errors, spec=spec, labels=LAB, structured=True, reference=known, previous=other, run_info=info
        )
        assert check(rep, "accuracy_drop")["status"] == drop, (info, check(rep, "accuracy_drop"))
        refused = (rep.metrics["previous"] or {}).get("refused")
        assert (refused is not None) == (drop == "warn")
        if refused:
            assert refused["uri"] == spec.previous_report_uri and "'other', not of this job 'tickets'" in refused["why"]


def test_the_low_confidence_gate_counts_answers_without_a_confidence_as_low():
    rows = [ok_row(i, label="bug", confidence=0.99 if i < 5 else None) for i in range(1000)]
    results, errors = split(rows)
    spec = QASpec(warn_low_confidence_rate=0.1, fail_low_confidence_rate=0.2)
    rep = evaluate(results, errors, spec=spec, labels=LAB, structured=True)
    c = check(rep, "low_confidence_rate")
    assert rep.metrics["confidence"]["missing"] == 995
    assert c["status"] == "fail" and c["value"] == 995 / 1000 and "995 answer(s) without a confidence" in c["detail"]
    # the gate off (its default): the same run passes it
    assert (
        check(evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True), "low_confidence_rate")["status"]
        == "pass"
    )


def test_known_labels_are_stripped_as_the_worker_strips_the_answers():
    rows, known = _rows_known(40, 40)
    padded = pa.table(
        {
            "id": known["id"],
            "label": [f"\t{x}\n" if i % 2 else f"{x}\xa0" for i, x in enumerate(known["label"].to_pylist())],
        }
    )
    results, errors = split(rows)
    rep = evaluate(results, errors, spec=QASpec(), labels=LAB, structured=True, reference=padded)
    assert rep.metrics["quality"]["correct"] == 40 and check(rep, "accuracy")["status"] == "pass"


@pytest.mark.parametrize("source", ["golden_set", "ride_along"])
def test_golden_rows_without_a_right_answer_are_scored_wrong_not_left_out(source):
    """Of 100 golden rows, 40 answered right; the other 60 errored, answered invalid, answered a label outside the
    job's set, or with no label: every one of them is scored (wrong). Scoring only the 40 answered rows would pass
    a 40 % run at 100 %."""
    rows = [ok_row(i, label=LAB[i % 5], id=f"g{i}", confidence=0.9) for i in range(40)]
    rows += [err_row(i, id=f"g{i}") for i in range(40, 55)]
    rows += [ok_row(i, label=LAB[i % 5], id=f"g{i}", valid=False) for i in range(55, 70)]
    rows += [ok_row(i, label="Bug", id=f"g{i}") for i in range(70, 85)]  # not a label of the job (case)
    rows += [ok_row(i, label=None, id=f"g{i}") for i in range(85, 100)]
    known = pa.table({"id": [f"g{i}" for i in range(100)], "label": [LAB[i % 5] for i in range(100)]})
    results, errors = split(rows)
    empty = split([])
    if source == "golden_set":
        kw = dict(reference=known, reference_source="golden_set")
        main = (results, errors)
    else:
        kw = dict(ride_along=(results, errors, known))
        main = empty
    rep = evaluate(*main, spec=QASpec(), labels=LAB, structured=True, **kw)
    c = check(rep, "accuracy")
    assert (c["status"], c["value"], c["of"]) == ("fail", 0.4, 100), c
    assert rep.metrics["quality"]["sources"][source]["unmatched"] == 0 and rep.status == "fail"
