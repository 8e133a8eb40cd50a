"""steps/qa/accuracy.py against independent implementations: scikit-learn's metrics, scipy's Wilson
interval, and Newcombe's published example for the difference of two proportions."""

from __future__ import annotations

import math
import random

import pytest
from scipy.stats import binomtest
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support

from airflow_provider_vllm.steps.qa.accuracy import NO_ANSWER, classification, newcombe, versus, wilson

LABELS = ["billing", "bug", "feature_request", "account", "other"]


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (0, 10), (3, 10), (10, 10), (396, 1000), (792, 2000), (1, 10_000)])
def test_wilson_is_scipys_wilson_interval(k, n):
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson(k, n)
    assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)


def test_wilson_of_nothing_is_none():
    assert wilson(0, 0) is None


def test_newcombe_matches_the_published_example():
    # Newcombe (1998), Statistics in Medicine 17:873-890, table II, example (a): 56/70 - 48/80,
    # method 10 (score interval for each proportion, no continuity correction): +0.0524 to +0.3339.
    d, lo, hi = newcombe(56, 70, 48, 80)
    assert d == pytest.approx(0.2) and lo == pytest.approx(0.0524, abs=5e-5) and hi == pytest.approx(0.3339, abs=5e-5)


def test_newcombe_from_scipys_wilson_intervals():
    rnd = random.Random(3)
    for _ in range(50):
        n1, n0 = rnd.randint(1, 3000), rnd.randint(1, 3000)
        k1, k0 = rnd.randint(0, n1), rnd.randint(0, n0)
        a = binomtest(k1, n1).proportion_ci(method="wilson")
        b = binomtest(k0, n0).proportion_ci(method="wilson")
        p1, p0 = k1 / n1, k0 / n0
        lo = p1 - p0 - math.sqrt((p1 - a.low) ** 2 + (b.high - p0) ** 2)
        hi = p1 - p0 + math.sqrt((a.high - p1) ** 2 + (p0 - b.low) ** 2)
        d, got_lo, got_hi = newcombe(k1, n1, k0, n0)
        assert (
            d == pytest.approx(p1 - p0) and got_lo == pytest.approx(max(-1, lo)) and got_hi == pytest.approx(min(1, hi))
        )


def _rows(n, seed, accuracy=0.6, labels=LABELS, none_share=0.05):
    rnd = random.Random(seed)
    truth = [rnd.choice(labels) for _ in range(n)]
    pred = []
    for t in truth:
        u = rnd.random()
        pred.append(None if u < none_share else t if u < accuracy else rnd.choice(labels))
    return truth, pred


def _counts(truth, pred):
    c = {}
    for t, p in zip(truth, pred):
        c[(t, p)] = c.get((t, p), 0) + 1
    return c


@pytest.mark.parametrize("seed,n,labels", [(0, 2000, LABELS), (1, 37, LABELS), (2, 500, LABELS[:2]), (3, 300, None)])
def test_classification_equals_scikit_learn(seed, n, labels):
    truth, pred = _rows(n, seed)
    q = classification(_counts(truth, pred), labels)
    y_pred = [NO_ANSWER if p is None else p for p in pred]
    classes = q["classes"]
    present = (set(truth) | set(pred)) - {None}
    assert classes == [c for c in labels or [] if c in present] + sorted(present - set(labels or []))
    assert q["labelled"] == n
    assert q["accuracy"]["value"] == pytest.approx(accuracy_score(truth, y_pred), abs=1e-12)
    assert q["macro_f1"] == pytest.approx(
        f1_score(truth, y_pred, labels=classes, average="macro", zero_division=0), abs=1e-12
    )
    p, r, f, s = precision_recall_fscore_support(truth, y_pred, labels=classes, zero_division=0)
    for i, c in enumerate(classes):
        got = q["per_class"][c]
        assert (got["precision"], got["recall"], got["f1"], got["support"]) == pytest.approx((p[i], r[i], f[i], s[i]))
    cm = confusion_matrix(truth, y_pred, labels=classes + [NO_ANSWER])
    cells = {(c["true"], c["pred"]): c["count"] for c in q["confusion"]}
    for i, t in enumerate(classes):
        for j, pcol in enumerate(classes + [NO_ANSWER]):
            assert cells.get((t, pcol), 0) == cm[i, j]
    assert q["no_answer"] == sum(1 for x in pred if x is None)
    lo, hi = wilson(q["correct"], n)
    assert (q["accuracy"]["low"], q["accuracy"]["high"]) == (lo, hi)


