"""The shard commit protocol (attempt-private chunks, create-only commit marker).

Layout under the run's output prefix::

    shards/<shard_id>/attempts/<attempt_id>/chunk-00000.errors.parquet  the chunk's error rows (ERROR_SCHEMA)
    shards/<shard_id>/attempts/<attempt_id>/chunk-00000.parquet         the chunk's ok rows (RESULT_SCHEMA)
    shards/<shard_id>/attempts/<attempt_id>/chunk-00000.seal.json       the worker's seal over both (written last)
    shards/<shard_id>/_COMMITTED.json                                   create-only, sealed; names the files
    shards/<shard_id>/_ENGINE_LIMITS.json                          engine limits an OOM lowered to (a hint)

A chunk is two part files, each already in its published schema (merge publishes them without
decoding): its error rows (always written, possibly empty, first) and its ok rows (written
last), then its seal (``ChunkSeal``: both files' sizes, sha256 and rows, the chunk's identity and
the plan it was made under, sealed with the deployment's key, ``core/seal.py``): the seal says the
chunk is complete. Each file is complete or absent (atomic write). A later attempt reuses a chunk
of an earlier attempt only when its seal verifies, names this chunk of this plan, and both files
still have the sealed size and sha256, so a retry after a crash only redoes unfinished chunks,
and a file that another writer of the bucket put there is never reused. The commit marker is
sealed the same way. The first attempt to create the marker wins; a second commit is a no-op, and
nothing downstream reads files that a verified marker does not name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pydantic import ConfigDict, Field, ValidationError, field_validator

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.errors import CommitError, LinkRefused, ListingTooLarge, SealError, SpecError
from airflow_provider_vllm.core.part_names import run_file
from airflow_provider_vllm.core.records import FileBytes, FileRef, Record, RowCounts, Sha256, ShardStats
from airflow_provider_vllm.core.rows import split_rows
from airflow_provider_vllm.core.seal import Keyring, Seal
from airflow_provider_vllm.core.storage import Storage

log = logging.getLogger(__name__)
PROBE_DIR = "_probes"  # create-only probe objects (removed after the probe; ignored if one stays)
PartFile = FileRef  # one part file: path, bytes, sha256, rows
MARKER = "_COMMITTED.json"
LIMITS = "_ENGINE_LIMITS.json"
FOOTER_KEY = "vllm_batch.chunk"
PART_KEY = "vllm_batch.part"  # footer: 'results' or 'errors'
_LIMIT_KEYS = ("max_num_seqs", "max_num_batched_tokens")
_LIMITS_MAX_BYTES = 1 << 16  # the hint is a few dozen bytes
# A chunk's number as its file names write it (``{k:05d}``): five digits, more from chunk 100000 on (a shard of
# more than 100,000 chunks: small ``sharding.chunk_rows``), never another spelling of the same number.
CHUNK_NUMBER = r"(\d{5}|[1-9]\d{5,})"
_CHUNK_RE = re.compile(rf"^chunk-{CHUNK_NUMBER}\.parquet$")
ATTEMPTS_LISTED = 1000
"""The most attempt folders of one shard listed for chunks to reuse: each try of the shard task (a retry, a
cleared task, a zombie pod) makes one; a shard with more is not scanned (a warning names it; its chunks are
redone)."""
REUSE_LISTED_PER_CHUNK = 8
"""With ``REUSE_LISTED_SLACK``, the most entries of all of a shard's attempt folders listed together for reuse:
an attempt writes three files per chunk (its part, its errors part, its seal), and killed writers leave temp
files. Past it the scan stops (a warning names the folder and the bound) and the chunks not found are redone."""
REUSE_LISTED_SLACK = 1000
_SEAL_RE = re.compile(rf"^chunk-{CHUNK_NUMBER}\.seal\.json$")
ERRORS_SUFFIX = ".errors.parquet"
SEAL_SUFFIX = ".seal.json"


@dataclass(frozen=True)
class RunSeal:
    """How one run's shard records are sealed and checked: the deployment's keys, and the plan's own seal
    (``plan_mac``), so that a chunk or marker of another plan, run or folder never verifies here."""

    keyring: Keyring
    plan_mac: str


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
    """One chunk named by a commit marker: its ok-rows file (``path``) and its error-rows file (``errors``).

    ``rows`` = ``ok_rows`` (in ``path``) + ``error_rows`` (in ``errors``). ``errors`` is None only
    in markers of workers before 0.2 (one file of mixed rows), which merge refuses.
    """

    path: str = Field(description="the ok rows: shards/<shard>/attempts/<attempt>/chunk-NNNNN.parquet (RESULT_SCHEMA)")
    bytes: FileBytes = Field(description="size of the ok-rows file")
    sha256: Sha256 = Field(description="sha256 of the ok-rows file's bytes")
    errors: PartFile | None = Field(
        None, description="the error rows: .../chunk-NNNNN.errors.parquet (ERROR_SCHEMA), written even when empty"
    )

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        return run_file(v)

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
    plan_mac: str | None = Field(None, description="the seal of the plan the shard ran under (its mac)")
    engine_identity: str | None = Field(
        None,
        description="the engine that ran (vLLM distribution and version, the env that reached it; "
        "steps/cache/key.py), as the worker saw it: the result cache appends rows only when it is the key's",
    )
    prompt_reads_clock: bool | None = Field(
        None,
        description="whether the job's chat template renders another prompt on another day (transformers' "
        "strftime_now, e.g. Llama 3.x's 'Today Date'), as this attempt's worker probed it (worker/prompts.py); "
        "None: not probed (no engine started, or a worker before it was): the result cache appends a chat job's "
        "rows only when every shard's is false",
    )
    seal: Seal | None = Field(None, description="the committing worker's seal (core/seal.py, domain commit)")


class ChunkSeal(Record):
    """``chunk-NNNNN.seal.json`` beside a chunk's two files: the writing worker vouches for both (written last)."""

    meta: ChunkMeta = Field(description="which chunk of which shard (and config)")
    plan_mac: str = Field(description="the seal of the plan the chunk was made under (its mac)")
    entry: FileEntry = Field(description="the chunk's files: the ok rows (path) and the error rows (errors)")
    engine_identity: str | None = Field(
        None,
        description="the engine that made the chunk's rows, as its worker saw it (CommitMarker.engine_identity); "
        "None: a worker before it was recorded. An attempt that reuses the chunk names it in its marker",
    )
    seal: Seal | None = Field(None, description="the worker's seal (core/seal.py, domain chunk)")


