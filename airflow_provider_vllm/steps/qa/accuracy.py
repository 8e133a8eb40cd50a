"""Classification quality from counts: accuracy with its interval, per-class precision / recall /
F1 / support, macro-F1, the confusion matrix, and the change in accuracy against an earlier run.

Pure arithmetic over ``(true label, predicted label) -> rows`` counts (``labelled`` gets them from
one DuckDB GROUP BY); no I/O. The definitions are scikit-learn's, and the tests hold them to it:

* ``accuracy`` = rows whose predicted label equals the known one / scored rows
  (``accuracy_score``). A row without a predicted label (an error row, an invalid structured
  answer) is scored and wrong: its prediction is ``NO_ANSWER``.
* per class ``c`` of ``classes`` (the job's labels, then any other known or predicted label;
  never ``NO_ANSWER``): precision = tp / predicted c, recall = tp / support (rows known to be c),
  F1 = 2 tp / (support + predicted c); 0 where the denominator is 0. ``macro_f1`` is their
  unweighted mean over ``classes``: ``f1_score(y_true, y_pred, labels=classes, average="macro",
  zero_division=0)``, where y_pred holds ``NO_ANSWER`` for the unanswered rows.
* the 95% interval of a proportion is Wilson's score interval (``wilson``; scipy's
  ``binomtest(k, n).proportion_ci(method="wilson")``); the interval of the difference of two
  independent proportions is Newcombe's hybrid score interval built from the two Wilson
  intervals (``newcombe``, method 10 of Newcombe 1998). Two runs scored on the same golden
  rows are not independent samples; the independent interval is wider than a paired one, so a
  drop it calls real is real (it may miss a small one).
* the interval of the difference of two proportions measured on the same rows (each row right or wrong in both
  runs) is Newcombe's paired score interval (``newcombe_paired``, method 10 of Newcombe 1998, Statist. Med. 17,
  2635-2650: the two Wilson intervals combined with the rows' phi correlation, continuity-corrected); the change in
  accuracy on the ids two golden sets share is judged so (``versus_paired``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

NO_ANSWER = "(none)"  # the predicted label of a scored row without an answer (JSON key and display)
Z95 = 1.959963984540054  # the standard normal's 0.975 quantile
MAX_CELLS = 10_000  # confusion cells kept in the report (largest first); 1000 labels could make a million


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson's score interval of k successes in n trials; None when n is 0."""
    if n <= 0:
        return None
    p = k / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def newcombe(k1: int, n1: int, k0: int, n0: int, z: float = Z95) -> tuple[float, float, float] | None:
    """(p1 - p0, low, high): Newcombe's hybrid score interval of the difference of two proportions."""
    a, b = wilson(k1, n1, z), wilson(k0, n0, z)
    if a is None or b is None:
        return None
    p1, p0 = k1 / n1, k0 / n0
    d = p1 - p0
    low = d - math.sqrt((p1 - a[0]) ** 2 + (b[1] - p0) ** 2)
    high = d + math.sqrt((a[1] - p1) ** 2 + (p0 - b[0]) ** 2)
    return d, max(-1.0, low), min(1.0, high)


def newcombe_paired(both: int, now_only: int, before_only: int, neither: int, z: float = Z95):
    """(p_now - p_before, low, high) over rows scored in both runs: ``both`` right in both, ``now_only`` right now
    and wrong before, ``before_only`` right before and wrong now, ``neither`` wrong in both. Newcombe's method 10
    (paired); None when there is no row."""
    n = both + now_only + before_only + neither
    a, b = wilson(both + now_only, n, z), wilson(both + before_only, n, z)
    if a is None or b is None:
        return None
    p1, p0 = (both + now_only) / n, (both + before_only) / n
    d = p1 - p0
    phi = 0.0
    margins = (both + now_only) * (before_only + neither) * (both + before_only) * (now_only + neither)
    if margins:
        cross = both * neither - now_only * before_only
        corrected = cross - n / 2 if cross > n / 2 else cross if cross < 0 else 0.0
        phi = corrected / math.sqrt(margins)
    low_sq = (p1 - a[0]) ** 2 - 2 * phi * (p1 - a[0]) * (b[1] - p0) + (b[1] - p0) ** 2
    high_sq = (a[1] - p1) ** 2 - 2 * phi * (a[1] - p1) * (p0 - b[0]) + (p0 - b[0]) ** 2
    return d, max(-1.0, d - math.sqrt(max(0.0, low_sq))), min(1.0, d + math.sqrt(max(0.0, high_sq)))


def proportion(k: int, n: int) -> dict[str, Any]:
    """``{value, low, high, count, of}``: k / n with its 95% Wilson interval (value None when n is 0)."""
    ci = wilson(k, n)
    return {
        "value": k / n if n else None,
        "low": ci[0] if ci else None,
        "high": ci[1] if ci else None,
        "count": int(k),
        "of": int(n),
    }


