"""The plan: the typed manifest (``_plan.json``) that plan writes and every shard and merge reads.

Pure data plus the one token estimate planner and worker must agree on; the planner that
builds it is ``steps.plan.planner``.
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
        return {
            "shard_id": self.shard_id,
            "index": self.index,
            "rows": self.rows,
            "est_tokens": self.est_tokens,
            "bucket": self.bucket,
        }


class CacheFile(BaseModel):
    """One file the plan wrote under ``_cache/`` (named by its content: ``hits-<sha16>.parquet``)."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="path under the output prefix")
    bytes: int
    sha256: str
    rows: int
    version: str = Field("", description="etag / generation / mtime when written (the worker checks it)")


class CachePlan(BaseModel):
    """The result cache as the plan applied it (``steps/cache/result_cache.py``); shards hold the misses only."""

    model_config = ConfigDict(extra="forbid")
    uri: str = Field(description="the cache folder")
    key_hash: str = Field(description="hash of the key config: everything but the row that decides an answer")
    key_config: dict[str, Any] = Field(description="what key_hash covers (model, weights, prompt, sampling, ...)")
    commits_read: list[str] = Field(description="entry ids of the committed cache entries joined against")
    rows: int = Field(description="input rows")
    hits: int = Field(description="rows answered from the cache")
    misses: int = Field(description="rows sent to the shards")
    hits_file: CacheFile = Field(description="id + cached answer columns + cached_from, in input order")
    misses_file: CacheFile = Field(description="the miss rows (id, template columns, key), in input order")
    misses_root: str = Field(description="folder of misses_file: the shards' input root")
    hit_est_tokens: int = Field(0, description="estimated prompt tokens of the hit rows (not inferred)")


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
    cache: CachePlan | None = Field(
        None, description="The result cache (cache.uri set): shards' segments then index the misses file."
    )

    def dump_json(self) -> bytes:
        """``_plan.json``'s bytes; ``cache`` only when set (plans without it stay as they were)."""
        return self.model_dump_json(indent=1, exclude={"cache"} if self.cache is None else None).encode()

    def input_files(self) -> list[InputFile]:
        return [InputFile(**f) for f in self.files]

    def shard_input(self) -> tuple[str, list[InputFile]]:
        """The shards' input root and files: the input, or with the cache the misses file alone."""
        if self.cache is None:
            return self.input_root, self.input_files()
        m = self.cache.misses_file
        name = m.path.rsplit("/", 1)[-1]
        return self.cache.misses_root, [InputFile(path=name, size=m.bytes, version=m.version)]

    def shard(self, shard_id: str) -> ShardPlan:
        for s in self.shards:
            if s.shard_id == shard_id:
                return s
        raise SpecError(f"shard {shard_id!r} is not in the plan")


def estimate_tokens(chars: np.ndarray | int, chars_per_token: float) -> np.ndarray:
    """Prompt-token estimate from characters (an int64 array; 0-d for an int); worker and planner must agree on it."""
    return np.ceil(np.asarray(chars, dtype=np.float64) / chars_per_token).astype(np.int64)


def load_plan(spec: JobSpec, filesystems: FileSystems | None = None) -> Plan:
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    if not out.exists(PLAN_FILE):
        raise SpecError(f"no plan at {out.uri(PLAN_FILE)}; run the plan step first")
    return Plan.model_validate_json(out.read_bytes(PLAN_FILE))
