"""QA entry point: evaluate() over empty inputs and over tables missing optional columns."""

from __future__ import annotations

import json

import pyarrow as pa

from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from airflow_provider_vllm.steps.qa.html import render_report_html
from tests.support.qa_rows import LABELS, empty_tables


def test_empty_inputs():
    results, errors = empty_tables()
    rep = evaluate(results, errors, spec=QASpec(), labels=LABELS, structured=True, previous=None)
    assert rep.status == "pass"
    assert rep.metrics["total"] == 0
    assert all(c["value"] in (0.0, None) for c in rep.checks)
    assert rep.sample.num_rows == 0
    assert any("no rows" in n for n in rep.notes)
    assert rep.metrics["latency_ms"] is None
    html = render_report_html(rep.to_dict(), [])
    assert "<svg" in html
    json.dumps(rep.to_dict(), allow_nan=False)


def test_missing_optional_columns_and_extra_columns():
    results = pa.table({"id": ["a", "b", "c"], "output": ["x", "", "y"], "input_excerpt": ["in a", "in b", "in c"]})
    errors = pa.table({"id": pa.array([], pa.string()), "error_code": pa.array([], pa.string())})
    rep = evaluate(results, errors, spec=QASpec(sample_size=2), labels=None, structured=False)
    assert rep.metrics["rates"]["empty_rate"]["count"] == 1
    assert rep.sample.num_rows == 2 and "input_excerpt" in rep.sample.column_names
