"""The plan: the typed manifest (``_plan.json``) that plan writes and every shard and merge reads.

Pure data plus the one token estimate planner and worker must agree on; the planner that
builds it is ``steps.plan.planner``.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.adapters import AdapterRef
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.formats.files import InputFile
from airflow_provider_vllm.core.records import FileRef
from airflow_provider_vllm.core.rows import decode_schema, error_schema, result_schema
from airflow_provider_vllm.core.seal import Keyring, Seal
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
    input_file: FileRef | None = Field(
        None,
        description="With the result cache: the shard's own input file (its miss rows, in order) under the "
        "output prefix; the worker reads exactly these bytes (size and sha256 checked) and its segments index it",
    )

    def summary(self) -> dict[str, Any]:
        """The small dict passed through XCom to each mapped shard task."""
        return {
            "shard_id": self.shard_id,
            "index": self.index,
            "rows": self.rows,
            "est_tokens": self.est_tokens,
            "bucket": self.bucket,
        }


class CacheFile(FileRef):
    """One file the plan wrote under ``_cache/`` (named by its content: ``hits-<sha16>.parquet``)."""

    version: str = Field("", description="etag / generation / mtime when written")


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
    misses_root: str = Field(description="folder of the shards' input files (ShardPlan.input_file): the miss rows")
    hit_est_tokens: int = Field(0, description="estimated prompt tokens of the hit rows (not inferred)")


class Passthrough(BaseModel):
    """The input columns copied into results/ and errors/ (``io.passthrough``), as the plan resolved them."""

    model_config = ConfigDict(extra="forbid")
    columns: list[str] = Field(description="input column names, in the order they are appended")
    names: list[str] = Field(description="their names in results/ and errors/ (io.passthrough_prefix + column)")
    schema_ipc: str = Field(description="their fields as published (Arrow IPC schema, base64; core.rows.encode_schema)")
    types: list[str] = Field(description="their Arrow types, readable")

    def schema(self) -> pa.Schema:
        """The passthrough fields under their published names and the input's types."""
        return decode_schema(self.schema_ipc)


class Plan(BaseModel):
    """``_plan.json``: written once (create-only) and sealed by the plan task (``core/seal.py``, domain ``plan``,
    scope the output URI); every reader checks the seal (``load_plan``)."""

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
        None, description="The result cache (cache.uri set): shards then read their own input files of misses."
    )
    passthrough: Passthrough | None = Field(
        None, description="io.passthrough resolved against the input: the columns the parts carry, and their types"
    )
    adapters: list[AdapterRef] = Field(
        default_factory=list, description="the job's LoRA adapters and their identities (core/adapters.py)"
    )
    seal: Seal | None = Field(None, description="the plan task's seal (core/seal.py): what every reader checks")

    def passthrough_schema(self) -> pa.Schema | None:
        return self.passthrough.schema() if self.passthrough is not None else None

    def result_schema(self) -> pa.Schema:
        """The schema of this run's ``results/`` parts (``core.rows.result_schema``)."""
        return result_schema(self.passthrough_schema())

    def error_schema(self) -> pa.Schema:
        """The schema of this run's ``errors/`` parts (``core.rows.error_schema``)."""
        return error_schema(self.passthrough_schema())

    def dump_json(self) -> bytes:
        """``_plan.json``'s bytes: the fields that were set, and the seal."""
        return seals.record_bytes(self)

    def sealed(self, keyring: Keyring, output_uri: str) -> Plan:
        """This plan sealed for the run at ``output_uri``."""
        return seals.seal_record(keyring, seals.PLAN, seals.scope_of(output_uri), self)

    def verify(self, keyring: Keyring, output_uri: str) -> None:
        """SealError unless the plan task of this deployment wrote this plan for the run at ``output_uri``."""
        where = f"{output_uri.rstrip('/')}/{PLAN_FILE}"
        seals.verify_record(keyring, seals.PLAN, seals.scope_of(output_uri), self, f"the plan {where}")

    def input_files(self) -> list[InputFile]:
        return [InputFile(**f) for f in self.files]

    def shard_input(self, shard: ShardPlan) -> tuple[str, list[InputFile]]:
        """The shard's input root and files (its segments index them): the input, or the shard's own input file."""
        if shard.input_file is None:
            return self.input_root, self.input_files()
        f = shard.input_file
        root, name = self.cache.misses_root if self.cache else "", f.path.rsplit("/", 1)[-1]
        return root, [InputFile(path=name, size=f.bytes, version="")]

    def shard(self, shard_id: str) -> ShardPlan:
        for s in self.shards:
            if s.shard_id == shard_id:
                return s
        raise SpecError(f"shard {shard_id!r} is not in the plan")


def estimate_tokens(chars: np.ndarray | int, chars_per_token: float) -> np.ndarray:
    """Prompt-token estimate from characters (an int64 array; 0-d for an int); worker and planner must agree on it."""
    return np.ceil(np.asarray(chars, dtype=np.float64) / chars_per_token).astype(np.int64)


def load_plan(spec: JobSpec, filesystems: FileSystems | None = None, keyring: Keyring | None = None) -> Plan:
    """The run's plan, its seal checked (``keyring`` default: the worker's, ``VLLM_BATCH_SIGNING_KEY``).

    SpecError when there is none; SealError when this deployment's plan task did not write it for this run.
    """
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    if not out.exists(PLAN_FILE):
        raise SpecError(f"no plan at {out.uri(PLAN_FILE)}; run the plan step first")
    plan = Plan.model_validate_json(out.read_bytes(PLAN_FILE))
    plan.verify(keyring or Keyring.from_env(), spec.io.output_uri)
    return plan
