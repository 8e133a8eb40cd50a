"""Typed records that cross a process or a task: written and read through these models.

- ``ShardStats``: a shard attempt's statistics (in the commit marker, the worker manifest and
  the merge summary's ``shard_stats``).
- ``WorkerManifest`` / ``FailureManifest``: the worker's last stdout line (and
  ``/airflow/xcom/return.json``), the shard task's XCom value; ``read_manifest`` tells them apart.
- ``MergeSummary``: ``_MERGED.json`` and, without per-shard stats, the merge task's XCom.
- ``ChangesSummary``: ``changes/_changes.json``, what moved since the previous run (``steps/merge/changes.py``).
- ``QARecord``: ``qa/_QA.json``, QA's sealed verdict and the digests of its report files (``steps/qa/store.py``).
- ``ReviewRecord``: ``qa/_REVIEW.json``, the review task's sealed decision on that verdict (``steps/qa/store.py``).
- ``DagRunRef``: the Airflow DAG run a sealed verdict or decision was made in (both records name it).
- ``TaskGroupRef``: the task group (and map index) of that DAG run whose task made it: one job of the run.
- ``PublishingRecord``: ``_PUBLISHING.json``, publish's sealed notice that it began a table commit
  (``steps/tables/commit.py``).
- ``GoldenSummary``: ``golden/_golden.json``, the golden rows that rode along (``steps/golden.py``).
- ``ThroughputRecord``: one line of the throughput history (``steps/plan/sizing.py``).
- ``CacheCommit`` / ``CacheMergeSummary``: the result cache's commit marker and what a merge did
  with the cache (``steps/cache/result_cache.py``).

The commit marker and its file entries live beside their protocol in ``core/commit.py``.
The JSON shape is the one the dict-writing code produced (same field names and meaning), so
files written before these models existed still validate; ``dump`` leaves out fields that were
never set, so an optional field absent on disk stays absent when written back. Writers are
ours, hence ``extra="forbid"``: an unknown field or a wrong type is refused, naming the field.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from airflow_provider_vllm.core.part_names import cache_part_path, part_name, run_file
from airflow_provider_vllm.core.seal import Seal

# Names read back from bucket files, checked on every read (``core/part_names.py``)
PartName = Annotated[str, AfterValidator(part_name)]
RunFile = Annotated[str, AfterValidator(run_file)]
CachePartPath = Annotated[str, AfterValidator(cache_part_path)]


class Record(BaseModel):
    """Base of the records: unknown fields refused; ``dump`` gives the JSON-ready dict."""

    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The record as JSON-ready data, fields that were never set left out."""
        return self.model_dump(mode="json", exclude_unset=True)


class RowCounts(Record):
    """Rows and how they ended; shared by the file entry, the marker, the manifest and the merge summary."""

    rows: int = Field(description="rows (a shard's or a run's: the planned rows)")
    ok_rows: int = Field(description="rows with status 'ok' (after a merge: in the parts of results/)")
    error_rows: int = Field(description="rows with status 'error' (after a merge: in the parts of errors/)")


class GpuPeak(Record):
    """One GPU's sampled utilisation and memory over a shard attempt."""

    index: int = Field(description="GPU index as the sampler saw it")
    name: str = Field(description="device name")
    util_peak_pct: float | None = Field(None, description="highest sampled utilisation, percent")
    util_mean_pct: float | None = Field(None, description="mean sampled utilisation, percent")
    mem_peak_mb: float = Field(description="highest sampled memory in use, MB")
    mem_total_mb: float = Field(description="device memory, MB")


