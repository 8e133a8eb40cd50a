"""The merge task: ``execute()`` over committed shards (the worker ran in this process with the fake engine),
a minimal context, no Airflow process and no metadata DB. The merge itself: tests/unit/steps/merge/."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_vllm.core.errors import TransientError
from airflow_provider_vllm.operators import merge as merge_operator
from airflow_provider_vllm.operators.merge import VllmMergeOperator
from tests.support.task_context import committed_job, context


def test_construction_reads_nothing_and_templates_only_the_spec(tmp_path):
    op = VllmMergeOperator(task_id="merge", spec={"io": {"output_uri": str(tmp_path / "nowhere")}}, memory_limit="2GB")
    assert tuple(op.template_fields) == ("spec",) and op.memory_limit == "2GB"
    assert not (tmp_path / "nowhere").exists()


def test_execute_returns_the_summary_without_per_shard_stats(tmp_path, fake_engine_factory):
    spec, plan = committed_job(tmp_path, fake_engine_factory, n=60, empty=(5,))
    op = VllmMergeOperator(task_id="merge", spec=spec)
    result = op.execute(context())
    assert (result["rows"], result["ok_rows"], result["error_rows"], result["shards"]) == (60, 59, 1, 3)
    assert "shard_stats" not in result  # the XCom stays small; _MERGED.json keeps them
    merged = json.loads((tmp_path / "out" / "_MERGED.json").read_text())
    assert len(merged["shard_stats"]) == len(plan.shards) == 3 and merged["checksums"] == result["checksums"]
    assert op._lineage is not None  # recorded for get_openlineage_facets_on_complete


def test_a_shard_that_is_not_committed_fails_the_task_without_retry(tmp_path, fake_engine_factory):
    spec, plan = committed_job(tmp_path, fake_engine_factory, n=60, run=[0, 2])
    with pytest.raises(AirflowFailException, match=plan.shards[1].shard_id):
        VllmMergeOperator(task_id="merge", spec=spec).execute(context())
    assert not (tmp_path / "out" / "_MERGED.json").exists()


def test_a_transient_storage_failure_is_retried_not_failed(tmp_path, fake_engine_factory, monkeypatch):
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=20)

    def throttled(*a, **kw):
        raise TransientError("SlowDown from the store")

    monkeypatch.setattr(merge_operator, "merge", throttled)
    with pytest.raises(AirflowException, match="transient, retried") as e:
        VllmMergeOperator(task_id="merge", spec=spec).execute(context())
    assert not isinstance(e.value, AirflowFailException)


def test_a_spec_that_is_not_a_job_spec_fails_without_retry():
    with pytest.raises(AirflowFailException, match="merge: invalid job spec"):
        VllmMergeOperator(task_id="merge", spec={"model": {"name": "m"}}).execute(context())
