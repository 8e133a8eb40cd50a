"""The QA step over a whole (small) run: what it reads besides the merged parts."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa import stage
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task


def test_an_input_text_that_is_not_utf8_is_an_error_row_and_qa_still_shows_the_excerpts(tmp_path, fake_engine_factory):
    """DuckDB refuses a whole Parquet file holding one string that is not UTF-8: QA's input excerpts failed the QA
    task with a raw InvalidInputException. They are read as bytes then (U+FFFD for what is not UTF-8)."""
    raw = [f"ticket {i} about billing".encode() for i in range(20)]
    raw[5] = b"bad \xff text"
    texts = pa.Array.from_buffers(pa.string(), 20, pa.array(raw, pa.binary()).buffers())
    ids = [f"r{i:03d}" for i in range(20)]
    pq.write_table(pa.table({"text": texts, "id": ids}), tmp_path / "in.parquet", row_group_size=4)
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out",
        sharding={"target_rows": 10, "dedupe": False},
        qa={"sample_size": 20},
    )
    plan = plan_job(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    summary = merge(spec)
    assert (summary.ok_rows, summary.error_rows) == (19, 1)
    errors = pq.read_table(tmp_path / "out" / "errors").to_pylist()
    assert [(e["id"], e["error_code"], e["error_message"]) for e in errors] == [
        ("r005", "INVALID_ROW", "column 'text' is not valid UTF-8 text (byte 4)")
    ]
    report, _ = stage.qa_run(spec)
    excerpts = dict(zip(report.sample.column("id").to_pylist(), report.sample.column("input_excerpt").to_pylist()))
    assert excerpts["r005"] == "bad \ufffd text" and excerpts["r006"] == "ticket 6 about billing"


def test_qa_measures_a_run_only_with_the_spec_it_was_merged_with(tmp_path, fake_engine_factory):
    """A PASS computed with other thresholds (here the error gate relaxed from 0 to 1) would be sealed under the merge's
    spec hash, which publish compares: QA refuses, as merge refuses a spec the plan was not made for."""
    from airflow_provider_vllm.core.errors import CommitError

    texts = ["my invoice was charged twice"] * 30 + [""] * 10  # 10 EMPTY_INPUT errors: 25 %
    pq.write_table(pa.table({"id": [f"t{i:03d}" for i in range(40)], "text": texts}), tmp_path / "in.parquet")
    strict = make_spec(tmp_path / "in.parquet", tmp_path / "out", qa={"warn_error_rate": 0.0, "fail_error_rate": 0.0})
    for s in plan_job(strict).shards:
        run_shard(shard_task(spec=strict, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    merge(strict)
    relaxed = strict.model_copy(update={"qa": strict.qa.model_copy(update={"fail_error_rate": 1.0})})
    with pytest.raises(CommitError, match="was made for another spec"):
        stage.qa_run(relaxed)
    assert not (tmp_path / "out" / "qa").exists()  # nothing written, nothing sealed
    report, _ = stage.qa_run(strict)
    assert report.status == "fail"
    # a previous report where there is no run at all (the first night, or a wrong folder): a note, not silence
    first = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out2",
        qa={"fail_error_rate": 1.0, "previous_report_uri": str(tmp_path / "none" / "qa/report.json")},
    )
    for s in plan_job(first).shards:
        run_shard(shard_task(spec=first, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    merge(first)
    notes = stage.qa_run(first)[0].notes
    assert any(n.startswith("previous report: no run at ") and "none/qa/report.json" in n for n in notes), notes
