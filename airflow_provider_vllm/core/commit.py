"""The shard commit protocol (attempt-private chunks, create-only commit marker).

Layout under the run's output prefix::

    shards/<shard_id>/attempts/<attempt_id>/chunk-00000.errors.parquet  the chunk's error rows (ERROR_SCHEMA)
    shards/<shard_id>/attempts/<attempt_id>/chunk-00000.parquet         the chunk's ok rows (RESULT_SCHEMA)
    shards/<shard_id>/_COMMITTED.json                                   create-only; names the files
    shards/<shard_id>/_ENGINE_LIMITS.json                          engine limits an OOM lowered to (a hint)

A chunk is two part files, each already in its published schema (merge publishes them without
decoding): its error rows (always written, possibly empty, first) and its ok rows (written
last: its presence says the chunk is complete). Each file is complete or absent (atomic
write). A later attempt reuses a chunk of an earlier attempt when both its files are there and
both footers match (same shard, chunk, rows, config; which part; their rows add up), so a retry
after a crash only redoes unfinished chunks. The first attempt to create the marker
wins; a second commit is a no-op, and nothing downstream reads files the marker does not name.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ConfigDict, Field, ValidationError

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.records import Record, RowCounts, ShardStats
from airflow_provider_vllm.core.rows import split_rows
from airflow_provider_vllm.core.storage import Storage

MARKER = "_COMMITTED.json"
LIMITS = "_ENGINE_LIMITS.json"
FOOTER_KEY = "vllm_batch.chunk"
PART_KEY = "vllm_batch.part"  # footer: 'results' or 'errors'
_LIMIT_KEYS = ("max_num_seqs", "max_num_batched_tokens")
_CHUNK_RE = re.compile(r"^chunk-(\d{5})\.parquet$")
ERRORS_SUFFIX = ".errors.parquet"


def new_attempt_id() -> str:
    """Unique per worker process: time, host and a random suffix (sortable by start time)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:24]
    return f"a{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ChunkMeta(Record):
    """What identifies a chunk's content; stored in the Parquet footer and checked on reuse."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_id: str = Field(description="the shard")
    chunk: int = Field(description="chunk number within the shard")
    first_row: int = Field(description="shard-relative index of the chunk's first row")
    rows: int = Field(description="rows in the chunk")
    config_hash: str = Field(description="the plan's output-affecting config hash")

    def to_kv(self) -> dict[str, str]:
        return {FOOTER_KEY: json.dumps(self.model_dump(), sort_keys=True)}


class PartFile(Record):
    """One Parquet part file: where it is, its size, checksum and rows."""

    path: str = Field(description="path under the output prefix")
    bytes: int = Field(description="file size")
    sha256: str = Field(description="sha256 of the file's bytes")
    rows: int = Field(description="rows in the file")


class FileEntry(RowCounts):
    """One chunk named by a commit marker: its ok-rows file (``path``) and its error-rows file (``errors``).

    ``rows`` = ``ok_rows`` (in ``path``) + ``error_rows`` (in ``errors``). ``errors`` is None only
    in markers of workers before 0.2 (one file of mixed rows), which merge refuses.
    """

    path: str = Field(description="the ok rows: shards/<shard>/attempts/<attempt>/chunk-NNNNN.parquet (RESULT_SCHEMA)")
    bytes: int = Field(description="size of the ok-rows file")
    sha256: str = Field(description="sha256 of the ok-rows file's bytes")
    errors: PartFile | None = Field(
        None, description="the error rows: .../chunk-NNNNN.errors.parquet (ERROR_SCHEMA), written even when empty"
    )

    def parts(self) -> tuple[PartFile, PartFile | None]:
        """(ok-rows part, error-rows part)."""
        return PartFile(path=self.path, bytes=self.bytes, sha256=self.sha256, rows=self.ok_rows), self.errors


class CommitMarker(RowCounts):
    """``shards/<shard_id>/_COMMITTED.json``: the files of the shard's winning attempt, their rows, how it ran."""

    shard_id: str = Field(description="the shard")
    attempt_id: str = Field(description="the attempt that committed")
    config_hash: str = Field(description="the plan's output-affecting config hash")
    spec_hash: str = Field(description="the plan's spec hash")
    plan_fingerprint: str = Field(description="the plan's input fingerprint")
    files: list[FileEntry] = Field(description="the shard's chunk files, in chunk order")
    stats: ShardStats = Field(default_factory=ShardStats, description="the committing attempt's statistics")
    versions: dict[str, str | None] = Field(default_factory=dict, description="package, engine and model versions")
    committed_at: str = Field(description="UTC time of the commit")


