"""The publish task: ``execute()`` over a merged and QA-checked run (shards committed in this process with the
fake engine), a minimal context, no Airflow process and no metadata DB."""

from __future__ import annotations

import hashlib
import json

import pytest
from airflow.sdk import Asset
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.operators.merge import VllmMergeOperator
from airflow_provider_vllm.operators.publish import VllmPublishOperator
from airflow_provider_vllm.operators.qa import VllmQAOperator
from airflow_provider_vllm.steps.publish import verify_published
from tests.support.task_context import committed_job, context


def checked_job(tmp_path, factory, **over):
    spec, _ = committed_job(tmp_path, factory, n=60, **over)
    VllmMergeOperator(task_id="merge", spec=spec).execute(context())
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    return spec


def test_construction_templates_the_spec_and_the_extra_files():
    assert tuple(VllmPublishOperator(task_id="publish", spec={}).template_fields) == ("spec", "extra_files")


def test_publish_writes_the_sealed_marker_last_and_fills_the_asset_event(tmp_path, fake_engine_factory):
    spec = checked_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    (out / "extra.txt").write_text("a file the DAG adds")
    asset = Asset(uri="x-vllm-batch://test")
    ctx = context()
    op = VllmPublishOperator(task_id="publish", spec=spec, outlets=[asset], extra_files={"notes": "extra.txt"})
    event = op.execute(ctx)
    body = (out / "_SUCCESS.json").read_bytes()
    assert event["success_sha256"] == hashlib.sha256(body).hexdigest() and event["rows"] == 60
    assert ctx["outlet_events"][asset].extra == event
    marker = json.loads(body)
    assert marker["files"]["notes"] == "extra.txt" and marker["airflow"] == {
        "dag_id": "d",
        "run_id": "r1",
        "logical_date": None,
        "task_id": "publish",
    }
    newest = max((p for p in out.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == "_SUCCESS.json"
    # a consumer checks the run through the event alone (no key): the marker and every part it names
    assert verify_published(str(out), success_sha256=event["success_sha256"])["rows"] == 60


def test_nothing_merged_is_nothing_to_publish(tmp_path, fake_engine_factory):
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=20)
    with pytest.raises(AirflowFailException, match="nothing to publish"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())


def test_a_missing_extra_file_or_a_changed_part_publishes_nothing(tmp_path, fake_engine_factory):
    spec = checked_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    with pytest.raises(AirflowFailException, match=r"files missing under .*\['absent.txt'\]"):
        VllmPublishOperator(task_id="publish", spec=spec, extra_files={"x": "absent.txt"}).execute(context())
    part = next((out / "results").glob("part-*.parquet"))
    data = bytearray(part.read_bytes())
    data[-20] ^= 0xFF  # same size, other bytes
    part.unlink()  # (a hard link to the committed chunk: replace it, leave the chunk alone)
    part.write_bytes(bytes(data))
    with pytest.raises(
        AirflowFailException, match=r"publish: CommitError: .*part-.* does not have the size and sha256"
    ):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert not (out / "_SUCCESS.json").exists()


def test_a_failed_qa_or_another_specs_merge_publishes_nothing(tmp_path, fake_engine_factory):
    spec = checked_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    report = json.loads((out / "qa" / "report.json").read_text())
    (out / "qa" / "report.json").write_text(json.dumps({**report, "status": "fail"}))
    with pytest.raises(AirflowFailException, match="QA failed"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    (out / "qa" / "report.json").write_text(json.dumps(report))
    other = {**spec, "sampling": {**spec["sampling"], "max_tokens": spec["sampling"]["max_tokens"] + 1}}
    with pytest.raises(AirflowFailException, match="merged for another spec"):
        VllmPublishOperator(task_id="publish", spec=other).execute(context())
    assert not (out / "_SUCCESS.json").exists()
