"""VllmPlanOperator's dry run: report in the log and XCom, nothing written, the run skipped."""

from __future__ import annotations

import pytest

from tests.airflow.test_operators import context, dataset, spec_doc


@pytest.mark.parametrize("how", ["argument", "param"])
def test_plan_dry_run_reports_and_skips_without_writing(tmp_path, how, capsys):
    from airflow.sdk import DAG, Param
    from airflow.sdk.exceptions import AirflowSkipException

    from airflow_provider_vllm.operators import VllmPlanOperator

    dataset(tmp_path, n=120)
    with DAG("d", schedule=None, params={"dry_run": Param(False, type="boolean")}):  # as vllm_batch_rerun
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rerun_dag_dry_run_param_skips_the_run_in_real_airflow(airflow_sandbox, tiny_model):
    """`airflow dags test` with dry_run true: plan logs the report and pushes it, every other task
    is skipped, the run succeeds and nothing is written under the data root's outputs."""
    from tests.support.airflow_env import tail
    from tests.support.data import write_parquet

    box = airflow_sandbox
    write_parquet(box.data / "dry" / "t.parquet", [f"d{i}" for i in range(50)], ["I was charged twice."] * 50)
    conf = {"input_uri": str(box.data / "dry"), "model": tiny_model, "shard_rows": 20, "dry_run": True}
    p = box.dags_test("vllm_batch_rerun", "2026-11-25", conf=conf)
    assert p.returncode == 0, tail(p)
    db = box.inspect("vllm_batch_rerun")
    # the sandbox is shared with other tests' runs of this DAG: take the dry run
    (run_id,) = [r["run_id"] for r in db["runs"] if (r["conf"] or {}).get("input_uri") == conf["input_uri"]]
    got = {t["task_id"].split(".")[-1]: t["state"] for t in db["tis"] if t["run_id"] == run_id}
    assert got.pop("plan") == "skipped" and set(got.values()) == {"skipped"}, got
    report = next(x["value"] for x in db["xcoms"] if x["run_id"] == run_id and x["key"] == "dry_run")
    assert report["rows"] == 50 and report["shards"] == 3 and report["memory"]["available"]
    assert "GPU-hours" in p.stdout + p.stderr
    planned = [p for p in box.data.rglob("_plan.json") if str(box.data / "dry") in p.read_text()]
    assert not planned, planned  # other tests' runs may have planned elsewhere; this one wrote nothing


def test_plan_dry_run_logs_the_gpu_layout_and_refuses_a_tp_the_model_cannot_split(tmp_path, capsys):
    """The rerun DAG's dry_run param goes through the plan operator: the layout is logged and in the XCom;
    a tensor_parallel_size vLLM cannot split the model over fails the task (no retry), naming the field."""
    from airflow.sdk import DAG, Param
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from airflow_provider_vllm.operators import VllmPlanOperator
    from airflow_provider_vllm.testing.local_models import default_cache_dir, make_tiny_llama

    model = str(make_tiny_llama(default_cache_dir() / "tiny-llama"))  # 2 attention heads, 2 KV heads
    dataset(tmp_path, n=40)
    dag = DAG("d", schedule=None, params={"dry_run": Param(False, type="boolean")})  # as vllm_batch_rerun
    op = VllmPlanOperator(
        task_id="plan",
        spec=spec_doc(tmp_path, model={"name": model}, sharding={"hardware": "1x NVIDIA H200"}),
        dag=dag,
    )
    ctx = context({"dry_run": True})
    with pytest.raises(AirflowSkipException):
        op.execute(ctx)
    layout = ctx["ti"].xcoms["dry_run"]["layout"]
    assert layout["tensor_parallel_size"] == layout["gpus_per_pod"] == 1 and layout["verdict"] == "fits"
    assert "layout: 1 GPU per shard pod (TP=1)" in capsys.readouterr().out
    bad = VllmPlanOperator(
        task_id="plan_tp4",
        spec=spec_doc(tmp_path, model={"name": model}, engine={"tensor_parallel_size": 4}),
        dag=dag,
    )
    with pytest.raises(AirflowFailException, match=r"engine.tensor_parallel_size 4: 2 attention heads do not divide"):
        bad.execute(context({"dry_run": True}))
    assert not (tmp_path / "out").exists()