class ShardStats(Record):
    """Statistics of the attempt that committed a shard; every field optional (older markers lack some)."""

    rows: int | None = Field(None, description="rows of the shard")
    read_s: float | None = Field(None, description="seconds spent reading the shard's rows")
    reused_chunks: int | None = Field(None, description="chunks reused from earlier attempts")
    engine_start_s: float | None = Field(None, description="seconds to start the engine (0: not started)")
    compile_cache: Literal["warm", "cold"] | None = Field(
        None,
        description="the shared compile cache: 'warm' (a snapshot was restored before the engine started) or "
        "'cold' (none: this attempt compiled); None: no shared compile cache",
    )
    compile_cache_s: float | None = Field(
        None, description="seconds restoring and publishing the shared compile cache (besides engine_start_s)"
    )
    infer_s: float | None = Field(None, description="seconds of inference by this attempt")
    prompt_tokens: int | None = Field(None, description="prompt tokens inferred by this attempt")
    completion_tokens: int | None = Field(None, description="completion tokens generated by this attempt")
    infer_rows: int | None = Field(
        None, description="rows this attempt sent to the engine (reused chunks and rows refused before it excluded)"
    )
    hardware: str | None = Field(None, description="hardware id, e.g. '1x NVIDIA H200' (worker/hardware.py)")
    rows_per_s: float | None = Field(
        None,
        description="rows this attempt finished (reused chunks excluded) / infer_s; None when nothing was inferred",
    )
    tokens_per_s: float | None = Field(None, description="(prompt + completion tokens) / infer_s")
    wall_s: float | None = Field(None, description="seconds from reading to the commit")
    oom_events: int | None = Field(None, description="out-of-memory events the engine guard recovered from")
    engine_rebuilds: int | None = Field(None, description="engine restarts after a failure")
    oom_error_rows: int | None = Field(None, description="rows that failed for lack of memory")
    step_failures: int | None = Field(None, description="engine steps that failed")
    engine_error_rows: int | None = Field(None, description="rows failed by engine errors")
    engine_limits: dict[str, int | None] | None = Field(None, description="engine limits in force at the end")
    progress_lines: int | None = Field(None, description="progress lines logged")
    peak_rss_mb: float | None = Field(None, description="peak resident memory of the process tree, MB")
    resource_samples: int | None = Field(None, description="resource samples taken")
    gpus: list[GpuPeak] | None = Field(None, description="per-GPU peaks, when GPUs were sampled")
    gpu_util_peak_pct: float | None = Field(None, description="highest utilisation over all GPUs, percent")
    gpu_mem_peak_mb: float | None = Field(None, description="highest memory in use over all GPUs, MB")


class WorkerManifest(RowCounts):
    """A finished shard: the worker's manifest, also the shard task's XCom value."""

    status: Literal["committed", "already_committed"] = Field(
        description="'committed' by this attempt, or 'already_committed' by an earlier or concurrent one"
    )
    shard_id: str = Field(description="the shard")
    attempt_id: str = Field(description="the attempt whose commit marker won")
    stats: ShardStats = Field(default_factory=ShardStats, description="the committing attempt's statistics")


class FailureManifest(Record):
    """A worker that ended itself with a failure (exit 2 or 75)."""

    status: Literal["failed"] = Field(description="always 'failed'")
    error: str = Field(description="exception class name, e.g. 'SpecError', 'Preempted', 'Stalled'")
    message: str = Field(description="what went wrong (secrets redacted)")
    terminal: bool = Field(description="True: a retry cannot help (exit 2)")


Manifest = Annotated[WorkerManifest | FailureManifest, Field(discriminator="status")]
_MANIFEST = TypeAdapter(Manifest)


def read_manifest(doc: Any) -> WorkerManifest | FailureManifest:
    """Validate a manifest (dict or JSON text); raises pydantic's ValidationError naming the field."""
    if isinstance(doc, (str, bytes)):
        return _MANIFEST.validate_json(doc)
    return _MANIFEST.validate_python(doc)


class ShardStatsEntry(ShardStats):
    """One shard's statistics in the merge summary, with the shard and the committing attempt."""

    shard_id: str = Field(description="the shard")
    attempt_id: str = Field(description="the attempt that committed it")


class Duplicates(Record):
    """Ids committed more than once (identical copies), counted before the dedupe."""

    ids: int = Field(description="ids seen more than once")
    rows_dropped: int = Field(description="extra rows dropped")
    examples: list[str] = Field(description="a few of those ids")


# A file's size and digest as every file record declares them (FileDigest and its kin, the commit marker's FileEntry)
FileBytes = Annotated[int, Field(ge=0, description="file size")]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the file's bytes")]
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # the same digest checked outside a record (fullmatch)


class FileDigest(Record):
    """What one file must be: its size, sha256 and rows (the shape every file record shares)."""

    bytes: FileBytes
    sha256: Sha256
    rows: int = Field(ge=0, description="rows in the file")


class FileRef(FileDigest):
    """One file by its path under a folder (a run's output prefix, the cache folder) and what it must be.

    ``path`` is relative, made of plain segments (letters, digits, ``._-``; no ``.``/``..``, no glob or URL
    characters): a record read from a bucket can never name a file outside its folder with it.
    """

    path: str = Field(max_length=1024, description="path under the folder")

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        return run_file(v)


