"""The settings that decide whether a run is published, and which way each one loosens the gate.

Trust model (docs/security.md, "QA gates"): the DAG file (or the deployment config) sets these; a Variable or the
trigger may only make them *stricter* than what the DAG file says (the spec default where the DAG file sets
nothing). ``utils/provenance.gate_violations`` finds who set each one and the DAG file's own value (the *floor*);
``loosenings`` here says, purely, which of them loosen it. The review's ``ask`` (whether a 'warn' waits for a
person) follows the same rule (``utils/provenance.review_ask_violation``).

Directions:

* ``LOWER``: a lower value is stricter (the ``warn_*`` / ``fail_*`` rates, drift and drop thresholds: a run fails
  or warns *above* them; 1.0 turns a rate gate off).
* ``HIGHER``: a higher value is stricter (``warn/fail_accuracy_below``: a run fails or warns *below* them, 0 turns
  the gate off; ``low_confidence``: more answers count as low; ``sample_size`` / ``least_confident``: the rows a
  person reviewing a 'warn' is shown).
* ``KEPT``: either way can loosen, so only the DAG file's value: ``min_labelled`` (raising it turns a failing
  accuracy into a 'too few rows' warning, lowering it a 'too few rows' warning into a verdict on noise),
  ``confidence`` (turning it on where a low-confidence gate counts missing confidences as low; off, it drops the
  least confident rows from the review sample).
* ``BASELINE``: what QA compares with (``qa.previous_report_uri`` / ``previous_published``: label drift and the
  accuracy drop; ``changes.*``: the churn rate). A baseline the DAG file sets is kept as it is (another one is a
  yardstick chosen to pass); where the DAG file sets none, one may be added: the checks it feeds are skipped
  without one, so adding one only adds checks.
* ``SOURCE``: a source of known labels (``qa.reference.input_column`` / ``golden_uri`` / ``ride_along_uri``). One the
  DAG file sets is kept; one it leaves unset may be added (the accuracy check is the worst source's, so a source
  added beside the DAG file's cannot pass what they fail), except where the DAG file asks for an accuracy gate
  (thresholds other than the defaults) and names no source: QA then warns that nothing is judged, and a source of
  someone else's choosing would turn that warning into a pass.
* ``SOURCE_COLUMN``: ``qa.reference.id_column`` / ``label_column``, the columns of the golden files: kept while the
  DAG file names a golden file (``golden_uri`` or ``ride_along_uri``).

``qa.seed`` is not among them: it picks which random rows the sample draws, not how many, and decides no verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from airflow_provider_vllm.core.allow_list import redact_userinfo
from airflow_provider_vllm.core.spec import QA_RATES, JobSpec, QASpec

LOWER = "lower"
HIGHER = "higher"
KEPT = "kept"
BASELINE = "baseline"
SOURCE = "source"
SOURCE_COLUMN = "source column"

GATE_SETTINGS: dict[str, str] = {
    **{f"qa.{level}_{m}": LOWER for m in QA_RATES for level in ("warn", "fail")},
    "qa.warn_accuracy_below": HIGHER,
    "qa.fail_accuracy_below": HIGHER,
    "qa.low_confidence": HIGHER,
    "qa.sample_size": HIGHER,
    "qa.least_confident": HIGHER,
    "qa.min_labelled": KEPT,
    "qa.confidence": KEPT,
    "qa.previous_report_uri": BASELINE,
    "qa.previous_published": BASELINE,
    "changes.previous_uri": BASELINE,
    "changes.previous_table": BASELINE,
    "changes.previous_published": BASELINE,
    "qa.reference.input_column": SOURCE,
    "qa.reference.golden_uri": SOURCE,
    "qa.reference.ride_along_uri": SOURCE,
    "qa.reference.id_column": SOURCE_COLUMN,
    "qa.reference.label_column": SOURCE_COLUMN,
}
"""Every setting that decides whether a run is published -> which way it loosens (the module docstring)."""

SOURCES = tuple(p for p, d in GATE_SETTINGS.items() if d == SOURCE)
_GOLDEN_FILES = ("qa.reference.golden_uri", "qa.reference.ride_along_uri")
_ACCURACY = ("qa.warn_accuracy_below", "qa.fail_accuracy_below")

_WHY = {
    LOWER: "a higher threshold passes runs the DAG file's would warn on or fail, 1.0 never warns or fails",
    HIGHER: "a lower value passes runs the DAG file's would warn on or fail, 0 turns the gate off",
    KEPT: "another value, either way, can pass a run the DAG file's would warn on or fail",
    BASELINE: "it is what QA compares with: a baseline the DAG file sets stays as it is, one may only be added where "
    "the DAG file sets none",
    SOURCE: "it is the known labels QA scores against: a source the DAG file names stays as it is, one may only be "
    "added where the DAG file names none",
    SOURCE_COLUMN: "it is a column of the golden file the DAG file names, which QA scores against",
}
_WHY_PATH = {
    "qa.sample_size": "fewer sampled rows for the person who reviews a 'warn'",
    "qa.least_confident": "fewer of the least confident answers for the person who reviews a 'warn'",
    "qa.low_confidence": "fewer answers count as low confidence",
}
_WHY_UNASKED = (
    "with both accuracy thresholds at their defaults QA takes no accuracy gate as asked for (no warning when no known "
    "label reaches it), while the DAG file's thresholds ask for one"
)
_WHY_UNNAMED = (
    "the DAG file asks for an accuracy gate (qa.warn_accuracy_below / qa.fail_accuracy_below other than the defaults) "
    "and names no known labels, so QA warns that nothing is judged, and known labels of another's choosing would turn "
    "that warning into a pass: name the reference in the DAG file"
)


class Unreadable:
    """A value a layer sets but that cannot be read at the path (a section given as a string, ...)."""

    def __repr__(self) -> str:
        return "<unreadable>"


UNREADABLE = Unreadable()


def default_values() -> dict[str, Any]:
    """The spec defaults of every gate setting (what a DAG file that sets nothing says)."""
    doc = JobSpec.load({"model": {"name": "m"}, "io": {"input_uri": "/i", "output_uri": "/o"}}).model_dump(mode="json")
    return {p: value_at(doc, p) for p in GATE_SETTINGS}


def value_at(doc: Any, path: str) -> Any:
    """The value at dotted ``path`` of a spec document; ``UNREADABLE`` when a step is not a mapping or missing."""
    node = doc
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return UNREADABLE
        node = node[part]
    return node


def coerce(path: str, value: Any) -> Any:
    """``value`` as the spec would validate it at ``path`` (``"0.5"`` -> 0.5, ``''`` -> None for a reference);
    ``UNREADABLE`` when it would not validate."""
    if value is UNREADABLE:
        return value
    *parents, name = path.split(".")
    model: Any = JobSpec
    for part in parents:
        model = model.model_fields[part].annotation
    field = model.model_fields[name]
    if path in SOURCES and isinstance(value, str) and not value.strip():
        return None  # ReferenceSpec._empty_is_none: a template over an unset Variable
    kind: Any = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError:
        return UNREADABLE


def _asks_for_accuracy(values: Mapping[str, Any]) -> bool:
    """Whether accuracy thresholds ask for the gate as QA reads them (``steps/qa/checks._unmeasured``): other than
    the defaults and warn not 0. Then a run with no known label warns instead of skipping the check."""
    warn, fail = (_number(values.get(p)) for p in _ACCURACY)
    if warn is None or fail is None:
        return True  # unreadable: fail closed
    defaults = (QASpec.model_fields["warn_accuracy_below"].default, QASpec.model_fields["fail_accuracy_below"].default)
    return (warn, fail) != defaults and warn > 0


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def loosening(path: str, floor: Mapping[str, Any], value: Mapping[str, Any]) -> str | None:
    """Why ``value[path]`` loosens the DAG file's ``floor[path]``, or None when it is as strict or stricter.

    ``floor`` and ``value``: every gate setting's DAG-file value and effective value (validated spec values; a floor
    ``UNREADABLE`` fails closed). Comparisons are positive tests: NaN, a non-number, an unreadable floor loosen."""
    direction = GATE_SETTINGS[path]
    f, v = floor.get(path, UNREADABLE), value.get(path, UNREADABLE)
    if f is UNREADABLE or v is UNREADABLE:
        return "the DAG file's value could not be read to compare with"
    why = _WHY_PATH.get(path, _WHY[direction])
    if direction in (LOWER, HIGHER):
        fn, vn = _number(f), _number(v)
        if fn is None or vn is None:
            return why
        stricter = vn <= fn if direction == LOWER else vn >= fn
        if not stricter:
            return why
        if path in _ACCURACY and _asks_for_accuracy(floor) and not _asks_for_accuracy(value):
            return _WHY_UNASKED
        return None
    if direction == KEPT:
        return None if v == f else why
    if direction == BASELINE:
        return None if f in (None, False) or v == f else why
    if direction == SOURCE:
        if f is not None:
            return None if v == f else why
        if v is None or any(floor.get(s) is not None for s in SOURCES) or not _asks_for_accuracy(floor):
            return None
        return _WHY_UNNAMED
    # SOURCE_COLUMN
    if not any(floor.get(g) not in (None, UNREADABLE) for g in _GOLDEN_FILES):
        return None
    return None if v == f else why


def loosenings(paths: Iterable[str], floor: Mapping[str, Any], value: Mapping[str, Any]) -> dict[str, str]:
    """path -> why, for each of ``paths`` whose value loosens the DAG file's (``loosening``)."""
    found = {}
    for path in paths:
        why = loosening(path, floor, value)
        if why is not None:
            found[path] = why
    return found


def shown(value: Any) -> str:
    """A value for a message: JSON-like (``null``, ``false``, ``0.5``, ``'s3://x'``; a location without its
    userinfo), at most 240 characters."""
    if value is None or isinstance(value, bool):
        text = "null" if value is None else str(value).lower()
    elif isinstance(value, str):
        text = repr(redact_userinfo(value))
    else:
        text = repr(value)
    return text if len(text) <= 240 else text[:237] + "..."