def class_order(labels: Sequence[str] | None, seen: Iterable[str | None]) -> list[str]:
    """The job's labels in their order, then any other label seen (sorted); never ``NO_ANSWER`` or None."""
    out = [x for x in (labels or [])]
    extra = sorted({x for x in seen if x is not None and x != NO_ANSWER and x not in set(out)})
    return out + extra


def classification(counts: Mapping[tuple[str, str | None], int], labels: Sequence[str] | None) -> dict[str, Any]:
    """Accuracy, per-class figures, macro-F1 and the confusion cells of ``(true, predicted) -> rows``.

    A predicted None is ``NO_ANSWER``. ``labels``: the job's label set (order of the classes);
    classes nobody knew or predicted are left out of the per-class table and the macro mean,
    as scikit-learn leaves out labels absent from both y_true and y_pred.
    """
    # no answer stays None here (NO_ANSWER only in the confusion cells shown): a known label spelled like it
    # must not make every unanswered row right
    cells: dict[tuple[str, str | None], int] = {}
    for (t, p), n in counts.items():
        if n:
            key = (str(t), None if p is None else str(p))
            cells[key] = cells.get(key, 0) + int(n)
    present = {t for t, _ in cells} | {p for _, p in cells if p is not None}
    classes = [c for c in class_order(labels, present) if c in present]
    n = sum(cells.values())
    correct = sum(k for (t, p), k in cells.items() if t == p)
    support = {c: 0 for c in classes}
    predicted = {c: 0 for c in classes}
    for (t, p), k in cells.items():
        support[t] = support.get(t, 0) + k
        if p is not None:
            predicted[p] = predicted.get(p, 0) + k
    per_class = {}
    for c in classes:
        tp = cells.get((c, c), 0)
        per_class[c] = {
            "precision": tp / predicted[c] if predicted[c] else 0.0,
            "recall": tp / support[c] if support[c] else 0.0,
            "f1": 2 * tp / (support[c] + predicted[c]) if support[c] + predicted[c] else 0.0,
            "support": support[c],
            "predicted": predicted[c],
            "correct": tp,
        }
    no_answer = sum(k for (_, p), k in cells.items() if p is None)
    shown: dict[tuple[str, str], int] = {}
    for (t, p), k in cells.items():
        shown[(t, NO_ANSWER if p is None else p)] = shown.get((t, NO_ANSWER if p is None else p), 0) + k
    ordered = sorted(shown.items(), key=lambda kv: (-kv[1], kv[0][0], kv[0][1]))
    return {
        "labelled": n,
        "correct": correct,
        "accuracy": proportion(correct, n),
        "macro_f1": (sum(v["f1"] for v in per_class.values()) / len(per_class)) if per_class else None,
        "classes": classes,
        "per_class": per_class,
        "no_answer": no_answer,
        "confusion": [{"true": t, "pred": p, "count": k} for (t, p), k in ordered[:MAX_CELLS]],
        "confusion_cells": len(cells),
    }


def versus(now: Mapping[str, Any], previous: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The change in accuracy since ``previous`` (an earlier ``classification`` dict): ``delta`` with
    its 95% Newcombe interval; ``real_drop`` when the whole interval lies below 0 (``real_gain`` above)."""
    if not previous or not now.get("labelled"):
        return None
    k0, n0 = previous.get("correct"), previous.get("labelled")
    if not isinstance(k0, int) or not isinstance(n0, int) or n0 <= 0 or not 0 <= k0 <= n0:
        return None
    d = newcombe(int(now["correct"]), int(now["labelled"]), k0, n0)
    if d is None:
        return None
    delta, low, high = d
    return {
        "previous": k0 / n0,
        "previous_correct": k0,
        "previous_labelled": n0,
        "delta": delta,
        "low": low,
        "high": high,
        "method": "newcombe-wilson",
        "real_drop": high < 0,
        "real_gain": low > 0,
    }


def versus_paired(both: int, now_only: int, before_only: int, neither: int) -> dict[str, Any] | None:
    """``versus`` for rows scored in both runs (``newcombe_paired``'s counts): the change in accuracy on those rows
    with its paired 95% interval; ``previous`` is the earlier run's accuracy on them. None when there is none."""
    d = newcombe_paired(both, now_only, before_only, neither)
    if d is None:
        return None
    delta, low, high = d
    n = both + now_only + before_only + neither
    return {
        "previous": (both + before_only) / n,
        "previous_correct": both + before_only,
        "previous_labelled": n,
        "correct": both + now_only,
        "delta": delta,
        "low": low,
        "high": high,
        "method": "newcombe-paired",
        "real_drop": high < 0,
        "real_gain": low > 0,
        "paired": {"both": both, "now_only": now_only, "before_only": before_only, "neither": neither},
    }
