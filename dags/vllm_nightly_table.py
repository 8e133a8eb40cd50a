"""
### Nightly ticket reclassification, table in and table out (Apache Iceberg)

The table variant of `vllm_nightly_reclassification`: every night at 02:00 (UTC) it classifies the
previous day's tickets, reading them from an Iceberg table and publishing the labels to another:

`plan` -> `shard` (one mapped task per shard) -> `merge` -> `qa` -> `publish`

**Input.** The rows of `support.tickets` (columns `id` and `text`; `INPUT_TABLE` in this file)
whose `dt` column is the run's date (`dt = '{{ ds }}'`). `plan` pins the table's current snapshot: every
shard and retry reads that snapshot, whatever lands in the table meanwhile, and the plan, the QA report,
the lineage and the published snapshot's summary name it. A table partitioned by `dt` is read in place
(its data files for that day, by reference); otherwise the plan writes the day's rows once under the run
folder.

**Output.** The run folder `<root>/reclassification_table/dt=D/` as for the folder variant, and one
snapshot of `support.ticket_labels` (`OUTPUT_TABLE` in this file; created on the first run),
partitioned by `run_date`: the run's results are added by reference (no copy) and replace that date's
partition, so re-running or backfilling a date replaces its labels. Publishing a run twice commits once.

**Only what changed.** As in the folder variant, the result cache (`<root>/reclassification_table/_cache/`,
shared by every date) answers the rows whose text, model, prompt and sampling an earlier run already saw, so
only new and edited tickets reach the GPU (it needs `model.revision` pinned to a commit for a hub model, or
`{"cache": {"uri": null}}` in the overrides). `changes/` lists what moved against the run this DAG last
published before D, and QA's label drift and accuracy drop compare with that run's report
(`changes.previous_published`, `qa.previous_published`: the Asset's events, by logical date): a date that
failed QA is never the baseline. The first published date has no `changes/`.

**The catalog** is the deployment's: the Airflow Connection named by `[vllm_batch] iceberg_conn_id`
(default `iceberg_default`); the tables must be listed in `[vllm_batch] allowed_tables` (docs/tables.md).
Which tables a run reads and publishes to is this file's (or, with `[vllm_batch]
deployment_settings_from_variables`, a Variable's), never a trigger's: edit `INPUT_TABLE` and `OUTPUT_TABLE`.
The model, shard size, golden rows, overrides, review and runner Variables are those of the folder variant: the
golden rows of `vllm_batch_golden_uri` ride along with every night's tickets and QA gates on their accuracy (warns
below 80%, fails below 50% or on a real drop of more than 5 points since the last published run).
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, Asset, CronDataIntervalTimetable

from airflow_provider_vllm.task_groups.batch_job import TEMPLATE_FILTERS, vllm_batch_job

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

# deployment-owned (core/spec_guard.py DEPLOYMENT_OWNED): publish commits here with the catalog's identity and
# replaces a date's rows, so the DAG file names the tables, not a Variable
INPUT_TABLE = "support.tickets"
OUTPUT_TABLE = "support.ticket_labels"

with DAG(
    dag_id="vllm_nightly_table",
    schedule=CronDataIntervalTimetable("0 2 * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=2,
    doc_md=__doc__,
    tags=["vllm", "batch-inference", "iceberg"],
    user_defined_macros=TEMPLATE_MACROS,
    user_defined_filters=TEMPLATE_FILTERS,
) as dag:
    vllm_batch_job(
        ticket_spec(
            name="nightly-table",
            input_uri=None,
            output_uri=DATA_ROOT + "/reclassification_table/dt={{ ds }}/",
            io={
                "input_table": {"identifier": INPUT_TABLE, "row_filter": "dt = '{{ ds }}'", "columns": ["id", "text"]},
                "output_table": {
                    "identifier": OUTPUT_TABLE,
                    "mode": "overwrite",
                    "date_column": "run_date",
                    "create": True,
                },
            },
            qa={
                "previous_published": True,
                "warn_churn_rate": 0.05,
                "fail_churn_rate": 0.5,
                # the golden rows of vllm_batch_golden_uri ride along and are scored, as in the folder variant
                "reference": {"ride_along_uri": GOLDEN_URI},
            },
            cache={"uri": DATA_ROOT + "/reclassification_table/_cache/"},
            # the run this DAG last published (its Asset event), not whatever dt=D-1 holds
            changes={"previous_published": True},
        ),
        group_id="reclassify",
        overrides=SPEC_OVERRIDES,
        human_review=HUMAN_REVIEW,
        runner=RUNNER,
        asset=Asset(uri="x-vllm-batch://ticket_labels_table", name="ticket_labels_table"),
    )
