"""The runner branch: the shard task of the runner named at run time, or a failure naming the param (an unknown
runner, or one ``[vllm_batch] allowed_runners`` does not let a run choose)."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.operators.runner_branch import VllmRunnerBranchOperator
from tests.support.task_context import context

TASKS = {"local": "job.shard", "kubernetes": "job.shard_kubernetes"}


def branch(runner):
    return VllmRunnerBranchOperator(task_id="runner", runner=runner, shard_tasks=TASKS)


@pytest.mark.parametrize("runner, task", [("local", "job.shard"), (" kubernetes\n", "job.shard_kubernetes")])
def test_the_named_runners_shard_task_is_followed(runner, task):
    assert branch(runner).choose_branch(context()) == task


@pytest.mark.parametrize("runner", ["docker", "", "{{ params.runner }}", "Local"])
def test_an_unknown_runner_fails_without_retry_naming_the_choices(runner):
    with pytest.raises(
        AirflowFailException, match=r"runner=.* is not a runner; choose one of \['local', 'kubernetes'\]"
    ):
        branch(runner).choose_branch(context())


def test_only_the_runner_is_templated_and_the_task_map_is_copied():
    tasks = dict(TASKS)
    op = VllmRunnerBranchOperator(task_id="runner", runner="{{ params.runner }}", shard_tasks=tasks)
    tasks["local"] = "changed"
    assert tuple(op.template_fields) == ("runner",) and op.shard_tasks["local"] == "job.shard"
    op.render_template_fields({"params": {"runner": "kubernetes"}})
    assert op.runner == "kubernetes" and op.choose_branch(context()) == "job.shard_kubernetes"


@pytest.mark.reliability
def test_a_runner_the_deployment_does_not_allow_fails_without_retry_a_literal_is_followed(monkeypatch):
    """Defence in depth behind the plan task: a Kubernetes deployment (allowed_runners unset) does not follow a
    trigger's runner=local onto the Airflow worker; an allowed value, or the DAG file's literal, is followed."""
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", raising=False)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", "vllm-batch-signing:key")
    op = branch("{{ params.runner }}")
    op.render_template_fields({"params": {"runner": "local"}})
    with pytest.raises(
        AirflowFailException, match=r"runner: runner='local' .*trigger params.*allowed: \['kubernetes'\]"
    ):
        op.choose_branch(context())
    op = branch("{{ params.runner }}")
    op.render_template_fields({"params": {"runner": "kubernetes"}})
    assert op.choose_branch(context()) == "job.shard_kubernetes"
    assert branch("local").choose_branch(context()) == "job.shard"  # the DAG file's choice
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", "kubernetes, local")
    op = branch("{{ params.runner }}")
    op.render_template_fields({"params": {"runner": "local"}})
    assert op.choose_branch(context()) == "job.shard"
