"""QA threshold checks: each metric against its warn / fail thresholds in ``QASpec``, and the
overall verdict (the worst check; ``pass`` when every check was skipped).

Most checks fail *above* their thresholds (rates, drift). ``accuracy`` fails *below* them
(``direction`` 'below'), and it does not pass by default when it cannot be judged: known labels
configured but fewer than ``min_labelled`` rows scored is a warning (a failure when even the top of the
95% interval is below the fail line); each source of known labels (the run's own rows, the ride-along golden
rows) is judged on its own rows, the check being the worst; accuracy thresholds the job set (other than the
defaults, and not 0: off), or a previous report that had known labels, with none reaching this run warn. Known
labels that are all one class (of a job with several) never pass: a model answering that class to every row would
score as well (a warning); nor an accuracy whose 95% interval reaches down to the share of the most common known
label (what answering it to every row scores: a warning).
``accuracy_drop`` (the drop since the previous report) warns or fails only when the 95% interval of the
change lies below 0 (a real drop), and then by its size; like ``accuracy``, each source of known labels is compared
with the same source of the previous report (a pooled figure alone would hide a fall of the golden rows beside a
larger night of the run's own labelled rows), only when both scored the same yardstick (``yardstick.judge``: a golden
set replaced since is compared paired on the ids both share with the same label, or, when nothing can be paired, not
compared: a warning, never a pass nor a fail; so is a previous report that did not record its yardstick), and, when
both reports have the same sources each on the same yardstick, so is the pooled accuracy; the check is the worst.
The gates off by default (``low_confidence_rate``,
``inconsistency_rate``) warn, once turned on, for a run that lacks their measure (no confidence; no
prompt hashes: an embed job, or requests that sample at random), rather than skipping. So do ``label_drift``
and ``accuracy_drop`` when ``qa.previous_report_uri`` is set but its report was not used (no sealed QA record of
its run vouches for it: ``store.load_previous_report``), for a run that has labels to compare; and ``churn_rate``,
once turned on (a threshold below 1), when ``changes.previous_uri`` holds a run whose ``_MERGED.json`` this
deployment's merge did not seal (``previous_state`` 'unverified': not read, every id 'added').
"""

from __future__ import annotations

from typing import Any

from airflow_provider_vllm.core.spec import QA_RATES, QASpec
from airflow_provider_vllm.steps.qa.accuracy import proportion

# the rate checks (warn and fail above their thresholds), with accuracy (below its own) just before its drop
_DROP = QA_RATES.index("accuracy_drop")
CHECKS = (*QA_RATES[:_DROP], "accuracy", *QA_RATES[_DROP:])
STATUS_ORDER = {"skip": -1, "pass": 0, "warn": 1, "fail": 2}

_CHECK_TEXT = {
    "error_rate": "rows that failed (error rows / all rows)",
    "empty_rate": "ok rows with null or whitespace-only output",
    "invalid_rate": "structured outputs that do not parse / match",
    "truncation_rate": "ok rows whose prompt was truncated",
    "label_drift": "total variation distance of the label distribution vs the previous run",
    "churn_rate": "ids answered in both runs whose answer changed (changes.previous_uri)",
    "accuracy": "labelled rows answered with the known label (qa.reference; errors and invalid answers are wrong)",
    "accuracy_drop": "fall in accuracy since the previous report, when its 95% interval is below 0",
    "low_confidence_rate": "answers whose confidence is below qa.low_confidence",
    "inconsistency_rate": "prompts sent more than once that got different answers",
}


# the gates off by default (thresholds 1.0) whose measure a run may lack: once turned on, a run without it warns
_OPT_IN = {"low_confidence_rate": "confidence", "inconsistency_rate": "consistency"}


def _pt(x: float) -> str:
    return f"{100 * x:+.1f} pt"


def _status(value: float | None, warn: float, fail: float) -> str:
    if value is None:
        return "skip"
    return "fail" if value > fail else "warn" if value > warn else "pass"


