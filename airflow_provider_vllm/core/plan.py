"""The plan: the typed manifest (``_plan.json``) that plan writes and every shard and merge reads.

Pure data plus the one token estimate planner and worker must agree on; the planner that
builds it is ``steps.plan.planner``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.adapters import AdapterRef
from airflow_provider_vllm.core.errors import CommitError, InputChangedError, SpecError
from airflow_provider_vllm.core.formats.files import InputFile
from airflow_provider_vllm.core.records import FileRef, MergeSummary, PinnedFile
from airflow_provider_vllm.core.rows import decode_schema, error_schema, result_schema
from airflow_provider_vllm.core.seal import Keyring, Seal
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage
from airflow_provider_vllm.core.weights import WeightsPin

PLAN_FILE = "_plan.json"


class Segment(BaseModel):
    """Rows [start, start+count) of one input file (JSONL: from byte ``offset``, line ``line``)."""

    model_config = ConfigDict(extra="forbid")
    file: int = Field(description="Index into Plan.files.")
    start: int
    count: int
    offset: int = 0
    line: int = 1


SHARD_ID_PATTERN = r"^(shard|golden)-\d{5}-[0-9a-f]{8}$"  # golden-...: the golden rows' shards
SHA256_PATTERN = r"^[0-9a-f]{64}$"


class ShardSummary(BaseModel):
    """One item of the plan task's return value: what each mapped shard task receives (``.expand(shard=...)``).

    It crosses XCom as JSON; ``dump()`` gives the shape the plan task has always pushed (``shard_id``,
    ``index``, ``rows``, ``est_tokens``, ``bucket``, and ``name`` once the plan task named the shards), so
    that the XComs of runs started before this model still validate. Unknown fields are refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    shard_id: str = Field(pattern=SHARD_ID_PATTERN, description="the shard's id in the plan")
    index: int = Field(ge=0, description="the shard's position in the plan (the mapped task's map index)")
    rows: int = Field(ge=0, description="rows of the shard")
    est_tokens: int = Field(ge=0, description="estimated prompt tokens of the shard's rows")
    bucket: Literal["all", "short", "long"] = Field(description="short/long: only rows of that length class")
    name: str | None = Field(
        None, max_length=200, description="the mapped task's display name (core/shard_names.py); absent before"
    )
    golden: Literal[True] | None = Field(
        None, description="a shard of the golden rows that ride along (qa.reference.ride_along_uri); absent else"
    )
    plan_mac: str | None = Field(
        None,
        pattern=SHA256_PATTERN,
        description="the seal (mac) of the plan the plan task wrote: the shard's worker runs only under that plan; "
        "absent in the values of runs planned before per-role keys (their shard tasks fail: plan again)",
    )
    plan_sha256: str | None = Field(
        None, pattern=SHA256_PATTERN, description="that sealed plan's digest (``plan_sha256``): its content"
    )

    def dump(self) -> dict[str, Any]:
        """The XCom value: JSON data, ``name`` left out while it is unset."""
        return self.model_dump(mode="json", exclude_none=True)


