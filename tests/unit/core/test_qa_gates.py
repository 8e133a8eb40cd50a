"""Which way each setting that decides publication loosens it (``core/qa_gates.py``), pure: the floor is the DAG
file's value, the value is what a Variable or the trigger made it. The plan task's use of it (who set what) is in
tests/unit/utils/test_provenance.py."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core import qa_gates
from airflow_provider_vllm.core.spec import JobSpec, QASpec

pytestmark = pytest.mark.unit

DEFAULTS = qa_gates.default_values()


def loosens(path: str, floor_value, value, **floor_more) -> bool:
    floor = {**DEFAULTS, **floor_more, path: floor_value}
    return qa_gates.loosening(path, floor, {**floor, path: value}) is not None


def test_every_threshold_of_qaspec_has_a_direction_and_only_the_seed_is_free():
    """A QA field added later must say which way it loosens (or be listed here as deciding no verdict)."""
    qa = {f"qa.{name}" for name in QASpec.model_fields if name != "reference"}
    assert qa - set(qa_gates.GATE_SETTINGS) == {"qa.seed"}
    assert {f"qa.reference.{n}" for n in QASpec.model_fields["reference"].default_factory().model_fields} <= set(
        qa_gates.GATE_SETTINGS
    )
    assert {f"changes.{n}" for n in JobSpec.model_fields["changes"].default_factory().model_fields} <= set(
        qa_gates.GATE_SETTINGS
    )


@pytest.mark.parametrize(
    "path", ["qa.fail_churn_rate", "qa.warn_error_rate", "qa.fail_label_drift", "qa.fail_accuracy_drop"]
)
def test_a_rate_threshold_may_only_go_down(path):
    assert loosens(path, 0.5, 0.9) and loosens(path, 0.5, 1.0)
    assert not loosens(path, 0.5, 0.5) and not loosens(path, 0.5, 0.1) and not loosens(path, 0.5, 0.0)


@pytest.mark.parametrize(
    "path", ["qa.fail_accuracy_below", "qa.sample_size", "qa.least_confident", "qa.low_confidence"]
)
def test_an_accuracy_floor_or_the_review_sample_may_only_go_up(path):
    assert loosens(path, 0.5 if "sample" not in path else 200, 0) and loosens(path, 0.6, 0.59)
    assert not loosens(path, 0.5, 0.5) and not loosens(path, 0.5, 0.6)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "0.9", None, True, [0.9], {"x": 1}])
def test_anything_but_a_finite_number_loosens_a_threshold(value):
    """Comparisons are positive tests: NaN compares False both ways, and must not pass as 'not looser'."""
    assert loosens("qa.fail_churn_rate", 0.5, value)
    assert loosens("qa.fail_accuracy_below", 0.5, value)


def test_an_unreadable_floor_fails_closed():
    assert loosens("qa.fail_churn_rate", qa_gates.UNREADABLE, 0.1)
    assert loosens("qa.reference.golden_uri", qa_gates.UNREADABLE, None)


def test_min_labelled_and_confidence_are_kept_either_way():
    """Raising min_labelled turns a failing accuracy into a 'too few rows' warning; lowering it a warning into a
    verdict on noise: neither direction is stricter."""
    assert loosens("qa.min_labelled", 30, 31) and loosens("qa.min_labelled", 30, 29)
    assert not loosens("qa.min_labelled", 30, 30)
    assert loosens("qa.confidence", None, True) and loosens("qa.confidence", True, False)
    assert not loosens("qa.confidence", None, None)


@pytest.mark.parametrize(
    "path, set_value, other",
    [
        ("qa.previous_report_uri", "/runs/dt=1/qa/report.json", "/runs/dt=2/qa/report.json"),
        ("qa.previous_published", True, False),
        ("changes.previous_uri", "/runs/dt=1", "/runs/dt=2"),
        ("changes.previous_table", True, False),
        ("changes.previous_published", True, False),
    ],
)
def test_a_baseline_the_dag_file_sets_is_kept_one_it_leaves_unset_may_be_added(path, set_value, other):
    assert loosens(path, set_value, other)  # changed
    assert loosens(path, set_value, None if isinstance(set_value, str) else False)  # removed
    assert not loosens(path, set_value, set_value)
    assert not loosens(path, None if isinstance(set_value, str) else False, other)  # added


def test_a_source_of_known_labels_the_dag_file_names_is_kept():
    golden = "qa.reference.golden_uri"
    assert loosens(golden, "/g/a.parquet", "/g/run-answers.parquet") and loosens(golden, "/g/a.parquet", None)
    assert loosens("qa.reference.input_column", "label", "predicted")
    # the golden file's columns, while the DAG file names a golden file
    assert loosens("qa.reference.label_column", "label", "answer", **{golden: "/g/a.parquet"})
    assert loosens("qa.reference.id_column", "id", "row", **{"qa.reference.ride_along_uri": "/g/r.parquet"})
    assert not loosens("qa.reference.label_column", "label", "answer")  # no golden file of the DAG file's


def test_a_source_may_be_added_unless_the_dag_file_asks_for_accuracy_and_names_none():
    """Added beside the DAG file's source, or where its accuracy gate is not asked for (defaults: the check is
    skipped without labels), a source only adds a check. Where the DAG file asks for one (thresholds other than the
    defaults) and names no labels, QA warns that nothing is judged: labels of another's choosing would pass it."""
    ride = "qa.reference.ride_along_uri"
    assert not loosens(ride, None, "/g/r.parquet")
    assert not loosens(ride, None, "/g/r.parquet", **{"qa.warn_accuracy_below": 0.0, "qa.fail_accuracy_below": 0.0})
    assert loosens(ride, None, "/g/r.parquet", **{"qa.warn_accuracy_below": 0.9})
    assert not loosens(ride, None, "/g/r.parquet", **{"qa.warn_accuracy_below": 0.9, "qa.reference.input_column": "y"})


def test_tightening_the_accuracy_thresholds_back_to_the_defaults_does_not_unask_the_gate():
    """QA reads thresholds at their defaults as no accuracy gate asked for: a run without known labels then skips
    the check instead of warning. So 0.7 -> 0.8 (higher, but the default) loosens; 0.7 -> 0.85 does not."""
    assert loosens("qa.warn_accuracy_below", 0.7, 0.8)
    assert not loosens("qa.warn_accuracy_below", 0.7, 0.85)
    assert not loosens("qa.warn_accuracy_below", 0.8, 0.8)


@pytest.mark.parametrize(
    "path, raw, want",
    [
        ("qa.fail_accuracy_below", "0.5", 0.5),
        ("qa.fail_accuracy_below", " 0 ", 0.0),
        ("qa.fail_accuracy_below", "nan", qa_gates.UNREADABLE),
        ("qa.fail_accuracy_below", 2, qa_gates.UNREADABLE),
        ("qa.sample_size", "200", 200),
        ("qa.reference.golden_uri", "  ", None),
        ("qa.reference.golden_uri", "/g/a.parquet", "/g/a.parquet"),
        ("qa.previous_published", "true", True),
    ],
)
def test_a_floor_is_read_as_the_spec_would_validate_it(path, raw, want):
    assert qa_gates.coerce(path, raw) == want or qa_gates.coerce(path, raw) is want
