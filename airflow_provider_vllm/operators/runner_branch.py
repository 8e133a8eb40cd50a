"""Choose the shard task of the runner named at run time (a DAG param or a Variable)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.providers.common.compat.sdk import BaseBranchOperator

from airflow_provider_vllm.utils import provenance
from airflow_provider_vllm.utils.deployment import check_runner_choice
from airflow_provider_vllm.utils.job_spec import check_runner


class VllmRunnerBranchOperator(BaseBranchOperator):
    """Follow the shard task of ``runner`` (templated); the other shard task is skipped whole.

    :param runner: ``local`` or ``kubernetes``, usually a template such as ``{{ params.runner }}``. A template
        may name only a runner ``[vllm_batch] allowed_runners`` allows (checked again here, after the plan task);
        a literal is the DAG file's choice.
    :param shard_tasks: runner name -> task id of that runner's (mapped) shard task.
    """

    template_fields: Sequence[str] = ("runner",)
    ui_color = "#f1f3f4"

    def __init__(self, *, runner: str, shard_tasks: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.runner = runner
        self._raw_runner = runner  # before rendering: a literal or a run-time choice
        self.shard_tasks = dict(shard_tasks)

    def choose_branch(self, context: Any) -> str:
        name = check_runner(self.runner)
        check_runner_choice(self._raw_runner, name, "runner", provenance.template_env(self))
        self.log.info("runner %s: shards run in %s", name, self.shard_tasks[name])
        return self.shard_tasks[name]