def _accuracy(metrics: dict[str, Any], spec: QASpec) -> tuple[float | None, str, str, dict[str, Any]]:
    q = metrics.get("quality")
    if q is None:
        return None, *_unmeasured(metrics, spec), {}
    sources = {s: v for s, v in (q.get("sources") or {}).items() if isinstance(v, dict)}
    if len(sources) <= 1:  # one source (or a report without them): the pooled figure is that source's
        acc = q["accuracy"]
        k, n = int(q["correct"]), int(q["labelled"])
        known = next(iter(sources.values()), {}).get("known")
        none = (
            "known labels are configured but none names a row of this run"
            if known != 0
            else "the reference is configured but holds no known label (every label null or blank)"
        )
        one = q if len(sources) != 1 else next(iter(sources.values()))
        status, why = _judge(k, n, spec, none, one.get("only_label"), one.get("majority"))
        extra = {"interval": [acc["low"], acc["high"]], "of": n}
        return acc["value"], status, _detail(k, n, acc, why), extra
    # Each source is judged on its own rows: the run's own labelled rows at 40 % must not pass because golden
    # rows riding along are right, nor a golden set that names no row of this run because the other one does.
    judged = []
    for source, v in sources.items():
        k, n = int(v["count"]), int(v["of"])
        known = v.get("known", 0)
        none = (
            f"none of its {known} known labels names a row of this run"
            if known
            else "it holds no known label (every label null or blank)"
        )
        status, why = _judge(k, n, spec, none, v.get("only_label"), v.get("majority"))
        judged.append((STATUS_ORDER[status], -1.0 if v["value"] is None else -v["value"], source, status, why, v))
    _, _, source, status, _, worst = max(judged, key=lambda j: j[:2])
    detail = "; ".join(f"{s}: {_detail(int(v['count']), int(v['of']), v, why)}" for _, _, s, _, why, v in judged)
    extra = {"interval": [worst["low"], worst["high"]], "of": int(worst["of"]), "source": source}
    return worst["value"], status, f"{detail} (the check is the worst source's)", extra


