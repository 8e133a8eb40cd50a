"""VllmPlanOperator's dry run: report in the log and XCom, nothing written, the run skipped."""

from __future__ import annotations

import pytest

from tests.airflow.test_operators import context, dataset, spec_doc


@pytest.mark.parametrize("how", ["argument", "param"])
def test_plan_dry_run_reports_and_skips_without_writing(tmp_path, how, capsys):
    from airflow.sdk.exceptions import AirflowSkipException

    from airflow_provider_vllm.operators import VllmPlanOperator

    dataset(tmp_path, n=120)
    op = VllmPlanOperator(task_id="plan", spec=spec_doc(tmp_path), dry_run=how == "argument")
    ctx = context({"dry_run": True} if how == "param" else None)
    with pytest.raises(AirflowSkipException, match="dry run"):
        op.execute(ctx)
    report = ctx["ti"].xcoms["dry_run"]
    assert report["rows"] == 120 and report["shards"] == 2 and report["est_gpu_hours"] > 0
    logged = capsys.readouterr().out  # the task logger writes to stdout outside a task runner
    assert "GPU-hours" in logged and "rows             120" in logged
    assert not (tmp_path / "out").exists()  # no _plan.json, no shard launched


def test_plan_dry_run_on_a_bad_dataset_fails_without_retry(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPlanOperator

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "in" / "a.parquet")
    with pytest.raises(AirflowFailException, match="missing column"):
        VllmPlanOperator(task_id="plan", spec=spec_doc(tmp_path), dry_run=True).execute(context())
