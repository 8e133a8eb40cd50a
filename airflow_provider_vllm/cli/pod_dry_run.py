"""Print the pod a DAG's Kubernetes shard task would launch, without a cluster and without a run.

    python -m airflow_provider_vllm.cli.pod_dry_run DAG_ID LOGICAL_DATE [--map-index N] [--conf JSON]

Renders the DAG's plan task for that logical date the way ``airflow tasks render`` does
(same CLI helpers: DAG from the DAG folder and the metadata DB, Variables, params, macros),
builds and validates the job spec, unmaps the Kubernetes shard task for shard ``N`` and prints
its pod manifest (camelCase YAML, ready for ``kubectl apply --dry-run=server -f -``). The
shard id (and the plan seal the worker would run under) is an example unless ``--from-plan`` reads it from the
run's ``_plan.json``;
nothing is written, and no Kubernetes API is called. The DAG must be serialized in the
metadata DB (``airflow dags reserialize``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kubernetes.client import ApiClient


def _tasks(dag: Any) -> tuple[Any, Any]:
    """The plan task and the Kubernetes shard task (mapped) of the DAG's first vLLM batch job."""
    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator
    from airflow_provider_vllm.operators.plan import VllmPlanOperator

    plans = [t for t in dag.tasks if isinstance(t, VllmPlanOperator)]
    shards = [
        t
        for t in dag.tasks
        if getattr(t, "operator_class", None) is VllmKubernetesShardOperator
        or isinstance(t, VllmKubernetesShardOperator)
    ]
    if not plans or not shards:
        raise SystemExit(
            f"{dag.dag_id}: no Kubernetes shard task (build it with runner='kubernetes' or a templated runner)"
        )
    group = plans[0].task_id.rpartition(".")[0]
    shard = next((s for s in shards if s.task_id.rpartition(".")[0] == group), shards[0])
    return plans[0], shard


def _shard(spec: Any, map_index: int, from_plan: bool, filesystems: Any = None) -> tuple[dict[str, Any], str | None]:
    from airflow_provider_vllm.core.plan import ShardSummary, load_plan

    if not from_plan:
        example = ShardSummary(
            shard_id=f"shard-{map_index:05d}-00000000",
            index=map_index,
            rows=0,
            est_tokens=0,
            bucket="all",
            plan_mac="0" * 64,
            plan_sha256="0" * 64,
        )
        return example.dump(), "example shard id and plan seal (--from-plan reads the run's _plan.json)"

    from airflow.exceptions import AirflowFailException

    from airflow_provider_vllm.utils.deployment import signing_keyring

    try:  # the plan's seal checked with the deployment's key, as the plan task sealed it ([vllm_batch] signing_key)
        keyring = signing_keyring()
    except AirflowFailException as e:
        raise SystemExit(f"--from-plan: {e}") from None
    plan = load_plan(spec, filesystems, keyring=keyring)
    mapped = plan.mapped_shards()  # the input's shards, then the golden rows' (the mapped task's order)
    if map_index >= len(mapped):
        raise SystemExit(f"map index {map_index} out of range: the plan has {len(mapped)} shard(s)")
    return mapped[map_index].dump(), None


def _check_declared(plan: Any, dag: Any, params: dict[str, Any], conf: dict[str, Any]) -> None:
    """The plan task's rule for the run's conf (``VllmPlanOperator.check_declared``), as the plan's own dry run
    applies it: a ``--conf`` key the DAG declares no Param for is an error here too, not a pod of the defaults."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        plan.check_declared(params, {"dag": dag}, conf=conf)
    except AirflowFailException as e:
        raise SystemExit(f"--conf: {e}") from None


def render_shard_pod(
    dag_id: str, logical_date: str, *, map_index: int = 0, conf: dict[str, Any] | None = None, from_plan: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """(pod manifest, notes) for shard ``map_index`` of ``dag_id``'s run at ``logical_date``."""
    from airflow.cli.commands.task_command import _get_template_context, _get_ti
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
    from airflow.utils.cli import get_bagged_dag, get_db_dag

    from airflow_provider_vllm.utils.job_spec import check_runner

    sdk_dag = get_bagged_dag(None, dag_id)
    plan, mapped = _tasks(sdk_dag)
    ti, _ = _get_ti(
        get_db_dag(None, dag_id).get_task(plan.task_id),
        -1,
        logical_date_or_run_id=logical_date,
        create_if_necessary="memory",
    )
    context = _get_template_context(ti, plan)
    if conf:
        context["params"].update(conf)
    _check_declared(plan, sdk_dag, dict(context["params"]), conf or {})
    plan.render_template_fields(context)
    notes = []
    runner = check_runner(plan.runner)
    if runner != "kubernetes":
        notes.append(f"runner renders to {runner!r} for this run: the pod below is what runner=kubernetes launches")
    spec = plan.build_spec(dict(context["params"]))
    shard, note = _shard(spec, map_index, from_plan, plan.filesystems() if from_plan else None)
    if note:
        notes.append(note)
    op = mapped.unmap({"shard": shard}) if hasattr(mapped, "unmap") else mapped
    op.dag = sdk_dag
    shard_ti = RuntimeTaskInstance.model_construct(
        dag_id=dag_id, task_id=op.task_id, run_id=context["run_id"], try_number=1, map_index=map_index, task=op
    )
    shard_context = {**context, "ti": shard_ti, "task_instance": shard_ti, "task": op}
    op.spec = None  # data from the plan, never templated (a real run resolves the plan's XCom)
    op.render_template_fields(shard_context)
    op.spec = spec.model_dump(mode="json")
    op.shard = shard
    pod = op.build_pod_request_obj(shard_context, dry_run=True)
    from airflow_provider_vllm.utils.pod_spec import adapter_sources

    notes += adapter_sources(spec, op.settings(spec))  # the layered settings the pod above was built from
    return ApiClient().sanitize_for_serialization(pod), notes


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(
        prog="python -m airflow_provider_vllm.cli.pod_dry_run", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("dag_id")
    p.add_argument("logical_date", help="logical date (or run id) of the run to render")
    p.add_argument("--map-index", type=int, default=0, help="which shard (default 0)")
    p.add_argument("--conf", default=None, help="JSON object of DAG params for this run")
    p.add_argument("--from-plan", action="store_true", help="take the shard from the run's _plan.json")
    args = p.parse_args(argv)
    if args.map_index < 0:
        p.error(f"--map-index {args.map_index}: a map index is 0 or more (the mapped shard task's position)")
    conf = json.loads(args.conf) if args.conf else None
    # Airflow logs to stdout; stdout carries only the manifest, so everything else goes to stderr.
    sys.stdout.flush()
    manifest_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        manifest, notes = render_shard_pod(
            args.dag_id, args.logical_date, map_index=args.map_index, conf=conf, from_plan=args.from_plan
        )
    finally:
        sys.stdout.flush()
        os.dup2(manifest_fd, 1)
        os.close(manifest_fd)
    for n in notes:
        print(f"# note: {n}")
    print(yaml.safe_dump(manifest, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