class ShardStore:
    """The files of one shard under a run's output prefix."""

    def __init__(self, out: Storage, shard_id: str):
        self.out = out
        self.shard_id = shard_id
        self.dir = f"shards/{shard_id}"

    # ---- marker ---------------------------------------------------------------------
    def marker(self) -> CommitMarker | None:
        """The shard's commit marker, None when absent; CommitError when it is not a valid marker."""
        rel = f"{self.dir}/{MARKER}"
        if not self.out.exists(rel):
            return None
        raw = self.out.read_bytes(rel)
        try:
            return CommitMarker.model_validate_json(raw)
        except ValidationError as e:
            what = (
                "is not valid JSON" if any(x["type"] == "json_invalid" for x in e.errors()) else "is not a valid marker"
            )
            raise CommitError(f"commit marker {self.out.uri(rel)} {what}: {e}") from e

    def commit(self, marker: CommitMarker) -> bool:
        """Create the marker; False when another attempt committed first (then nothing changes)."""
        body = json.dumps(marker.dump(), indent=1, sort_keys=True).encode()
        faults.hit("commit.after_data")
        with faults.writing("commit.mid_marker"):
            created = self.out.create_only(f"{self.dir}/{MARKER}", body)
        faults.hit("commit.after_marker")
        return created

    # ---- engine limits carried across attempts ---------------------------------------
    def engine_limits(self) -> dict[str, int] | None:
        """The limits an earlier attempt lowered to after running out of memory, or None.

        A hint only: an unreadable or odd file is ignored (the next OOM lowers again).
        """
        rel = f"{self.dir}/{LIMITS}"
        try:
            if not self.out.exists(rel):
                return None
            doc = json.loads(self.out.read_bytes(rel))
            lim = {k: int(doc[k]) for k in _LIMIT_KEYS}
        except (ValueError, KeyError, TypeError, OSError):
            return None
        return lim if all(v >= 1 for v in lim.values()) else None

    def save_engine_limits(self, limits: dict[str, int], attempt_id: str) -> None:
        """Record lowered limits so a retry starts there instead of running out of memory again."""
        doc: dict[str, Any] = {k: int(limits[k]) for k in _LIMIT_KEYS}
        doc.update(attempt_id=attempt_id, at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self.out.write_atomic(f"{self.dir}/{LIMITS}", json.dumps(doc, sort_keys=True).encode())

    # ---- chunks ---------------------------------------------------------------------
    def chunk_rel(self, attempt_id: str, chunk: int) -> str:
        """The chunk's ok-rows file (its presence marks the chunk complete)."""
        return f"{self.dir}/attempts/{attempt_id}/chunk-{chunk:05d}.parquet"

    def write_chunk(self, attempt_id: str, meta: ChunkMeta, table: pa.Table) -> FileEntry:
        """Write one chunk (a ``ROW_SCHEMA`` table) as its two part files, atomically each; returns its entry.

        The error rows first, the ok rows last: a crash in between leaves no ok-rows file, so
        the chunk is not complete and a retry redoes it.
        """
        if table.num_rows != meta.rows:
            raise CommitError(f"chunk {meta.chunk} of {self.shard_id}: {table.num_rows} rows, expected {meta.rows}")
        ok, err = split_rows(table)
        rel = self.chunk_rel(attempt_id, meta.chunk)
        err_rel = errors_rel(rel)
        faults.hit("chunk.before_write")
        with faults.writing("chunk.mid_file"):
            self.out.write_parquet_atomic(err_rel, err, metadata={**meta.to_kv(), PART_KEY: "errors"})
            faults.hit("chunk.between_parts")
            self.out.write_parquet_atomic(rel, ok, metadata={**meta.to_kv(), PART_KEY: "results"})
        faults.hit("chunk.after_write")
        return self.file_entry(rel, ok.num_rows, err.num_rows)

    def file_entry(self, rel: str, ok_rows: int | None = None, error_rows: int | None = None) -> FileEntry:
        """The marker entry of the chunk whose ok-rows file is ``rel`` (rows from the footers when not given)."""
        err_rel = errors_rel(rel)
        if ok_rows is None or error_rows is None:
            ok_rows, error_rows = _footer_rows(self.out, rel), _footer_rows(self.out, err_rel)
        errors = PartFile(path=err_rel, rows=error_rows, bytes=self.out.size(err_rel), sha256=self.out.sha256(err_rel))
        return FileEntry(
            path=rel,
            rows=ok_rows + error_rows,
            ok_rows=ok_rows,
            error_rows=error_rows,
            bytes=self.out.size(rel),
            sha256=self.out.sha256(rel),
            errors=errors,
        )

    def reusable_chunks(
        self, expected: dict[int, ChunkMeta], beat: Callable[[], None] = lambda: None
    ) -> dict[int, str]:
        """Complete chunks left by any attempt whose footer matches ``expected``; chunk -> path.

        ``beat()`` after each listing and footer read (the worker's watchdog counts them as progress).
        """
        found: dict[int, str] = {}
        for attempt in self.out.listdir(f"{self.dir}/attempts"):
            beat()
            for name in self.out.listdir(f"{self.dir}/attempts/{attempt}"):
                m = _CHUNK_RE.match(name)
                if not m:
                    continue  # temp files of a killed writer
                k = int(m.group(1))
                if k in found or k not in expected:
                    continue
                rel = f"{self.dir}/attempts/{attempt}/{name}"
                ok_rows = _footer_matches(self.out, rel, expected[k], "results")
                err_rows = (
                    _footer_matches(self.out, errors_rel(rel), expected[k], "errors") if ok_rows is not None else None
                )
                if ok_rows is not None and err_rows is not None and ok_rows + err_rows == expected[k].rows:
                    found[k] = rel
                beat()
        return found


def errors_rel(rel: str) -> str:
    """The error-rows file next to the ok-rows file ``rel`` (chunk-NNNNN.parquet -> chunk-NNNNN.errors.parquet)."""
    return rel[: -len(".parquet")] + ERRORS_SUFFIX


def _footer_rows(out: Storage, rel: str) -> int:
    with out.open(rel) as f:
        return int(pq.ParquetFile(f).metadata.num_rows)


def _footer_matches(out: Storage, rel: str, meta: ChunkMeta, part: str) -> int | None:
    """The file's rows when its footer is this chunk's ``part`` ('results' | 'errors'); None otherwise."""
    try:
        faults.hit("reuse.footer")  # inside the broad except: a stop request here must still stop
        with out.open(rel) as f:
            md = pq.ParquetFile(f).metadata
    except Exception:  # unreadable or absent: the chunk is redone (never a BaseException: SIGTERM)
        return None
    kv = md.metadata or {}
    raw = kv.get(FOOTER_KEY.encode())
    if raw is None or kv.get(PART_KEY.encode()) != part.encode():
        return None
    try:
        stored = ChunkMeta.model_validate_json(raw)
    except ValidationError:
        return None
    return int(md.num_rows) if stored == meta and md.num_rows <= meta.rows else None
