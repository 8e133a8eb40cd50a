"""What every operator shares: loading the job spec, and mapping data-plane errors to Airflow.

Terminal data-plane errors (bad spec, bad dataset, failed verification) fail the task
without retry (``AirflowFailException``); transient ones are re-raised so Airflow retries.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import yaml
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from pydantic import ValidationError

from airflow_provider_vllm.core.errors import SpecError, VllmBatchError
from airflow_provider_vllm.core.plan import Plan, PlanRef, ShardSummary
from airflow_provider_vllm.core.spec import JobSpec, format_validation_error
from airflow_provider_vllm.core.spec_guard import local_model_path

SPEC_XCOM_KEY = "spec"
"""XCom key under which the plan task pushes the validated spec (a JSON-able dict)."""
PLAN_XCOM_KEY = "plan"
"""XCom key under which the plan task pushes the sealed plan's identity (``PlanRef.dump()``) for merge."""

RUNNERS = ("local", "kubernetes")


def spec_document(value: Any) -> dict[str, Any]:
    """A spec as a plain dict: from a dict, a JobSpec, or YAML/JSON text (``job:`` key optional)."""
    if isinstance(value, JobSpec):
        return value.model_dump(mode="json")
    doc = value
    if isinstance(value, (str, bytes)):
        try:
            doc = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise SpecError(f"job spec is not valid YAML or JSON: {e}") from None
    if isinstance(doc, Mapping) and "job" in doc and "model" not in doc:
        doc = doc["job"]
    if not isinstance(doc, Mapping):
        raise SpecError(f"job spec must be a mapping, got {type(doc).__name__}")
    return json.loads(json.dumps(doc, default=str))


def overrides_document(value: Any) -> dict[str, Any]:
    """Flat overrides (dotted keys or ``PARAM_ALIASES``) from a dict or YAML/JSON text; SpecError (no retry)
    naming them when the text does not parse."""
    if value is None or value == "":
        return {}
    try:
        doc = yaml.safe_load(value) if isinstance(value, (str, bytes)) else value
    except yaml.YAMLError as e:
        raise SpecError(
            f"spec overrides (the plan's overrides, e.g. the vllm_batch_spec_overrides Variable) are not valid "
            f"YAML or JSON: {e}"
        ) from None
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise SpecError(f"spec overrides must be a mapping, got {type(doc).__name__}")
    return dict(doc)


def load_spec(value: Any, what: str) -> JobSpec:
    """The spec a downstream task received as data (from the plan's XCom); fails without retry."""
    try:
        return JobSpec.load(value)
    except SpecError as e:
        raise AirflowFailException(f"{what}: {e}") from None


def check_runner(runner: Any, param: str = "runner") -> str:
    """The runner name, or a failure naming the param when it is unknown."""
    name = str(runner).strip()
    if name in RUNNERS:
        return name
    raise AirflowFailException(f"{param}={name!r} is not a runner; choose one of {list(RUNNERS)}")


def check_local_model(spec: JobSpec) -> None:
    """With the local runner, a model given as a local path must exist on this machine. What is local, and what
    is refused (a relative path, a hub id that also names a path relative to the working directory), is
    ``spec_guard.local_model_path``'s rule, the allow-list's."""
    name = spec.model.name
    try:
        local = local_model_path(name, "model.name")
    except SpecError as e:
        raise AirflowFailException(str(e)) from None
    if local is not None and not os.path.exists(local.removeprefix("file://")):
        raise AirflowFailException(
            f"model.name {name!r} is a local path that does not exist on this machine; "
            "prepare it first (e.g. python -m airflow_provider_vllm.testing.local_models smollm2)"
        )


@contextlib.contextmanager
def data_plane_errors(what: str) -> Iterator[None]:
    """Terminal VllmBatchError -> AirflowFailException (no retry); transient -> retried."""
    try:
        yield
    except VllmBatchError as e:
        if e.terminal:
            raise AirflowFailException(f"{what}: {type(e).__name__}: {e}") from e
        raise AirflowException(f"{what}: {type(e).__name__} (transient, retried): {e}") from e


def shard_summary(shard: Any) -> ShardSummary:
    """One item of the plan's return value (its JSON form, as XCom hands it to a mapped shard task), read
    through ``ShardSummary``; fails without retry, naming the field, when it is not one."""
    if isinstance(shard, ShardSummary):
        return shard
    try:
        return ShardSummary.model_validate(shard)
    except ValidationError as e:
        detail = format_validation_error(e).replace("invalid job spec", "not a shard of the plan")
        raise AirflowFailException(f"shard {shard!r:.200}: {detail}") from None


def shard_plan(shard: Any) -> dict[str, str]:
    """The sealed plan a shard task's worker must run under, as the plan task named it in its return value (XCom,
    which the bucket's writers cannot write): ``plan_mac`` and ``plan_sha256`` for ``ShardTask``. Fails without retry
    for a bare shard id, or a value of a run planned before per-role keys."""
    s = None if isinstance(shard, str) else shard_summary(shard)
    if s is None or s.plan_mac is None or s.plan_sha256 is None:
        raise AirflowFailException(
            f"shard {shard_id_of(shard)}: the plan task's value names no sealed plan (plan_mac, plan_sha256): a bare "
            "shard id, or a run planned by a version before per-role keys; run the job again from its plan task"
        )
    return {"plan_mac": s.plan_mac, "plan_sha256": s.plan_sha256}


def plan_ref(value: Any, what: str) -> PlanRef:
    """The sealed plan the plan task named in its value under ``PLAN_XCOM_KEY`` (XCom, which the bucket's writers
    cannot write), as ``PlanRef``; fails without retry when there is none (the task was built without it, or the run
    was planned by a version before merge took it: run the job again from its plan task) or it is no plan identity."""
    if value is None:
        raise AirflowFailException(
            f"{what}: no plan identity given (plan: the plan task's value under XCom key {PLAN_XCOM_KEY!r}, "
            f"plan_task.output[{PLAN_XCOM_KEY!r}]; vllm_batch_job passes it): {what} takes only the sealed plan the "
            "plan task wrote. A run planned by a version before this one: run the job again from its plan task"
        )
    try:
        return value if isinstance(value, PlanRef) else PlanRef.model_validate(value)
    except ValidationError as e:
        detail = (
            format_validation_error(e).replace("invalid job spec", "not a plan identity").replace("<spec>", "the value")
        )
        raise AirflowFailException(
            f"{what}: plan {value!r:.200}: {detail}. It is the plan task's value under XCom key {PLAN_XCOM_KEY!r} "
            f"(plan_task.output[{PLAN_XCOM_KEY!r}], a mapping of plan_mac and plan_sha256), not its return value (the "
            "shards)"
        ) from None


def load_shard_plan(spec: JobSpec, shard: Any, filesystems: Any = None) -> Plan:
    """The plan a shard task's worker will run under, as the shard task reads it on the Airflow side (the engine the
    plan keyed, a table's data files): exactly the sealed plan the plan task named in ``shard`` (``shard_plan``), never
    whatever sealed plan of the folder is at ``_plan.json`` now (an earlier one put back). CommitError (terminal)
    otherwise, as the worker's; AirflowFailException for a shard value that names no plan."""
    from airflow_provider_vllm.core.plan import load_pinned_plan

    ref = shard_plan(shard)
    return load_pinned_plan(spec, ref["plan_mac"], ref["plan_sha256"], filesystems)


def shard_id_of(shard: Any) -> str:
    """The shard id of one item of the plan's return value (``shard_summary``) or of a bare id."""
    return shard if isinstance(shard, str) else shard_summary(shard).shard_id
