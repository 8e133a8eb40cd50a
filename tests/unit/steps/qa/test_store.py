"""Storing QA reports: write_qa files, report.json round trip, the sealed qa/_QA.json, and a previous run's report
used only when its run's sealed record vouches for it."""

from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from airflow_provider_vllm.steps.qa.report import QAReport
from airflow_provider_vllm.steps.qa.store import write_qa
from tests.support.data import make_spec, merge_summary, shard_task, write_parquet
from tests.support.ledger import record_malicious
from tests.support.qa_rows import LABELS, check, labelled_tables, sample_ids


def test_write_qa_roundtrip(tmp_path):
    results, errors = labelled_tables(200, 10)
    prev = evaluate(results, errors, spec=QASpec(), labels=LABELS, structured=True).to_dict()
    rep = evaluate(results, errors, spec=QASpec(sample_size=25), labels=LABELS, structured=True, previous=prev)
    st_ = Storage(str(tmp_path))
    paths = write_qa(rep, st_)
    digests = {k: paths.pop(f"{k}_sha256") for k in ("report_html", "report_json")}
    assert paths == {"sample": "qa/sample.parquet", "report_html": "qa/report.html", "report_json": "qa/report.json"}
    for p in paths.values():
        assert (tmp_path / p).is_file()
    assert digests == {k: hashlib.sha256((tmp_path / paths[k]).read_bytes()).hexdigest() for k in digests}
    assert not (tmp_path / "qa" / "_QA.json").exists()  # nothing to vouch with: no key, no merge measured
    d = json.loads((tmp_path / "qa/report.json").read_text())
    assert d == json.loads(json.dumps(rep.to_dict()))
    assert QAReport.from_dict(d).to_dict() == d
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


def test_the_record_names_the_dag_run_qa_ran_in_and_one_that_names_none_still_verifies(tmp_path):
    """``dag_run`` (handed in by the QA operator) is sealed into the record; a record of the earlier version, which
    has no such field, still verifies and reads as naming no run (review and publish then refuse it)."""
    from airflow_provider_vllm.core.records import DagRunRef
    from airflow_provider_vllm.steps.qa.store import read_qa

    keyring, scope = Keyring.from_env(), seals.scope_of(str(tmp_path))
    merged = seals.seal_record(keyring, seals.MERGED, scope, merge_summary(210, 200, 10))
    rep = evaluate(*labelled_tables(200, 10), spec=QASpec(sample_size=25), labels=LABELS, structured=True)
    run = DagRunRef(dag_id="nightly", run_id="scheduled__2026-12-01T02:00:00+00:00")
    write_qa(rep, Storage(str(tmp_path)), keyring=keyring, measured=merged, dag_run=run)
    assert read_qa(Storage(str(tmp_path)), keyring).dag_run == run
    assert json.loads((tmp_path / "qa" / "_QA.json").read_text())["dag_run"] == run.model_dump()
    sealed_qa(tmp_path)  # as the earlier version wrote it: no dag_run field at all
    assert "dag_run" not in json.loads((tmp_path / "qa" / "_QA.json").read_text())
    assert read_qa(Storage(str(tmp_path)), keyring).dag_run is None


def test_the_review_decision_is_sealed_for_its_folder(tmp_path):
    """``write_review`` seals ``qa/_REVIEW.json`` for the run's folder: ``read_review`` gives it back; a copy in
    another folder or a changed field is refused by its seal."""
    from airflow_provider_vllm.core.errors import SealError
    from airflow_provider_vllm.core.records import DagRunRef, ReviewRecord
    from airflow_provider_vllm.steps.qa.store import read_review, write_review

    keyring = Keyring.from_env()
    record = ReviewRecord(
        dag_run=DagRunRef(dag_id="d", run_id="r1"),
        qa_record_mac="a" * 64,
        qa_status="warn",
        ask=True,
        asked=False,
        approved=False,
        decided_at="2026-12-06T12:00:00Z",
    )
    sealed = write_review(Storage(str(tmp_path / "a")), keyring, record)
    assert read_review(Storage(str(tmp_path / "a")), keyring) == sealed
    raw = (tmp_path / "a" / "qa" / "_REVIEW.json").read_bytes()
    (tmp_path / "b" / "qa").mkdir(parents=True)
    (tmp_path / "b" / "qa" / "_REVIEW.json").write_bytes(raw)
    with pytest.raises(SealError, match="moved from another run or folder"):
        read_review(Storage(str(tmp_path / "b")), keyring)
    (tmp_path / "a" / "qa" / "_REVIEW.json").write_bytes(raw.replace(b'"approved": false', b'"approved": true'))
    with pytest.raises(SealError, match="changed after the pipeline wrote it"):
        read_review(Storage(str(tmp_path / "a")), keyring)


