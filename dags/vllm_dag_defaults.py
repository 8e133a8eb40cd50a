"""Defaults shared by the example DAGs (a helper module, not a DAG: see .airflowignore).

Every value that differs between a laptop and a cluster is a Jinja template over Airflow
Variables, so it is read at run time (never while the DAG file is parsed):

    vllm_batch_data_root       root of inputs and outputs (default /tmp/vllm-batch); s3://... in a cluster
    vllm_batch_model           chat model name or path (required by the ticket DAGs)
    vllm_batch_embedding_model embedding model name or path (required by vllm_embeddings)
    vllm_batch_shard_rows      rows per shard (default 1000)
    vllm_batch_golden_uri      golden rows that ride along with every run (default: none): a Parquet file of
                               id, text and label; QA scores them every night (qa.reference.ride_along_uri)
    vllm_batch_human_review    "true" (default): a QA 'warn' waits for a person to approve publication;
                               "false": publish warned runs without asking (a 'fail' never publishes), only where
                               the deployment sets [vllm_batch] qa_settings_from_variables = True (else plan fails)
    vllm_batch_spec_overrides  JSON object of spec overrides, e.g. {"engine.enforce_eager": false,
                               "engine.max_num_seqs": 256, "sharding.max_shards": 64}; QA settings only stricter
                               than the DAG file's (a lower qa.fail_error_rate, ...) unless the deployment sets
                               [vllm_batch] qa_settings_from_variables = True
    vllm_batch_runner          where shards run: local (default) or kubernetes (one pod per shard), one that
                               [vllm_batch] allowed_runners allows (unset: kubernetes where a kubernetes_*
                               option is set, else local)
    vllm_batch_kubernetes      JSON object of pod settings for the kubernetes runner (GPUs, node pool, Kueue
                               queue, sizes; see airflow_provider_vllm/core/pod_settings.py and docs/kubernetes.md)

Set them in the UI, with `airflow variables set`, or as AIRFLOW_VAR_<NAME> environment variables.
Variables never decide where jobs may read and write, nor (unless the deployment opts in with
[vllm_batch] deployment_settings_from_variables) the pod image, service account, env, Secrets,
trust_remote_code or code-loading engine options: those are the deployment's [vllm_batch]
configuration (allowed_uri_prefixes, kubernetes_defaults, ...) or the DAG file's (docs/security.md). Nor do they
loosen what decides whether a run is published (QA thresholds, baselines, known labels the DAG file sets, the
review of a 'warn') unless the deployment opts in with [vllm_batch] qa_settings_from_variables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _required_variable(name: str) -> str:
    """An unset model Variable: the run's plan task fails here, naming the Variable to set."""
    raise ValueError(
        f"the example DAG needs the Airflow Variable {name!r} (a model name on the hub or a path the "
        f"workers can read): `airflow variables set {name} <model>` or AIRFLOW_VAR_{name.upper()}=<model>"
    )


TEMPLATE_MACROS: dict[str, Callable[..., str]] = {"vllm_required_variable": _required_variable}
"""``user_defined_macros`` for the example DAGs: a clear failure, at run time, for a model Variable left unset."""

LABELS = ["billing", "bug", "feature_request", "account", "other"]

SYSTEM_PROMPT = (
    "You classify customer support tickets into exactly one category. "
    "billing: payments, charges, refunds, invoices, prices, plans. "
    "bug: the product is broken, crashes, shows errors or does not work as expected. "
    "feature_request: the customer asks for a new feature or an improvement. "
    "account: login, password, email address, two-factor, profile, account access or deletion. "
    "other: anything else (general questions, feedback, partnerships). "
    "Answer with the category name only.\n\n"
    # A few examples lift SmolLM2-135M from ~35% to ~40% accuracy on the demo tickets; larger models
    # need none. They are not taken from the demo's ticket templates.
    "Examples:\n"
    "Ticket: My card was charged but I never got a receipt. -> billing\n"
    "Ticket: The app shows an error and closes when I press save. -> bug\n"
    "Ticket: Please add an option to export my data to Excel. -> feature_request\n"
    "Ticket: I cannot log in, the password reset link does not work. -> account\n"
    "Ticket: Do you sponsor local events? -> other"
)

DATA_ROOT = "{{ var.value.get('vllm_batch_data_root', '/tmp/vllm-batch').rstrip('/') }}"
CHAT_MODEL = "{{ var.value.get('vllm_batch_model', '') or vllm_required_variable('vllm_batch_model') }}"
EMBEDDING_MODEL = (
    "{{ var.value.get('vllm_batch_embedding_model', '') or vllm_required_variable('vllm_batch_embedding_model') }}"
)
SHARD_ROWS = "{{ var.value.get('vllm_batch_shard_rows', '1000') }}"
GOLDEN_URI = "{{ var.value.get('vllm_batch_golden_uri', '') }}"  # '' (unset): no golden rows
SPEC_OVERRIDES = "{{ var.value.get('vllm_batch_spec_overrides', '{}') }}"
HUMAN_REVIEW = "{{ var.value.get('vllm_batch_human_review', 'true') }}"
RUNNER = "{{ var.value.get('vllm_batch_runner', 'local') }}"

# Local CPU defaults: eager mode and a 1 GiB KV cache start vLLM's CPU build in ~25 s.
# A GPU cluster overrides them through vllm_batch_spec_overrides.
LOCAL_ENGINE = {"enforce_eager": True, "cpu_kvcache_space_gb": 1, "max_num_seqs": 64}


def ticket_spec(name: str, input_uri: str | None, output_uri: str, **sections: Any) -> dict[str, Any]:
    """The ticket classification job (chat + a fixed label set); strings may hold Jinja."""
    spec: dict[str, Any] = {
        "name": name,
        "task": "chat",
        "model": {"name": CHAT_MODEL, "max_model_len": 2048},
        "engine": dict(LOCAL_ENGINE),
        "prompt": {
            "id_column": "id",
            "template": "Ticket: {text}",
            "system_prompt": SYSTEM_PROMPT,
            "truncation": "truncate",
        },
        # 16: xgrammar may spell a label in more tokens than the tokenizer's shortest split
        "sampling": {"temperature": 0, "max_tokens": 16, "structured": {"choice": list(LABELS)}},
        "io": {"input_uri": input_uri, "output_uri": output_uri},
        "sharding": {"target_rows": SHARD_ROWS, "chunk_rows": 256},
        "qa": {"sample_size": 200},
    }
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec
