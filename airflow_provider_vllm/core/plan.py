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
    """The result cache as the plan applied it (``steps/cache.py``); shards hold the misses only."""

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


class GoldenPlan(BaseModel):
    """The golden rows that ride along (``qa.reference.ride_along_uri``), as the plan applied them.

    Their own input file (``_golden/input-<sha16>.parquet``: reserved ids, the template's columns and the
    known label) and their own shards (``golden-NNNNN-<hash>``), which the shard tasks run like any other
    and which merge verifies and publishes apart, under ``golden/`` (``steps/golden.py``). They are not
    in ``Plan.shards`` nor ``Plan.total_rows``: the input's exactly-once accounting never sees them.
    """

    model_config = ConfigDict(extra="forbid")
    uri: str = Field(description="qa.reference.ride_along_uri when planned")
    fingerprint: str = Field(description="fingerprint of its files (sizes and versions) when planned")
    root: str = Field(description="the folder of input_file (the golden shards' input root)")
    input_file: CacheFile = Field(description="the golden rows as the golden shards read them")
    rows: int = Field(description="golden rows (all labelled)")
    shards: list[ShardPlan] = Field(description="the golden shards, over input_file")

    def view(self, plan: Plan) -> Plan:
        """``plan`` as the golden shards see it: their input file, their shards, no cache, no golden rows."""
        name = self.input_file.path.rsplit("/", 1)[-1]
        f = InputFile(path=name, size=self.input_file.bytes, version=self.input_file.version)
        return plan.model_copy(
            update={
                "format": "parquet",
                "input_root": self.root,
                "files": [f.to_dict()],
                "total_rows": self.rows,
                "shards": self.shards,
                "long_row_tokens": None,
                "cache": None,
                "golden": None,
            }
        )


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
    golden: GoldenPlan | None = Field(
        None, description="Golden rows that ride along (qa.reference.ride_along_uri): their file and shards."
    )

    def dump_json(self) -> bytes:
        """``_plan.json``'s bytes; ``cache`` and ``golden`` only when set (plans without them stay as they were)."""
        unset = {k for k in ("cache", "golden") if getattr(self, k) is None}
        return self.model_dump_json(indent=1, exclude=unset or None).encode()

    def for_shard(self, shard_id: str) -> Plan:
        """The plan a shard's worker reads by: this one, or for a golden shard the golden rows' view."""
        if self.golden is not None and any(s.shard_id == shard_id for s in self.golden.shards):
            return self.golden.view(self)
        return self

    def mapped_shards(self) -> list[dict[str, Any]]:
        """Every shard a task runs, as ``ShardPlan.summary()``: the input's, then the golden rows' (``golden``)."""
        golden = [{**s.summary(), "golden": True} for s in self.golden.shards] if self.golden is not None else []
        return [s.summary() for s in self.shards] + golden

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


def estimate_tokens(chars: np.ndarray | int, chars_per_token: float) -> np.ndarray | int:
    """Prompt-token estimate from characters; worker and planner must agree on it."""
    return np.ceil(np.asarray(chars, dtype=np.float64) / chars_per_token).astype(np.int64)


def load_plan(spec: JobSpec, filesystems: FileSystems | None = None) -> Plan:
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    if not out.exists(PLAN_FILE):
        raise SpecError(f"no plan at {out.uri(PLAN_FILE)}; run the plan step first")
    return Plan.model_validate_json(out.read_bytes(PLAN_FILE))