def _judge(
    k: int,
    n: int,
    spec: QASpec,
    none_scored: str,
    only_label: str | None = None,
    majority: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """The accuracy check's status for k right answers of n scored rows, and why when that is not the value's.
    ``only_label``: the known label of every scored row, when they all have the same one: a pass becomes a warning
    (answering that label to every row would score as well). ``majority``: the most common known label and its
    rows: a pass whose 95 % interval reaches down to the accuracy of answering it to every row becomes a warning
    (the known labels cannot tell this model from that one)."""
    if not n:
        return "warn", f"{none_scored}: nothing to score"
    high = proportion(k, n)["high"]
    if n < spec.min_labelled:
        if high < spec.fail_accuracy_below:  # too few to gate on, yet the whole 95 % interval is below the fail line
            return (
                "fail",
                f"only {n} scored rows, but even the top of the 95 % interval is below qa.fail_accuracy_below",
            )
        return "warn", f"only {n} scored rows, fewer than qa.min_labelled {spec.min_labelled}"
    value = k / n
    status = "fail" if value < spec.fail_accuracy_below else "warn" if value < spec.warn_accuracy_below else "pass"
    if status == "pass" and only_label is not None and spec.warn_accuracy_below > 0:  # 0: the gate is off
        return "warn", (
            f"every scored row's known label is {only_label!r}: a model that answers {only_label!r} to every row "
            "would score as well; known labels of one class cannot pass a run"
        )
    if status == "pass" and majority is not None and spec.warn_accuracy_below > 0:
        baseline, low = int(majority["count"]) / n, proportion(k, n)["low"]
        if low is not None and low <= baseline:
            return "warn", (
                f"{100 * baseline:.1f} % of the scored rows' known labels are {majority['label']!r}: a model that "
                f"answers {majority['label']!r} to every row would score that, and this accuracy is not above it by "
                f"its 95 % interval (from {100 * low:.1f} %)"
            )
    return status, ""


def _detail(k: int, n: int, acc: dict[str, Any], why: str) -> str:
    if not n:
        return why
    text = f"{k} / {n}, 95% interval {100 * acc['low']:.1f}-{100 * acc['high']:.1f}%"
    return f"{text}; {why}" if why else text


def _unmeasured(metrics: dict[str, Any], spec: QASpec) -> tuple[str, str]:
    """The accuracy check of a run without known labels: skipped, unless the job or its previous report expected
    some (then a warning, not a silent pass)."""
    prev = metrics.get("previous") or {}
    if prev.get("accuracy"):
        return "warn", (
            "the previous report measured accuracy on known labels; no known label reaches this run's QA "
            "(qa.reference): nothing to judge it on"
        )
    # thresholds other than the defaults, not both 0 (the gate turned off): the job asked for the gate (not
    # ``model_fields_set``: the plan task hands the spec on as a whole dump, every field set)
    fields = ("warn_accuracy_below", "fail_accuracy_below")
    if any(getattr(spec, f) != QASpec.model_fields[f].default for f in fields) and spec.warn_accuracy_below > 0:
        return "warn", (
            "qa.warn_accuracy_below / qa.fail_accuracy_below are set, but no known label reaches this run's QA "
            "(qa.reference): nothing to judge them on"
        )
    return "skip", "no known labels (qa.reference)"


def _refused(metrics: dict[str, Any]) -> str | None:
    """Why the previous report (qa.previous_report_uri) was not used, if it was not (``store.load_previous_report``)."""
    r = (metrics.get("previous") or {}).get("refused")
    return None if r is None else f"the previous report {r['uri']} was not used ({r['why']}): nothing to judge it on"


def _drop(metrics: dict[str, Any], spec: QASpec) -> tuple[float | None, str, str, dict[str, Any]]:
    q = metrics.get("quality") or {}
    sources = {s: v for s, v in (q.get("sources") or {}).items() if isinstance(v, dict) and "vs_previous" in v}
    if sources:  # the previous report has figures: each source against its own (labelled.quality, yardstick.judge)
        judged = [(s, *_drop_of_source(v, spec)) for s, v in sources.items() if v.get("compared") is not None]
        if not judged:
            return (
                None,
                "skip",
                "no source of known labels has scored rows both in this run and in the previous report",
                {},
            )
        if len(sources) == 1:
            return judged[0][1:]
        if q.get("vs_previous") is not None:  # the same sources on the same yardsticks: their pooled change (more rows)
            judged.append(("all sources", *_drop_of(q["vs_previous"], spec)))
        # the worst (the largest real drop); a source that did not really drop passes, one not compared warns
        source, drop, status, _, extra = max(
            judged, key=lambda j: (STATUS_ORDER[j[2]], float("-inf") if j[1] is None else j[1])
        )
        detail = "; ".join(
            [f"{s}: {d}" for s, _, _, d, _ in judged]
            + [f"{s}: not scored in both reports" for s, v in sources.items() if v.get("compared") is None]
        )
        worst = " (the check is the worst)" if len(judged) > 1 else ""
        return drop, status, detail + worst, {**extra, "source": source}
    v = q.get("vs_previous")
    if v is None:
        if q.get("labelled") and (refused := _refused(metrics)):
            return None, "warn", refused, {}  # a previous report that was set but not vouched for: not a pass
        why = "no known labels" if not q else "no previous report with an accuracy (qa.previous_report_uri)"
        return None, "skip", why, {}
    return _drop_of(v, spec)


def _drop_of_source(v: dict[str, Any], spec: QASpec) -> tuple[float | None, str, str, dict[str, Any]]:
    """The accuracy_drop check of one source, by how it compares with the previous report (``compared``,
    ``yardstick.judge``): on the same yardstick, its change; on the ids a changed golden set shares with the previous
    one, their paired change (a pass on fewer than qa.min_labelled of them warns); not compared (the yardstick changed
    and nothing can be paired, or the previous report did not record it): a warning, never a pass nor a fail."""
    c = v["compared"]
    basis, why = c.get("basis"), c.get("detail") or ""
    if v["vs_previous"] is None or basis not in ("same", "shared"):
        return None, "warn", why, {}
    drop, status, detail, extra = _drop_of(v["vs_previous"], spec)
    if basis == "shared":
        detail = f"{why}: {detail}"
        if status == "pass" and int(c.get("shared") or 0) < spec.min_labelled:
            status = "warn"
            detail += f"; only {c.get('shared')} shared id(s), fewer than qa.min_labelled {spec.min_labelled}"
        return drop, status, detail, {**extra, "basis": basis}
    return drop, status, f"{detail} ({why})" if why else detail, extra


def _drop_of(v: dict[str, Any], spec: QASpec) -> tuple[float, str, str, dict[str, Any]]:
    """The accuracy_drop check of one change in accuracy (``accuracy.versus``)."""
    drop = -v["delta"]
    extra = {"interval": [-v["high"], -v["low"]], "previous": v["previous"]}
    detail = (
        f"{_pt(v['delta'])} vs {100 * v['previous']:.1f}% of {v['previous_labelled']} "
        f"(95% interval {_pt(v['low'])} to {_pt(v['high'])})"
    )
    if not v["real_drop"]:
        return drop, "pass", detail + (": a real gain" if v["real_gain"] else ": the interval includes 0"), extra
    return drop, _status(drop, spec.warn_accuracy_drop, spec.fail_accuracy_drop), detail + ": a real drop", extra


def run_checks(metrics: dict[str, Any], spec: QASpec, *, structured: bool) -> list[dict[str, Any]]:
    """One check dict per name in ``CHECKS`` (value, warn, fail, status, detail, description; ``direction``
    'below' for accuracy); a check whose metric is absent (not structured, no previous run, no labels) is ``skip``."""
    out = []
    for name in CHECKS:
        extra: dict[str, Any] = {}
        if name == "accuracy":
            warn, fail = spec.warn_accuracy_below, spec.fail_accuracy_below
            value, status, detail, extra = _accuracy(metrics, spec)
            extra["direction"] = "below"
        elif name == "accuracy_drop":
            warn, fail = spec.warn_accuracy_drop, spec.fail_accuracy_drop
            value, status, detail, extra = _drop(metrics, spec)
        else:
            warn, fail = getattr(spec, f"warn_{name}"), getattr(spec, f"fail_{name}")
            value, detail = _value(name, metrics)
            status = _status(value, warn, fail)
            ld = metrics.get("label_distribution") or {}
            if name == "label_drift" and value is None and ld.get("labelled") and (refused := _refused(metrics)):
                status, detail = "warn", refused  # a previous report that was set but not vouched for: not a pass
            if name in _OPT_IN and metrics.get(_OPT_IN[name]) is None and min(warn, fail) < 1:
                # a gate the job turned on, with nothing to measure it on: not a silent pass
                status = "warn"
                detail += f": qa.warn_{name} / qa.fail_{name} are set, but this run has nothing to judge them on"
            if name == "churn_rate" and value is None and min(warn, fail) < 1 and _unverified(metrics):
                # a previous run whose merge summary this deployment did not seal (forged, moved) was not read: the
                # gate the job turned on has nothing to judge, which must not pass as a first run does
                status = "warn"
                detail = (
                    f"the previous run, {_unverified(metrics)}, is not sealed by this deployment's merge (not read: "
                    "every id is 'added'); qa.warn_churn_rate / qa.fail_churn_rate are set, but this run has nothing "
                    "to judge them on"
                )
            elif name == "churn_rate" and value is None and min(warn, fail) < 1 and (gone := _replaced(metrics)):
                # no answered id in both runs, and the previous run's ids gone: the corpus was swapped for another
                # (which a churn gate is there to catch), not a first run
                status = "warn"
                detail = (
                    f"no id answered in both runs, and {gone} id(s) of the previous run are not in this one: the input "
                    "is not the corpus the previous run answered; qa.warn_churn_rate / qa.fail_churn_rate are set, "
                    "but this run has nothing to judge them on (a job whose every run holds only new ids by design, "
                    "e.g. one day's new rows, has no churn to judge: set both to 1 for it)"
                )
        out.append(
            {
                "name": name,
                "value": value,
                "warn": warn,
                "fail": fail,
                "status": status,
                "detail": detail,
                "description": _CHECK_TEXT[name],
                **extra,
            }
        )
    return out


def _unverified(metrics: dict[str, Any]) -> str | None:
    """The change set's previous run (``changes.previous_uri``) when its ``_MERGED.json`` lacked this deployment's
    seal (``previous_state`` 'unverified': nothing of it was compared), else None."""
    ch = metrics.get("changes") or {}
    if ch.get("previous_state") != "unverified":
        return None
    uri = ch.get("previous_uri")
    return f"changes.previous_uri {uri!r}" if uri else "changes.previous_uri"


def _replaced(metrics: dict[str, Any]) -> int:
    """The previous run's ids that are not in this one, when the change set compared with a complete previous run
    and no id was answered in both (nor recovered from an error): the corpus was replaced. Else 0."""
    ch = metrics.get("changes") or {}
    counts = ch.get("counts") or {}
    if ch.get("previous_state") != "complete" or ch.get("in_both") or counts.get("recovered"):
        return 0
    return int(counts.get("removed") or 0)


def _value(name: str, metrics: dict[str, Any]) -> tuple[float | None, str]:
    if name == "label_drift":
        d = metrics.get("label_drift")
        return (None, "no previous run to compare") if d is None else (d["tvd"], "vs previous run")
    if name == "churn_rate":
        ch = metrics.get("changes")
        value = None if ch is None else ch.get("churn_rate")
        if ch is None:
            return None, "no change set (changes.previous_uri not set, or no earlier run published)"
        if value is None:
            done = ch.get("previous_state") == "complete"
            return None, "no id answered in both runs" if done else "no complete previous run"
        return value, f"{ch['counts']['changed']} / {ch['in_both']}"
    if name == "low_confidence_rate":
        c = metrics.get("confidence")
        if c is None:
            return None, "no answer has a confidence"
        r, missing = c["low_rate"], int(c.get("missing") or 0)
        detail = f"{r['count']} / {r['of']} below {c['low_threshold']}"
        if not missing:
            return r["value"], detail
        # an answer without a confidence is not a confident one: counted as low (the gate is not judged on the few
        # rows that have one, e.g. when the result cache served the rest from a run that did not record it)
        value = (r["count"] + missing) / (r["of"] + missing)
        return value, f"{detail}, and {missing} answer(s) without a confidence, counted as low"
    if name == "inconsistency_rate":
        c = metrics.get("consistency")
        if c is None:
            return None, "no prompt hashes (requests that sample at random, temperature > 0 without a seed, have none)"
        r = c["inconsistency_rate"]
        if not r["of"]:
            return None, "no prompt was sent twice"
        return r["value"], f"{r['count']} / {r['of']} repeated prompts"
    r = metrics["rates"].get(name)
    return (None, "not a structured-output job") if r is None else (r["value"], f"{r['count']} / {r['of']}")


def overall_status(checks: list[dict[str, Any]]) -> str:
    """The worst status among ``checks``; ``pass`` when there are none or all were skipped."""
    status = max((c["status"] for c in checks), key=STATUS_ORDER.__getitem__, default="pass")
    return "pass" if status == "skip" else status
