"""Storing QA reports: write_qa files, report.json round trip, the sealed qa/_QA.json."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from airflow_provider_vllm.steps.qa.report import QAReport
from airflow_provider_vllm.steps.qa.store import load_report, write_qa
from tests.support.data import merge_summary
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
    assert not (tmp_path / "qa" / "_QA.json").exists()  # nothing to vouch with: no key, no merge measured
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


def sealed_qa(folder, status_rows=(200, 10)):
    """QA files and their sealed record under ``folder`` (as qa_run writes them) for a sealed merge summary."""
    from airflow_provider_vllm.steps.qa.store import write_qa

    keyring, scope = Keyring.from_env(), seals.scope_of(str(folder))
    merged = seals.seal_record(keyring, seals.MERGED, scope, merge_summary(210, 200, 10))
    rep = evaluate(*labelled_tables(*status_rows), spec=QASpec(sample_size=25), labels=LABELS, structured=True)
    write_qa(rep, Storage(str(folder)), keyring=keyring, measured=merged)
    return rep, merged


def test_the_sealed_record_is_written_last_and_names_each_file_as_written(tmp_path):
    from airflow_provider_vllm.steps.qa.store import read_qa

    rep, merged = sealed_qa(tmp_path)
    newest = max((p for p in tmp_path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == "_QA.json"
    record = read_qa(Storage(str(tmp_path)), Keyring.from_env())
    assert (record.status, record.summary, record.rows) == (rep.status, rep.summary_line(), 210)
    assert (record.spec_hash, record.config_hash, record.merged_mac) == (
        merged.spec_hash,
        merged.config_hash,
        merged.seal.mac,
    )
    assert {f.path: f.bytes for f in record.files.values()} == {
        p: (tmp_path / p).stat().st_size for p in ("qa/report.json", "qa/report.html", "qa/sample.parquet")
    }
