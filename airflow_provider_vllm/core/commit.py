"""The shard commit protocol (attempt-private chunks, create-only commit marker).

Layout under the run's output prefix::

    shards/<shard_id>/attempts/<attempt_id>/chunk-00000.parquet   written atomically, one per chunk
    shards/<shard_id>/_COMMITTED.json                              create-only; names the files
    shards/<shard_id>/_ENGINE_LIMITS.json                          engine limits an OOM lowered to (a hint)

A chunk file is complete or absent (atomic write). A later attempt reuses any complete chunk
of an earlier attempt whose footer metadata matches (same shard, chunk, rows, config), so a
retry after a crash only redoes unfinished chunks. The first attempt to create the marker
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
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import ConfigDict, Field, ValidationError

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.records import Record, RowCounts, ShardStats
from airflow_provider_vllm.core.storage import Storage

MARKER = "_COMMITTED.json"
LIMITS = "_ENGINE_LIMITS.json"
FOOTER_KEY = "vllm_batch.chunk"
_LIMIT_KEYS = ("max_num_seqs", "max_num_batched_tokens")
_CHUNK_RE = re.compile(r"^chunk-(\d{5})\.parquet$")


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


class FileEntry(RowCounts):
    """One chunk file named by a commit marker, with its rows."""

    path: str = Field(description="path under the output prefix: shards/<shard>/attempts/<attempt>/chunk-NNNNN.parquet")
    bytes: int = Field(description="file size")
    sha256: str = Field(description="sha256 of the file's bytes")


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
            what = "is not valid JSON" if any(x["type"] == "json_invalid" for x in e.errors()) else "is not a valid marker"
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
        return f"{self.dir}/attempts/{attempt_id}/chunk-{chunk:05d}.parquet"

    def write_chunk(self, attempt_id: str, meta: ChunkMeta, table: pa.Table) -> FileEntry:
        """Write one chunk atomically; returns its file entry for the marker."""
        if table.num_rows != meta.rows:
            raise CommitError(f"chunk {meta.chunk} of {self.shard_id}: {table.num_rows} rows, expected {meta.rows}")
        rel = self.chunk_rel(attempt_id, meta.chunk)
        faults.hit("chunk.before_write")
        with faults.writing("chunk.mid_file"):
            self.out.write_parquet_atomic(rel, table, metadata=meta.to_kv())
        faults.hit("chunk.after_write")
        return self.file_entry(rel, table)

    def file_entry(self, rel: str, table: pa.Table | None = None) -> FileEntry:
        if table is None:
            with self.out.open(rel) as f:
                table = pq.read_table(f, columns=["status"])
        ok = int(pc.sum(pc.equal(table.column("status"), "ok")).as_py() or 0)
        return FileEntry(path=rel, rows=table.num_rows, ok_rows=ok, error_rows=table.num_rows - ok,
                         bytes=self.out.size(rel), sha256=self.out.sha256(rel))

    def reusable_chunks(self, expected: dict[int, ChunkMeta],
                        beat: Callable[[], None] = lambda: None) -> dict[int, str]:
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
                if _footer_matches(self.out, rel, expected[k]):
                    found[k] = rel
                beat()
        return found


def _footer_matches(out: Storage, rel: str, meta: ChunkMeta) -> bool:
    try:
        faults.hit("reuse.footer")  # inside the broad except: a stop request here must still stop
        with out.open(rel) as f:
            md = pq.ParquetFile(f).metadata
    except Exception:  # unreadable: treat as absent, the chunk is redone (never a BaseException: SIGTERM)
        return False
    raw = (md.metadata or {}).get(FOOTER_KEY.encode())
    if raw is None:
        return False
    try:
        stored = ChunkMeta.model_validate_json(raw)
    except ValidationError:
        return False
    return stored == meta and md.num_rows == meta.rows
