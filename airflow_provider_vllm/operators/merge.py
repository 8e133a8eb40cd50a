"""The merge task: committed shards -> verified results and errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException, XComNotFound
from pydantic import ValidationError

from airflow_provider_vllm.core.plan import Plan, PlanRef, load_plan
from airflow_provider_vllm.core.records import WorkerManifest, read_manifest
from airflow_provider_vllm.hooks.filesystems import task_filesystems
from airflow_provider_vllm.steps.lineage import merge_lineage
from airflow_provider_vllm.steps.merge.merger import merge
from airflow_provider_vllm.utils.deployment import check_spec_allowed, signing_keyring
from airflow_provider_vllm.utils.job_spec import PLAN_XCOM_KEY, data_plane_errors, load_spec, plan_ref
from airflow_provider_vllm.utils.worker_outcome import first_error


class VllmMergeOperator(BaseOperator):
    """Run ``merge(spec)``; return the merge summary without per-shard stats (``MergeSummary.xcom()``).

    Fails without retry when a shard is not committed, a marker names a file outside its
    shard's attempts or one that does not match it, two committed outputs of one id differ,
    or input ids != result ids + error ids (each once).

    ``shard_results``: the shard tasks' XComs (a list of ``shard.output``, one per runner's shard task;
    ``vllm_batch_job`` passes them): each shard's commit marker must be the attempt its task reported (the
    worker's manifest, ``attempt_id``), not an earlier genuine one put back. Each entry is read as a
    ``WorkerManifest``: one that is not, or two naming different attempts of one shard, fail the merge.
    None: not checked, unless ``require_shard_results`` (set by ``vllm_batch_job``): then a shard no task
    reported fails.

    ``plan``: the plan task's value naming the sealed plan it wrote (its XCom under ``PLAN_XCOM_KEY``,
    ``{"plan_mac": ..., "plan_sha256": ...}``; ``vllm_batch_job`` passes ``plan.output["plan"]``): merge takes
    ``_plan.json`` only when it is that plan, never another sealed plan of the folder put back (an earlier plan or
    run of the same output prefix). Required: without it, or with a value that is no plan identity, the task fails
    without retry; so does a plan task that pushed no such value (a run planned by a version before merge took it:
    Airflow's ``XComNotFound``, which it would retry, to no avail).

    ``aws_conn_id`` / ``gcp_conn_id``: the Airflow Connections through which this task reaches
    ``s3://`` / ``gs://`` locations (DAG-file settings, never templated; None: ``[vllm_batch]
    aws_conn_id`` / ``gcp_conn_id``, else ``aws_default`` / ``google_cloud_default``). See
    ``airflow_provider_vllm.hooks.filesystems``.
    """

    template_fields: Sequence[str] = ("spec", "shard_results", "plan")
    template_fields_renderers = {"spec": "json", "shard_results": "json", "plan": "json"}
    ui_color = "#e6f4ea"
    # the plan task pushed no value under PLAN_XCOM_KEY (``render_template``): execute fails without retry, naming it
    _plan_not_pushed: XComNotFound | None = None

    def __init__(
        self,
        *,
        spec: Any,
        plan: Any = None,
        memory_limit: str = "1GB",
        shard_results: Any = None,
        require_shard_results: bool = False,
        aws_conn_id: str | None = None,
        gcp_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self.spec = spec
        self.plan = plan
        self.memory_limit = memory_limit
        self.shard_results = shard_results
        self.require_shard_results = require_shard_results

    def render_template(
        self, content: Any, context: Any, jinja_env: Any = None, seen_oids: set[int] | None = None
    ) -> Any:
        """Airflow's rendering; but ``plan`` naming a value its plan task never pushed (``XComNotFound`` for the key
        ``plan``: a run planned by a version before merge took it) is kept for ``execute``, which fails without
        retry naming it. Airflow fails the task on ``XComNotFound`` while rendering, and retries it, to no avail."""
        try:
            return super().render_template(content, context, jinja_env, seen_oids)
        except XComNotFound as e:
            if content is not self.plan or e.key != PLAN_XCOM_KEY:
                raise
            self._plan_not_pushed = e
            return None

    def execute(self, context: Any) -> dict[str, Any]:
        spec = load_spec(self.spec, "merge")
        check_spec_allowed(spec, "merge")  # the spec came through XCom: the deployment's rules again
        if self._plan_not_pushed is not None:
            raise AirflowFailException(
                f"merge: the plan task ({self._plan_not_pushed.task_id}) pushed no value under XCom key "
                f"{PLAN_XCOM_KEY!r}, which names the sealed plan merge takes: the run was planned by a version before "
                "merge took it. Run the job again from its plan task (clear it with its downstream tasks)"
            )
        pinned = plan_ref(self.plan, "merge")
        lineage_plan = self._lineage_plan(spec, pinned)  # before the merge writes anything
        with data_plane_errors("merge"):
            summary = merge(
                spec,
                memory_limit=self.memory_limit,
                filesystems=task_filesystems(self.aws_conn_id, self.gcp_conn_id),
                keyring=signing_keyring(),
                attempts=self._reported_attempts(),
                plan=pinned,
            )
        infer_s = sum(s.infer_s or 0 for s in summary.shard_stats or [])
        self.log.info(
            "merged %s: %d rows = %d ok + %d errors, %d duplicate id(s) committed (identical, "
            "%d extra row(s) dropped), %d shard(s); "
            "inference %.1f s over all shards (%.2f rows/s); merge %.2f s",
            spec.io.output_uri,
            summary.rows,
            summary.ok_rows,
            summary.error_rows,
            summary.duplicates.ids,
            summary.duplicates_dropped,
            summary.shards,
            infer_s,
            summary.rows / infer_s if infer_s else 0.0,
            summary.merge_s,
        )
        self._lineage = self._merge_lineage(spec, summary, lineage_plan)
        return summary.xcom()

    def _reported_attempts(self) -> dict[str, str] | None:
        """shard id -> the attempt its shard task reported committing (the worker manifests in the shard tasks'
        XComs, through Airflow's metadata database), when given or required; a runner's skipped task adds none.
        Each is read as the record the shard task wrote (``WorkerManifest``): one that is not, or two that name
        different attempts of one shard, fail the merge without a retry."""
        if self.shard_results is None and not self.require_shard_results:
            return None
        groups = self.shard_results if isinstance(self.shard_results, (list, tuple)) else [self.shard_results]
        # each group: one runner's mapped task (a lazy list of manifests), or one manifest
        entries = [m for g in groups if g is not None for m in ([g] if isinstance(g, (Mapping, str)) else g)]
        reported: dict[str, str] = {}
        for n, entry in enumerate(entries):
            m = _reported_manifest(n, entry)
            if reported.setdefault(m.shard_id, m.attempt_id) != m.attempt_id:
                raise AirflowFailException(
                    f"merge: the shard tasks report two attempts of shard {m.shard_id!r} ({reported[m.shard_id]} "
                    f"and {m.attempt_id}); a shard is one runner's task: clear the shard tasks, then the merge"
                )
        return reported

    def _lineage_plan(self, spec: Any, pinned: PlanRef) -> Plan | None:
        """The plan merge runs under (the plan task's: ``pinned``), for the lineage's adapter identities, passthrough
        columns and table when the job has them (None otherwise). Read before the merge writes anything: another
        plan put back at ``_plan.json`` then fails the task before it merged, never after it sealed its merge."""
        if not (spec.model.adapters or spec.io.passthrough or spec.io.input_table):
            return None
        with data_plane_errors("merge"):
            return load_plan(
                spec, task_filesystems(self.aws_conn_id, self.gcp_conn_id), signing_keyring(), pinned=pinned
            )

    def _merge_lineage(self, spec: Any, summary: Any, plan: Plan | None) -> Any:
        """The lineage, with the plan's adapter identities and passthrough columns when the job has them (``plan``:
        the plan merge ran under, ``_lineage_plan``)."""
        if plan is None:
            return merge_lineage(spec, summary)
        return merge_lineage(spec, summary, plan.adapters, plan.passthrough, plan.table)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: the input location in; results and errors out, with row counts and columns; the run
        facet naming the model, revision, adapter, vLLM version and settings that produced them.

        Recorded by ``execute``.
        """
        from airflow_provider_vllm.utils.openlineage_facets import operator_lineage

        return operator_lineage(getattr(self, "_lineage", None))


def _reported_manifest(n: int, entry: Any) -> WorkerManifest:
    """The ``n``-th shard task XCom as the worker manifest that task pushed (AirflowFailException otherwise)."""
    try:
        m = entry if isinstance(entry, WorkerManifest) else read_manifest(entry)
    except ValidationError as e:
        raise AirflowFailException(
            f"merge: shard result {n} ({entry!r:.120}) is not a worker manifest ({e.error_count()} error(s): "
            f"{first_error(e)}); the shard tasks' XComs "
            "are the manifests their workers wrote: clear the shard tasks, then the merge"
        ) from None
    if not isinstance(m, WorkerManifest):
        raise AirflowFailException(f"merge: shard result {n} is a failed worker's manifest, not a committed shard's")
    return m
