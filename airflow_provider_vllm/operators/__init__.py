"""Airflow operators: thin adapters over the pure modules (no I/O at construction).

plan -> shard (mapped, one per planned shard; local process or Kubernetes pod) -> merge -> qa ->
review (human gate) -> publish; wire them with
``airflow_provider_vllm.task_groups.batch_job.vllm_batch_job``.
"""

from __future__ import annotations

from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator
from airflow_provider_vllm.operators.merge import VllmMergeOperator
from airflow_provider_vllm.operators.plan import VllmPlanOperator
from airflow_provider_vllm.operators.publish import VllmPublishOperator
from airflow_provider_vllm.operators.qa import VllmQAFailed, VllmQAOperator
from airflow_provider_vllm.operators.review import VllmQAReviewOperator
from airflow_provider_vllm.operators.runner_branch import VllmRunnerBranchOperator
from airflow_provider_vllm.operators.shard import VllmLocalShardOperator

__all__ = [
    "VllmKubernetesShardOperator",
    "VllmLocalShardOperator",
    "VllmMergeOperator",
    "VllmPlanOperator",
    "VllmPublishOperator",
    "VllmQAFailed",
    "VllmQAOperator",
    "VllmQAReviewOperator",
    "VllmRunnerBranchOperator",
]
