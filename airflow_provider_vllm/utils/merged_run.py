"""The merged run a task between QA and publish reads (a ``before_publish`` step of ``vllm_batch_job``): the parts of
the merge this run's merge task reported, as local copies checked against that merge's sealed manifests.

A step that read ``results/`` from the bucket itself would read whatever is there when it reads: a part swapped
after the merge (and put back before publish checks it), or the parts of another sealed ``_MERGED.json`` of the
folder put back (an earlier merge). Publish would then vouch for a table or export built from rows no merge
wrote. ``merged_parts`` takes the merge's identity from the merge task's XCom (``merged_mac``; Airflow's metadata
database, which the bucket's writers cannot write), checks the folder's ``_MERGED.json`` is that merge, and yields
local copies of its parts, each checked (size, sha256) as it was copied::

    @task
    def export(spec):
        with merged_parts(spec) as run:
            for path in run.paths:
                ...  # pyarrow.parquet.ParquetFile(path): the checked bytes
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.records import MergeSummary
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import CheckedCopies, Storage, copies_folder
from airflow_provider_vllm.hooks.filesystems import task_filesystems
from airflow_provider_vllm.steps.merge.merger import ERRORS, MERGED, RESULTS, checked_parts, read_merged
from airflow_provider_vllm.utils.deployment import check_spec_allowed, signing_keyring
from airflow_provider_vllm.utils.job_spec import data_plane_errors, load_spec


@dataclass(frozen=True)
class MergedParts:
    """What ``merged_parts`` yields: the sealed merge summary, the local paths of the checked copies of its ``kind``
    parts (valid inside the ``with`` block only; an empty run has one empty part), and the run's output."""

    merged: MergeSummary
    kind: str
    paths: list[str]
    output: Storage  # the run's output prefix, reached through the task's Connections (to write a file beside)


def merge_task_of(task_id: str, task_ids: Collection[str] | None = None) -> str:
    """The merge task of the ``vllm_batch_job`` group the task ``task_id`` sits in: ``<group>.merge`` of the
    innermost group around it that has one, ``task_ids`` being the DAG's (a step in a task group of its own inside
    the job's group: ``job.exports.export`` -> ``job.merge``); without ``task_ids``, its own group's (``merge`` at the
    top level)."""
    group, dot, _ = task_id.rpartition(".")
    nearest = f"{group}.merge" if dot else "merge"
    while task_ids is not None:
        candidate = f"{group}.merge" if group else "merge"
        if candidate in task_ids:
            return candidate
        if not group:
            break
        group = group.rpartition(".")[0]
    return nearest


def _dag_merge_tasks(context: Mapping[str, Any]) -> set[str] | None:
    """The ids of the merge tasks (``VllmMergeOperator``, by its task type: this layer imports no operator) of the
    DAG of ``context``'s task; None when unknown."""
    dag = getattr(context.get("task"), "dag", None) or context.get("dag")
    tasks = getattr(dag, "task_dict", None)
    if not isinstance(tasks, Mapping):
        return None
    return {i for i, t in tasks.items() if getattr(t, "task_type", None) == "VllmMergeOperator"}


def reported_merge(context: Mapping[str, Any], merge_task_id: str | None = None) -> str:
    """The seal (``merged_mac``) the merge task of this task's group reported in its XCom; AirflowFailException
    (no retry) when it reported none."""
    ti = context["ti"]
    merge_task = merge_task_id or merge_task_of(ti.task_id, _dag_merge_tasks(context))
    told = ti.xcom_pull(task_ids=merge_task)
    mac = told.get("merged_mac") if isinstance(told, Mapping) else None
    if not isinstance(mac, str) or not mac:
        raise AirflowFailException(f"the merge task {merge_task!r} of this run reported no merged run (merged_mac)")
    return mac


@contextmanager
def merged_parts(
    spec: Any,
    merged_mac: str | None = None,
    *,
    kind: str = RESULTS,
    aws_conn_id: str | None = None,
    gcp_conn_id: str | None = None,
    context: Mapping[str, Any] | None = None,
) -> Iterator[MergedParts]:
    """Inside a task of a ``vllm_batch_job`` run after its merge: local checked copies of the ``kind`` parts
    (``results`` or ``errors``) of the merge this run's merge task reported.

    ``spec``: the job spec as the plan task pushed it (the value ``before_publish`` is called with, rendered);
    it passes the deployment's rules again. ``merged_mac``: the merge's seal (default: the ``merged_mac`` of the
    XCom of the merge task of the job's group around this task, a task group of the step's own inside it included,
    from ``context`` or the running task's). The folder's
    ``_MERGED.json`` must carry this deployment's seal and be that merge; each part must have the size and sha256
    its sealed manifest names. Otherwise the task fails without retry, naming the file. What the block itself raises
    leaves it as raised. The copies are removed
    when the block ends (also after a kill: the next task's sweep removes them)."""
    if kind not in (RESULTS, ERRORS):
        raise ValueError(f"kind={kind!r}: 'results' or 'errors'")
    job: JobSpec = load_spec(spec, "merged_parts")
    check_spec_allowed(job, "merged_parts")  # the spec came through XCom: the deployment's rules again
    if merged_mac is None:
        if context is None:
            from airflow.sdk import get_current_context

            context = get_current_context()
        merged_mac = reported_merge(context)
    out = Storage(job.io.output_uri, job.io.storage_options, task_filesystems(aws_conn_id, gcp_conn_id))
    with copies_folder("merged") as tmp:
        # what goes wrong reading the merge is merged_parts'; what the caller's block raises is the caller's, as is
        with data_plane_errors("merged_parts"):
            try:
                merged = read_merged(out, signing_keyring())
            except FileNotFoundError:
                raise AirflowFailException(f"merged_parts: no merged run at {out.uri(MERGED)}") from None
            if merged.seal is None or merged.seal.mac != merged_mac:
                raise CommitError(
                    f"{out.uri(MERGED)} is not the merge the merge task reported (another sealed merge of the folder "
                    "put back): nothing is read from it"
                )
            paths = checked_parts(out, kind, merged, CheckedCopies(out, tmp))
        yield MergedParts(merged=merged, kind=kind, paths=paths, output=out)
