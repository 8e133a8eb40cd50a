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
        "config": {
            "vllm_batch": {
                "description": "Limits the deployment sets on vLLM batch jobs.",
                "options": {
                    "allowed_uri_prefixes": {
                        "description": "JSON list or comma-separated URI prefixes that job inputs and outputs "
                        "must lie under (e.g. s3://ml-batch/,/data/batch). Empty: the Airflow Variable "
                        "vllm_batch_allowed_prefixes, else no limit.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://ml-batch/,/data/batch",
                        "default": "",
                    },
                    "aws_conn_id": {
                        "description": "Airflow Connection through which the Airflow-side tasks (plan, merge, QA, "
                        "publish), the local runner's workers and the QA report page reach s3:// locations "
                        "(the amazon provider's fsspec helper). A DAG can name another one (aws_conn_id of "
                        "vllm_batch_job); a missing Connection means the default AWS credential chain.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "aws_default",
                        "default": "aws_default",
                    },
                    "gcp_conn_id": {
                        "description": "Airflow Connection through which the Airflow-side tasks and the QA report "
                        "page reach gs:// locations (the google provider's fsspec helper); a missing Connection "
                        "means Application Default Credentials.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "google_cloud_default",
                        "default": "google_cloud_default",
                    },
                    "report_roots": {
                        "description": "Optional: comma-separated URI prefixes that narrow, within "
                        "allowed_uri_prefixes, which run outputs the QA report page may read.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://ml-batch/reports/",
                        "default": "",
                    },
                },
            }
        },
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
