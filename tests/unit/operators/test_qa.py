"""The QA task: ``execute()`` over a merged run (shards committed in this process with the fake engine), a
minimal context, no Airflow process and no metadata DB. The checks themselves: tests/unit/steps/qa/."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.links.report import VllmQAReportLink
from airflow_provider_vllm.operators.merge import VllmMergeOperator
from airflow_provider_vllm.operators.qa import VllmQAFailed, VllmQAOperator
from airflow_provider_vllm.steps.qa.report import QAFailed
from tests.support.data import plan_xcom
from tests.support.task_context import committed_job, context, rerun_a_shard


def merged_job(tmp_path, factory, **over):
    spec, _ = committed_job(tmp_path, factory, n=60, **over)
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    return spec


def test_construction_templates_the_spec_and_links_the_report():
    op = VllmQAOperator(task_id="qa", spec={})
    assert tuple(op.template_fields) == ("spec", "merge_result")
    assert [type(link) for link in op.operator_extra_links] == [VllmQAReportLink]


def test_a_passing_run_returns_the_summary_and_writes_the_report(tmp_path, fake_engine_factory):
    spec = merged_job(tmp_path, fake_engine_factory)
    ctx = context()
    summary = VllmQAOperator(task_id="qa", spec=spec).execute(ctx)
    assert summary["status"] == "pass" and summary["report_html"] == f"{tmp_path / 'out'}/qa/report.html"
    assert json.loads((tmp_path / "out" / "qa" / "report.json").read_text())["status"] == "pass"
    assert (tmp_path / "out" / "qa" / "sample.parquet").exists()
    assert ctx["ti"].xcoms == {}  # returned, not pushed: only a failing run pushes before it raises


def test_the_sealed_verdict_names_the_dag_run_qa_ran_in(tmp_path, fake_engine_factory):
    """Review and publish take no verdict of another DAG run: the verdict names the run of the QA task's instance."""
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.qa.store import read_qa

    spec = merged_job(tmp_path, fake_engine_factory)
    VllmQAOperator(task_id="qa", spec=spec).execute(context(dag_id="nightly", run_id="scheduled__2026-12-01"))
    record = read_qa(Storage(str(tmp_path / "out")), Keyring.from_env())
    assert record.dag_run is not None and record.dag_run.model_dump() == {
        "dag_id": "nightly",
        "run_id": "scheduled__2026-12-01",
    }


def test_a_warning_goes_on_and_says_so(tmp_path, fake_engine_factory, capsys):
    spec = merged_job(tmp_path, fake_engine_factory, empty=(3,), qa={"warn_error_rate": 0.0, "fail_error_rate": 0.5})
    capsys.readouterr()
    summary = VllmQAOperator(task_id="qa", spec=spec).execute(context())
    logged = "".join(capsys.readouterr())  # the task logger writes to stdout outside a task runner
    assert summary["status"] == "warn" and "QA warning: error_rate=" in logged


def test_a_failing_run_pushes_its_summary_then_fails_without_retry(tmp_path, fake_engine_factory):
    spec = merged_job(tmp_path, fake_engine_factory, empty=(3, 4), qa={"warn_error_rate": 0.0, "fail_error_rate": 0.01})
    ctx = context()
    with pytest.raises(VllmQAFailed) as e:
        VllmQAOperator(task_id="qa", spec=spec).execute(ctx)
    assert isinstance(e.value, QAFailed) and isinstance(e.value, AirflowFailException)
    assert [c["name"] for c in e.value.failing] == ["error_rate"]
    assert ctx["ti"].xcoms["return_value"]["status"] == "fail"
    assert json.loads((tmp_path / "out" / "qa" / "report.json").read_text())["status"] == "fail"
    # Airflow serializes the exception across the task runner: it must come back whole
    path, args, kwargs = e.value.serialize()
    assert path == "airflow_provider_vllm.operators.qa.VllmQAFailed" and VllmQAFailed(*args, **kwargs).failing


def test_qa_measures_only_the_merge_this_runs_merge_task_wrote(tmp_path, fake_engine_factory):
    """An earlier merge of this folder is sealed for it too: put back (with its manifests and parts) before QA, QA
    measured it and publish then published it. The merge task's XCom names the seal of the merge it wrote."""
    import shutil

    spec, plan = committed_job(tmp_path, fake_engine_factory, n=60)
    out = tmp_path / "out"
    first = VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    shutil.copytree(out, tmp_path / "earlier", symlinks=True)
    rerun_a_shard(spec, plan, out, fake_engine_factory)
    now = VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(
        context()
    )  # a cleared merge ran again
    assert first["merged_mac"] != now["merged_mac"]
    for rel in ("_MERGED.json", "results", "errors", "shards"):  # the earlier sealed merge put back, whole
        shutil.rmtree(out / rel) if (out / rel).is_dir() else (out / rel).unlink()
        (shutil.copytree if (tmp_path / "earlier" / rel).is_dir() else shutil.copy2)(
            tmp_path / "earlier" / rel, out / rel
        )
    with pytest.raises(AirflowFailException, match=r"_MERGED.json is not the merge this run's merge task wrote"):
        VllmQAOperator(task_id="qa", spec=spec, merge_result=now).execute(context())
    for told in ({"rows": 60}, None):  # None: no XCom (merge marked success by hand), where one is required
        with pytest.raises(AirflowFailException, match="the merge task's result names no sealed merge"):
            VllmQAOperator(task_id="qa", spec=spec, merge_result=told, require_merge_result=True).execute(context())
    assert not (out / "qa").exists()
    assert VllmQAOperator(task_id="qa", spec=spec, merge_result=first).execute(context())["status"] == "pass"
