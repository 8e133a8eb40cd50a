"""The worker's one argument: a shard task, and the command line that carries it.

The local runner and the Kubernetes pod run exactly ``worker_command(task)``: the fixed
entrypoint plus one JSON argument, never through a shell, never re-templated.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import SHA256_PATTERN, SHARD_ID_PATTERN
from airflow_provider_vllm.core.spec import JobSpec, format_validation_error

ENTRYPOINT = ["-m", "airflow_provider_vllm.worker"]


class ShardTask(BaseModel):
    """Everything one worker process needs; the plan (``_plan.json``) holds the shard's rows.

    The worker holds no key that checks the plan's seal: the task names the plan (``plan_mac``, ``plan_sha256``), as
    the Airflow side checked it, and the worker takes ``_plan.json`` only when it is that record."""

    model_config = ConfigDict(extra="forbid")
    spec: JobSpec
    shard_id: str = Field(
        pattern=SHARD_ID_PATTERN,
        description="A shard id from the plan (golden-...: a shard of the golden rows that ride along).",
    )
    plan_mac: str = Field(
        pattern=SHA256_PATTERN,
        description="The seal (mac) of the plan the plan task wrote, from its XCom: the worker runs the shard only "
        "under that plan and seals its chunks and commit marker for it.",
    )
    plan_sha256: str = Field(
        pattern=SHA256_PATTERN,
        description="That sealed plan's digest (core/plan.plan_sha256): a _plan.json with another content is refused.",
    )
    attempt_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$", description="Default: generated per process."
    )
    progress_interval_s: float = Field(10.0, gt=0, description="Seconds between progress lines.")

    @classmethod
    def load(cls, data: Any) -> ShardTask:
        try:
            if isinstance(data, (str, bytes)):
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(format_validation_error(e).replace("invalid job spec", "invalid shard task")) from None


def worker_command(task: ShardTask, python: str | None = None) -> list[str]:
    """argv of the worker process: ``python -m airflow_provider_vllm.worker '<task json>'``."""
    return [python or sys.executable, *ENTRYPOINT, task.model_dump_json(exclude_none=True)]
