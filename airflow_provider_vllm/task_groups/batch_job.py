"""Wire a whole batch job into a DAG: plan -> shard x N -> merge -> qa -> [review] -> publish.

Usage, inside ``with DAG(...)``::

    from airflow_provider_vllm.task_groups.batch_job import vllm_batch_job

    vllm_batch_job({"model": {"name": "..."}, "io": {"input_uri": ".../dt={{ ds }}/", ...}, ...})

Nothing here does I/O: the spec is rendered and validated at run time by the plan task.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import Asset, BaseOperator, TaskGroup

from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.operators import (
    VllmLocalShardOperator,
    VllmMergeOperator,
    VllmPlanOperator,
    VllmPublishOperator,
    VllmQAOperator,
    VllmQAReviewOperator,
)
from airflow_provider_vllm.operators.kubernetes import SETTINGS_VARIABLE, VllmKubernetesShardOperator
from airflow_provider_vllm.operators.runner_branch import VllmRunnerBranchOperator
from airflow_provider_vllm.utils.job_spec import PLAN_XCOM_KEY, RUNNERS, SPEC_XCOM_KEY

# "shard 3/8 rows 1200-1599" (see shard_names); the id when a plan predates the names.
SHARD_MAP_INDEX_TEMPLATE = "{{ task.shard.get('name') or task.shard['shard_id'] }}"
KUBERNETES_SETTINGS_TEMPLATE = "{{ var.value.get('%s', '{}') }}" % SETTINGS_VARIABLE
"""Default pod settings of the Kubernetes runner: the ``vllm_batch_kubernetes`` Variable, read at run time."""
_JINJA = re.compile(r"{{|{%")
FORBIDDEN_SHARD_TASK_KWARGS = frozenset(
    {
        # identity and wiring of the mapped task
        "task_id",
        "map_index_template",
        "task_group",
        "dag",
        "shard",
        "expand",
        "trigger_rule",
        "do_xcom_push",
        "multiple_outputs",
        "inlets",
        "outlets",
        "default_args",
        # what runs: the spec and the worker command
        "spec",
        "python",
        "env",
        "progress_interval_s",
        "kubernetes",
        "cmds",
        "arguments",
        "image",
        "env_vars",
        "env_from",
        "secrets",
        "volumes",
        "volume_mounts",
        # pod identity and trust (deployment-owned: docs/security.md)
        "service_account_name",
        "namespace",
        "in_cluster",
        "kubernetes_conn_id",
        "cluster_context",
        "config_file",
        "security_context",
        "container_security_context",
        "automount_service_account_token",
        "host_network",
        "pod_template_file",
        "pod_template_dict",
        "full_pod_spec",
        "labels",
        "annotations",
        "name",
        "trust",
        "trusted",
        "run_as_user",
        "aws_conn_id",
        "gcp_conn_id",
    }
)
"""Keys ``shard_task_kwargs`` refuses: they belong to the builder, the spec or the deployment."""
FORBIDDEN_KUBERNETES_OPERATOR_KWARGS = frozenset({"pod_template_dict", "full_pod_spec", "pod_template_file"})
"""Keys ``kubernetes_operator_kwargs`` refuses: pod spec parts outside the checked ``KubernetesSettings`` (a pod
template goes in the deployment's settings, ``kubernetes.pod_template_file``)."""


def vllm_batch_job(
    spec: Mapping[str, Any] | str | JobSpec,
    *,
    group_id: str = "vllm_batch",
    overrides: Mapping[str, Any] | str | None = None,
    param_overrides: Sequence[str] = (),
    runner: str = "local",
    asset: Asset | str | None = None,
    shard_retries: int = 2,
    shard_retry_delay: timedelta | None = None,
    shard_env: Mapping[str, str] | None = None,
    max_active_shards: int | None = None,
    shard_task_kwargs: Mapping[str, Any] | None = None,
    progress_interval_s: float = 10.0,
    before_publish: Callable[[Any], Any] | None = None,
    publish_extra_files: Mapping[str, str] | None = None,
    kubernetes: Mapping[str, Any] | str | None = KUBERNETES_SETTINGS_TEMPLATE,
    kubernetes_operator_kwargs: Mapping[str, Any] | None = None,
    human_review: bool | str = True,
    output_under: str | None = None,
    review_timeout: timedelta | None = timedelta(hours=12),
    review_notifiers: Sequence[Any] | None = None,
    aws_conn_id: str | None = None,
    gcp_conn_id: str | None = None,
    kubernetes_conn_id: str | None = None,
    namespace: str | None = None,
    in_cluster: bool | None = None,
) -> TaskGroup:
    """Add one batch inference job to the current DAG; returns its TaskGroup.

    :param spec: the job spec: a dict (Jinja allowed in any string), YAML/JSON text (e.g.
        ``"{% include 'job.yaml' %}"`` for a file beside the DAG), or a ``JobSpec``. Rendered and validated at
        run time by the plan task, then handed to the other tasks as data (XCom).
    :param overrides: flat overrides (dotted keys or ``JobSpec`` param aliases), templated.
    :param param_overrides: DAG params applied over the spec (typed; ``None`` = keep); never a
        deployment-owned setting (``spec_guard.DEPLOYMENT_OWNED``: a ValueError at parse time). Each must be a
        ``Param`` the DAG declares: a value for an undeclared one came from the run's conf and fails the plan.
    :param runner: ``"local"`` (a subprocess per shard on the Airflow worker), ``"kubernetes"``
        (a pod per shard, ``VllmKubernetesShardOperator``), or a template such as
        ``"{{ params.runner }}"`` checked by the plan task: then both shard tasks are in the
        DAG (``shard`` and ``shard_kubernetes``) and a ``runner`` branch task after the plan
        follows the chosen one; the other is skipped.
    :param asset: the Asset the publish task updates (default: the output URI when it is
        static, else ``x-vllm-batch://<group_id>``); the event's extra names the output URI.
        When the input URI is static, the plan task has it as an inlet Asset (``s3://``,
        ``gs://``, ``file://``).
    :param shard_retries, shard_retry_delay: for the mapped shard task (delay default:
        Airflow's ``[core] default_task_retry_delay``).
    :param shard_env: extra environment for the worker processes (templated).
    :param max_active_shards: at most this many shards of one run at once.
    :param shard_task_kwargs: more ``BaseOperator`` arguments for the mapped shard task(s) of
        either runner (``pool``, ``pool_slots``, ``queue``, ``executor_config``, ``priority_weight``,
        ``weight_rule``, ``execution_timeout``, ...); they win over ``shard_retries`` /
        ``shard_retry_delay`` / ``max_active_shards``. Keys that would break the job's contract
        (``FORBIDDEN_SHARD_TASK_KWARGS``: task id, map index, the spec, the worker command, pod
        identity and settings) are a ValueError naming them.
    :param before_publish: called with the spec XComArg inside the group; what it returns
        (tasks or XComArgs) runs after QA and before publish.
    :param publish_extra_files: name -> path under the output prefix, listed in ``_SUCCESS.json``.
    :param kubernetes: Kubernetes runner: defaults for the pods (``KubernetesSettings`` fields as a
        dict or JSON text, templated; default the ``vllm_batch_kubernetes`` Variable), over the
        deployment's ``[vllm_batch] kubernetes_defaults``. The job spec's ``kubernetes`` section wins
        over them. ``shard_env`` joins their ``env``. Deployment-owned fields (image, namespace,
        service account, env, Secrets, PVCs, ...) set here through a Variable need
        ``[vllm_batch] deployment_settings_from_variables``; through params they are refused.
    :param kubernetes_operator_kwargs: more ``KubernetesPodOperator`` arguments for the shard
        task (e.g. ``kubernetes_conn_id``, ``deferrable``). The cluster and its credentials
        (``kubernetes_conn_id``, ``config_file``, ``cluster_context``, ``in_cluster``) are DAG-file
        settings: not templated, and a template over trigger values fails the shard task. Pod spec parts
        the provider does not check (``FORBIDDEN_KUBERNETES_OPERATOR_KWARGS``: ``pod_template_dict``,
        ``full_pod_spec``, ``pod_template_file``) are a ValueError; a pod template goes in the settings.
    :param output_under: a folder every run of this job must write inside (``io.output_uri`` strictly below it),
        or the plan fails without retry. For a DAG whose form or conf may set the output (``param_overrides`` with
        ``output_uri``): without it a trigger may write wherever the allow-list lets it, another job's folders
        included (a nightly's next date), unless ``[vllm_batch] scheduled_output_prefixes`` names them. The DAG
        file's (a template may read Variables, never params, the conf or the run id).
    :param human_review: add the ``review`` task after QA: a 'warn' verdict waits for a person to
        approve (publish) or reject (the run fails, nothing published); 'pass' goes on without
        asking. False: no review task (fully automatic: a 'warn' is logged and published). A
        template (e.g. ``"{{ var.value.get('vllm_batch_human_review', 'true') }}"``) keeps the
        task and decides at run time, but may only turn asking *off* where the DAG file chose so: a template
        that reads a Variable only with ``[vllm_batch] qa_settings_from_variables = True``, one over trigger
        params never (the plan task fails without retry, naming it, and the review task checks again when it
        decides; docs/security.md).
    :param review_timeout: how long a 'warn' waits for a decision; then the review task fails
        and nothing is published (clear the task to ask again). ``None`` waits for ever.
    :param review_notifiers: Airflow notifiers (e.g. a Slack or SMTP notifier) told when a
        decision is needed; the request carries the QA summary and a link to the report.
    :param aws_conn_id, gcp_conn_id: the Airflow Connections through which plan, the local
        shards, merge, QA and publish reach ``s3://`` / ``gs://`` (the amazon / google providers'
        fsspec helpers; the local worker gets the identity through its environment). DAG-file
        settings, never trigger params; None: ``[vllm_batch] aws_conn_id`` / ``gcp_conn_id``,
        else ``aws_default`` / ``google_cloud_default``. Pods use workload identity or Secret
        references instead (docs/kubernetes.md).
    :param kubernetes_conn_id, namespace, in_cluster: Kubernetes runner: the cluster Connection,
        the pods' namespace and whether Airflow runs inside that cluster (``KubernetesPodOperator``
        arguments; None: KPO's defaults, ``kubernetes_default``). They win over the same keys in
        ``kubernetes_operator_kwargs``.
    """
    runner_name = str(runner).strip()
    static = runner_name in RUNNERS
    if not static and not _JINJA.search(runner_name):
        raise ValueError(f"runner={runner_name!r}: choose one of {list(RUNNERS)} or a template")
    if isinstance(spec, JobSpec):
        spec = spec.model_dump(mode="json")
    if asset is None:
        asset = _default_asset(spec, group_id)
    elif isinstance(asset, str):
        asset = Asset(uri=asset)
    shard_kwargs = checked_shard_task_kwargs(shard_task_kwargs)
    pod_kwargs = checked_kubernetes_operator_kwargs(kubernetes_operator_kwargs)
    source = _static_asset(spec.get("io", {}).get("input_uri") if isinstance(spec, Mapping) else None)

    with TaskGroup(group_id, tooltip="vLLM batch job: plan -> shards -> merge -> QA -> review -> publish") as group:
        conns = {"aws_conn_id": aws_conn_id, "gcp_conn_id": gcp_conn_id}
        plan = VllmPlanOperator(
            task_id="plan",
            spec=spec,
            overrides=overrides,
            param_overrides=param_overrides,
            runner=runner,
            kubernetes=kubernetes,
            shard_env=dict(shard_env) if shard_env else None,
            # changes.previous_published (set in the DAG file's spec): the Asset's events are read as an inlet
            inlets=[a for a in (source, asset if _compares_with_published(spec) else None) if a is not None],
            published_asset=asset,
            publish_task_id=group.child_id("publish"),
            # the review's ask, checked before any shard runs: a Variable or trigger may not turn it off
            review_ask=None if human_review is False else human_review,
            output_under=output_under,
            **conns,
        )
        job = plan.output[SPEC_XCOM_KEY]
        common = dict(
            spec=job,
            progress_interval_s=progress_interval_s,
            retries=shard_retries,
            map_index_template=SHARD_MAP_INDEX_TEMPLATE,
            max_active_tis_per_dagrun=max_active_shards,
            **({"retry_delay": shard_retry_delay} if shard_retry_delay is not None else {}),
        )
        common.update(shard_kwargs)
        env = dict(shard_env) if shard_env else None
        cluster = {
            **pod_kwargs,
            **{
                k: v
                for k, v in {
                    "kubernetes_conn_id": kubernetes_conn_id,
                    "namespace": namespace,
                    "in_cluster": in_cluster,
                }.items()
                if v is not None
            },
        }
        shard_tasks = {}
        for name in [runner_name] if static else RUNNERS:
            if name == "local":
                op = VllmLocalShardOperator.partial(task_id="shard", env=env, **common, **conns)
            else:
                op = VllmKubernetesShardOperator.partial(
                    task_id="shard" if static else "shard_kubernetes",
                    kubernetes=kubernetes,
                    env=env,
                    **common,
                    **cluster,
                )
            shard_tasks[name] = op.expand(shard=plan.output)
        if not static:  # chosen at run time: the other runner's shard task is skipped whole
            branch = VllmRunnerBranchOperator(
                task_id="runner", runner=runner, shard_tasks={n: t.task_id for n, t in shard_tasks.items()}
            )
            plan >> branch >> list(shard_tasks.values())
        # An empty input plans zero shards (the mapped task is skipped) and merge still runs after
        # plan's success; a dry run skips plan, and then merge is skipped too.
        merge = VllmMergeOperator(
            task_id="merge",
            spec=job,
            # the sealed plan the plan task wrote: no other sealed plan of the folder (put back) is merged under
            plan=plan.output[PLAN_XCOM_KEY],
            trigger_rule="none_failed_min_one_success",
            # the attempt each shard task committed (its XCom): no earlier genuine marker put back is merged
            shard_results=[t.output for t in shard_tasks.values()],
            require_shard_results=True,
            **conns,
        )
        # each step takes the sealed record the step before wrote (its XCom), not an earlier one put back
        qa = VllmQAOperator(task_id="qa", spec=job, merge_result=merge.output, require_merge_result=True, **conns)
        list(shard_tasks.values()) >> merge
        merge >> qa
        gate = qa
        if human_review is not False:
            gate = VllmQAReviewOperator(
                task_id="review",
                spec=job,  # where the sealed verdict lies: what the person is shown and what is decided on
                qa_result=qa.output,
                qa_task_id=qa.task_id,
                ask=human_review,
                response_timeout=review_timeout,
                notifiers=review_notifiers,
                **conns,
            )
            qa >> gate
        publish = VllmPublishOperator(
            task_id="publish",
            spec=job,
            qa_result=qa.output,  # the verdict this run's QA wrote, through the metadata database
            require_qa_result=True,
            # the approval names the verdict it approved: publish takes no other (QA run again alone after it)
            review_result=gate.output if gate is not qa else None,
            require_review_result=gate is not qa,
            outlets=[asset],
            **conns,
            extra_files=dict(publish_extra_files) if publish_extra_files else None,
        )
        if before_publish is not None:
            extra = before_publish(job)
            gate >> extra >> publish
        else:
            gate >> publish
    return group


def checked_shard_task_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``shard_task_kwargs`` as a dict; a ValueError naming any key the builder owns."""
    given = dict(kwargs or {})
    bad = sorted(k for k in given if k in FORBIDDEN_SHARD_TASK_KWARGS)
    if bad:
        raise ValueError(
            f"shard_task_kwargs {bad}: set by vllm_batch_job and the job spec, not per task "
            f"(refused: {sorted(FORBIDDEN_SHARD_TASK_KWARGS)})"
        )
    allowed = inspect.signature(BaseOperator.__init__).parameters
    unknown = sorted(k for k in given if k not in allowed or k in ("self", "kwargs"))
    if unknown:
        raise ValueError(
            f"shard_task_kwargs {unknown}: not BaseOperator arguments (Kubernetes pod arguments go "
            "in kubernetes_operator_kwargs)"
        )
    return given


def checked_kubernetes_operator_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``kubernetes_operator_kwargs`` as a dict; a ValueError naming any pod spec part the provider does not check."""
    given = dict(kwargs or {})
    bad = sorted(k for k in given if k in FORBIDDEN_KUBERNETES_OPERATOR_KWARGS)
    if bad:
        raise ValueError(
            f"kubernetes_operator_kwargs {bad}: pod spec parts the provider does not check; the pod comes from the "
            "job spec and the deployment's kubernetes settings (a pod template: kubernetes.pod_template_file in "
            "[vllm_batch] kubernetes_defaults)"
        )
    return given


def _compares_with_published(spec: Any) -> bool:
    """Whether the DAG file's spec sets ``changes.previous_published`` (a templated spec: not known here)."""
    changes = spec.get("changes") if isinstance(spec, Mapping) else None
    return isinstance(changes, Mapping) and changes.get("previous_published") is True


def _static_asset(uri: Any) -> Asset | None:
    """The Asset of a location known when the DAG is parsed (no template): s3://, gs://, file://."""
    if isinstance(uri, str) and uri.strip() and not _JINJA.search(uri):
        if "://" in uri:
            return Asset(uri=uri.rstrip("/"))
        if uri.startswith("/"):
            return Asset(uri=f"file://{uri.rstrip('/')}")
    return None


def _default_asset(spec: Any, group_id: str) -> Asset:
    asset = _static_asset(spec.get("io", {}).get("output_uri") if isinstance(spec, Mapping) else None)
    return asset if asset is not None else Asset(uri=f"x-vllm-batch://{group_id}")


def _path_safe(value: Any) -> str:
    """One path segment for ``value`` (a run id): its readable part, then 16 hex digits of its SHA-256.

    Never empty, never ``.`` or ``..``, and two values give two segments (a run id the trigger chooses, such
    as ``-`` or ``:``, kept nothing readable and made a re-run's default output the shared ``reruns`` folder;
    ``a:b`` and ``a+b`` shared one)."""
    raw = str(value)
    readable = re.sub(r"[^A-Za-z0-9_.=-]+", "-", raw).strip("-.")[:100].rstrip("-.")
    digest = hashlib.sha256(raw.encode()).hexdigest()[:16]
    return f"{readable}-{digest}" if readable else digest


TEMPLATE_FILTERS: dict[str, Callable[..., str]] = {"path_safe": _path_safe}
"""``user_defined_filters``: ``{{ run_id | path_safe }}`` -> one path segment, distinct per value (a hash)."""
