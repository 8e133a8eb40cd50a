"""
### Nightly ticket reclassification with vLLM

Every night at 02:00 (UTC) this DAG classifies the previous day's support tickets into
`billing`, `bug`, `feature_request`, `account` or `other` with an LLM, offline, in shards:

`plan` -> `shard` (one mapped task per shard, named by shard id) -> `merge` -> `qa` -> `publish`

**Data layout.** The run for logical date *D* (the data interval D 02:00 .. D+1 02:00)
reads `<root>/tickets/dt=D/` (Parquet or JSONL with `id` and `text` columns) and writes
`<root>/reclassification/dt=D/`. One run owns one output prefix, so re-running a date is
idempotent (committed shards are not recomputed; the merged files come out byte-identical)
and a backfill over a date range from the UI (*Trigger* -> *Backfill*) just works.
`_SUCCESS.json` under the prefix is written last; read nothing before it exists. QA compares
the label distribution (and the accuracy, below) with the report of the run this DAG last
published (`qa.previous_published`, the run the change set below compares with): a date that
failed QA is never the baseline, so a broken model that stays broken the next night still fails.

**Only what changed.** Most tickets are the same as last night's. The result cache
(`cache.uri` = `<root>/reclassification/_cache/`, shared by every date) answers a row whose
model, prompt, sampling and text are unchanged from an earlier run without the GPU; `plan`
sends only the misses to the shards. It needs answers that repeat: greedy decoding
(temperature 0, as here) and, for a hub model, `model.revision` pinned to a full commit hash
(40 hex characters; set it in `vllm_batch_spec_overrides`, or turn the cache off with
`{"cache": {"uri": null}}`).
`changes/changes.parquet` under each date's prefix lists every ticket id as added, removed,
changed (old and new label), unchanged, error or recovered against the run this DAG last
published before D (`changes.previous_published`: its Asset's events, by logical date; usually
`dt=D-1`, a date that failed QA is skipped), so syncing the rows where `change = 'changed'` of each
published date, in date order, keeps a ticketing system equal to the published labels, as long as
each change set's `_changes.json` names (`previous_uri`) the date the sync applied last: two dates
that ran side by side, or a date published only after a later one, compare with an earlier run
(docs/operations.md). The first published date has no `changes/`: sync its results whole. The QA
page shows the counts, the old x new label matrix and the cache hit rate.

**Churn thresholds.** QA warns when more than 5% of the tickets labelled on both days moved
to another label, and fails above 50%. The same model on the same text gives the same label,
so moved labels come from edited tickets; a few percent is a normal night, while a large
share means the model, prompt or labelling changed under the data, or the input is not the
corpus it claims to be: a person looks before it is published (`vllm_batch_human_review`),
and past half the corpus the run is not published at all. Both are spec fields
(`qa.warn_churn_rate`, `qa.fail_churn_rate`) that `vllm_batch_spec_overrides` can lower (stricter). A Variable
that loosens a gate this file sets (a higher churn threshold, a lower accuracy one, another baseline, the review
off through `vllm_batch_human_review`) fails `plan`, naming it, unless the deployment sets `[vllm_batch]
qa_settings_from_variables = True`; edit this file instead (docs/security.md).

**Is it right?** The checks above say a run completed, not that its answers are right. Give
the DAG a golden set, `vllm_batch_golden_uri` (a Parquet file of `id`, `text` and `label`): its
rows ride along with every night's tickets under reserved ids, are answered with the same model
and prompt, scored by QA and never published, changed or cached. QA reports the accuracy with its
95% interval, per-class precision and recall, the confusion matrix, and how far to trust the
engine's confidence (accuracy by confidence); it warns below 80% accuracy, fails below 50%, and
fails on a drop of more than 5 points since the last published run that the interval says is real
(`qa.warn_accuracy_below`, `qa.fail_accuracy_below`, `qa.fail_accuracy_drop`; through `vllm_batch_spec_overrides`
only raised, or lowered for the drop). Known labels of the night's own tickets can come in too:
`{"qa.reference.golden_uri": ...}` (an id -> label file) or `{"qa.reference.input_column": ...}` in
`vllm_batch_spec_overrides`. The golden rows and labels a Variable names are then the yardstick, chosen by whoever
edits it: to keep it out of their hands, name them in this file.

**Adapting it.** Set Airflow Variables (or `AIRFLOW_VAR_*` environment variables):
`vllm_batch_data_root` (e.g. `s3://bucket/support`), `vllm_batch_model` (a hub id or a
mounted path), `vllm_batch_shard_rows`, and `vllm_batch_spec_overrides` (a JSON object of
spec overrides such as `{"engine.enforce_eager": false, "engine.max_num_seqs": 256}`).

**Where shards run.** `vllm_batch_runner` = `local` (default: a worker process per shard on
the Airflow worker) or `kubernetes` (one GPU pod per shard from the pinned worker image; pod
settings such as image, namespace, GPUs, node pool and Kueue queue come from the
`vllm_batch_kubernetes` Variable, see docs/kubernetes.md). Both shard tasks are in the DAG;
a `runner` task after `plan` follows the chosen one and skips the other.
To change the prompt, labels or columns, copy this file and edit the `ticket_spec(...)`
call: any job spec field can be set there (see `airflow_provider_vllm/core/spec.py`), and any
string may use Jinja (`{{ ds }}`, `{{ var.value.get(...) }}`). The spec is rendered and
validated by `plan` at run time; an invalid spec or dataset fails `plan` without retry.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, Asset, CronDataIntervalTimetable

from airflow_provider_vllm.task_groups.batch_job import TEMPLATE_FILTERS, vllm_batch_job

# The shared defaults sit beside the DAG files (the repository's dags/ folder, the installed
# package's example_dags/); a DAG file copied alone into another dags folder finds them in the package.
try:
    from vllm_dag_defaults import (
        DATA_ROOT,
        GOLDEN_URI,
        HUMAN_REVIEW,
        RUNNER,
        SPEC_OVERRIDES,
        TEMPLATE_MACROS,
        ticket_spec,
    )
except ModuleNotFoundError as missing:
    if missing.name != "vllm_dag_defaults":
        raise
    from airflow_provider_vllm.example_dags.vllm_dag_defaults import (
        DATA_ROOT,
        GOLDEN_URI,
        HUMAN_REVIEW,
        RUNNER,
        SPEC_OVERRIDES,
        TEMPLATE_MACROS,
        ticket_spec,
    )

with DAG(
    dag_id="vllm_nightly_reclassification",
    schedule=CronDataIntervalTimetable("0 2 * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=2,
    doc_md=__doc__,
    tags=["vllm", "batch-inference"],
    user_defined_macros=TEMPLATE_MACROS,
    user_defined_filters=TEMPLATE_FILTERS,
) as dag:
    vllm_batch_job(
        ticket_spec(
            name="nightly-reclassification",
            input_uri=DATA_ROOT + "/tickets/dt={{ ds }}/",
            output_uri=DATA_ROOT + "/reclassification/dt={{ ds }}/",
            qa={
                # drift and the accuracy drop against the report of the run last published (pinned with it)
                "previous_published": True,
                "warn_churn_rate": 0.05,
                "fail_churn_rate": 0.5,
                "reference": {"ride_along_uri": GOLDEN_URI},
            },
            cache={"uri": DATA_ROOT + "/reclassification/_cache/"},
            # the run this DAG last published (its Asset event), not whatever dt=D-1 holds: a date that failed QA,
            # or was never published, is no baseline for what a ticketing system synced
            changes={"previous_published": True},
        ),
        group_id="reclassify",
        overrides=SPEC_OVERRIDES,
        human_review=HUMAN_REVIEW,
        runner=RUNNER,
        asset=Asset(uri="x-vllm-batch://ticket_reclassification", name="ticket_reclassification"),
    )