def test_a_label_nobody_knew_or_predicted_is_not_a_class():
    q = classification({("bug", "bug"): 3, ("billing", "bug"): 1}, LABELS)
    assert q["classes"] == ["billing", "bug"]
    assert q["macro_f1"] == pytest.approx(
        f1_score(["bug"] * 3 + ["billing"], ["bug"] * 4, labels=["billing", "bug"], average="macro", zero_division=0)
    )


def test_labels_outside_the_job_label_set_are_classes_after_it():
    q = classification({("spam", "bug"): 2, ("bug", "bug"): 1}, ["bug", "billing"])
    assert q["classes"] == ["bug", "spam"]


def test_no_labelled_rows():
    q = classification({}, LABELS)
    assert q["labelled"] == 0 and q["accuracy"]["value"] is None and q["macro_f1"] is None and q["confusion"] == []


def test_versus_calls_a_drop_real_only_when_the_interval_is_below_zero():
    prev = {"correct": 800, "labelled": 1000}
    clear = versus({"correct": 600, "labelled": 1000}, prev)
    assert clear["real_drop"] and clear["high"] < 0 and clear["delta"] == pytest.approx(-0.2)
    noise = versus({"correct": 790, "labelled": 1000}, prev)
    assert not noise["real_drop"] and noise["low"] < 0 < noise["high"]
    small = versus({"correct": 7, "labelled": 10}, {"correct": 9, "labelled": 10})
    assert not small["real_drop"]  # 2 of 10 fewer right proves nothing
    gain = versus({"correct": 950, "labelled": 1000}, prev)
    assert gain["real_gain"] and not gain["real_drop"]


@pytest.mark.parametrize(
    "prev", [None, {}, {"correct": 5}, {"correct": 3, "labelled": 0}, {"correct": 11, "labelled": 10}, {"correct": "a"}]
)
def test_versus_ignores_a_previous_report_without_usable_counts(prev):
    assert versus({"correct": 5, "labelled": 10}, prev) is None


def test_a_known_label_spelled_like_no_answer_does_not_make_unanswered_rows_right():
    # a golden label "(none)" (NO_ANSWER's spelling) against rows that got no answer at all: wrong, not right
    q = classification({("(none)", None): 100, ("(none)", "bug"): 100, ("bug", "bug"): 10}, ["bug"])
    assert q["correct"] == 10 and q["labelled"] == 210 and q["no_answer"] == 100
    assert {"true": "(none)", "pred": NO_ANSWER, "count": 100} in q["confusion"]
    # the label itself, when the model gives it, is a right answer
    assert classification({("(none)", "(none)"): 4}, None)["correct"] == 4


def test_the_paired_interval_is_newcombes_method_10_and_covers():
    """newcombe_paired (Newcombe 1998, Statist. Med. 17:2635, method 10): no discordant row is no change; the roles
    swapped negate the interval; on rows right or wrong together it is narrower than the independent interval; and
    over simulated paired runs its 95% interval covers the true change about 95% of the time."""
    from airflow_provider_vllm.steps.qa.accuracy import newcombe_paired, versus_paired

    d, lo, hi = newcombe_paired(200, 0, 0, 100)
    assert d == 0 and lo < 0 < hi
    d, lo, hi = newcombe_paired(200, 0, 70, 30)
    assert d == pytest.approx(-70 / 300) and hi < 0
    assert newcombe_paired(200, 70, 0, 30) == pytest.approx((-d, -hi, -lo))
    _, ilo, ihi = newcombe(230, 300, 240, 300)
    _, plo, phi = newcombe_paired(225, 5, 15, 55)  # the same margins, rows that mostly agree
    assert phi - plo < ihi - ilo
    assert newcombe_paired(0, 0, 0, 0) is None and versus_paired(0, 0, 0, 0) is None
    v = versus_paired(200, 0, 70, 30)
    assert v["real_drop"] and v["previous"] == pytest.approx(270 / 300) and v["previous_labelled"] == 300
    rnd = random.Random(7)
    cells, n, hits, runs = (0.7, 0.05, 0.1, 0.15), 200, 0, 2000  # both, now only, before only, neither
    for _ in range(runs):
        counts = [0, 0, 0, 0]
        for _ in range(n):
            u, k = rnd.random(), 0
            while u > cells[k] and k < 3:
                u -= cells[k]
                k += 1
            counts[k] += 1
        _, lo, hi = newcombe_paired(*counts)
        hits += lo <= cells[1] - cells[2] <= hi
    assert 0.93 <= hits / runs <= 0.975
