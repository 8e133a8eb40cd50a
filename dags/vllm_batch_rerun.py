"""
### Re-run ticket classification on any dataset, from the trigger form

Trigger this DAG with *Trigger DAG* and fill in the form. The form is validated by Airflow
before the run is created: an unknown runner, a shard size below 1, a malformed URI or a
temperature out of range is refused and no task runs. Then `plan` validates the whole job
spec (a bad model path, a missing id column or duplicate ids fail it without retry), and the
deployment's rules: every location (input, output, a local model path) must lie under
`[vllm_batch] allowed_uri_prefixes`, and the form cannot set what the deployment owns (pod
image, service account, secrets, `trust_remote_code`; docs/security.md), nor loosen what decides whether the run
is published: QA's thresholds, baselines and known labels, and the review of a QA 'warn', are this file's (and
`vllm_batch_spec_overrides` / `vllm_batch_human_review` may loosen them only where the deployment sets
`[vllm_batch] qa_settings_from_variables = True`).

Empty fields keep the defaults: the model from the `vllm_batch_model` Variable (which this DAG
needs set; the plan task fails naming it otherwise) and the output `<vllm_batch_data_root>/reruns/<run id>-<hash>/`, so
every run writes its own prefix. An output named in the form must be a folder inside
`<vllm_batch_data_root>/reruns/` (`output_under`): a re-run never writes where a nightly does (its next
date, its cache), whatever the allow-list lets it reach. Reusing an output prefix is allowed only for the same
input and spec (a re-run then reuses the committed shards).

*Compare with* names an earlier run's output prefix (a nightly date, another re-run): the run
then writes `changes/` (every id added, removed, changed or unchanged against it) and the QA
page shows the old x new label matrix, e.g. to see what a new prompt or model would move. Like
every location it must lie under `allowed_uri_prefixes`. This file sets no baseline, so the form may add one (a
DAG file that sets `changes.previous_uri` keeps it: the form cannot move a gate's baseline). The form offers no
cache location: a re-run recomputes every row (the point of most re-runs); a deployment that wants one sets
`cache.uri` in `vllm_batch_spec_overrides`.

*Dry run* only validates and estimates (see `python -m airflow_provider_vllm.cli.dry_run`): the
plan task logs rows, tokens, shards, GPU-hours and the memory plan, and the rest is skipped.

Runners: `local` (a worker process per shard on the Airflow worker) or `kubernetes` (one pod
per shard from the pinned worker image, configured by the `vllm_batch_kubernetes` Variable;
see docs/kubernetes.md). The `runner` task after `plan` skips the shard task of the runner not chosen
(it shows as skipped). An empty *Runner* field takes the `vllm_batch_runner` Variable (else
`local`), as the nightly DAGs do. Whatever the form or Variable says must be a runner the deployment
allows, `[vllm_batch] allowed_runners`; unset, only the one it configured: `kubernetes` where any
`kubernetes_*` option is set, else `local`. So on a Kubernetes deployment *Runner* `local` (vLLM
on the Airflow worker, as the worker's identity) fails `plan`, naming the option, until the
deployment lists it.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, Asset, Param

from airflow_provider_vllm.core.param_schemas import PARAM_SCHEMAS
from airflow_provider_vllm.task_groups.batch_job import TEMPLATE_FILTERS, vllm_batch_job

# The shared defaults sit beside the DAG files (the repository's dags/ folder, the installed
# package's example_dags/); a DAG file copied alone into another dags folder finds them in the package.
try:
    from vllm_dag_defaults import (
        DATA_ROOT,
        HUMAN_REVIEW,
        LABELS,
        SPEC_OVERRIDES,
        SYSTEM_PROMPT,
        TEMPLATE_MACROS,
        ticket_spec,
    )
except ModuleNotFoundError as missing:
    if missing.name != "vllm_dag_defaults":
        raise
    from airflow_provider_vllm.example_dags.vllm_dag_defaults import (
        DATA_ROOT,
        HUMAN_REVIEW,
        LABELS,
        SPEC_OVERRIDES,
        SYSTEM_PROMPT,
        TEMPLATE_MACROS,
        ticket_spec,
    )


def param(name: str, *default, **ui) -> Param:
    """A form field with the provider's JSON schema for that param (re-checked by plan and worker)."""
    return Param(*default, **PARAM_SCHEMAS[name], **ui)


with DAG(
    dag_id="vllm_batch_rerun",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    doc_md=__doc__,
    tags=["vllm", "batch-inference"],
    user_defined_macros=TEMPLATE_MACROS,
    user_defined_filters=TEMPLATE_FILTERS,
    params={
        "input_uri": param(
            "input_uri",
            title="Input dataset",
            description="Parquet/JSONL file or folder with id and text columns: /abs/path, file://, s3://, gs://",
        ),
        "output_uri": param(
            "output_uri",
            None,
            title="Output prefix",
            description="A folder inside <vllm_batch_data_root>/reruns/. Empty: "
            "<vllm_batch_data_root>/reruns/<run id>-<hash>/",
        ),
        "model": param(
            "model", None, title="Model", description="Hub id or local path. Empty: the vllm_batch_model Variable"
        ),
        "labels": param("labels", LABELS, title="Labels", description="One label per line"),
        "system_prompt": param("system_prompt", SYSTEM_PROMPT, title="System prompt", format="multiline"),
        "temperature": param("temperature", 0.0, title="Temperature"),
        "max_tokens": param("max_tokens", 16, title="Max output tokens"),
        "shard_rows": param("shard_rows", 1000, title="Rows per shard"),
        "compare_with": param(
            "compare_with",
            None,
            title="Compare with",
            description="Output prefix of an earlier run (e.g. a nightly date's). Set: the run "
            "writes changes/ (labels added, removed, changed against it) and QA shows the churn "
            "matrix. Empty: no comparison",
        ),
        "runner": param(
            "runner",
            None,
            title="Runner",
            description="Where shards run: local or kubernetes, one the deployment allows ([vllm_batch] "
            "allowed_runners). Empty: the vllm_batch_runner Variable (else local), as the nightly DAGs",
        ),
        "dry_run": param(
            "dry_run",
            False,
            title="Dry run",
            description="Only estimate: rows, tokens, shards, GPU-hours and the GPU memory plan in "
            "the plan task's log and 'dry_run' XCom; nothing is written or launched",
        ),
    },
) as dag:
    vllm_batch_job(
        ticket_spec(
            name="rerun",
            input_uri="{{ params.input_uri }}",
            output_uri=DATA_ROOT + "/reruns/{{ run_id | path_safe }}/",
        ),
        output_under=DATA_ROOT + "/reruns/",  # an output from the form too: never another job's folders
        group_id="rerun",
        overrides=SPEC_OVERRIDES,
        human_review=HUMAN_REVIEW,
        param_overrides=[
            "input_uri",
            "output_uri",
            "model",
            "labels",
            "system_prompt",
            "temperature",
            "max_tokens",
            "shard_rows",
            "compare_with",
        ],
        # an empty Runner field: the deployment's runner, as the nightly DAGs' (RUNNER)
        runner="{{ params.runner or var.value.get('vllm_batch_runner', 'local') }}",
        asset=Asset(uri="x-vllm-batch://ticket_reclassification_reruns", name="ticket_reclassification_reruns"),
    )
