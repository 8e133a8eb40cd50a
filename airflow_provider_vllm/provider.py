"""The provider's metadata in one place: what Airflow reads through the ``apache_airflow_provider``
entry point (``get_provider_info``), and the ``[vllm_batch]`` configuration options every
Airflow-side module reads by these names (``tests/unit/test_provider_info.py`` checks that each
option read anywhere is declared here and each declared option is read).

Pure: no Airflow import, no I/O.
"""

from __future__ import annotations

from airflow_provider_vllm import __version__

PACKAGE_NAME = "airflow-provider-vllm"
CONFIG_SECTION = "vllm_batch"
ALLOWED_URI_PREFIXES = "allowed_uri_prefixes"
ALLOWED_RUNNERS = "allowed_runners"
ALLOW_ANY_LOCATION = "allow_any_location"
ALLOW_REMOTE_CODE = "allow_remote_code"
DEPLOYMENT_SETTINGS_FROM_VARIABLES = "deployment_settings_from_variables"
QA_SETTINGS_FROM_VARIABLES = "qa_settings_from_variables"
KUBERNETES_DEFAULTS = "kubernetes_defaults"
AWS_CONN_ID = "aws_conn_id"
GCP_CONN_ID = "gcp_conn_id"
REPORT_ROOTS = "report_roots"
SIGNING_KEY = "signing_key"
KUBERNETES_SIGNING_SECRET = "kubernetes_signing_secret"
CACHE_URI_PREFIXES = "cache_uri_prefixes"
SCHEDULED_OUTPUT_PREFIXES = "scheduled_output_prefixes"
KUBERNETES_COMPILE_CACHE_PVC = "kubernetes_compile_cache_pvc"
ICEBERG_CONN_ID = "iceberg_conn_id"
ALLOWED_TABLES = "allowed_tables"


def setting(option: str) -> str:
    """How a person sets ``option``: ``[vllm_batch] option (AIRFLOW__VLLM_BATCH__OPTION)``."""
    return f"[{CONFIG_SECTION}] {option} (AIRFLOW__{CONFIG_SECTION.upper()}__{option.upper()})"


def get_provider_info() -> dict:
    """Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""
    return {
        "package-name": PACKAGE_NAME,
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
            CONFIG_SECTION: {
                "description": "What the deployment allows vLLM batch jobs to do. Read at task run time from the "
                "Airflow configuration only (never from Variables, params or XCom); the defaults fail closed. "
                "See docs/security.md.",
                "options": {
                    ALLOWED_URI_PREFIXES: {
                        "description": "JSON list or comma-separated URI prefixes that every location of a job "
                        "(input, output, sharding.history_uri, qa.previous_report_uri, qa.reference.golden_uri, "
                        "qa.reference.ride_along_uri, cache.uri, "
                        "changes.previous_uri, "
                        "a local model or tokenizer path) must lie under, by whole path segments. "
                        "Empty: nothing is allowed (plan refuses, "
                        "naming this option) unless allow_any_location is True.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://ml-batch/,/data/batch,/models",
                        "default": "",
                    },
                    ALLOWED_RUNNERS: {
                        "description": "JSON list or comma-separated runners (local, kubernetes) that a runner "
                        'chosen at run time may name: a template such as runner="{{ params.runner }}" (a trigger '
                        "form) or over a Variable; a literal runner in the DAG file is not restricted. Entries are "
                        "trimmed and lower-cased, blank ones dropped; an unknown name fails every run-time choice, "
                        "naming this option. Empty: only the runner this deployment configured: kubernetes when any "
                        "kubernetes_* option below is set (so a trigger cannot move shards onto the Airflow worker, "
                        "with its identity), else local (a laptop, CI). The plan and runner tasks refuse any other "
                        "value before anything is written or launched.",
                        "version_added": "0.3.0",
                        "type": "string",
                        "example": "kubernetes",
                        "default": "",
                    },
                    ALLOW_ANY_LOCATION: {
                        "description": "True: with no allowed_uri_prefixes, jobs may read and write any location "
                        "that passes the syntax checks (a laptop, a single-tenant Airflow). Never needed when "
                        "allowed_uri_prefixes is set.",
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
                    },
                    ALLOW_REMOTE_CODE: {
                        "description": "True: a DAG file may set model.trust_remote_code and engine options that "
                        "make vLLM import code by name (compilation_config backend/inductor passes, custom "
                        "tokenizer modes, hf_overrides auto_map). Trigger params never may.",
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
                    },
                    DEPLOYMENT_SETTINGS_FROM_VARIABLES: {
                        "description": "True: the vllm_batch_spec_overrides and vllm_batch_kubernetes Variables "
                        "(and any template reading a Variable) may set deployment-owned settings: pod image, "
                        "namespace, service account, env, Secret references, PVCs, pod template, labels, "
                        "annotations, trust_remote_code, code-loading engine options. False: Variables may set "
                        "the other settings only.",
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "False",
                        "default": "False",
                    },
                    QA_SETTINGS_FROM_VARIABLES: {
                        "description": "True: Variables (vllm_batch_spec_overrides, vllm_batch_human_review, any "
                        "template reading a Variable) may also loosen what decides whether a run is published: raise "
                        "a QA rate threshold, lower an accuracy threshold (0: off), change min_labelled or "
                        "confidence, change or remove a baseline or a source of known labels the DAG file sets, "
                        "turn the review of a QA 'warn' off. False: Variables may only make them stricter than the "
                        "DAG file's values (the spec defaults where it sets none). Trigger params never loosen them.",
                        "version_added": "0.3.0",
                        "type": "boolean",
                        "example": "False",
                        "default": "False",
                    },
                    KUBERNETES_DEFAULTS: {
                        "description": "JSON object of pod settings (KubernetesSettings fields: image, namespace, "
                        "service_account, secret_env, ...) for every shard pod; the vllm_batch_kubernetes "
                        "Variable and the DAG file's settings are layered over it.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": '{"image": "registry.example.com/ml/vllm-worker:0.1.0@sha256:...", '
                        '"namespace": "ml-batch", "service_account": "vllm-batch"}',
                        "default": "",
                    },
                    AWS_CONN_ID: {
                        "description": "Airflow Connection through which the Airflow-side tasks (plan, merge, QA, "
                        "publish), the local runner's workers and the QA report page reach s3:// locations "
                        "(the amazon provider's fsspec helper). A DAG can name another one (aws_conn_id of "
                        "vllm_batch_job); a missing Connection means the default AWS credential chain.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "aws_default",
                        "default": "aws_default",
                    },
                    GCP_CONN_ID: {
                        "description": "Airflow Connection through which the Airflow-side tasks and the QA report "
                        "page reach gs:// locations (the google provider's fsspec helper); a missing Connection "
                        "means Application Default Credentials.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "google_cloud_default",
                        "default": "google_cloud_default",
                    },
                    SIGNING_KEY: {
                        "description": "Required. The secret key (or keys, comma separated: the first signs, all "
                        "verify) with which the pipeline seals what it writes and later trusts: the plan, each "
                        "chunk and commit marker of a shard, merge summary, QA verdict, _SUCCESS.json and every result "
                        "cache entry. Whoever can write an output prefix or the cache folder but lacks this key "
                        "cannot make the pipeline publish or reuse an answer. At least 32 characters, e.g. "
                        "python -c 'import secrets; print(secrets.token_urlsafe(48))'. Keep it in a secrets "
                        "backend (AIRFLOW__VLLM_BATCH__SIGNING_KEY_SECRET) or the environment; unset: every run "
                        "fails in plan, naming this option. Only Airflow tasks hold it: shard workers get its worker "
                        "key (python -m airflow_provider_vllm.cli.worker_key), which seals only their chunks, commit "
                        "markers and compile cache snapshots. See docs/adr/0007-sealed-records.md and "
                        "docs/adr/0011-per-role-keys.md.",
                        "version_added": "0.3.0",
                        "type": "string",
                        "sensitive": True,
                        "example": None,
                        "default": "",
                    },
                    KUBERNETES_SIGNING_SECRET: {
                        "description": "Kubernetes runner: the Secret key holding the shard pods' worker key (not "
                        "signing_key itself: print the worker key with python -m "
                        "airflow_provider_vllm.cli.worker_key), as <secret name>:<key> in the pods' namespace; the "
                        "pods get it as VLLM_BATCH_WORKER_KEY through a secretKeyRef, never as a literal. A pod given "
                        "signing_key itself refuses to start. Unset: the Kubernetes runner refuses to start pods, "
                        "naming this option.",
                        "version_added": "0.3.0",
                        "type": "string",
                        "example": "vllm-batch-signing:key",
                        "default": "",
                    },
                    CACHE_URI_PREFIXES: {
                        "description": "JSON list or comma-separated URI prefixes under which a job's result "
                        "cache (cache.uri) may live, by whole path segments (each also inside "
                        "allowed_uri_prefixes). Empty: no job may use a result cache (plan refuses cache.uri, "
                        "naming this option), so that one team's job cannot read or fill another team's cache.",
                        "version_added": "0.3.0",
                        "type": "string",
                        "example": "s3://ml-batch/cache/triage/",
                        "default": "",
                    },
                    SCHEDULED_OUTPUT_PREFIXES: {
                        "description": "JSON list or comma-separated URI prefixes that only runs Airflow schedules "
                        "(scheduled, backfill, asset-triggered) may write: a run triggered by a person or a "
                        "program (the form, the REST API, airflow dags trigger or test, TriggerDagRunOperator) whose "
                        "io.output_uri lies under one, or above one, fails its plan (no retry) before anything is "
                        "written, so that it cannot claim a prefix a scheduled run writes later (tomorrow's dt= "
                        "folder). Re-run a scheduled date by clearing its run. Empty: none (a triggered run may "
                        "write any allowed prefix).",
                        "version_added": "0.3.0",
                        "type": "string",
                        "example": "s3://ml-batch/reclassification/",
                        "default": "",
                    },
                    KUBERNETES_COMPILE_CACHE_PVC: {
                        "description": "Kubernetes runner: a PersistentVolumeClaim (ReadWriteMany, in the pods' "
                        "namespace, writable by their run_as_group through fsGroup) on which the shard pods share "
                        "their compile caches (vLLM's torch.compile artefacts, torch inductor's and Triton's "
                        "kernels), mounted at /compile-cache: a pod restores the published snapshot of its key "
                        "(vLLM, torch and Triton builds, GPU type, model and engine settings) before vLLM starts, "
                        "checking its seal and every file's hash, and a pod that found none publishes its own "
                        "after its engine started, by a create-only rename. An 8B model then starts in about "
                        "41 s instead of 105-115 s on an H200. Whoever can write the claim can put code there that "
                        "later pods run: keep it for the shard pods' service account alone; pods that may run code "
                        "from the model repo mount it read-only. Empty (default): every pod compiles from scratch. "
                        "Never a hostPath. See docs/adr/0008-shared-compile-cache.md.",
                        "version_added": "0.3.0",
                        "type": "string",
                        "example": "vllm-compile-cache",
                        "default": "",
                    },
                    ICEBERG_CONN_ID: {
                        "description": "The Airflow Connection of the Iceberg catalog that table jobs "
                        "(io.input_table, io.output_table) read and publish through, in the convention of "
                        "Airflow's Iceberg provider: type iceberg, host the catalog URI, login/password a REST "
                        "catalog's OAuth client id and secret, extra any other pyiceberg catalog property (type, "
                        "warehouse, s3.endpoint, ...). Never taken from a job. See docs/tables.md.",
                        "version_added": "0.3.0",
                        "type": "string",
                        "example": "iceberg_lake",
                        "default": "iceberg_default",
                    },
                    ALLOWED_TABLES: {
                        "description": "JSON list or comma-separated Iceberg table identifiers (namespace.table) "
                        "or namespaces (namespace.*) that jobs may read (io.input_table) and publish to "
                        "(io.output_table). Empty (default): every table job fails in plan, naming this option.",
                        "version_added": "0.3.0",
                        "type": "string",
                        "example": "support.tickets,triage.*",
                        "default": "",
                    },
                    REPORT_ROOTS: {
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
        "extra-links": ["airflow_provider_vllm.links.report.VllmQAReportLink"],
        "plugins": [{"name": "vllm_batch", "plugin-class": "airflow_provider_vllm.plugins.report.VllmBatchPlugin"}],
        # `airflow vllm-batch dry-run ...` (cli/definition.py), loaded by Airflow's CLI like amazon's and cncf's
        "cli": ["airflow_provider_vllm.cli.definition.get_vllm_batch_cli_commands"],
    }