class PinnedFile(Record):
    """One file of a folder the plan pinned (a golden set, a local model or tokenizer folder): its path under the
    folder, size and sha256 as the plan read them; readers later take exactly these bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(min_length=1, max_length=4096, description="its path under the folder ('/'-separated)")
    bytes: FileBytes
    sha256: Sha256

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        if v.startswith("/") or any(s in ("", ".", "..") for s in v.split("/")):
            raise ValueError(f"{v!r} is not a relative path of plain segments")
        return v


class CacheFileEntry(FileRef):
    """One Parquet part of a cache entry: ``entries/<entry_id>/part-NNNNN.parquet`` (the cache folder's own)."""

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:  # replaces FileRef's: stricter, and names what it must be
        return cache_part_path(v)


class PartEntry(FileDigest):
    """One published Parquet part of a merged folder."""

    name: PartName = Field(
        max_length=255,
        description="file name inside the folder, e.g. part-00000-<shard>-00000.parquet: one segment, no glob",
    )


class PartsManifest(Record):
    """``results/_manifest.json`` / ``errors/_manifest.json``: every part of the folder, in plan order.

    The folder is exactly these parts (merge removes any other ``part-*.parquet`` and refuses
    foreign files); it is complete once ``_MERGED.json`` is written after it.
    """

    version: int = Field(1, description="manifest format version")
    kind: Literal["results", "errors"] = Field(description="which folder")
    rows: int = Field(description="rows over all parts")
    parts: list[PartEntry] = Field(description="the parts, in plan order (their names sort in this order)")


class MergeSummary(RowCounts):
    """``_MERGED.json``; the merge task's XCom is ``xcom()`` (no per-shard stats: 10k shards stay small)."""

    duplicates_dropped: int = Field(description="committed rows dropped as identical duplicates")
    duplicates: Duplicates = Field(description="duplicate ids, counted before the dedupe")
    shards: int = Field(description="shards of the plan")
    files: dict[str, RunFile] = Field(
        description="output kind -> path under the output prefix: 'results' and 'errors' (folders of Parquet "
        "parts, ending in '/'), 'results_manifest' and 'errors_manifest' (their _manifest.json), "
        "and for openai_batch output 'openai_output' and 'openai_errors'"
    )
    checksums: dict[RunFile, str] = Field(
        description="path -> sha256 of the two manifests (which carry the sha256 of every part)"
    )
    sizes: dict[RunFile, FileBytes] | None = Field(
        None,
        description="path -> size in bytes of each file in checksums: a reader checks no more bytes than that "
        "(absent in summaries written before it was recorded)",
    )
    parts: dict[str, int] = Field(
        default_factory=dict, description="'results' / 'errors' -> Parquet parts in the folder"
    )
    shard_stats: list[ShardStatsEntry] | None = Field(None, description="per-shard statistics (not in the XCom)")
    config_hash: str = Field(description="the plan's output-affecting config hash")
    spec_hash: str = Field(description="the plan's spec hash")
    merge_s: float = Field(description="seconds the merge took")
    versions: dict[str, str | None] | None = Field(None, description="package versions of the merge")
    engine_versions: list[str] = Field(
        default_factory=list,
        description="vLLM versions the committed shards ran, sorted (one unless shards ran on different images; "
        "empty in summaries written before it was recorded)",
    )
    history_record: str | None = Field(
        None, description="URI of the throughput record written after the merge (return value only)"
    )
    task: str | None = Field(None, description="the job's task (absent in summaries written before it was recorded)")
    id_column: str | None = Field(None, description="the input column the ids came from (absent in older summaries)")
    cache: CacheMergeSummary | None = Field(
        None, description="what the merge took from and added to the result cache (cache.uri set)"
    )
    dedupe: DedupeMergeSummary | None = Field(
        None, description="rows answered by another row of the same prompt (plan.dedupe; sharding.dedupe)"
    )
    golden: GoldenSummary | None = Field(
        None, description="the golden rows that rode along (qa.reference.ride_along_uri), published under golden/"
    )
    adapters: dict[str, str] | None = Field(
        None,
        description="the job's LoRA adapters as the sealed plan found them: name -> identity (sha256:<hex> of its "
        "files, or <hub repo>@<commit>); absent without adapters and in summaries written before it was recorded",
    )
    plan_mac: str | None = Field(None, description="the seal of the plan the run was merged under (its mac)")
    seal: Seal | None = Field(None, description="the merge's seal (core/seal.py, domain merged, scope the run)")

    XCOM_FIELDS: ClassVar[tuple[str, ...]] = (
        "rows",
        "ok_rows",
        "error_rows",
        "duplicates_dropped",
        "duplicates",
        "shards",
        "files",
        "checksums",
        "config_hash",
        "spec_hash",
        "merge_s",
        "cache",
        "dedupe",
    )

    def xcom(self) -> dict[str, Any]:
        """The run-level part pushed to XCom, and the seal (mac) of the ``_MERGED.json`` written: QA measures no
        other (``merged_mac``; an earlier merge of the folder put back is sealed for it too)."""
        x = {k: v for k, v in self.dump().items() if k in self.XCOM_FIELDS}
        return {**x, "merged_mac": self.seal.mac if self.seal is not None else None}


class ThroughputRecord(Record):
    """One line of the throughput history: a merged run's pooled throughput on one hardware."""

    version: int = Field(description="record format version (sizing.HISTORY_VERSION)")
    recorded_at: str = Field(description="UTC time the record was written")
    job: str = Field(description="job name")
    task: str = Field(description="job task (chat, generate, embed, classify)")
    model: str = Field(description="model name")
    model_revision: str | None = Field(None, description="model revision")
    hardware: str = Field(description="hardware id the shards reported")
    tensor_parallel_size: int = Field(1, description="engine tensor_parallel_size")
    max_num_seqs: int | None = Field(None, description="engine max_num_seqs (absent in early records)")
    config_hash: str = Field(description="the job's output-affecting config hash")
    spec_hash: str = Field(description="the job's spec hash")
    shards: int = Field(description="shards pooled into this record")
    rows: int = Field(description="rows inferred (reused chunks excluded)")
    infer_s: float = Field(description="inference seconds over those shards")
    prompt_tokens: int = Field(0, description="prompt tokens inferred")
    completion_tokens: int = Field(0, description="completion tokens generated")
    engine_start_s: float | None = Field(None, description="median engine start, seconds")
    engine_start_warm_s: float | None = Field(
        None, description="median start of the shards that restored a shared compile cache (compile_cache 'warm')"
    )
    engine_start_cold_s: float | None = Field(
        None, description="median start of the shards that found none and compiled (compile_cache 'cold')"
    )
    rows_per_s: float = Field(description="rows / infer_s")
    tokens_per_s: float = Field(description="(prompt + completion tokens) / infer_s")
    prompt_tokens_per_row: float = Field(description="prompt tokens per row")
    completion_tokens_per_row: float = Field(description="completion tokens per row")
    est_prompt_tokens_per_row: float | None = Field(None, description="the planner's estimate, for comparison")
    seal: Seal | None = Field(
        None,
        description="the writing merge's seal (core/seal.py, domain history, scope the history folder); a record "
        "without a valid one is never used",
    )


ChangeKind = Literal["added", "removed", "changed", "unchanged", "error", "recovered"]
CHANGE_KINDS: tuple[str, ...] = ("added", "removed", "changed", "unchanged", "error", "recovered")


class ChangeCounts(Record):
    """Ids per change kind (``steps/merge/changes.py`` defines the kinds)."""

    added: int = Field(description="an answer now, the id was not in the previous run")
    removed: int = Field(description="in the previous run (answer or error), not in this one")
    changed: int = Field(description="an answer in both runs, and they differ")
    unchanged: int = Field(description="an answer in both runs, and they are equal")
    error: int = Field(description="an error row in this run (old_status says what it was before, if anything)")
    recovered: int = Field(description="an error row in the previous run, an answer now")


class MatrixCell(Record):
    """One cell of the old x new label matrix; null on a side: the id is absent from that run."""

    old: str | None = Field(description="label in the previous run (null: added)")
    new: str | None = Field(description="label in this run (null: removed)")
    count: int = Field(description="ids")


class ChangesSummary(Record):
    """``changes/_changes.json``: what moved between the previous run and this one (written after the Parquet)."""

    version: int = Field(description="record format version")
    previous_uri: str = Field(description="changes.previous_uri, the previous run's output prefix")
    previous_state: Literal["complete", "incomplete", "absent", "unverified"] = Field(
        description="complete: its _MERGED.json exists, carries this deployment's seal, and was compared; "
        "incomplete / absent / unverified (no valid seal: nothing of it is read): not compared, "
        "every id of this run is 'added' (or 'error')"
    )
    previous_config_hash: str | None = Field(None, description="the previous run's config hash (complete only)")
    config_hash: str = Field(description="this run's config hash")
    compared: Literal["label", "parsed_json", "output", "embedding"] = Field(
        description="the result column compared (embedding: equal or not, no values in the file)"
    )
    ids: int = Field(description="rows of changes.parquet: ids in this run or the previous one")
    counts: ChangeCounts = Field(description="ids per change kind")
    in_both: int = Field(description="ids with an answer in both runs (changed + unchanged)")
    churn_rate: float | None = Field(description="changed / in_both; null when no id has an answer in both")
    reasons: dict[str, int] | None = Field(
        None,
        description="changed ids by why they moved: settings, input, unified, engine, unknown (steps/changes.py); "
        "null when nothing changed",
    )
    matrix: list[MatrixCell] | None = Field(
        None,
        description="old x new label counts, largest first (label jobs: structured choice, classify); "
        "ids with an error on either side are not in it",
    )
    matrix_cells: int | None = Field(None, description="non-empty cells of the full matrix (matrix may hold fewer)")
    files: dict[str, RunFile] = Field(description="output kind -> path under the output prefix")
    checksums: dict[RunFile, str] = Field(description="path -> sha256 of changes.parquet")
    sizes: dict[RunFile, FileBytes] | None = Field(
        None,
        description="path -> size in bytes of changes.parquet (absent in summaries written before it was recorded)",
    )
    notes: list[str] = Field(default_factory=list, description="what the reader should know (no previous run ...)")
    merged_mac: str | None = Field(
        None,
        description="the seal (mac) of this run's _MERGED.json the change set was computed from; publish refuses a "
        "change set of another merge of the folder (absent in summaries written before it was recorded: refused)",
    )
    previous_merged_mac: str | None = Field(
        None, description="the seal (mac) of the previous run's _MERGED.json it was compared with (complete only)"
    )
    seal: Seal | None = Field(None, description="the QA task's seal (core/seal.py, domain changes, scope the run)")


class QAFile(Record):
    """One file QA wrote, as it wrote it."""

    path: RunFile = Field(description="path under the output prefix")
    bytes: FileBytes
    sha256: Sha256


class DagRunRef(Record):
    """The Airflow DAG run a sealed record was made in (its task's ``dag_id`` and ``run_id``, handed in by the
    operator as plain values: the steps import no Airflow). Review and publish take only their own run's records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dag_id: str = Field(min_length=1, description="the DAG's id")
    run_id: str = Field(min_length=1, description="the DAG run's id")

    def describe(self) -> str:
        return f"DAG run {self.dag_id!r} / {self.run_id!r}"


class TaskGroupRef(Record):
    """The task group, and the map index, of the task that made a sealed record: within one DAG run, the job
    (``vllm_batch_job``'s group) it belongs to. A DAG run may hold several jobs (several groups, or one group mapped
    over jobs); their QA, review and publish tasks take only their own job's records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_id: str | None = Field(description="the task's task group id (None: the task is at the DAG's top level)")
    map_index: int = Field(description="the task instance's map index (-1: not mapped)")

    def describe(self) -> str:
        where = "the top level" if self.group_id is None else f"task group {self.group_id!r}"
        return where + ("" if self.map_index < 0 else f" (map index {self.map_index})")


class QARecord(Record):
    """``qa/_QA.json``: what QA concluded about a run, written after its report files and sealed (``core/seal.py``,
    domain ``qa``, scope the run). Publish gates on this ``status``, never on ``report.json``'s; a later run's drift
    checks use ``report.json`` only when its bytes are the ones this record names."""

    version: int = Field(1, description="record format version")
    status: Literal["pass", "warn", "fail"] = Field(description="QA's verdict")
    summary: str = Field(description="the report's one-line summary")
    spec_hash: str = Field(description="the spec hash of the merged run QA measured (its sealed _MERGED.json)")
    config_hash: str = Field(description="the config hash of the merged run QA measured")
    merged_mac: str = Field(description="the seal (mac) of the _MERGED.json QA measured")
    changes_mac: str | None = Field(
        None,
        description="the seal (mac) of the changes/_changes.json this QA wrote and judged (changes.previous_uri "
        "set; absent otherwise): publish publishes no other change set",
    )
    rows: int = Field(ge=0, description="rows of the merged run (results + errors)")
    files: dict[Literal["report_json", "report_html", "sample"], QAFile] = Field(
        description="what QA wrote: report_json, report_html, sample -> path, size, sha256"
    )
    dag_run: DagRunRef | None = Field(
        None,
        description="the DAG run whose QA task wrote it: review and publish take no other run's verdict (absent: "
        "written before this field, refused by both: run QA again)",
    )
    task_group: TaskGroupRef | None = Field(
        None,
        description="the task group (and map index) of the QA task that wrote it: review and publish take only their "
        "own job's verdict (absent: written before this field, refused by both: run QA again)",
    )
    seal: Seal | None = Field(None, description="the QA task's seal (core/seal.py, domain qa, scope the run)")


class ReviewAnswer(Record):
    """A person's answer to the review's approval request, as Airflow's HITL response gives it."""

    chosen_options: list[str] = Field(description="the option(s) chosen: ['Approve'] or ['Reject']")
    responded_by: str | None = Field(None, description="the responding user's name (Airflow's responded_by_user)")
    responded_by_id: str | None = Field(None, description="the responding user's id")
    responded_at: str | None = Field(None, description="when they answered (ISO 8601)")


class ReviewRecord(Record):
    """``qa/_REVIEW.json``: the review task's decision on one sealed QA verdict, sealed (``core/seal.py``, domain
    ``review``, scope the run) and written before the task returns. Publish decides from it, never from the review
    task's XCom: the QA verdict it names must be the one publish checks, made in the same DAG run, and approved."""

    version: int = Field(1, description="record format version")
    dag_run: DagRunRef = Field(description="the DAG run whose review task decided")
    task_group: TaskGroupRef | None = Field(
        None,
        description="the task group (and map index) of the review task that decided: publish takes only its own "
        "job's decision (absent: decided before this field, refused: clear the review task)",
    )
    qa_record_mac: str = Field(pattern=r"^[0-9a-f]{64}$", description="the seal (mac) of the qa/_QA.json decided on")
    qa_status: Literal["pass", "warn", "fail"] = Field(description="that sealed verdict's status")
    ask: bool | None = Field(
        None, description="whether the review was on for a 'warn' (its ask setting, checked); absent: QA passed"
    )
    asked: bool = Field(description="whether a person was asked (a 'warn' with the review on)")
    approved: bool = Field(description="the decision: publication approved (a 'pass', review off, or Approve)")
    answer: ReviewAnswer | None = Field(None, description="the person's answer (asked only)")
    decided_at: str = Field(description="UTC time the review task recorded the decision (ISO 8601)")
    seal: Seal | None = Field(None, description="the review task's seal (core/seal.py, domain review, scope the run)")


COMMITTED_PROPERTY = "vllm-batch.committed."  # + sha256(run id)[:32]: the table property a run's commit sets


def committed_key(run_id: str) -> str:
    """The key of the table property that the table commit of run ``run_id`` sets (``steps/tables/commit.py``)."""
    return COMMITTED_PROPERTY + hashlib.sha256(run_id.encode()).hexdigest()[:32]


class PublishingRecord(Record):
    """``_PUBLISHING.json``: written and sealed by publish (``core/seal.py``, domain ``publishing``, scope the run)
    before its first commit of the run's parts to ``io.output_table``; from then on merge never changes the parts
    (the table references them by path). One without this deployment's seal is ignored."""

    version: int = Field(1, description="record format version")
    table: str = Field(description="io.output_table.identifier: the table the parts are committed to")
    run_id: str = Field(description="the run id the table's snapshot summary carries (vllm-batch.run-id)")
    results_manifest_sha256: str | None = Field(None, description="sha256 of the results manifest being committed")
    report_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of qa/report.json of the QA verdict publish gated on: the baseline of "
        "qa.previous_published with changes.previous_table (absent: none, or a record from before this field)",
    )
    started: str = Field(description="UTC time publish began its commit (ISO 8601)")
    seal: Seal | None = Field(None, description="the publish task's seal (core/seal.py, domain publishing)")


class CacheCommit(Record):
    """``<cache.uri>/commits/<key_hash[:32]>/<entry_id>.json``: written create-only after every file it names,
    sealed by the merge that wrote the entry (``core/seal.py``, domain ``cache-entry``, scope the cache folder)."""

    version: int = Field(2, description="marker format version (2: sealed, per-row computed_at, compaction)")
    entry_id: str = Field(
        pattern=r"^[0-9a-f]{32}$",
        description="derived from the merge that filed the answers (spec hash + output URI + the sha256 of the "
        "parts its shards computed), or from the "
        "entries a compaction merged",
    )
    key_hash: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="the job's key config hash (steps/cache/key.py): rows of other configurations are never read",
    )
    files: list[CacheFileEntry] = Field(description="the entry's Parquet parts: entries/<entry_id>/part-NNNNN.parquet")
    rows: int = Field(ge=0, description="rows over all parts")
    source_output_uri: str = Field(description="output prefix of the run that computed the answers ('' compaction)")
    source_config_hash: str = Field(description="that run's config hash")
    source_spec_hash: str = Field(description="that run's spec hash")
    versions: dict[str, str | None] = Field(description="package versions of the writer")
    created: str = Field(description="UTC time of the commit (ISO 8601), as the sealing merge wrote it")
    supersedes: list[str] = Field(
        default_factory=list,
        description="a compaction: the entries whose rows this entry holds (their newest answer per key); a "
        "merge of a run merged before over other parts: the entries of its earlier merges; readers skip them",
    )
    seal: Seal | None = Field(None, description="the writing merge's seal; an entry without a valid one is never read")