def test_a_previous_report_is_used_only_when_its_runs_sealed_record_vouches_for_it(tmp_path):
    from airflow_provider_vllm.steps.qa.store import load_previous_report

    day1 = tmp_path / "day1"
    rep, _ = sealed_qa(day1)
    uri = str(day1 / "qa" / "report.json")
    genuine = (day1 / "qa" / "report.json").read_bytes()
    assert load_previous_report(uri) == json.loads(genuine)
    assert load_previous_report(str(tmp_path / "day0" / "qa" / "report.json")) is None  # no run there

    def refused(u=uri):
        got = load_previous_report(u)
        assert set(got) == {"refused"} and got["refused"]["uri"] == u
        return got["refused"]["why"]

    (day1 / "qa" / "report.json").write_bytes(genuine.replace(b'"status": "pass"', b'"status": "fail"'))
    assert "report.json is not the file the sealed qa/_QA.json names" in refused()
    (day1 / "qa" / "report.json").write_bytes(genuine)
    copy = tmp_path / "elsewhere"
    (copy / "qa").mkdir(parents=True)
    for p in (day1 / "qa").iterdir():  # a genuine run's files, moved to another folder
        (copy / "qa" / p.name).write_bytes(p.read_bytes())
    assert "its seal does not match its content" in refused(str(copy / "qa" / "report.json"))
    (day1 / "qa" / "other.json").write_bytes(genuine)
    assert "does not end in /qa/report.json" in refused(str(day1 / "qa" / "other.json"))
    (day1 / "qa" / "_QA.json").unlink()
    assert "has no sealed QA record" in refused()


def _run(tmp_path, name, texts, factory, previous=None):
    """One run through the real steps (plan, fake-engine shards, merge, qa_run): its spec and QA report."""
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa.stage import qa_run
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import merge

    write_parquet(tmp_path / name / "in.parquet", [f"t{i:03d}" for i in range(len(texts))], texts)
    spec = make_spec(
        tmp_path / name / "in.parquet",
        tmp_path / name / "out",
        sharding={"target_rows": 40},
        qa={"previous_report_uri": previous, "warn_label_drift": 0.0, "fail_label_drift": 0.05},
    )
    for s in plan_job(spec).shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    merge(spec)
    return spec, qa_run(spec)[0]


@pytest.mark.reliability
def test_a_forged_previous_report_does_not_hide_drift(tmp_path, fake_engine_factory):
    """The genuine previous report (sealed by its run's QA) drives label drift: a real drift fails. The same report
    rewritten by a bucket writer to this run's label mix (drift 0, a pass) is not used: drift warns, with a note."""
    from airflow_provider_vllm.steps.qa.stage import qa_run

    _run(tmp_path, "day1", [f"my invoice {i} was charged twice" for i in range(80)], fake_engine_factory)
    previous = str(tmp_path / "day1" / "out" / "qa" / "report.json")
    day2 = [f"the app crashes on page {i}" for i in range(80)]
    spec, rep = _run(tmp_path, "day2", day2, fake_engine_factory, previous)
    drift = check(rep, "label_drift")
    assert drift["status"] == "fail" and drift["value"] > 0.05
    was = json.loads((tmp_path / "day1" / "out" / "qa" / "report.json").read_text())
    assert rep.metrics["label_drift"]["previous_fractions"] == pytest.approx(
        {k: was["metrics"]["label_distribution"]["fractions"].get(k, 0.0) for k in rep.metrics["label_drift"]["delta"]}
    )
    was["metrics"]["label_distribution"] = rep.metrics["label_distribution"]  # "no drift at all"
    (tmp_path / "day1" / "out" / "qa" / "report.json").write_text(json.dumps(was, indent=2))
    rep = qa_run(spec)[0]  # QA of day 2 again
    drift = check(rep, "label_drift")
    assert drift["status"] == "warn" and drift["value"] is None and previous in drift["detail"]
    assert rep.metrics["label_drift"] is None and rep.status == "warn"
    assert [n for n in rep.notes if f"previous report {previous} not used" in n and "qa/_QA.json" in n]
    record_malicious("forged_previous_qa_report", 1, 1)
