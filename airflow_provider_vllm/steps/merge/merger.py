"""Merge: committed shards -> the published ``results/`` and ``errors/`` folders, verified against the input ids.

Reads only files that commit markers name, and only when each lies under its own shard's
attempt folders (``shards/<shard_id>/attempts/<attempt>/chunk-NNNNN.parquet`` for ok rows,
``chunk-NNNNN.errors.parquet`` for error rows; a marker naming another shard's file, or any
other path, is refused) and matches the size and sha256 the marker records. The workers wrote
each part in its published schema (``core.rows.RESULT_SCHEMA`` / ``ERROR_SCHEMA``, with the plan's
passthrough columns appended: ``Plan.result_schema``), so merge
publishes them *by reference*, without decoding: a hard link (a copy across filesystems) or a
server-side copy on object stores, into ``results/part-<n>-<shard>-<chunk>.parquet`` and
``errors/...`` (names sort in plan order; empty error parts are left out; a folder with no rows
gets one empty part so every reader sees the schema), then ``_manifest.json`` per folder
(``PartsManifest``), then ``_MERGED.json`` last: the "complete" signal.

Verification reads only the id column of the parts. Where every shard reads the input itself, each
shard's parts are compared, row by row in input order, with its own input rows (``ordered.py``: streaming,
exact, no hash table of the run); elsewhere one exact semi-join of the input ids against the parts' ids
proves the common case. When either fails, every part is copied to local disk, checked against its sealed
record as it is copied, and what follows reads those copies only: duplicate ids across committed parts are
counted *before* anything is dropped; identical duplicates (same status and content;
provenance columns such as the attempt may differ) are dropped and reported (``duplicates``),
which re-encodes only the parts that held the dropped copies (from the same checked copies); copies whose
content differs fail the merge, naming the ids. Then input ids == result ids + error ids, no id twice, and (order path)
each row is its shard's, in input order.
A rerun after a crash at any step converges to the same bytes; files in ``results/`` or
``errors/`` that merge did not write are refused, stale parts of its own are removed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field, ValidationError

from airflow_provider_vllm import __version__
from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.commit import CHUNK_NUMBER, MARKER, CommitMarker, RunSeal, ShardStore
from airflow_provider_vllm.core.errors import CommitError, InputChangedError, VerificationError
from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.formats.files import check_unchanged
from airflow_provider_vllm.core.part_names import PART_NAME, check_inside
from airflow_provider_vllm.core.plan import Plan, PlanRef, load_plan
from airflow_provider_vllm.core.records import (
    DedupeMergeSummary,
    Duplicates,
    FileRef,
    MergeSummary,
    PartEntry,
    PartsManifest,
    PublishingRecord,
    ShardStatsEntry,
    committed_key,
)
from airflow_provider_vllm.core.rows import ERROR_SCHEMA, RESULT_SCHEMA, ROW_SCHEMA
from airflow_provider_vllm.core.seal import Keyring, Seal
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import (
    DISPLACED_NAME,
    CheckedCopies,
    FileSystems,
    Storage,
    copies_folder,
    hash_pool,
    is_temp_copy,
)
from airflow_provider_vllm.steps.cache import result_cache as cache
from airflow_provider_vllm.steps.golden import merge_golden
from airflow_provider_vllm.steps.merge import ordered

log = logging.getLogger(__name__)


class _Digested(Protocol):
    """A file reference with the size and sha256 its writer sealed (``SourcePart``, ``PartEntry``)."""

    @property
    def bytes(self) -> int: ...

    @property
    def sha256(self) -> str: ...


_P = TypeVar("_P", bound=_Digested)

RESULTS = "results"  # folder of Parquet parts (RESULT_SCHEMA, + the plan's passthrough columns)
ERRORS = "errors"  # folder of Parquet parts (ERROR_SCHEMA, + the plan's passthrough columns)
KINDS = (RESULTS, ERRORS)
MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS.json"  # written by publish (steps/publish.py) once the run is published
REPORT_JSON = "qa/report.json"  # QA's report (steps/qa/store.py): the one _PUBLISHING.json names
# written by publish before it commits the run's parts to an output table (the table then references them by path)
PUBLISHING = "_PUBLISHING.json"


@dataclasses.dataclass(frozen=True)
class Published:
    """Why a run's files may no longer change (``state``), what the operator can do (``remedy``), and the sha256 of
    each file its sealed publish record vouched for (``checksums``: path under the run -> sha256)."""

    state: str
    remedy: str
    checksums: Mapping[str, str] = dataclasses.field(default_factory=dict)


_NEW_PREFIX = "Merge into a new output prefix (io.output_uri)"
MERGED = "_MERGED.json"
OPENAI_OUT = "openai/output.jsonl"
OPENAI_ERR = "openai/errors.jsonl"
SCHEMAS = {RESULTS: RESULT_SCHEMA, ERRORS: ERROR_SCHEMA}
# Columns that say where and how fast a row was made, not what it is: two committed rows of one
# id that differ only here are the same result (e.g. one chunk named twice), anything else differs.
PROVENANCE_COLUMNS = ("shard_id", "attempt_id", "latency_ms", "cached_from")
DUPLICATE_EXAMPLES = 10
_ATTEMPT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK_NAME = {
    RESULTS: re.compile(rf"^chunk-{CHUNK_NUMBER}\.parquet$"),
    ERRORS: re.compile(rf"^chunk-{CHUNK_NUMBER}\.errors\.parquet$"),
}
_TMP_NAME = re.compile(r"^\.part-.*\.tmp-\d+$")


class SourcePart(FileRef):
    """A committed part file to publish: where it is (``path`` under the output prefix), what it must be (its
    sealed size, sha256 and rows), and its published name inside results/ or errors/."""

    name: str = Field(description="the published name inside results/ or errors/")

    @property
    def rel(self) -> str:
        return self.path


def merge(
    spec: JobSpec,
    memory_limit: str = "1GB",
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
    attempts: Mapping[str, str] | None = None,
    *,
    plan: PlanRef,
) -> MergeSummary:
    """Merge a run whose shards are all committed; returns the merge summary (also ``_MERGED.json``, sealed).

    ``plan``: the sealed plan to merge under, as the plan task named it (its XCom, ``PlanRef``; by hand:
    ``core.plan.current_plan_ref``, which takes whatever sealed plan the folder holds). CommitError, before
    anything is written, when ``_plan.json`` is another plan (an earlier sealed plan of this folder put back).

    ``filesystems``: how object stores are reached (``storage.FileSystems``; default fsspec).
    ``keyring``: the deployment's signing keys (default ``VLLM_BATCH_SIGNING_KEY``): the plan and every
    commit marker must carry this deployment's seal for this run, and every published part must have the
    size and sha256 its sealed marker (or the sealed plan, for the cache's hits) names.
    Raises CommitError (a marker missing, forged or not matching its files; a foreign file in
    results/ or errors/; a part whose bytes changed), SealError (a record not sealed by this deployment's
    pipeline for this run) or VerificationError (ids missing, extra, or committed twice with differing
    content). ``attempts``: shard id -> the attempt its shard task reported committing (the tasks' XComs):
    CommitError for a marker of another attempt (an earlier genuine one put back) or a shard not in it.
    """
    with copies_folder("merge") as tmp:
        return _merge(spec, memory_limit, filesystems, keyring, tmp, attempts, plan)


def _merge(
    spec: JobSpec,
    memory_limit: str,
    filesystems: FileSystems | None,
    keyring: Keyring | None,
    tmp: str,
    attempts: Mapping[str, str] | None,
    pinned: PlanRef,
) -> MergeSummary:
    """``merge``; ``tmp``: a private folder for the checked copies of what the merge reads again (the cache's
    entry, the followers, the golden rows are made from those copies, never from a second read of the bucket)."""
    t0 = time.monotonic()
    keyring = keyring or Keyring.from_env()
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    copies = CheckedCopies(out, tmp)
    plan = load_plan(spec, filesystems, keyring, pinned=pinned)  # the plan task's plan, not one put back
    if plan.spec_hash != spec.content_hash():
        raise CommitError(f"the plan at {spec.io.output_uri} was made for another spec; refusing to merge")
    assert plan.seal is not None
    # the computed parts the merge reads again (the cache's entry: results; the followers: both kinds) are checked
    # by copying them, once: those copies are what is read later, the others are checked by a streaming read
    again: tuple[str, ...] = ()
    if plan.dedupe is not None and plan.dedupe.followers_file is not None:
        again = KINDS
    elif plan.cache is not None:
        again = (RESULTS,)
    sources, markers = committed_parts(out, plan, RunSeal(keyring, plan.seal.mac), copies, again, attempts)
    # The one place for more result parts: the result cache's hits (the plan's hits file, a
    # RESULT_SCHEMA file checked against the sealed plan's sha256) are published like any committed
    # part, after the computed ones. The id verification, duplicate accounting and publishing
    # read every part from this dict.
    hits = cache.hits_part(out, plan, len(sources[RESULTS])) if plan.cache is not None else None
    if hits is not None:
        sources[RESULTS].append(SourcePart(**hits[0].model_dump(), name=hits[1]))
    # Rows that shared a prompt with an earlier row (plan.dedupe): their leader's row under their own id, one more
    # part per kind (checked below like every part: the exactly-once accounting covers them).
    followers = _follower_sources(out, plan, sources, copies)
    for kind in KINDS:
        check_folder(out, kind, len(sources[kind]))  # the cache's hits and the followers included
    # the input, or a materialized table's file as a local copy checked against the sealed plan's sha256
    in_root, input_checked = plan.input_storage(out, tmp)
    con = duck.connect(out, in_root, memory_limit=memory_limit)
    try:
        _ids_view(con, out, sources)
        check_footer_rows(con, out, sources)
        if not input_checked:
            check_unchanged(in_root, plan.files)
        register_input_ids(con, spec, plan, in_root)
        duplicates = Duplicates(ids=0, rows_dropped=0, examples=[])
        drop: dict[str, list[int]] = {}
        # Each shard's parts against its own input rows in order (streaming, exact; steps/merge/ordered.py) where
        # every shard reads the input itself; else one exact semi-join of all ids. Either proves exactly-once on
        # the common path; anything else goes to the detailed checks below.
        by_order = ordered.why_not(plan) is None
        findings: list[str] = []
        if by_order:
            findings = ordered.check(out, in_root, plan, spec.prompt.id_column, _shard_parts(plan, sources))
            proven = None if findings else plan.total_rows
        else:
            proven = exactly_once(con, plan.total_rows)
        total = distinct = proven or 0
        if proven is None:  # something is off: count duplicates first (they explain a shortfall), then name it
            # The reads above only sent merge here: whoever else writes the prefix may have changed a part while
            # merge read it. What is counted, which copies are dropped and the exactly-once proof are decided on
            # local copies of every part checked against its sealed record (the ones the dropped copies are
            # re-encoded from), never on another read of the prefix.
            checked = _checked_parts(copies, sources)
            check_footer_rows(con, out, sources, checked)
            con.execute("DROP VIEW ids")
            _ids_view(con, out, sources, checked)
            if by_order:  # what the order check finds on the checked bytes: named when the ids do not add up
                findings = ordered.check(
                    out, in_root, plan, spec.prompt.id_column, _shard_parts(plan, sources, local=checked)
                )
            # Distinct 64-bit hashes == rows proves distinct ids (equal ids hash equal) and is
            # cheaper than distinct strings; only a shortfall (a duplicate or a collision) pays for
            # the exact count.
            total, distinct = con.execute("SELECT count(*), count(DISTINCT hash(id)) FROM ids").fetchall()[0]
            if distinct != total:
                distinct = con.execute("SELECT count(DISTINCT id) FROM ids").fetchall()[0][0]
            if total != distinct:
                # Only a bug or a hand-edited marker gets here. Counted before anything is dropped;
                # identical copies are dropped (the first in plan order stays), differing ones fail.
                duplicates, drop = check_duplicates(con, out, sources, total, distinct, checked)
                log.warning(
                    "merge: %d id(s) were committed more than once with identical content; dropped %d "
                    "extra row(s), e.g. %s",
                    duplicates.ids,
                    duplicates.rows_dropped,
                    duplicates.examples[:5],
                )
            verify(con, "ids" if not drop else "(SELECT DISTINCT id FROM ids)", plan.total_rows, findings)
            if by_order:  # every id is there once (after dropping identical copies): are they where the plan put them?
                findings = ordered.check(
                    out, in_root, plan, spec.prompt.id_column, _shard_parts(plan, sources, drop, checked)
                )
                if findings:
                    raise VerificationError(
                        "row accounting failed: every input id is committed once, but not as its shard's rows in "
                        f"input order: {'; '.join(findings)}. Delete the folders of the shards named and rerun them"
                    )
    finally:
        con.close()
    faults.hit("merge.before_write")
    schemas = {RESULTS: plan.result_schema(), ERRORS: plan.error_schema()}
    # A published run's parts are what its readers and its output table reference by path: never changed
    published = published_state(out, keyring)
    manifests = {
        kind: publish_parts(out, kind, sources[kind], drop, schemas[kind], published, copies) for kind in KINDS
    }
    published_rows = sum(m.rows for m in manifests.values())
    if published_rows != plan.total_rows:  # the parts' sealed rows less the dropped copies: a last check
        raise CommitError(
            f"merge published {published_rows} rows under {out.uri()}, the plan has "
            f"{plan.total_rows}: the parts it published do not add up to the rows it verified; rerun "
            "the merge"
        )
    if not out.is_local:  # a server-side copy of a checked source: check what readers will read (local: links)
        for kind in KINDS:
            verify_parts(out, kind, manifests[kind])
    # The seal vouches for the bytes merge wrote, hashed before they leave this process: a hash of what the
    # bucket holds when the seal is made would vouch for whatever another writer put there in between.
    written: dict[str, str] = {}
    sizes: dict[str, int] = {}  # beside each checksum: a reader checks no more bytes than merge wrote
    for kind in KINDS:
        data = json.dumps(manifests[kind].dump(), indent=1, sort_keys=True).encode()
        out.write_atomic(manifest_rel(kind), data)
        written[manifest_rel(kind)] = hashlib.sha256(data).hexdigest()
        sizes[manifest_rel(kind)] = len(data)
    faults.hit("merge.after_manifests")
    extra: dict[str, str] = {}
    if spec.io.output_format == "openai_batch":
        extra, openai_sums = write_openai_outputs(out, spec, plan, manifests, copies)
        written.update({rel: sha for rel, (_, sha) in openai_sums.items()})
        sizes.update({rel: size for rel, (size, _) in openai_sums.items()})
    # result cache: this run's computed ok rows (as published) become its entry, committed create-only
    cache_summary = None
    if hits is not None:
        not_computed = {hits[1], *(name for _, name in followers.values())}
        # the published parts as their manifest names them, read from copies checked against it
        filed = [p for p in manifests[RESULTS].parts if p.name not in not_computed and p.rows]
        computed = copies.all([(f"{RESULTS}/{p.name}", p.bytes, p.sha256) for p in filed])
        made_by = [m.engine_identity for m in markers]
        clock = [m.prompt_reads_clock for m in markers]
        cache_summary = cache.append_results(
            out, spec, plan, computed, made_by, keyring, filesystems, clock, made_from=[p.sha256 for p in filed]
        )
    golden = (  # the golden rows that ride along: checked like the input's, published apart, under golden/
        merge_golden(
            out,
            spec,
            plan,
            committed_parts(out, plan.golden.view(plan), RunSeal(keyring, plan.seal.mac), copies, KINDS, attempts)[0],
            copies,
        )
        if plan.golden is not None
        else None
    )
    summary = MergeSummary(
        rows=plan.total_rows,
        ok_rows=manifests[RESULTS].rows,
        error_rows=manifests[ERRORS].rows,
        duplicates_dropped=int(total - distinct),
        # counted over the committed parts before the dedupe: ids seen more than once, extra rows
        duplicates=duplicates,
        shards=len(plan.shards),
        files={
            RESULTS: f"{RESULTS}/",
            ERRORS: f"{ERRORS}/",
            "results_manifest": manifest_rel(RESULTS),
            "errors_manifest": manifest_rel(ERRORS),
            **extra,
        },
        checksums=written,
        sizes=sizes,
        parts={k: len(manifests[k].parts) for k in KINDS},
        shard_stats=[ShardStatsEntry(**m.stats.dump(), shard_id=m.shard_id, attempt_id=m.attempt_id) for m in markers],
        config_hash=plan.config_hash,
        spec_hash=plan.spec_hash,
        merge_s=round(time.monotonic() - t0, 3),
        versions={"airflow-provider-vllm": __version__, "duckdb": duckdb.__version__},
        engine_versions=sorted({v for m in markers if (v := m.versions.get("vllm"))}),
        task=spec.task,
        id_column=spec.prompt.id_column,
        **({"cache": cache_summary} if cache_summary is not None else {}),
        **({"dedupe": _dedupe_summary(plan, followers)} if plan.dedupe is not None else {}),
        **({"golden": golden} if golden is not None else {}),
        **({"adapters": {a.name: a.identity() for a in plan.adapters}} if plan.adapters else {}),
    )
    summary = seals.seal_record(
        keyring, seals.MERGED, seals.scope_of(out.uri()), summary.model_copy(update={"plan_mac": plan.seal.mac})
    )
    faults.hit("merge.after_data")
    with faults.writing("merge.mid_marker"):
        out.write_atomic(MERGED, seals.record_bytes(summary))
    faults.hit("merge.after_marker")
    _record_throughput(spec, plan, markers, summary, filesystems, keyring)
    return summary


def _shard_parts(
    plan: Plan,
    sources: dict[str, list[SourcePart]],
    drop: dict[str, list[int]] | None = None,
    local: Mapping[str, str] | None = None,
) -> dict[str, ordered.ShardParts]:
    """The committed parts per shard (``shards/<shard_id>/...``, in marker order) for ``ordered.check``; ``local``:
    part path -> the checked local copy to read it from (``_checked_parts``; default: the output prefix)."""
    parts = {s.shard_id: ordered.ShardParts(ok=[], errors=[]) for s in plan.shards}
    for kind in KINDS:
        for p in sources[kind]:
            sp = parts.setdefault(p.rel.split("/")[1], ordered.ShardParts(ok=[], errors=[]))
            (sp.ok if kind == RESULTS else sp.errors).append(p.rel)
            if drop and p.rel in drop:
                sp.drop[p.rel] = drop[p.rel]
            if local is not None:
                sp.local[p.rel] = local[p.rel]
    return parts


def _checked_parts(copies: CheckedCopies, sources: dict[str, list[SourcePart]]) -> dict[str, str]:
    """Part path -> a local file of its own with the bytes of its copy in ``copies``, checked against the size and
    sha256 its sealed record names (the marker; the sealed plan for the cache's hits; the followers' part as merge
    staged it) as it was copied: CommitError naming the first part (results, then errors, each in plan order) whose
    bytes in the prefix are other ones. Parts of equal bytes share one copy in ``copies``; each gets its own name
    here (a hard link, else a copy) so that DuckDB's file name column tells them apart. Merge makes these only when
    something is off (a duplicate, a missing row): they hold every part of the run."""
    parts = [p for k in KINDS for p in sources[k]]
    try:
        local = copies.all([(p.rel, p.bytes, p.sha256) for p in parts])
    except (FileNotFoundError, IsADirectoryError) as e:
        raise CommitError(
            f"a committed part under {copies.storage.uri()} is gone or not a file any more ({e}); rerun the merge"
        ) from None
    folder = tempfile.mkdtemp(prefix="checked-parts-", dir=copies.root)
    paths: dict[str, str] = {}
    for i, (p, src) in enumerate(zip(parts, local, strict=True)):
        dest = os.path.join(folder, f"{i:06d}.parquet")
        try:
            os.link(src, dest)
        except OSError:  # a filesystem without hard links
            shutil.copyfile(src, dest)
        paths[p.rel] = dest
    return paths


def _follower_sources(
    out: Storage, plan: Plan, sources: dict[str, list[SourcePart]], copies: CheckedCopies
) -> dict[str, tuple[FileRef, str]]:
    """The followers' parts (``steps/cache/dedupe.py``), appended to ``sources``; {} without followers. The leaders'
    rows are read from ``copies`` of the committed parts, checked against their sealed markers."""
    if plan.dedupe is None or plan.dedupe.followers_file is None:
        return {}
    from airflow_provider_vllm.steps.cache.dedupe import follower_parts

    hits = plan.cache.hits_file.path if plan.cache is not None else None
    computed = {
        k: copies.all([(p.rel, p.bytes, p.sha256) for p in sources[k] if p.rel != hits and p.rows]) for k in KINDS
    }
    parts = follower_parts(out, plan, computed, {k: len(sources[k]) for k in KINDS})
    for kind, (ref, name) in parts.items():
        sources[kind].append(SourcePart(**ref.model_dump(), name=name))
    return parts


def _dedupe_summary(plan: Plan, followers: dict[str, tuple[FileRef, str]]) -> DedupeMergeSummary:
    d = plan.dedupe
    assert d is not None
    ok, err = (followers[k][0].rows if k in followers else 0 for k in KINDS)
    return DedupeMergeSummary(leaders=d.leaders, followers=d.followers, ok_rows=ok, error_rows=err)


def manifest_rel(kind: str) -> str:
    return f"{kind}/{MANIFEST}"


def read_manifest(out: Storage, kind: str) -> PartsManifest:
    """The manifest of ``results/`` or ``errors/`` of the run under ``out``, validated.

    CommitError naming the file when it is not a manifest this provider writes: among others,
    a part name that is not one ``part-*.parquet`` segment (``../``, ``/``, glob characters).
    """
    rel = manifest_rel(kind)
    return _parse_manifest(out, kind, out.read_bytes(rel))


def _parse_manifest(out: Storage, kind: str, raw: bytes) -> PartsManifest:
    rel = manifest_rel(kind)
    try:
        manifest = PartsManifest.model_validate_json(raw)
    except ValidationError as e:
        raise CommitError(
            f"{out.uri(rel)} is not a parts manifest this provider writes: {validation_detail(e)}"
        ) from None
    if manifest.kind != kind:
        raise CommitError(f"{out.uri(rel)} is the manifest of {manifest.kind}/, not of {kind}/")
    return manifest


def result_parts(out: Storage, kind: str = RESULTS) -> list[str]:
    """The merged ``kind`` ('results' | 'errors') as part paths under ``out``, in plan order (from its manifest).

    Never empty: a folder without rows holds one empty part. Open them as one table with
    ``duck.file_list(out, result_parts(out))`` in ``read_parquet(...)``, or pyarrow.dataset.
    Every reader of a merged run's parts goes through here: each name is one part-name segment
    (``read_manifest``) and, on local disk, the file itself, not a symlink out of ``kind``/
    (CommitError naming the manifest and the name).
    """
    rels = [f"{kind}/{p.name}" for p in read_manifest(out, kind).parts]
    for rel in rels:
        check_inside(out, rel, out.uri(manifest_rel(kind)))
    return rels


def validation_detail(e: ValidationError) -> str:
    """pydantic's first error as 'field.path: message' (the message names the offending value)."""
    err = e.errors()[0]
    return f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"


def read_merged(out: Storage, keyring: Keyring | None = None) -> MergeSummary:
    """``_MERGED.json`` of the run under ``out``, validated and its seal checked (SealError: not written by this
    deployment's merge for this run)."""
    summary = MergeSummary.model_validate_json(out.read_bytes(MERGED))
    seals.verify_record(
        keyring or Keyring.from_env(), seals.MERGED, seals.scope_of(out.uri()), summary, out.uri(MERGED)
    )
    return summary


def verified_manifest(out: Storage, kind: str, merged: MergeSummary) -> PartsManifest:
    """``kind``/_manifest.json of the run under ``out``, read only when its sha256 is the one the sealed
    ``_MERGED.json`` (``merged``, from ``read_merged``) names; CommitError otherwise."""
    rel = manifest_rel(kind)
    check_inside(out, rel, out.uri(MERGED))
    try:
        raw = out.read_bytes(rel)
    except FileNotFoundError:
        raise CommitError(f"{out.uri(rel)} is missing; the sealed {MERGED} names it") from None
    if hashlib.sha256(raw).hexdigest() != merged.checksums.get(rel):
        raise CommitError(f"{out.uri(rel)} is not the manifest the sealed {MERGED} names (sha256 differs)")
    return _parse_manifest(out, kind, raw)


def verified_parts(out: Storage, kind: str, merged: MergeSummary) -> list[str]:
    """The parts of ``kind``/ as paths under ``out`` (like ``result_parts``), each checked first against the
    sealed merge summary's manifest: size and sha256, a streaming read of every part."""
    manifest = verified_manifest(out, kind, merged)
    verify_parts(out, kind, manifest)
    return [f"{kind}/{p.name}" for p in manifest.parts]


def checked_parts(out: Storage, kind: str, merged: MergeSummary, copies: CheckedCopies) -> list[str]:
    """Local copies of the parts of ``kind``/ (``copies``), each checked against the manifest that the sealed
    merge summary ``merged`` names as it was copied: what a reader reads is what was checked, however the bucket
    changes meanwhile. CommitError when the manifest's rows are not the ones the summary sealed."""
    manifest = verified_manifest(out, kind, merged)
    sealed = merged.ok_rows if kind == RESULTS else merged.error_rows
    if manifest.rows != sealed:
        raise CommitError(f"{out.uri(manifest_rel(kind))} names {manifest.rows} rows; the sealed {MERGED} {sealed}")
    rels = [f"{kind}/{p.name}" for p in manifest.parts]
    for rel in rels:
        check_inside(out, rel, out.uri(manifest_rel(kind)))  # a local symlink leaving the run: refused, named
    return copies.all([(rel, p.bytes, p.sha256) for rel, p in zip(rels, manifest.parts)])


def verify_parts(out: Storage, kind: str, manifest: PartsManifest) -> None:
    """CommitError unless every part ``manifest`` names under ``kind``/ has exactly its size and sha256 (a
    streaming read of each); readers can trust the manifest's digests after this. The first part that fails,
    in the manifest's order, is the one named."""

    def rel(p: PartEntry) -> str:
        r = f"{kind}/{p.name}"
        check_inside(out, r, out.uri(manifest_rel(kind)))  # a local symlink leaving the run: refused
        return r

    bad = _first_unmatched(out, manifest.parts, rel)
    if bad is not None:
        raise CommitError(
            f"{out.uri(f'{kind}/{bad.name}')} does not have the size and sha256 its manifest names (the part "
            "was changed while it was being published); rerun the merge"
        )


def _first_unmatched(
    out: Storage, parts: Sequence[_P], rel: Callable[[_P], str], check: Callable[[_P], bool | None] | None = None
) -> _P | None:
    """The first of ``parts``, in their order, whose file ``rel(p)`` does not have its ``bytes`` and ``sha256``;
    None when every one does. hashlib and file reads release the GIL: parts are hashed side by side. ``check``:
    another way to check a part (its verdict; None: the streaming read)."""

    def matches(p: _P) -> bool:
        if check is not None and (verdict := check(p)) is not None:
            return verdict
        r = rel(p)
        return out.sha256(r, p.bytes) == p.sha256  # another size: not read, never equal

    pool = hash_pool(len(parts))
    try:
        for p, ok in zip(parts, pool.map(matches, parts), strict=True):
            if not ok:
                return p
        return None
    finally:
        pool.shutdown(cancel_futures=True)


def _record_throughput(
    spec: JobSpec,
    plan: Plan,
    markers: list[CommitMarker],
    summary: MergeSummary,
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
) -> None:
    """Throughput history for shard sizing (steps/plan/sizing.py), sealed; a failure here must not fail a merged
    run."""
    if not spec.sharding.history_uri:
        return
    from airflow_provider_vllm.steps.plan.sizing import record_run

    try:
        summary.history_record = record_run(spec, plan, markers, filesystems, keyring)
    except Exception as e:  # evidence for later plans, not part of this run's results
        log.warning("could not write the throughput record to %s: %s", spec.sharding.history_uri, e)


def committed_parts(
    out: Storage,
    plan: Plan,
    run: RunSeal,
    copies: CheckedCopies | None = None,
    copy_kinds: Sequence[str] = (),
    attempts: Mapping[str, str] | None = None,
) -> tuple[dict[str, list[SourcePart]], list[CommitMarker]]:
    """The part files named by the markers of every planned shard, in plan order, per kind; raises if any is missing.

    A marker must be this shard's (its ``shard_id``) and every path it names must be a part
    file under this shard's own attempt folders, named once: a forged or corrupt marker that
    names another shard's file, the merged outputs, the plan or anything outside the shard is
    refused (``CommitError``, terminal) before any file is opened. A marker is read only when it
    carries this deployment's worker seal for this shard of this run's plan (``ShardStore.marker``);
    its files' sizes and sha256 are checked here (a streaming read; on object stores the published copies
    are checked again after publishing, ``verify_parts``). The parts of ``copy_kinds`` are checked by copying
    them into ``copies`` instead (the check and the copy are one read): what the caller makes of them (the
    cache's entry, the followers, the golden rows) comes from those copies. The first id checks and the publishing by
    reference read the bucket's files (on object stores, the published copies are checked again); when those checks
    find something off, merge copies every part (``_checked_parts``) and decides on the copies only. Each part
    gets its published name: ``part-<n>-<shard>-<chunk>.parquet``, ``n`` its chunk's index in plan order.
    """
    entries: list[tuple[str, str, Any]] = []
    markers, missing = [], []
    for shard in plan.shards:
        store = ShardStore(out, shard.shard_id, run)
        m = store.marker()
        if m is None:
            missing.append(shard.shard_id)
            continue
        where = out.uri(f"{store.dir}/{MARKER}")
        if m.shard_id != shard.shard_id:
            raise CommitError(f"commit marker {where} is not shard {shard.shard_id}'s (it names shard {m.shard_id!r})")
        if attempts is not None and attempts.get(shard.shard_id) != m.attempt_id:
            told = attempts.get(shard.shard_id)
            raise CommitError(
                f"commit marker {where} is attempt {m.attempt_id}, not "
                + (
                    f"{told}, the one this run's shard task committed"
                    if told
                    else "one a shard task of this run reported"
                )
                + " (an earlier attempt put back?); rerun the shard task"
            )
        if m.rows != shard.rows:
            raise CommitError(f"shard {shard.shard_id}: marker says {m.rows} rows, plan {shard.rows}")
        for f in m.files:
            if f.errors is None:
                raise CommitError(
                    f"commit marker {where} was written by a worker before the results/ and errors/ part layout "
                    f"(one mixed chunk file, {f.path}); delete shards/{shard.shard_id} and rerun the shard"
                )
            entries.append((where, shard.shard_id, f))
        markers.append(m)
    if missing:
        raise CommitError(f"{len(missing)} of {len(plan.shards)} shard(s) not committed: {missing[:10]}")
    width = max(5, len(str(len(entries))))
    sources: dict[str, list[SourcePart]] = {RESULTS: [], ERRORS: []}
    seen: set[str] = set()
    for n, (where, shard_id, f) in enumerate(entries):
        ok_part, err_part = f.parts()
        chunk = check_marker_path(ok_part.path, shard_id, where, RESULTS)
        if (
            err_part is None
            or check_marker_path(err_part.path, shard_id, where, ERRORS) != chunk
            or err_part.path.rsplit("/", 1)[0] != ok_part.path.rsplit("/", 1)[0]
        ):
            raise CommitError(
                f"commit marker {where}: the error rows of {ok_part.path} are not its sibling "
                f"chunk-{chunk:05d}.errors.parquet"
            )
        if err_part.rows + ok_part.rows != f.rows:
            raise CommitError(
                f"commit marker {where}: {ok_part.path} has {ok_part.rows} ok + {err_part.rows} error "
                f"rows, the entry says {f.rows}"
            )
        for kind, part in ((RESULTS, ok_part), (ERRORS, err_part)):
            if part.path in seen:
                raise CommitError(f"commit marker {where} names {part.path} twice")
            seen.add(part.path)
            sources[kind].append(
                SourcePart(
                    path=part.path,
                    bytes=part.bytes,
                    sha256=part.sha256,
                    rows=part.rows,
                    name=f"part-{n:0{width}d}-{shard_id}-{chunk:05d}.parquet",
                )
            )
    copied = {p.path for k in copy_kinds for p in sources[k]} if copies is not None else set()
    _check_digests(out, [p for k in KINDS for p in sources[k]], copies, copied)
    return sources, markers


def _check_digests(
    out: Storage,
    parts: list[SourcePart],
    copies: CheckedCopies | None = None,
    copied: set[str] | frozenset = frozenset(),
) -> None:
    """CommitError naming the first part (in plan order) whose size or sha256 is not its marker's; the parts whose
    path is in ``copied`` are checked as ``copies`` copies them."""

    def by_copy(p: SourcePart) -> bool:
        assert copies is not None
        if out.size(p.path) != p.bytes:  # as the streaming check: a stat first (a folder, a file of another size)
            return False
        try:
            copies.get(p.path, p.bytes, p.sha256)
        except (CommitError, IsADirectoryError):
            return False
        return True

    bad = _first_unmatched(
        out, sorted(parts, key=lambda p: p.name), lambda p: p.path, lambda p: by_copy(p) if p.path in copied else None
    )
    if bad is not None:
        shard = bad.path.split("/")[1]  # shards/<shard>/attempts/...: check_marker_path checked the layout
        raise CommitError(
            f"{bad.path} does not match its commit marker (size or sha256): shard {shard}'s committed rows are no "
            f"longer the bytes its worker wrote. Rerunning the shard task alone does nothing (it is committed): "
            f"delete shards/{shard}/{MARKER}, rerun the shard task (it reuses every chunk whose files still match "
            "their seal and redoes the others), then the merge"
        )


def check_marker_path(path: Any, shard_id: str, where: str, kind: str = RESULTS) -> int:
    """``path`` is ``shards/<shard_id>/attempts/<attempt>/chunk-NNNNN.parquet`` (``kind`` errors:
    ``chunk-NNNNN.errors.parquet``); returns the chunk number; CommitError otherwise."""
    parts = path.split("/") if isinstance(path, str) else []
    m = _CHUNK_NAME[kind].match(parts[4]) if len(parts) == 5 else None
    ok = (
        m is not None
        and parts[0] == "shards"
        and parts[1] == shard_id
        and parts[2] == "attempts"
        and _ATTEMPT.match(parts[3]) is not None
        and parts[3] not in (".", "..")
    )
    if not ok or m is None:
        name = "chunk-NNNNN.parquet" if kind == RESULTS else "chunk-NNNNN.errors.parquet"
        raise CommitError(
            f"commit marker {where} names {path!r}, which is not a chunk file of shard {shard_id}'s own attempts "
            f"(shards/{shard_id}/attempts/<attempt>/{name}); refusing to merge a forged or corrupt "
            "marker: delete the shard's folder and rerun the shard"
        )
    return int(m.group(1))


def _duck_paths(out: Storage, parts: Sequence[SourcePart], local: Mapping[str, str] | None) -> list[str]:
    """The paths DuckDB reads ``parts`` from (and names in its file name columns): their checked local copies
    (``local``: part path -> file, ``_checked_parts``), else the files under ``out``."""
    if local is not None:
        return [local[p.rel] for p in parts]
    return [out.path(p.rel) if out.is_local else out.uri(p.rel) for p in parts]


def _ids_view(
    con: duckdb.DuckDBPyConnection,
    out: Storage,
    sources: dict[str, list[SourcePart]],
    local: Mapping[str, str] | None = None,
) -> None:
    """View ``ids(id)``: the id column of every committed part (the other columns are never decoded), read from
    the files under ``out`` or, given ``local``, from the parts' checked copies."""
    selects = [
        f"SELECT id FROM read_parquet({duck.local_list(_duck_paths(out, sources[k], local))})"
        for k in KINDS
        if sources[k]
    ]
    con.execute("CREATE VIEW ids AS " + (" UNION ALL ".join(selects) or "SELECT NULL::VARCHAR AS id WHERE false"))


def check_footer_rows(
    con: duckdb.DuckDBPyConnection,
    out: Storage,
    sources: dict[str, list[SourcePart]],
    local: Mapping[str, str] | None = None,
) -> None:
    """CommitError naming the first part (in plan order) whose Parquet footer holds another row count than its
    sealed marker claims: the id checks read every part, but publishing leaves out the parts claimed empty, so a
    claim that disagrees with the file would verify rows and then drop them. Reads the footers only (of the
    files under ``out`` or, given ``local``, of the parts' checked copies)."""
    parts = [p for k in KINDS for p in sources[k]]
    if not parts:
        return
    names = _duck_paths(out, parts, local)
    footer = dict(
        con.execute(f"SELECT file_name, num_rows FROM parquet_file_metadata({duck.local_list(names)})").fetchall()
    )
    for p, name in zip(parts, names, strict=True):
        got = footer.get(name)  # the name DuckDB was given
        if got != p.rows:
            raise CommitError(
                f"{out.uri(p.rel)} holds {got} rows, its commit marker says {p.rows}: the marker does not describe "
                "its files; delete that shard's folder and rerun the shard"
            )


def _rows_view(
    con: duckdb.DuckDBPyConnection,
    out: Storage,
    sources: dict[str, list[SourcePart]],
    local: Mapping[str, str] | None = None,
) -> None:
    """View ``chunks``: every committed row in ``ROW_SCHEMA`` columns plus its part (the path DuckDB read it from:
    ``_duck_paths``) and position (duplicates only)."""
    selects = []
    for kind in KINDS:
        if not sources[kind]:
            continue
        status = "ok" if kind == RESULTS else "error"
        selects.append(
            f"SELECT '{status}' AS status, * EXCLUDE (file_row_number, {duck.FILENAME}), {duck.FILENAME} AS part, "
            f"file_row_number AS pos FROM read_parquet({duck.local_list(_duck_paths(out, sources[kind], local))}, "
            f"filename = '{duck.FILENAME}', file_row_number = true)"
        )
    con.execute("CREATE VIEW chunks AS " + " UNION ALL BY NAME ".join(selects))


def check_duplicates(
    con: duckdb.DuckDBPyConnection,
    out: Storage,
    sources: dict[str, list[SourcePart]],
    total: int,
    distinct: int,
    local: Mapping[str, str] | None = None,
) -> tuple[Duplicates, dict[str, list[int]]]:
    """Ids committed more than once (counted before any dedupe); VerificationError when copies differ.

    Copies are the same result when every column but ``PROVENANCE_COLUMNS`` is equal. Returns
    the accounting and the rows to drop: source part path -> row positions (every copy but the
    first in plan order). ``local``: part path -> its checked local copy, the file read (``_checked_parts``:
    merge passes them, so the positions are those of the bytes it re-encodes); default the files under ``out``.
    """
    _rows_view(con, out, sources, local)
    content = ", ".join(f.name for f in ROW_SCHEMA if f.name not in ("id", *PROVENANCE_COLUMNS))
    con.execute(
        "CREATE TEMP TABLE dup_ids AS SELECT id, count(*) AS n, "
        f"count(DISTINCT row({content})) AS versions, "
        "string_agg(DISTINCT shard_id || '/' || attempt_id, ', ' ORDER BY shard_id || '/' || attempt_id) AS made_by "
        "FROM chunks GROUP BY id HAVING count(*) > 1"
    ).fetchall()
    n_ids, n_differ = con.execute("SELECT count(*), count(*) FILTER (WHERE versions > 1) FROM dup_ids").fetchall()[0]
    if n_differ:
        bad = con.execute(
            f"SELECT id, n, made_by FROM dup_ids WHERE versions > 1 ORDER BY id LIMIT {DUPLICATE_EXAMPLES}"
        ).fetchall()
        shown = "; ".join(f"{i!r} x{n} (from {by})" for i, n, by in bad)
        raise VerificationError(
            f"{n_differ} id(s) have committed outputs that differ: {shown}; refusing to pick one. Each id must be "
            "committed once; delete the folders of the shards involved and rerun them"
        )
    examples = [r[0] for r in con.execute(f"SELECT id FROM dup_ids ORDER BY id LIMIT {DUPLICATE_EXAMPLES}").fetchall()]
    parts = [p for k in KINDS for p in sources[k]]
    names = _duck_paths(out, parts, local)
    order = {name: i for i, name in enumerate(names)}
    by_path = {name: p.rel for p, name in zip(parts, names, strict=True)}
    copies = con.execute("SELECT id, part, pos FROM chunks WHERE id IN (SELECT id FROM dup_ids)").fetchall()
    first: dict[str, tuple[int, int]] = {}
    for i, part, pos in copies:
        key = (order.get(part, len(order)), int(pos))
        first[i] = min(first.get(i, key), key)
    drop: dict[str, list[int]] = {}
    for i, part, pos in copies:
        if (order.get(part, len(order)), int(pos)) != first[i]:
            drop.setdefault(by_path.get(part, part), []).append(int(pos))
    return (
        Duplicates(ids=int(n_ids), rows_dropped=int(total - distinct), examples=[str(e) for e in examples]),
        {k: sorted(v) for k, v in drop.items()},
    )


def register_input_ids(con: duckdb.DuckDBPyConnection, spec: JobSpec, plan: Plan, root: Storage) -> None:
    """View ``input_ids(id VARCHAR)``: all input ids, the independent side of the verification."""
    names = [f.path for f in plan.files]
    if plan.format == "parquet" and plan.total_rows:
        col = '"' + spec.prompt.id_column.replace('"', '""') + '"'
        con.execute(
            f"CREATE VIEW input_ids AS SELECT CAST({col} AS VARCHAR) AS id "
            f"FROM read_parquet({duck.file_list(root, names)})"
        ).fetchall()
        return
    ids: list[str] = []
    counts: list[int] = []
    if plan.format != "parquet":
        for name in names:
            got = input_format(plan.format).file_ids(root, name, spec)
            ids += got
            counts.append(len(got))
    column = pa.array(ids, pa.string())
    _check_still_distinct(column, names, counts)
    con.register("input_ids", pa.table({"id": column}))


def _check_still_distinct(ids: pa.Array, names: list[str], counts: list[int]) -> None:
    """InputChangedError when the line-format input's ids, read again here, are no longer distinct.

    The exactly-once proofs take distinct input ids from the plan's check, with the files unchanged since (same
    size and version). A local file rewritten in place with its size and modification time kept (copied with its
    timestamps, ``touch -r``) passes that check with other content: an id repeated there would be counted as
    answered while another id is missing. Reading these ids costs a pass over every line; the count is free
    beside it (Parquet ids are read by DuckDB and not counted again)."""
    if len(ids) < 2 or pc.count_distinct(ids).as_py() == len(ids):
        return
    seen: dict[str, int] = {}
    for i, rid in enumerate(ids.to_pylist()):
        if rid in seen:
            break
        seen[rid] = i
    first, again = seen[rid], i
    starts = np.cumsum([0, *counts])

    def where(p: int) -> str:
        f = int(np.searchsorted(starts, p, side="right")) - 1
        return f"{names[f]} (its row {p - int(starts[f]) + 1})"

    raise InputChangedError(
        f"the input's ids are no longer distinct: {rid!r} is at {where(first)} and at {where(again)}, but the plan "
        "found every id once in the same files (same sizes and versions): a file was rewritten since the plan "
        "with its size and modification time kept. Its rows cannot be accounted for; plan the run again into a "
        "new output prefix"
    )


def exactly_once(con: duckdb.DuckDBPyConnection, planned_rows: int) -> int | None:
    """The rows when every input id is in ``ids`` exactly once and nothing else is; None when not proven.

    One semi-join over strings (exact): ``covered`` = input ids found among the output ids. The
    input's ids are distinct (checked by the plan, files unchanged since), so ``covered ==
    n_in`` rows of output covering ``n_in`` distinct input ids with ``n_out == n_in`` rows leaves
    no row for a duplicate or a foreign id (pigeonhole). This replaces a distinct count plus a
    semi-join on the common path; any shortfall goes to the detailed checks.
    """
    n_in, n_out, covered = con.execute(
        "SELECT (SELECT count(*) FROM input_ids), (SELECT count(*) FROM ids), "
        "(SELECT count(*) FROM input_ids WHERE id IN (SELECT id FROM ids))"
    ).fetchall()[0]
    return int(n_out) if n_in == planned_rows == n_out == covered else None


def verify(con: duckdb.DuckDBPyConnection, source: str, planned_rows: int, findings: list[str] | None = None) -> None:
    """input ids == output ids, each once; raises VerificationError naming counts and examples.

    ``source`` has distinct ids (deduped) and the input's ids are distinct (checked by the
    plan, files unchanged since), so equal counts plus every output id found in the input
    prove the two sets equal; one semi-join instead of a full outer join. ``findings``: what the
    order-based check found (``ordered.check``), named in the error too.
    """
    n_in, n_out, n_found = con.execute(
        f"SELECT (SELECT count(*) FROM input_ids), (SELECT count(*) FROM {source}), "
        f"(SELECT count(*) FROM {source} WHERE id IN (SELECT id FROM input_ids))"
    ).fetchall()[0]
    if n_in == planned_rows == n_out == n_found:
        return
    ex_missing = [
        r[0]
        for r in con.execute(
            f"SELECT id FROM input_ids WHERE id NOT IN (SELECT id FROM {source}) ORDER BY id LIMIT 5"
        ).fetchall()
    ]
    ex_extra = [
        r[0]
        for r in con.execute(
            f"SELECT id FROM {source} WHERE id NOT IN (SELECT id FROM input_ids) ORDER BY id LIMIT 5"
        ).fetchall()
    ]
    raise VerificationError(
        f"row accounting failed: {n_in} input ids (plan: {planned_rows}), {n_out} output rows; "
        f"{n_in - n_found} missing (e.g. {ex_missing}), {n_out - n_found} not in the input (e.g. {ex_extra})"
        + (f"; per shard: {'; '.join(findings)}" if findings else "")
    )


def write_openai_outputs(
    out: Storage, spec: JobSpec, plan: Plan, manifests: Mapping[str, PartsManifest], copies: CheckedCopies
) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
    """openai/output.jsonl and openai/errors.jsonl in the OpenAI Batch API line formats, from the published parts
    ``manifests`` names, read from ``copies`` checked against them (merge seals these files: a part replaced in the
    bucket after merge checked it must not reach them); returns their ``files`` entries and the size and sha256
    of the bytes written (for the seal).

    (Outside results/ so that a Parquet reader of that folder never meets a JSONL file.)
    """
    from airflow_provider_vllm.core.openai_output import error_line, response_line

    sums: dict[str, tuple[int, str]] = {}
    for kind, fn, dest in ((RESULTS, response_line, OPENAI_OUT), (ERRORS, error_line, OPENAI_ERR)):
        lines = []
        columns = SCHEMAS[kind].names  # the line formats' columns: passthrough columns are not decoded
        for path in copies.all([(f"{kind}/{p.name}", p.bytes, p.sha256) for p in manifests[kind].parts]):
            with open(path, "rb") as fh:
                for batch in pq.ParquetFile(fh).iter_batches(batch_size=8192, columns=columns):
                    lines += [json.dumps(fn(r, spec), ensure_ascii=False) for r in batch.to_pylist()]
        data = ("\n".join(lines) + ("\n" if lines else "")).encode()
        out.write_atomic(dest, data)
        sums[dest] = (len(data), hashlib.sha256(data).hexdigest())
    return {"openai_output": OPENAI_OUT, "openai_errors": OPENAI_ERR}, sums


FOLDER_SLACK = 1000
"""Entries of ``results/`` or ``errors/`` listed beyond twice the parts the merge publishes there (its manifest,
temp files of killed merges): the listing stops past that bound with a ``ListingTooLarge`` naming the folder."""


def folder_bound(parts: int) -> int:
    """The most entries listed in a ``results/`` or ``errors/`` folder of a merge of ``parts`` parts."""
    return 2 * parts + FOLDER_SLACK


def _displaced_part(out: Storage, name: str) -> bool:
    """Whether ``name`` is where merge moved aside what another writer put at one of its parts' names
    (``storage.DISPLACED_NAME``): left by a merge killed before it removed it, removed by the next one. Local only:
    on an object store merge moves nothing aside, so such a key is another writer's (refused by ``check_folder``)."""
    if not out.is_local:
        return False
    m = DISPLACED_NAME.match(name)
    return m is not None and PART_NAME.fullmatch(m.group("name")) is not None


def check_folder(out: Storage, kind: str, parts: int) -> None:
    """CommitError when ``kind``/ holds a file merge does not write (its parts, its manifest, its temp files).

    ``parts``: the parts the merge publishes there (the listing's bound, ``folder_bound``).
    Merge owns these folders: its own stale parts are removed when it publishes, anything else
    (e.g. ``results/results.parquet`` of the layout before 0.2, or a user's file) is refused
    rather than deleted or silently served as part of the results.
    """
    foreign = [
        n
        for n in out.listdir(kind, limit=folder_bound(parts))
        if n != MANIFEST
        and not PART_NAME.fullmatch(n)
        and not _TMP_NAME.match(n)
        and not is_temp_copy(n, MANIFEST)
        and not _displaced_part(out, n)
    ]
    if foreign:
        raise CommitError(
            f"{out.uri(kind)}/ holds {foreign[:5]}, which merge did not write; it publishes {kind}/ as a folder of "
            f"part-*.parquet files named by {kind}/{MANIFEST} (results/results.parquet and results/errors.parquet "
            f"are the layout before 0.2). Move those files away and rerun the merge"
        )


def publish_parts(
    out: Storage,
    kind: str,
    sources: list[SourcePart],
    drop: dict[str, list[int]],
    schema: pa.Schema | None,
    published: Published | None,
    copies: CheckedCopies,
) -> PartsManifest:
    """Publish ``sources`` into ``kind``/ by reference, in order; returns the folder's manifest (not yet written).

    Empty parts are left out, except that a folder with no rows gets one (the first source,
    or a fresh empty file of ``schema``, default ``SCHEMAS[kind]``: the plan's per-job schema) so readers see
    the schema. A part that lost dropped duplicate rows is re-encoded without them, from its copy checked against
    its sealed marker (``copies``): its new sha256 goes into the manifest
    merge seals. A part already published with the right size and sha256 is kept (a regular file only: a link
    there, even to the right bytes, is replaced), so a rerun only does what a crash left undone; stale ``part-*``
    files and temp files are removed.
    ``published``: why the run's parts may not change (``published_state``: a sealed ``_SUCCESS.json`` or
    ``_PUBLISHING.json``): CommitError before anything is written when a part would be added, replaced or removed
    (only a rerun whose parts are all in place goes on).
    """
    chosen = [p for p in sources if p.rows - len(drop.get(p.rel, ())) > 0] or sources[:1]
    entries: list[PartEntry] = []
    with tempfile.TemporaryDirectory(dir=copies.root) as tmp:  # inside merge's copies_folder
        if not chosen:
            local = os.path.join(tmp, "empty.parquet")
            pq.write_table((schema or SCHEMAS[kind]).empty_table(), local, compression="zstd")
            entries.append(_publish_local(out, kind, local, "part-00000.parquet", published))
        for p in chosen:
            if p.rel in drop:
                entries.append(_publish_local(out, kind, _without_rows(copies, p, drop[p.rel], tmp), p.name, published))
            else:
                _publish_reference(out, p, f"{kind}/{p.name}", published)
                entries.append(PartEntry(name=p.name, bytes=p.bytes, sha256=p.sha256, rows=p.rows))
            faults.hit("merge.between_parts")
    keep = {e.name for e in entries} | {MANIFEST}
    listed = out.listdir(kind, limit=folder_bound(len(sources) + 1))
    stale = [n for n in listed if n not in keep and PART_NAME.fullmatch(n)]
    if published and stale:
        _refuse_published(out, f"{kind}/{stale[0]}", "remove", published)
    for name in listed:
        if _displaced_part(out, name):  # what another writer put at a part's name, moved aside by a merge killed since
            out.discard(f"{kind}/{name}")
        elif name not in keep:
            out.remove(f"{kind}/{name}")
    return PartsManifest(kind=kind, rows=sum(e.rows for e in entries), parts=entries)


def success_doc(out: Storage, raw: bytes, keyring: Keyring | None) -> Any:
    """``_SUCCESS.json`` of the run under ``out`` (its bytes ``raw``) without its seal; given ``keyring``, the seal
    checked first (SealError: not this deployment's publish of this run; ValueError: not JSON, not a seal)."""
    doc = json.loads(raw)
    seal = doc.pop("seal", None) if isinstance(doc, dict) else None
    if keyring is not None:
        keyring.verify(
            seals.SUCCESS, seals.scope_of(out.uri()), doc, Seal.model_validate(seal) if seal else None, out.uri(SUCCESS)
        )
    return doc


def read_publishing(out: Storage, keyring: Keyring) -> PublishingRecord:
    """``_PUBLISHING.json`` under ``out``, validated and its seal checked (this deployment's publish, for this run
    folder). FileNotFoundError when there is none; ValueError when it is not a record; SealError otherwise."""
    rec = PublishingRecord.model_validate_json(out.read_bytes(PUBLISHING))
    seals.verify_record(keyring, seals.PUBLISHING, seals.scope_of(out.uri()), rec, out.uri(PUBLISHING))
    return rec


def published_state(out: Storage, keyring: Keyring) -> Published | None:
    """Why merge may no longer change the run's parts and what the operator can do, or None: a ``_SUCCESS.json``
    (the run is published) or a ``_PUBLISHING.json`` (publish began committing its parts to ``io.output_table``)
    carrying this deployment's seal for the run. One without that seal was not written by this pipeline (whoever
    may write the prefix can write any file, and change the parts themselves): ignored, with a warning naming it."""
    if out.exists(SUCCESS):
        try:
            doc = success_doc(out, out.read_bytes(SUCCESS), keyring)
            sums = doc.get("checksums") if isinstance(doc, dict) else None
            return Published(f"published ({SUCCESS})", _NEW_PREFIX, dict(sums) if isinstance(sums, dict) else {})
        except (ValueError, CommitError) as e:  # not JSON, not a seal, SealError
            log.warning("%s is not a marker this deployment's publish sealed; ignored: %s", out.uri(SUCCESS), e)
    if out.exists(PUBLISHING):
        try:
            rec = read_publishing(out, keyring)
            return Published(
                f"published to table {rec.table} ({PUBLISHING}: publish began its commit at {rec.started})",
                f"{_NEW_PREFIX}; or, only when no snapshot of table {rec.table} names run {rec.run_id} (its "
                f"summary's vllm-batch.run-id) and the table has no property {committed_key(rec.run_id)} (the "
                f"commit failed), delete {out.uri(PUBLISHING)} and merge again",
                {REPORT_JSON: rec.report_sha256} if rec.report_sha256 else {},
            )
        except (ValueError, CommitError) as e:
            log.warning("%s is not a marker this deployment's publish sealed; ignored: %s", out.uri(PUBLISHING), e)
    return None


def _refuse_published(out: Storage, rel: str, change: str, published: Published | None) -> None:
    p = published or Published("published", _NEW_PREFIX)
    raise CommitError(
        f"{out.uri(rel)}: the run under {out.uri()} is {p.state} and this merge would {change} that part (the "
        "committed parts changed since the merge that was published, e.g. a shard rerun): readers and the output "
        f"table reference the published parts by path. {p.remedy}"
    )


def keep_published(out: Storage, published: Published | None, rel: str, sha256: str, writer: str) -> None:
    """CommitError, before ``writer`` writes anything, when the run is published and ``rel`` is a file its publish
    vouched for (its sealed record names the sha256) that ``writer`` would replace with other bytes. The same bytes
    again (a cleared run that computes what it published) go on."""
    sealed = published.checksums.get(rel) if published is not None else None
    if published is None or sealed is None or sealed == sha256:
        return
    raise CommitError(
        f"{out.uri(rel)}: the run under {out.uri()} is {published.state}, and {writer} would replace that file with "
        f"other bytes (sha256 {sha256[:16]}..., the published one {sealed[:16]}...: computed by another provider "
        "version, or against another golden set or previous run than the published one): its readers, and the next "
        f"runs that compare with it, take the file publish vouched for. Nothing was written. {published.remedy}"
    )


def _publish_reference(out: Storage, src: SourcePart, rel: str, published: Published | None = None) -> None:
    """``src`` visible whole at ``rel`` without decoding it: hard link, else copy (local), server-side copy (remote).

    A part already there (a rerun) is kept only when it is a regular file that is the source itself (a hard link,
    local) or has the source's sealed size and sha256 (``Storage.holds``: never through a symbolic link); anything
    else there (a link, even to a file of the right bytes; a FIFO; a folder) is replaced. Object stores: its bytes
    are checked again after publishing (``verify_parts``)."""
    if out.holds(rel, src.bytes, src.sha256, same_as=src.rel if out.is_local else None):
        return
    if published:
        _refuse_published(out, rel, "replace" if _there(out, rel) else "add", published)
    if not out.is_local:
        out.copy(src.rel, rel)  # server-side: one object, visible whole or not at all
        return
    # through descriptors, no link below the output followed (drills: a copy killed half-way at merge.mid_file)
    out.link_or_copy(
        src.rel, rel, temp=f".{os.path.basename(rel)}.tmp-{os.getpid()}", fault="merge.mid_file", displace=True
    )


def _there(out: Storage, rel: str) -> bool:
    """Whether anything is at ``rel`` (local: a link too, dangling or not)."""
    return out.lstat(rel) is not None if out.is_local else out.exists(rel)


def _publish_local(out: Storage, kind: str, local: str, name: str, published: Published | None = None) -> PartEntry:
    """A file merge wrote itself (an empty part, a part re-encoded without dropped duplicates) at ``kind/name``."""
    rel = f"{kind}/{name}"
    size, digest = os.path.getsize(local), Storage(os.path.dirname(local)).sha256(os.path.basename(local))
    if not out.holds(rel, size, digest):  # a regular file of these bytes: never through a link
        if published:
            _refuse_published(out, rel, "replace" if _there(out, rel) else "add", published)
        # local: a copy beside it, then a rename, no link below the output followed (a link, FIFO or folder at
        # the part's name is replaced itself); remote: one object
        out.publish(local, rel, temp=f".{name}.tmp-{os.getpid()}", fault="merge.mid_file", displace=True)
    return PartEntry(name=name, bytes=size, sha256=digest, rows=pq.ParquetFile(local).metadata.num_rows)


def _without_rows(copies: CheckedCopies, p: SourcePart, positions: list[int], tmp: str) -> str:
    """A local copy of part ``p`` without the rows at ``positions`` (re-encoded; deterministic bytes), made from its
    checked copy (CommitError naming it when its bytes are not the ones its sealed marker names)."""
    table = pq.read_table(copies.get(p.rel, p.bytes, p.sha256))
    keep = pc.invert(pc.is_in(pa.array(range(table.num_rows), pa.int64()), pa.array(positions, pa.int64())))
    local = os.path.join(tmp, p.name)
    pq.write_table(table.filter(keep), local, compression="zstd")
    return local
