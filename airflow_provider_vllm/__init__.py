"""Offline (batch) LLM inference with vLLM, orchestrated by Apache Airflow.

Importing this package does no I/O and imports neither Airflow nor vLLM: the pod-side
worker (``airflow_provider_vllm.worker``) shares the pure modules with the operators.
"""

from __future__ import annotations

__version__ = "0.1.0"


def get_provider_info() -> dict:
    """Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""
    return {
        "package-name": "airflow-provider-vllm",
        "name": "vLLM batch inference",
        "description": "Offline LLM inference with vLLM: plan, shard, merge, QA and publish "
        "datasets of any size from Airflow DAGs.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "vLLM batch inference",
                "external-doc-url": "https://docs.vllm.ai/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "vLLM batch inference",
                "python-modules": [
                    "airflow_provider_vllm.operators.plan",
                    "airflow_provider_vllm.operators.shard",
                    "airflow_provider_vllm.operators.kubernetes",
                    "airflow_provider_vllm.operators.runner_branch",
                    "airflow_provider_vllm.operators.merge",
                    "airflow_provider_vllm.operators.qa",
                    "airflow_provider_vllm.operators.publish",
                    "airflow_provider_vllm.operators.review",
                ],
            }
        ],
        "extra-links": ["airflow_provider_vllm.ui.links.VllmQAReportLink"],
        "plugins": [{"name": "vllm_batch", "plugin-class": "airflow_provider_vllm.ui.plugin.VllmBatchPlugin"}],
    }