class CacheVouch(Record):
    """``<cache.uri>/published/<key_hash[:32]>/<entry_id>.json``: an entry serves later runs only with this record,
    sealed by this deployment's publish once the run that made the entry was published (or by the compaction that
    made the entry from vouched entries only; ``core/seal.py``, domain ``cache-published``, scope the cache folder).
    It names the entry's commit by its seal: another commit later written under the same id is not vouched for."""

    version: int = Field(1, description="record format version")
    entry_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="the entry vouched for")
    key_hash: str = Field(pattern=r"^[0-9a-f]{64}$", description="its key config hash")
    commit_mac: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="the seal (mac) of the entry's commit this record vouches for"
    )
    vouched_by: Literal["publish", "compaction"] = Field(
        description="publish (the run that made the entry was published) or compaction (made from vouched entries)"
    )
    source_output_uri: str = Field(description="the published run's output prefix ('' compaction)")
    created: str = Field(description="UTC time the record was written (ISO 8601)")
    seal: Seal | None = Field(None, description="the writer's seal; an entry without a valid record is never read")


class CacheMergeSummary(Record):
    """What a merge took from the result cache and added to it."""

    uri: str = Field(description="the cache folder")
    hits: int = Field(description="rows answered from the cache (in results, with cached_from set)")
    appended: int = Field(description="ok rows of this run in this run's cache entry (0: none computed)")
    entry_id: str | None = Field(None, description="this run's cache entry (None: nothing to append)")
    committed_by: Literal["this_merge", "earlier_merge"] | None = Field(
        None, description="whether this merge wrote the entry's commit marker or found it (a rerun)"
    )
    commit_mac: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="the seal (mac) of this run's entry's commit as this merge wrote or found it: what publish "
        "vouches for (None: nothing appended, or merged before it was recorded: such an entry serves no later run)",
    )
    skipped: str | None = Field(
        None, description="why this run's rows were not appended (e.g. made by another engine than the key's)"
    )
    compacted_into: str | None = Field(
        None, description="the entry a compaction after this append merged the key config's live entries into"
    )


class DedupeMergeSummary(Record):
    """What the merge gave the rows that shared a leader's prompt (``plan.dedupe``)."""

    leaders: int = Field(description="rows inferred for themselves and for their followers")
    followers: int = Field(description="rows given their leader's answer or error (not sent to the engine)")
    ok_rows: int = Field(description="followers in results/ (their leader's answer)")
    error_rows: int = Field(description="followers in errors/ (their leader's error)")


class GoldenSummary(RowCounts):
    """``golden/_golden.json``: the golden rows of a run, verified and published apart from its results
    (written after the two files it names)."""

    shards: int = Field(description="golden shards")
    input_file: str = Field(description="the plan's golden input file (ids and known labels) under the output prefix")
    files: dict[str, str] = Field(description="'results' / 'errors' -> path under the output prefix")
    checksums: dict[str, str] = Field(description="path -> sha256 of the two files")
    sizes: dict[str, int] | None = Field(
        default=None, description="path -> size in bytes of the two files (None: merged by an earlier version)"
    )


MergeSummary.model_rebuild()  # its ``cache`` field names a record defined below it
