"""The plan: the typed manifest (``_plan.json``) that plan writes and every shard and merge reads.

Pure data plus the one token estimate planner and worker must agree on; the planner that
builds it is ``steps.plan``.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.formats.files import InputFile
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage

PLAN_FILE = "_plan.json"


class Segment(BaseModel):
    """Rows [start, start+count) of one input file (JSONL: from byte ``offset``, line ``line``)."""

    model_config = ConfigDict(extra="forbid")
    file: int = Field(description="Index into Plan.files.")
    start: int
    count: int
    offset: int = 0
    line: int = 1


class ShardPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shard_id: str
    index: int
    bucket: Literal["all", "short", "long"] = Field(description="short/long: only rows of that length class.")
    rows: int
    est_tokens: int
    segments: list[Segment]

    def summary(self) -> dict[str, Any]:
        """The small dict passed through XCom to each mapped shard task."""
        return {"shard_id": self.shard_id, "index": self.index, "rows": self.rows,
                "est_tokens": self.est_tokens, "bucket": self.bucket}


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = 1
    spec_hash: str
    config_hash: str
    input_uri: str
    input_root: str
    format: Literal["parquet", "jsonl", "openai_batch"]
    files: list[dict[str, Any]]
    fingerprint: str
    total_rows: int
    invalid_lines: int = 0
    est_tokens: int
    long_row_tokens: int | None = None
    chars_per_token: float
    shards: list[ShardPlan]
    created_with: dict[str, str]
    sizing: dict[str, Any] | None = Field(None, description="How shards were sized from throughput history.")

    def input_files(self) -> list[InputFile]:
        return [InputFile(**f) for f in self.files]

    def shard(self, shard_id: str) -> ShardPlan:
        for s in self.shards:
            if s.shard_id == shard_id:
                return s
        raise SpecError(f"shard {shard_id!r} is not in the plan")


def estimate_tokens(chars: np.ndarray | int, chars_per_token: float) -> np.ndarray | int:
    """Prompt-token estimate from characters; worker and planner must agree on it."""
    return np.ceil(np.asarray(chars, dtype=np.float64) / chars_per_token).astype(np.int64)


def load_plan(spec: JobSpec, filesystems: FileSystems | None = None) -> Plan:
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    if not out.exists(PLAN_FILE):
        raise SpecError(f"no plan at {out.uri(PLAN_FILE)}; run the plan step first")
    return Plan.model_validate_json(out.read_bytes(PLAN_FILE))
