"""The worker's one argument: a shard task, and the command line that carries it.

The local runner and the Kubernetes pod run exactly ``worker_command(task)``: the fixed
entrypoint plus one JSON argument, never through a shell, never re-templated.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import SHARD_ID_PATTERN
from airflow_provider_vllm.core.spec import JobSpec, format_validation_error

ENTRYPOINT = ["-m", "airflow_provider_vllm.worker"]


class ShardTask(BaseModel):
    """Everything one worker process needs; the plan (``_plan.json``) holds the shard's rows."""

    model_config = ConfigDict(extra="forbid")
    spec: JobSpec
    shard_id: str = Field(
        pattern=SHARD_ID_PATTERN,
        description="A shard id from the plan (golden-...: a shard of the golden rows that ride along).",
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
