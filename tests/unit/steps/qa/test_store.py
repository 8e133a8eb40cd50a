"""Storing QA reports: write_qa files, report.json round trip, load_report."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from airflow_provider_vllm.steps.qa.report import QAReport
from airflow_provider_vllm.steps.qa.store import load_report, write_qa
from tests.support.qa_rows import LABELS, labelled_tables, sample_ids


def test_write_qa_roundtrip(tmp_path):
    results, errors = labelled_tables(200, 10)
    prev = evaluate(results, errors, spec=QASpec(), labels=LABELS, structured=True).to_dict()
    rep = evaluate(results, errors, spec=QASpec(sample_size=25), labels=LABELS, structured=True, previous=prev)
    st_ = Storage(str(tmp_path))
    paths = write_qa(rep, st_)
    assert paths == {"sample": "qa/sample.parquet", "report_html": "qa/report.html", "report_json": "qa/report.json"}
    for p in paths.values():
        assert (tmp_path / p).is_file()
    d = json.loads((tmp_path / "qa/report.json").read_text())
    assert d == json.loads(json.dumps(rep.to_dict()))
    assert QAReport.from_dict(d).to_dict() == d
    assert load_report(str(tmp_path / "qa/report.json")) == d
    assert load_report(str(tmp_path / "nope.json")) is None
    sample = pq.read_table(tmp_path / "qa/sample.parquet")
    assert sample.column("id").to_pylist() == sample_ids(rep)
    html = (tmp_path / "qa/report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "previous run" in html
    assert not list(tmp_path.rglob("*.tmp-*"))