class ShardStore:
    """The files of one shard under a run's output prefix."""

    def __init__(self, out: Storage, shard_id: str, run: RunSeal):
        self.out = out
        self.shard_id = shard_id
        self.dir = f"shards/{shard_id}"
        self.run = run
        self.scope = seals.scope_of(out.uri())

    # ---- marker ---------------------------------------------------------------------
    def marker(self) -> CommitMarker | None:
        """The shard's commit marker, None when absent.

        CommitError when it is not a valid marker; SealError when it is not sealed by this deployment's worker
        for this shard of this run's plan (another writer of the bucket wrote or changed it).
        """
        rel = f"{self.dir}/{MARKER}"
        if not self.out.exists(rel):
            return None
        raw = self.out.read_bytes(rel)
        try:
            m = CommitMarker.model_validate_json(raw)
        except ValidationError as e:
            what = (
                "is not valid JSON" if any(x["type"] == "json_invalid" for x in e.errors()) else "is not a valid marker"
            )
            raise CommitError(f"commit marker {self.out.uri(rel)} {what}: {e}") from e
        seals.verify_record(self.run.keyring, seals.COMMIT, self.scope, m, f"commit marker {self.out.uri(rel)}")
        if m.shard_id != self.shard_id or m.plan_mac != self.run.plan_mac:
            raise SealError(
                f"commit marker {self.out.uri(rel)} is sealed for shard {m.shard_id!r} of another plan, not shard "
                f"{self.shard_id} of this run's plan; refusing it"
            )
        return m

    def commit(self, marker: CommitMarker) -> bool:
        """Seal and create the marker; False when another attempt committed first (then nothing changes)."""
        marker = seals.seal_record(
            self.run.keyring, seals.COMMIT, self.scope, marker.model_copy(update={"plan_mac": self.run.plan_mac})
        )
        body = seals.record_bytes(marker)
        faults.hit("commit.after_data")
        with faults.writing("commit.mid_marker"):
            created = self.out.create_only(f"{self.dir}/{MARKER}", body)
        faults.hit("commit.after_marker")
        return created

    # ---- engine limits carried across attempts ---------------------------------------
    def engine_limits(self) -> dict[str, int] | None:
        """The limits an earlier attempt lowered to after running out of memory, or None.

        A hint only, in a file whoever writes the bucket can replace: an unreadable or odd file (not a regular
        file, larger than a hint, JSON nested too deep, a number that is no integer) is ignored with a warning, never
        the shard's failure (the next OOM lowers again).
        """
        rel = f"{self.dir}/{LIMITS}"
        try:
            if not self.out.exists(rel):
                return None
            doc = json.loads(self.out.read_bytes(rel, limit=_LIMITS_MAX_BYTES))
            lim = {k: int(doc[k]) for k in _LIMIT_KEYS}
        except Exception as e:  # never a BaseException: a stop request still stops
            log.warning("ignoring the engine limits hint %s: %s", self.out.uri(rel), str(e)[:200])
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

    def write_chunk(
        self,
        attempt_id: str,
        meta: ChunkMeta,
        table: pa.Table,
        passthrough: pa.Table | None = None,
        engine_identity: str | None = None,
        seal: bool = True,
    ) -> FileEntry:
        """Write one chunk (a ``ROW_SCHEMA`` table) as its two part files, atomically each, then its seal;
        returns its entry. ``passthrough``: the chunk's passthrough columns, a row per row (``rows.split_rows``);
        ``engine_identity``: the engine that made the rows (sealed with the chunk, ``ChunkSeal``); ``seal``
        False: no seal yet (``seal_chunk`` later): until then no attempt reuses the chunk.

        The error rows first, the ok rows next, the seal last: a crash before the seal leaves a chunk
        that is not complete, and a retry redoes it.
        """
        if table.num_rows != meta.rows:
            raise CommitError(f"chunk {meta.chunk} of {self.shard_id}: {table.num_rows} rows, expected {meta.rows}")
        ok, err = split_rows(table, passthrough)
        rel = self.chunk_rel(attempt_id, meta.chunk)
        err_rel = errors_rel(rel)
        faults.hit("chunk.before_write")
        with faults.writing("chunk.mid_file"):
            err_size, err_sha = self.out.write_parquet_atomic(
                err_rel, err, metadata={**meta.to_kv(), PART_KEY: "errors"}
            )
            faults.hit("chunk.between_parts")
            ok_size, ok_sha = self.out.write_parquet_atomic(rel, ok, metadata={**meta.to_kv(), PART_KEY: "results"})
        entry = FileEntry(
            path=rel,
            rows=ok.num_rows + err.num_rows,
            ok_rows=ok.num_rows,
            error_rows=err.num_rows,
            bytes=ok_size,
            sha256=ok_sha,
            errors=PartFile(path=err_rel, rows=err.num_rows, bytes=err_size, sha256=err_sha),
        )
        if seal:
            self.seal_chunk(meta, entry, engine_identity)
        return entry

    def seal_chunk(self, meta: ChunkMeta, entry: FileEntry, engine_identity: str | None = None) -> None:
        """Write the seal of a chunk ``write_chunk`` wrote (``entry``): from then on an attempt may reuse it."""
        faults.hit("chunk.before_seal")
        sealed = seals.seal_record(
            self.run.keyring,
            seals.CHUNK,
            self.scope,
            ChunkSeal(meta=meta, plan_mac=self.run.plan_mac, entry=entry, engine_identity=engine_identity),
        )
        self.out.write_atomic(seal_rel(entry.path), seals.record_bytes(sealed))
        faults.hit("chunk.after_write")

    def reusable_chunks(
        self, expected: dict[int, ChunkMeta], beat: Callable[[], None] = lambda: None
    ) -> dict[int, FileEntry]:
        """``reusable_seals``' chunks, chunk -> entry."""
        return {k: s.entry for k, s in self.reusable_seals(expected, beat).items()}

    def reusable_seals(
        self, expected: dict[int, ChunkMeta], beat: Callable[[], None] = lambda: None
    ) -> dict[int, ChunkSeal]:
        """Complete chunks left by any attempt that this deployment's worker sealed for ``expected``; chunk -> seal
        (its entry, and the engine that made it).

        A chunk is reused only when its seal verifies (this run, this plan, this chunk's identity) and both
        its files still have the sealed size and sha256; anything else (a writer's temp file, a chunk
        killed before its seal, a file another writer of the bucket put or changed) is ignored and the
        chunk is redone. ``beat()`` after each listing and file check (the worker's watchdog counts them).
        """
        found: dict[int, ChunkSeal] = {}
        budget = REUSE_LISTED_PER_CHUNK * len(expected) + REUSE_LISTED_SLACK
        try:
            attempts = self.out.listdir(f"{self.dir}/attempts", limit=ATTEMPTS_LISTED)
        except ListingTooLarge as e:
            log.warning("no chunk of this shard is reused: %s", e)
            return found
        for attempt in attempts:
            beat()
            folder = f"{self.dir}/attempts/{attempt}"
            try:
                names = self.out.listdir(folder, limit=budget)
            except ListingTooLarge:
                log.warning(
                    "the shard's attempt folders hold more than the %d entries listed to find chunks to reuse "
                    "(stopped at %s; another writer of the folder put them there?): the chunks not found are redone",
                    REUSE_LISTED_PER_CHUNK * len(expected) + REUSE_LISTED_SLACK,
                    self.out.uri(folder),
                )
                return found
            except LinkRefused as e:
                log.warning("an attempt folder of this shard is not scanned for chunks to reuse: %s", e)
                continue
            budget -= len(names)
            for name in names:
                m = _SEAL_RE.match(name)
                if not m:
                    continue  # the part files themselves, temp files of a killed writer
                k = int(m.group(1))
                if k in found or k not in expected:
                    continue
                sealed = self._sealed_chunk(f"{self.dir}/attempts/{attempt}", k, expected[k])
                if sealed is not None:
                    found[k] = sealed
                beat()
        return found

    def _sealed_chunk(self, folder: str, k: int, meta: ChunkMeta) -> ChunkSeal | None:
        """The seal of chunk ``k`` in ``folder`` when it and both files check out, else None."""
        rel = f"{folder}/chunk-{k:05d}.parquet"
        try:
            faults.hit("reuse.footer")  # inside the broad except: a stop request here must still stop
            doc = ChunkSeal.model_validate_json(self.out.read_bytes(seal_rel(rel)))
            seals.verify_record(self.run.keyring, seals.CHUNK, self.scope, doc, self.out.uri(seal_rel(rel)))
            e = doc.entry
            if (
                doc.meta != meta
                or doc.plan_mac != self.run.plan_mac
                or e.path != rel
                or e.errors is None
                or e.errors.path != errors_rel(rel)
                or e.ok_rows + e.errors.rows != meta.rows
            ):
                return None
            for f in e.parts():
                if f is None or self.out.sha256(f.path, f.bytes) != f.sha256:
                    return None
        except Exception:  # unreadable, absent, forged: the chunk is redone (never a BaseException: SIGTERM)
            return None
        return doc