class PlanRef(BaseModel):
    """A sealed plan's identity as the plan task hands it to the tasks after it (XCom, which the bucket's writers
    cannot write): its seal's mac and ``plan_sha256``. Merge takes ``_plan.json`` only when it is this plan
    (``load_plan(pinned=...)``); ``ShardSummary`` carries the same two fields for each shard task's worker."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    plan_mac: str = Field(pattern=SHA256_PATTERN, description="the seal (mac) of the plan the plan task wrote")
    plan_sha256: str = Field(pattern=SHA256_PATTERN, description="that sealed plan's digest (``plan_sha256``)")

    def dump(self) -> dict[str, str]:
        """The XCom value: ``plan_mac`` and ``plan_sha256``."""
        return self.model_dump(mode="json")

    def describe(self) -> str:
        """The identity, short, for messages: the seal's and the digest's first 12 hex digits."""
        return f"seal {self.plan_mac[:12]}, sha256 {self.plan_sha256[:12]}"


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
        description="With the result cache or repeated prompts (dedupe): the shard's own input file (the rows it "
        "infers, in order) under the output prefix; the worker reads exactly these bytes (size and sha256 checked) "
        "and its segments index it",
    )

    def summary(self) -> ShardSummary:
        """What each mapped shard task receives (through XCom, as ``ShardSummary.dump()``)."""
        return ShardSummary(
            shard_id=self.shard_id, index=self.index, rows=self.rows, est_tokens=self.est_tokens, bucket=self.bucket
        )


class Evidence(BaseModel):
    """Pooled throughput of the throughput-history records that match a job (``steps/plan/sizing.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    basis: Literal["config", "model"] = Field(
        description="config: records of the same job configuration; model: same model, task and hardware"
    )
    hardware: str = Field(description="the hardware of the records, e.g. '1x NVIDIA H200'")
    records: int = Field(description="history records pooled")
    rows: int = Field(description="rows those records inferred")
    infer_s: float = Field(description="their inference seconds")
    rows_per_s: float = Field(description="rows / infer_s")
    tokens_per_s: float = Field(description="(prompt + completion tokens) / infer_s, per model replica")
    prompt_tokens_per_row: float = Field(description="prompt tokens per row")
    completion_tokens_per_row: float = Field(description="completion tokens per row")
    engine_start_s: float | None = Field(description="median engine start, seconds (None: not recorded)")
    engine_start_warm_s: float | None = Field(
        None, description="median start of shards that restored a shared compile cache (None: none recorded)"
    )
    engine_start_cold_s: float | None = Field(
        None, description="median start of shards that compiled with a shared compile cache on (None: none recorded)"
    )

    def rounded(self) -> Evidence:
        """The same evidence, floats rounded to 4 places (as the plan stores it)."""
        return self.model_copy(update={k: round(v, 4) for k, v in self.model_dump().items() if isinstance(v, float)})


class Sizing(BaseModel):
    """How the plan was sized from the throughput history (``_plan.json``'s ``sizing``; ``steps/plan/sizing.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    shards: int = Field(description="shards the history's throughput asks for")
    target_rows: int | None = Field(description="rows per shard that gives (None: sized by tokens)")
    target_tokens: int | None = Field(description="estimated tokens per shard that gives (None: sized by rows)")
    target_s: float = Field(description="target seconds per shard, engine start included")
    est_infer_s: float = Field(description="estimated inference seconds of the whole job")
    engine_start_s: float = Field(description="engine start per shard, seconds")
    engine_start_basis: str | None = Field(
        None,
        description="where engine_start_s comes from: history:warm / history:cold (the shards' starts with and "
        "without a restored compile cache), history (all starts), assumed:warm / assumed:cold",
    )
    evidence: Evidence = Field(description="the history it was sized from (floats rounded to 4 places)")

    def sharding_update(self) -> dict[str, Any]:
        """The sharding fields the plan is cut with."""
        return {"target_rows": self.target_rows, "target_tokens": self.target_tokens}


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
    hits_file: CacheFile = Field(
        description="id + cached answer columns + cached_from, in the cache entries' order (steps/cache/matching.py)"
    )
    misses_root: str = Field(description="folder of the shards' input files (ShardPlan.input_file): the miss rows")
    hit_est_tokens: int = Field(0, description="estimated prompt tokens of the hit rows (not inferred)")


class DedupePlan(BaseModel):
    """Rows of one rendered input inferred once per run (``steps/cache/dedupe.py``): the first row of each key in
    input order (the leader) goes to a shard, the others (followers) get its answer or error at merge."""

    model_config = ConfigDict(extra="forbid")
    key_hash: str = Field(description="the hash the rows' keys were computed under (the cache's key hash, if any)")
    rows: int = Field(description="rows deduplicated: the input's rows, or with the result cache its misses")
    leaders: int = Field(description="distinct keys among them: the rows sent to the shards")
    followers: int = Field(description="rows answered by their leader, not sent to the engine")
    followers_file: CacheFile | None = Field(
        None,
        description="follower id, its leader's id and the follower's passthrough columns, in input order "
        "(None: no followers)",
    )
    misses_root: str | None = Field(
        None, description="folder of the shards' input files (ShardPlan.input_file): the leaders (None: no followers)"
    )
    follower_est_tokens: int = Field(0, description="estimated prompt tokens of the followers (not inferred)")


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
        """``plan`` as the golden shards see it: their input file, their shards, no cache, no golden rows, no table, no
        passthrough columns (the golden file carries the template's columns only; golden parts are plain).

        Each golden shard reads the golden file as its own input file (``ShardPlan.input_file``: the size and sha256
        the sealed plan pins, checked as the worker copies it), never by a check of its size and version followed by
        another read of the output prefix, whose other writers could swap in other prompts under the golden ids."""
        name = self.input_file.path.rsplit("/", 1)[-1]
        f = InputFile(path=name, size=self.input_file.bytes, version=self.input_file.version)
        pinned = FileRef(
            path=self.input_file.path, bytes=self.input_file.bytes, sha256=self.input_file.sha256, rows=self.rows
        )
        return plan.model_copy(
            update={
                "format": "parquet",
                "input_root": self.root,
                "files": [f],
                "total_rows": self.rows,
                "shards": [s.model_copy(update={"input_file": s.input_file or pinned}) for s in self.shards],
                "long_row_tokens": None,
                "cache": None,
                "dedupe": None,
                "golden": None,
                "passthrough": None,
                "table": None,  # the golden rows are not the table's: a materialized table's pin names other bytes
            }
        )


class GoldenSetPin(BaseModel):
    """The golden set (``qa.reference.golden_uri``) as the plan pinned it (``steps/qa/golden_set.py``): its files,
    their sizes and sha256. QA scores against these bytes only and names them in its report."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    uri: str = Field(description="qa.reference.golden_uri when planned")
    root: str = Field(description="the folder its files lie under (the file's own folder for a single file)")
    files: list[PinnedFile] = Field(min_length=1, description="its Parquet files, sorted by path")


class Passthrough(BaseModel):
    """The input columns copied into results/ and errors/ (``io.passthrough``), as the plan resolved them."""

    model_config = ConfigDict(extra="forbid")
    columns: list[str] = Field(description="input column names, in the order they are appended")
    names: list[str] = Field(description="their names in results/ and errors/ (io.passthrough_prefix + column)")
    schema_ipc: str = Field(description="their fields as published (Arrow IPC schema, base64; core.rows.encode_schema)")
    types: list[str] = Field(description="their Arrow types, readable")

    def arrow_schema(self) -> pa.Schema:
        """The passthrough fields under their published names and the input's types."""
        return decode_schema(self.schema_ipc)


class TablePin(BaseModel):
    """The Iceberg snapshot a run reads (``io.input_table``), as the plan pinned it (``steps/tables/snapshot.py``).

    The shards never see the catalog: they read the plan's files, which are this snapshot's data files
    (``read`` 'reference') or the rows the plan read from it and wrote under the output prefix ('materialized').
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    identifier: str = Field(description="namespace.table")
    snapshot_id: int = Field(description="the pinned snapshot")
    schema_id: int | None = Field(
        description="the schema id read by: the table's current one for its current snapshot, else the snapshot's"
    )
    location: str = Field(description="the table's location (its OpenLineage dataset name)")
    row_filter: str | None = Field(description="io.input_table.row_filter as planned (null: none)")
    columns: list[str] = Field(description="the columns read (io.input_table.columns, or every column)")
    read: Literal["reference", "materialized"] = Field(
        description="reference: the plan's files are the snapshot's data files; materialized: the filtered rows, "
        "written once by the plan"
    )
    data_files: int = Field(ge=0, description="data files of the snapshot the scan selected")
    data_rows: int = Field(ge=0, description="their rows before any residual filter (the data files' record counts)")
    input_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="materialized: the sha256 of the file the plan wrote (the plan's one input file); every reader "
        "after the plan reads only these bytes. Absent for 'reference', and in materialized plans from before "
        "2026-12, which every reader refuses (plan again)",
    )
    input_bytes: int | None = Field(None, ge=0, description="materialized: that file's size in bytes")
    shard_inputs_root: str | None = Field(
        None,
        description="materialized: the folder of the shards' own input files (ShardPlan.input_file) that neither the "
        "result cache nor the dedupe wrote: each shard's rows of the materialized file",
    )

    def checked_materialized(self) -> TablePin | None:
        """This pin when the plan's input is the materialized file (None: 'reference'); InputChangedError for a
        materialized pin from before its bytes were pinned: nothing names the bytes a reader could check."""
        if self.read != "materialized":
            return None
        if self.input_sha256 is None or self.input_bytes is None or self.shard_inputs_root is None:
            raise InputChangedError(
                f"the plan read table {self.identifier} snapshot {self.snapshot_id} into a file under the output "
                "prefix but does not pin that file's bytes (a plan from before 2026-12): its rows cannot be checked. "
                "Plan the run again into a new output prefix"
            )
        return self


class LastPublished(BaseModel):
    """``changes.previous_published``: the event of the job's Airflow Asset that this DAG's publish task emitted for
    the latest-dated run before this one (``utils/published.py``), as the plan task read it from Airflow's metadata
    database (no such event: the fields None)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    asset: str = Field(description="the Asset's URI")
    event_id: int | None = Field(None, description="the event's id in Airflow")
    timestamp: str | None = Field(None, description="when it was emitted (ISO 8601)")
    logical_date: str | None = Field(None, description="the logical date of the run that published (ISO 8601)")
    output_uri: str | None = Field(None, description="its output_uri: the run that publish published")
    success_sha256: str | None = Field(None, description="its success_sha256: the sha256 of that run's _SUCCESS.json")


class ChangesFrom(BaseModel):
    """The run the change set compares with, as the plan resolved it through a channel outside the bucket:
    ``changes.previous_table`` (``source`` 'table': the run whose snapshot the output table held last) or
    ``changes.previous_published`` ('published': the run the job's Asset event names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: Literal["table", "published"] = Field("table", description="which channel named the run")
    identifier: str = Field(description="io.output_table's identifier, or the Asset's URI")
    snapshot_id: int | None = Field(description="the table's last snapshot committed by a run (None: none yet)")
    previous_uri: str | None = Field(description="that run's output prefix (its vllm-batch.run-id); None: none")
    results_manifest_sha256: str | None = Field(
        default=None,
        description="the sha256 of the results manifest that snapshot published (its "
        "vllm-batch.results-manifest-sha256): the change set compares only with that merge of the run (None: none, "
        "or a plan from before this field)",
    )
    event_id: int | None = Field(None, description="'published': the Asset event's id")
    published_at: str | None = Field(None, description="'published': when the event was emitted")
    report_sha256: str | None = Field(
        None,
        description="the sha256 of qa/report.json that the run's sealed _SUCCESS.json ('published') or "
        "_PUBLISHING.json ('table') names, the baseline of qa.previous_published (None: it names none, or a plan "
        "from before this field)",
    )

    def describe(self) -> str:
        """Where the pin came from, for messages."""
        if self.source == "published":
            return f"changes.previous_published: Asset {self.identifier} event {self.event_id} ({self.published_at})"
        return f"changes.previous_table: table {self.identifier} snapshot {self.snapshot_id}"


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
    files: list[InputFile] = Field(description="the input's files, in order (segments index them)")
    fingerprint: str
    total_rows: int
    invalid_lines: int = 0
    est_tokens: int
    long_row_tokens: int | None = None
    chars_per_token: float
    shards: list[ShardPlan]
    created_with: dict[str, str]
    sizing: Sizing | None = Field(None, description="How shards were sized from throughput history.")
    cache: CachePlan | None = Field(
        None, description="The result cache (cache.uri set): shards then read their own input files of misses."
    )
    dedupe: DedupePlan | None = Field(
        None, description="Each distinct prompt once per run (sharding.dedupe): shards then read their leaders' files."
    )
    golden: GoldenPlan | None = Field(
        None, description="Golden rows that ride along (qa.reference.ride_along_uri): their file and shards."
    )
    golden_set: GoldenSetPin | None = Field(
        None,
        description="qa.reference.golden_uri: its files' sizes and sha256, pinned by the plan; QA reads only these "
        "bytes (absent without a golden set, and in plans from before 2026-12, which QA refuses)",
    )
    passthrough: Passthrough | None = Field(
        None, description="io.passthrough resolved against the input: the columns the parts carry, and their types"
    )
    adapters: list[AdapterRef] = Field(
        default_factory=list, description="the job's LoRA adapters and their identities (core/adapters.py)"
    )
    weights: list[WeightsPin] = Field(
        default_factory=list,
        description="with the result cache: the local model and tokenizer folders as the plan hashed them (each file's "
        "name, size and sha256; core/weights.py): the workers check the folders they load against them",
    )
    table: TablePin | None = Field(
        None, description="io.input_table: the table snapshot the run reads, pinned by the plan; absent for files"
    )
    changes_from: ChangesFrom | None = Field(
        None,
        description="changes.previous_table / changes.previous_published: the run the changes compare with, pinned "
        "by the plan",
    )
    seal: Seal | None = Field(None, description="the plan task's seal (core/seal.py): what every reader checks")

    def passthrough_schema(self) -> pa.Schema | None:
        return self.passthrough.arrow_schema() if self.passthrough is not None else None

    def result_schema(self) -> pa.Schema:
        """The schema of this run's ``results/`` parts (``core.rows.result_schema``)."""
        return result_schema(self.passthrough_schema())

    def error_schema(self) -> pa.Schema:
        """The schema of this run's ``errors/`` parts (``core.rows.error_schema``)."""
        return error_schema(self.passthrough_schema())

    def dump_json(self) -> bytes:
        """``_plan.json``'s bytes: the fields that were set, and the seal."""
        return seals.record_bytes(self)

    def for_shard(self, shard_id: str) -> Plan:
        """The plan a shard's worker reads by: this one, or for a golden shard the golden rows' view."""
        if self.golden is not None and any(s.shard_id == shard_id for s in self.golden.shards):
            return self.golden.view(self)
        return self

    def mapped_shards(self) -> list[ShardSummary]:
        """Every shard a task runs: the input's, then the golden rows' (``golden``)."""
        golden = self.golden.shards if self.golden is not None else []
        # the sealed plan's identity rides along (through XCom, which the bucket's writers cannot write) to each
        # shard task, which hands it to its worker (``ShardTask``): the worker holds no key that checks the plan
        ref = {} if self.seal is None else self.ref().dump()
        return [s.summary().model_copy(update=ref) for s in self.shards] + [
            s.summary().model_copy(update={"golden": True, **ref}) for s in golden
        ]

    def ref(self) -> PlanRef:
        """This sealed plan's identity (``PlanRef``), as the plan task hands it on; CommitError for an unsealed plan
        (no plan task wrote it)."""
        if self.seal is None:
            raise CommitError("the plan carries no seal: no plan task of this deployment wrote it")
        return PlanRef(plan_mac=self.seal.mac, plan_sha256=plan_sha256(self))

    def sealed(self, keyring: Keyring, output_uri: str) -> Plan:
        """This plan sealed for the run at ``output_uri``."""
        return seals.seal_record(keyring, seals.PLAN, seals.scope_of(output_uri), self)

    def verify(self, keyring: Keyring, output_uri: str) -> None:
        """SealError unless the plan task of this deployment wrote this plan for the run at ``output_uri``."""
        where = f"{output_uri.rstrip('/')}/{PLAN_FILE}"
        seals.verify_record(keyring, seals.PLAN, seals.scope_of(output_uri), self, f"the plan {where}")

    def input_storage(self, out: Storage, tmp: str) -> tuple[Storage, bool]:
        """Where a step after the plan reads the plan's input files (``files``), and whether they were checked
        already. The input folder (its links followed: the user's choice), whose files the caller checks unchanged
        (``check_unchanged``); or, for a materialized table, a local copy of the file the plan wrote under the
        output prefix, fetched into ``tmp`` (a private folder) and read only when it has the size and sha256 the
        sealed plan pins: whoever else writes the prefix could have changed it (CommitError naming it; its links
        are refused; a second call with the same ``tmp`` reuses the checked copy). InputChangedError for a
        materialized plan from before the pin."""
        pin = self.table.checked_materialized() if self.table is not None else None
        if pin is None:
            return out.input_at(self.input_root), False
        if pin.input_sha256 is None or len(self.files) != 1:  # checked_materialized: never None here
            raise CommitError(
                f"the plan pins a materialized table input of {len(self.files)} files; it writes exactly one: plan "
                "the run again into a new output prefix"
            )
        name = self.files[0].path
        folder = os.path.join(tmp, "table-input")
        dest = os.path.join(folder, name)
        if not os.path.exists(dest):  # only a copy that passed the check is ever renamed to dest (tmp is private)
            os.makedirs(folder, exist_ok=True)
            src = Storage(self.input_root, out.options, out.filesystems)  # follow_links off: a link is refused
            src.fetch_verified(name, pin.input_bytes, pin.input_sha256, dest + ".part")
            os.replace(dest + ".part", dest)
        return Storage(folder), True

    def shard_input(self, shard: ShardPlan) -> tuple[str, list[InputFile]]:
        """The shard's input root and files (its segments index them): the input, or the shard's own input file."""
        if shard.input_file is None:
            return self.input_root, list(self.files)
        f = shard.input_file
        root = (self.cache.misses_root if self.cache else self.dedupe.misses_root if self.dedupe else None) or ""
        if not root and self.table is not None:  # a materialized table's shard files (the cache's and dedupe's win)
            root = self.table.shard_inputs_root or ""
        if not root:  # the golden rows' view (``GoldenPlan.view``): the golden file itself, pinned by sha256
            root = self.input_root
        name = f.path.rsplit("/", 1)[-1]
        return root, [InputFile(path=name, size=f.bytes, version="")]

    def shard(self, shard_id: str) -> ShardPlan:
        for s in self.shards:
            if s.shard_id == shard_id:
                return s
        raise SpecError(f"shard {shard_id!r} is not in the plan")


def pinned_changes(spec: JobSpec) -> bool:
    """Whether the plan pins the run the change set compares with (``Plan.changes_from``)."""
    return bool(spec.changes.previous_table or spec.changes.previous_published)


def changes_spec(spec: JobSpec, plan: Plan) -> JobSpec:
    """The spec the change set is computed and published by: with ``changes.previous_table`` or
    ``changes.previous_published``, its ``changes.previous_uri`` is the run the plan pinned (``Plan.changes_from``;
    None: nothing to compare)."""
    if not pinned_changes(spec) or plan.changes_from is None:
        return spec
    changes = spec.changes.model_copy(update={"previous_uri": plan.changes_from.previous_uri})
    return spec.model_copy(update={"changes": changes})


def estimate_tokens(chars: np.ndarray | int, chars_per_token: float) -> np.ndarray:
    """Prompt-token estimate from characters (an int64 array; 0-d for an int); worker and planner must agree on it."""
    return np.ceil(np.asarray(chars, dtype=np.float64) / chars_per_token).astype(np.int64)


def plan_sha256(plan: Plan) -> str:
    """The sealed plan's digest: sha256 of the canonical JSON of what its seal covers, and of the seal. Two
    ``_plan.json`` files with the same digest are the same plan to every reader (however their bytes are laid out)."""
    doc = seals.sealed_doc(plan)
    doc["seal"] = plan.seal.model_dump(mode="json") if plan.seal is not None else None
    return hashlib.sha256(seals.canonical(doc)).hexdigest()


def is_pinned(plan: Plan, mac: str, sha256: str) -> bool:
    """Whether ``plan`` is exactly the sealed plan named by ``mac`` (its seal) and ``sha256`` (``plan_sha256``)."""
    return plan.seal is not None and plan.seal.mac == mac and plan_sha256(plan) == sha256


def parse_plan(data: bytes, where: str) -> Plan:
    """The plan in ``data``, the bytes of the ``_plan.json`` at ``where`` (its seal not checked); CommitError (terminal)
    naming it when they are no plan (not JSON, not a plan's fields: no plan task of this version wrote them)."""
    try:
        return Plan.model_validate_json(data)
    except ValidationError as e:
        errors = e.errors()
        at = ".".join(str(x) for x in errors[0]["loc"])[:100] if errors else ""
        what = str(errors[0]["msg"])[:200] if errors else ""
        raise CommitError(
            f"{where} is not a plan this provider wrote ({e.error_count()} problem(s), first at {at or 'the top'}: "
            f"{what}); another writer of the output prefix put it there, or a version before this one wrote it. "
            "Plan and run the job again in an empty output prefix"
        ) from None


def read_plan(spec: JobSpec, filesystems: FileSystems | None = None) -> tuple[Plan, str]:
    """The run's ``_plan.json`` as it is (its seal not checked) and its URI; SpecError when there is none, CommitError
    (terminal) naming it when its bytes are no plan (``parse_plan``)."""
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    if not out.exists(PLAN_FILE):
        raise SpecError(f"no plan at {out.uri(PLAN_FILE)}; run the plan step first")
    return parse_plan(out.read_bytes(PLAN_FILE), out.uri(PLAN_FILE)), out.uri(PLAN_FILE)


def load_pinned_plan(spec: JobSpec, mac: str, sha256: str, filesystems: FileSystems | None = None) -> Plan:
    """The run's plan as a shard worker takes it: exactly the sealed plan the Airflow side checked and named in the
    shard task (``mac``, ``sha256``: ``ShardTask.plan_mac``, ``plan_sha256``). The worker holds no key that checks a
    plan's seal; the task names the plan through a channel the bucket's writers cannot write. SpecError when there
    is no plan; CommitError (terminal) when ``_plan.json`` is another record (another sealed plan of this folder put
    back, or a forged one)."""
    plan, where = read_plan(spec, filesystems)
    if not is_pinned(plan, mac, sha256):
        raise CommitError(
            f"{where} is not the plan this shard task was started for (the plan task's seal {mac[:12]}): it was "
            "replaced after the plan task wrote it (another plan of this folder, or a forged one); not running the "
            "shard. Plan and run the job again in an empty output prefix"
        )
    return plan


def load_plan(
    spec: JobSpec,
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
    merged: MergeSummary | None = None,
    pinned: PlanRef | None = None,
) -> Plan:
    """The run's plan, its seal checked (``keyring``: the deployment's; default ``VLLM_BATCH_SIGNING_KEY``). Airflow
    side only: a shard worker holds no key that checks a plan (``load_pinned_plan``).

    SpecError when there is none; SealError when this deployment's plan task did not write it for this run.
    ``pinned``: the plan the plan task named (its XCom, ``PlanRef``), for merge: CommitError (terminal) naming
    ``_plan.json``, the plan expected and the one found when it is another sealed plan (an earlier plan of this
    folder put back: it is sealed for the folder too).
    ``merged``: the run's sealed merge summary, for the readers after the merge (QA, publish): CommitError when
    the plan is not the one it names (``plan_mac``), or when it names none (a merge written before it recorded
    its plan: merge again). An earlier plan of the same folder (it was emptied and planned again) is sealed for
    it too, and its pins (``changes_from``: the change set's and QA's baseline) are not the ones the run was made
    with.
    """
    plan, where = read_plan(spec, filesystems)
    plan.verify(keyring or Keyring.from_env(), spec.io.output_uri)
    if pinned is not None and not is_pinned(plan, pinned.plan_mac, pinned.plan_sha256):
        found = plan.ref()  # verified above: it carries a seal
        raise CommitError(
            f"{where} is not the plan this run's plan task wrote (it named {pinned.describe()}; found "
            f"{found.describe()}): another sealed plan of this folder was put back (an earlier plan or run of this "
            "output prefix); not merging. Put the run's plan back, or plan and run the job again in an empty output "
            "prefix"
        )
    if merged is None:
        return plan
    if merged.plan_mac is None:  # fail closed: nothing says which of the folder's sealed plans the run was made with
        raise CommitError(
            f"the merge summary of {spec.io.output_uri} names no plan (a merge written before it recorded the plan "
            "it was merged under): run the merge task again, then QA and publish"
        )
    if plan.seal is None or plan.seal.mac != merged.plan_mac:
        raise CommitError(
            f"{where} is not the plan the run was merged under (the sealed merge names another: an "
            "earlier plan of this folder put back); put the run's plan back, or plan and run it again in an empty "
            "output prefix"
        )
    return plan


def current_plan_ref(spec: JobSpec, filesystems: FileSystems | None = None, keyring: Keyring | None = None) -> PlanRef:
    """The identity of the sealed plan at ``_plan.json`` now, its seal checked (``load_plan``), for a step run by
    hand where no plan task names the plan (a benchmark, a script, the tests): an explicit choice to take whatever
    sealed plan of the folder is there, which another writer of the output prefix could have put back. In a DAG
    the plan task's value names it (``PlanRef``)."""
    return load_plan(spec, filesystems, keyring).ref()
