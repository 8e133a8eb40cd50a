"""Choose the shard task of the runner named at run time (a DAG param or a Variable)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.providers.common.compat.sdk import BaseBranchOperator

from airflow_provider_vllm.utils.job_spec import check_runner


class VllmRunnerBranchOperator(BaseBranchOperator):
    """Follow the shard task of ``runner`` (templated); the other shard task is skipped whole.

    :param runner: ``local`` or ``kubernetes``, usually a template such as ``{{ params.runner }}``.
    :param shard_tasks: runner name -> task id of that runner's (mapped) shard task.
    """

    template_fields: Sequence[str] = ("runner",)
    ui_color = "#f1f3f4"

    def __init__(self, *, runner: str, shard_tasks: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.runner = runner
        self.shard_tasks = dict(shard_tasks)

    def choose_branch(self, context: Any) -> str:
        name = check_runner(self.runner)
        self.log.info("runner %s: shards run in %s", name, self.shard_tasks[name])
        return self.shard_tasks[name]