def seal_rel(rel: str) -> str:
    """The seal next to the ok-rows file ``rel`` (chunk-NNNNN.parquet -> chunk-NNNNN.seal.json)."""
    return rel[: -len(".parquet")] + SEAL_SUFFIX


def errors_rel(rel: str) -> str:
    """The error-rows file next to the ok-rows file ``rel`` (chunk-NNNNN.parquet -> chunk-NNNNN.errors.parquet)."""
    return rel[: -len(".parquet")] + ERRORS_SUFFIX


def probe_create_only(out: Storage, store: str) -> None:
    """Refuse (SpecError, terminal) a store that does not honour create-only writes.

    The commit protocol rests on write-if-absent (``Storage.create_only``: link locally,
    ``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS): the first attempt to commit a
    shard wins and a marker never changes. Stores differ (s3fs documents ``mode="create"`` as
    known to work on AWS S3 only; S3-compatible servers and emulators may ignore the
    precondition and overwrite), so before anything is planned this writes one new probe
    object create-only twice: the first write must succeed, the second must be refused, and
    the object must still hold the first body. Transient storage errors stay transient.
    """
    rel = f"{PROBE_DIR}/create-only-{uuid.uuid4().hex}"
    first, second = f"probe 1 {rel}".encode(), f"probe 2 {rel}".encode()
    need = (
        "the commit protocol needs write-if-absent (S3: If-None-Match: *, GCS: ifGenerationMatch=0, local "
        "files: link) so that a shard's commit marker is written once and never replaced; use a store that "
        "enforces it"
    )
    try:
        try:
            made = out.create_only(rel, first)
            again = out.create_only(rel, second) if made else None
            body = out.read_bytes(rel) if made else None
        except (NotImplementedError, OSError) as e:
            raise SpecError(
                f"output store {store}: a create-only write of the probe object {out.uri(rel)} failed "
                f"({type(e).__name__}: {e}); {need}"
            ) from None
    finally:
        try:
            out.remove(rel)
            out.rmdir(PROBE_DIR)  # only when empty: a racing plan's probe may be there
        except Exception as e:  # e.g. no delete permission: the probe object stays, ignored by the plan
            if not out.is_local or out.exists(rel):
                log.warning("could not remove the create-only probe object %s: %s", out.uri(rel), e)
    if not made:
        raise SpecError(
            f"output store {store}: the first create-only write of a new probe object {out.uri(rel)} "
            f"was refused as if it existed; {need}"
        )
    if again or body != first:
        what = "succeeded and replaced it" if again else "was reported refused, but the object was replaced"
        raise SpecError(
            f"output store {store} does not honour create-only writes: a second create-only write of "
            f"the probe object {out.uri(rel)} {what}. {need[0].upper()}{need[1:]}"
        )
