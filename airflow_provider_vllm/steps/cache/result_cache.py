"""The result cache: input rows whose answer a committed earlier run already computed skip the engine.

* Key (``steps/cache/key.py``: ``key_config``, ``key_sql``): per job a key config hash over everything
  but the row that decides an answer (model, pinned commit or weights fingerprint, tokenizer, dtype,
  quantization, context length, task, the prompt and sampling sections, the engine seed and the
  output-changing ``engine_kwargs``, the engine identity); per row sha256 over that hash and each
  template column's DuckDB type and value text, length-prefixed (equal keys: identical prompts), in DuckDB.
* Store (``CacheStore``): ``<cache.uri>/entries/<entry_id>/part-NNNNN.parquet`` (rows sorted by their 32-byte
  key) and ``<cache.uri>/commits/<key_hash[:32]>/<entry_id>.json`` (``records.CacheCommit``, sealed), the marker
  written create-only and last; readers read only verified copies of the files that a sealed marker of this key
  config names. The answer computed last wins a key.
* Plan (``plan_cache``): the input's keys looked up in an index of the verified entries' keys
  (``index.py``, ``matching.py``: no join of answers); writes ``_cache/hits-<sha16>.parquet`` (id + cached
  answer + cached_from, in the entries' order) and one input file per shard of the rows the shards infer,
  with their key (``write_shard_inputs``), named by content so that a plan killed or raced before its
  create-only ``_plan.json`` leaves only orphans.
* Merge: before publishing, ``hits_part`` checks the plan's hits file against the sealed plan (it never
  opens the cache folder) and it is published as one more part of ``results/``; after publishing,
  ``append_results`` enters the cache folder once: the ok rows computed by this run become this run's
  entry (id derived from the run: a rerun finds its commit and stops), then compaction when due.
* Publish: ``vouch_published`` vouches for the entry the sealed merge summary names (its id and commit seal):
  the plan reads only entries so vouched for, so a run that failed QA or its review serves no later run.

Parquet input only (``check_cacheable``). No Airflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core.adapters import AdapterRef
from airflow_provider_vllm.core.engine_identity import identity_env
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.formats.files import Input
from airflow_provider_vllm.core.plan import CacheFile, CachePlan, Passthrough, Plan, Segment, ShardPlan
from airflow_provider_vllm.core.records import CacheCommit, CacheMergeSummary, FileRef, MergeSummary
from airflow_provider_vllm.core.rows import RESULT_SCHEMA, result_schema
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage, copies_folder
from airflow_provider_vllm.core.weights import WeightsPin
from airflow_provider_vllm.steps.cache import matching
from airflow_provider_vllm.steps.cache.index import build_index, entry_meta, read_keys
from airflow_provider_vllm.steps.cache.key import (  # noqa: F401 (the key's names, also reached through this module)
    KEY_ENGINE_KWARGS,
    NON_KEY_ENGINE_KWARGS,
    UNKEYED_ENGINE_ENV,
    check_cacheable,
    column_types,
    is_local_model,
    key_columns,
    key_config,
    key_hash,
    key_sql,
    weights_fingerprint,
)
from airflow_provider_vllm.steps.cache.matching import ANSWER_COLUMNS, CACHED_FROM, KEY_COLUMN, MISSES_ROW_GROUP
from airflow_provider_vllm.steps.cache.store import COMPUTED_AT, CacheStore, now

log = logging.getLogger(__name__)

CACHE_DIR = "_cache"  # under the run's output prefix
SHARD_INPUTS = f"{CACHE_DIR}/shard-inputs"  # one input file per shard: its miss rows
PLAN_MEMORY_LIMIT = "512MB"  # DuckDB's share of the plan's memory with the cache (docs/cache.md: at most 2 GiB)
ENTRY_SCHEMA = pa.schema(  # rows sorted by key; entries of the previous version hold the key as 64 hex characters
    [pa.field("key", pa.binary(), nullable=False), pa.field("source_id", pa.string())]
    + [RESULT_SCHEMA.field(c) for c in ANSWER_COLUMNS]
    + [pa.field(CACHED_FROM, pa.string()), pa.field(COMPUTED_AT, pa.string())]
)


def _q(col: str) -> str:
    return '"' + col.replace('"', '""') + '"'


def entry_id(plan: Plan, output_uri: str, made_from: Sequence[str]) -> str:
    """The cache entry of one merge of a run: the same run (spec hash, output prefix) merged from the same computed
    parts (``made_from``: their sha256, in the results manifest's order) always gets the same id, so a merge run
    again after a crash commits once; merged again from other parts (its shards run again), another id."""
    doc = "\n".join([plan.spec_hash, output_uri.rstrip("/"), *made_from])
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


def run_entry_id(plan: Plan, output_uri: str) -> str:
    """The id versions before ``entry_id`` covered the parts gave a run's entry: the run alone (spec hash, output
    prefix), so a merge of the run over other parts found the first merge's commit and filed nothing
    (``vouch_runs`` tells such entries apart)."""
    return hashlib.sha256(f"{plan.spec_hash}\n{output_uri.rstrip('/')}".encode()).hexdigest()[:32]


def made_from(parts: Sequence[Any]) -> list[str]:
    """``entry_id``'s ``made_from`` from a results manifest's parts (``PartEntry``, in its order): the sha256 of the
    parts with rows that the run's shards computed, the merge's own parts (``part-<n>-cache-hits.parquet``, the
    cache's hits; ``part-<n>-followers.parquet``, the dedupe's followers) left out, as the merge files them."""
    return [p.sha256 for p in parts if p.rows and not _MERGE_OWN_PART.fullmatch(p.name)]


_MERGE_OWN_PART = re.compile(r"part-[0-9]+-(cache-hits|followers)\.parquet")


# ---- plan -------------------------------------------------------------------------------
class _Prepared:
    """The key config, the verified local entry parts with their keys' index, and a connection over the input."""

    def __init__(self, con, khash, cfg, commits, parts, index, types) -> None:
        self.con, self.khash, self.cfg, self.commits = con, khash, cfg, commits
        self.parts, self.index, self.types = parts, index, types


def _prepare(
    spec: JobSpec,
    found: Input,
    engine_identity: str | None,
    filesystems: FileSystems | None,
    keyring: Keyring,
    workdir: str,
    adapters: list[AdapterRef] | None = None,
    weights: list[WeightsPin] | None = None,
) -> _Prepared:
    """Only entries sealed by this deployment's merge are read, from local copies whose bytes were checked
    against the seal (``CacheStore.fetch``); an entry whose keys are of neither format is skipped whole."""
    check_cacheable(spec, found.format)
    assert spec.cache.uri is not None
    cfg = key_config(spec, engine_identity, adapters, filesystems, weights)
    khash = key_hash(cfg)
    store = CacheStore(spec.cache.uri, spec.io.storage_options, keyring, filesystems)
    fetched, local = store.fetch(store.committed(khash), os.path.join(workdir, "entries"))
    commits: list[CacheCommit] = []
    parts: list[str] = []
    keys: list[np.ndarray] = []
    at = 0
    for c in fetched:
        mine = local[at : at + len(c.files)]
        at += len(c.files)
        try:
            got = [read_keys(p) for p in mine]
        except (ValueError, KeyError) as e:
            log.warning("cache: skipping entry %s: its keys cannot be read: %s", c.entry_id, str(e)[:300])
            continue
        commits.append(c)
        parts += mine
        keys += got
    index = build_index(keys, entry_meta(parts)) if parts else None
    # DuckDB streams the keys pass and joins only the misses here; the index and the hits are Python's memory
    con = duck.connect(found.root, memory_limit=PLAN_MEMORY_LIMIT)
    files = duck.file_list(found.root, found.names)
    types = column_types(
        con, f"read_parquet({files}, union_by_name = true)", spec
    )  # SpecError for a column the key cannot encode
    return _Prepared(con, khash, cfg, commits, parts, index, types)


def expected(
    spec: JobSpec,
    found: Input,
    engine_identity: str | None = None,
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
    adapters: list[AdapterRef] | None = None,
) -> dict[str, Any]:
    """Hits and misses the cache would give now (the dry run); nothing written."""
    with copies_folder("cache") as tmp:  # swept by the next one when a task killed with SIGKILL leaves it
        p = _prepare(spec, found, engine_identity, filesystems, keyring or Keyring.from_env(), tmp, adapters)
        try:
            if p.index is None:
                rows, hits, hit_tokens = _count_rows(found), 0, 0
            else:
                m = matching.match(p.con, spec, found, p.khash, p.types, p.index, None, keep=False)
                rows, hits, hit_tokens = m.rows, m.hits, m.hit_tokens
        finally:
            p.con.close()
    return {
        "uri": spec.cache.uri,
        "key_hash": p.khash,
        "commits": len(p.commits),
        "rows": rows,
        "hits": hits,
        "misses": rows - hits,
        "hit_est_tokens": hit_tokens,
    }


def _count_rows(found: Input) -> int:
    con = duck.connect(found.root)
    try:
        return int(
            con.execute(f"SELECT count(*) FROM read_parquet({duck.file_list(found.root, found.names)})").fetchall()[0][
                0
            ]
        )
    finally:
        con.close()


def plan_cache(
    spec: JobSpec,
    found: Input,
    out: Storage,
    workdir: str,
    engine_identity: str | None = None,
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
    adapters: list[AdapterRef] | None = None,
    passthrough: Passthrough | None = None,
    weights: list[WeightsPin] | None = None,
) -> tuple[CachePlan, str]:
    """Look the input's keys up in the cache; write the hits file under ``_cache/``; the CachePlan and the local
    misses file (in ``workdir``: the rows to infer with their keys, in input order), which the planner cuts
    into shards and ``write_shard_inputs`` splits into one input file per shard.

    The hits file is named by its sha256, so a plan killed (or beaten by a racing plan) before its
    create-only ``_plan.json`` leaves orphans that no plan names, never a file that changed under one.
    """
    assert spec.cache.uri is not None
    keyring = keyring or Keyring.from_env()
    from airflow_provider_vllm.core.commit import probe_create_only

    store = CacheStore(spec.cache.uri, spec.io.storage_options, keyring, filesystems)
    probe_create_only(store.st, f"{spec.cache.uri} (cache.uri)")
    p = _prepare(spec, found, engine_identity, filesystems, keyring, workdir, adapters, weights)
    needed = matching.needed_columns(spec, passthrough)
    # The hits file is published by merge as one more part of results/, by reference: it is written here in
    # exactly the parts' schema (the plan's result schema).
    schema = result_schema(passthrough.arrow_schema() if passthrough else None)
    hits_local, misses_local = os.path.join(workdir, "hits.parquet"), os.path.join(workdir, "misses.parquet")
    try:
        if p.index is None:  # nothing cached yet: every row is a miss, keyed as it is written
            rows = matching.write_all_misses(p.con, spec, found, p.khash, p.types, needed, misses_local)
            hits, hit_tokens = 0, 0
            matching.write_hits(matching.Matched(), [], schema, hits_local)
        else:
            m = matching.match(p.con, spec, found, p.khash, p.types, p.index, passthrough)
            p.index = None  # its memory, before the files are written
            rows, hits, hit_tokens = m.rows, m.hits, m.hit_tokens
            matching.write_misses(p.con, spec, found, p.khash, p.types, m, needed, misses_local)
            written = matching.write_hits(m, p.parts, schema, hits_local)
            if written != hits:
                raise CommitError(f"cache: {hits} hits were found but {written} written (a bug); plan again")
        faults.hit("cache.before_files")
        hits_file = put_by_content(out, hits_local, f"{CACHE_DIR}/hits", hits)
    finally:
        p.con.close()
    log.info(
        "cache %s: %d of %d rows answered from %d committed entries; %d to infer",
        spec.cache.uri,
        hits,
        rows,
        len(p.commits),
        rows - hits,
    )
    cp = CachePlan(
        uri=str(spec.cache.uri),
        key_hash=p.khash,
        key_config=p.cfg,
        commits_read=[c.entry_id for c in p.commits],
        rows=rows,
        hits=hits,
        misses=rows - hits,
        hits_file=hits_file,
        misses_root=out.uri(SHARD_INPUTS),
        hit_est_tokens=hit_tokens,
    )
    return cp, misses_local


def write_shard_inputs(
    out: Storage, misses_local: str, shards: list[ShardPlan], under: str = SHARD_INPUTS
) -> list[ShardPlan]:
    """One input file per shard under ``under`` (``_cache/shard-inputs/``; a materialized table's shards:
    ``_table/shard-inputs/``): the miss rows its segments select (index 0 of the misses file), in order; the
    shards returned read only it (one segment over the whole file).

    Each worker then fetches its own file and reads it only when its size and sha256 are the ones the
    sealed plan names: the rows it answers are exactly the rows whose keys the merge files its answers
    under. Names carry the file's sha256, so a killed or racing plan leaves only orphans.
    """
    if not shards:
        return shards
    folder = os.path.dirname(misses_local)
    con = duck.connect()
    done: list[ShardPlan] = []
    try:
        con.execute(
            "CREATE TEMP TABLE misses AS SELECT *, file_row_number AS _vllm_r "
            f"FROM read_parquet('{_sql_str(misses_local)}', file_row_number = true)"
        ).fetchall()
        for shard in shards:
            if any(seg.file != 0 for seg in shard.segments):
                raise CommitError(f"shard {shard.shard_id}: the misses plan has one file, segments name others")
            ranges = " OR ".join(
                f"(_vllm_r >= {seg.start} AND _vllm_r < {seg.start + seg.count})" for seg in shard.segments
            )
            local = os.path.join(folder, f"{shard.shard_id}.parquet")
            con.execute(
                f"COPY (SELECT * EXCLUDE (_vllm_r) FROM misses WHERE {ranges or 'false'} ORDER BY _vllm_r) "
                f"TO '{_sql_str(local)}' (FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {MISSES_ROW_GROUP})"
            ).fetchall()
            n = sum(seg.count for seg in shard.segments)
            f = put_by_content(out, local, f"{under}/{shard.shard_id}", n)
            done.append(
                shard.model_copy(
                    update={
                        "segments": [Segment(file=0, start=0, count=n)],
                        "input_file": FileRef(path=f.path, bytes=f.bytes, sha256=f.sha256, rows=n),
                    }
                )
            )
            os.unlink(local)
    finally:
        con.close()
    faults.hit("cache.after_files")
    return done


def _sql_str(s: str) -> str:
    return s.replace("'", "''")


def file_sha256(path: str) -> str:
    """The sha256 of the local file ``path`` (one the plan wrote itself)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def put_by_content(out: Storage, local: str, stem: str, rows: int) -> CacheFile:
    """The plan's local file at ``<stem>-<sha16>.parquet`` under ``out``: named by content, so an existing file of
    that name is kept only when it is a regular file of these bytes (a killed plan's), anything else (planted: the
    prefix has other writers and the name is predictable) is replaced: another file, a link, a FIFO or a folder
    (``Storage.publish``'s ``displace``: never followed, opened or read)."""
    sha, size = file_sha256(local), os.path.getsize(local)
    rel = f"{stem}-{sha[:16]}.parquet"
    if not out.holds(rel, size, sha):
        out.publish(local, rel, displace=True)
    return CacheFile(path=rel, bytes=size, sha256=sha, rows=rows)


# ---- merge ------------------------------------------------------------------------------
def engines_differ(key_identity: str, made_by: list[str | None]) -> str | None:
    """Why rows made by these engines (the identities the workers sealed into their commit markers) must not be
    filed under a key that names ``key_identity``; None when they are the key's engine.

    A worker that saw a variable the key cannot stand for (``UNKEYED_ENGINE_ENV``: say, from a Secret mounted whole)
    files nothing. Local runner: the identity must be the key's exactly. Kubernetes: the key names the image (pinned by
    digest, so its own environment with it) and the pod's engine variables; each worker must have seen
    every one of those variables with the key's value.
    """
    for got in made_by:
        seen = identity_env(got or "")
        for name in sorted(seen.keys() & UNKEYED_ENGINE_ENV.keys()):
            return f"a shard's engine ran with {name} set ({seen[name]!r}), which {UNKEYED_ENGINE_ENV[name]}"
    want_head, _, want_env = key_identity.partition(" env ")
    want = json.loads(want_env) if want_env else {}
    other = set()
    for got in made_by:
        if got is None:
            other.add("(not recorded, or more than one in one shard)")
            continue
        if not want_head.startswith("image "):
            if got != key_identity:
                other.add(got)
            continue
        seen = json.loads(got.partition(" env ")[2] or "{}")
        if any(seen.get(k) != v for k, v in want.items()):
            other.add(got)
    if not other:
        return None
    return (
        f"rows were made by engine(s) {sorted(other)[:3]}, the cache key names {key_identity}: a shard ran on "
        "another engine or environment than the plan keyed"
    )


def prompts_vary(spec: JobSpec, reads_clock: list[bool | None] | None) -> str | None:
    """Why rows of a chat job must not be filed under its key: a shard whose worker found that the chat template
    renders another prompt on another day (the key would stand for a prompt of one day only), or one that did not
    probe it (no engine started: every chunk an earlier attempt's; a worker before the probe); None otherwise.
    Only chat renders a chat template with the cache on (its input is Parquet rows, never OpenAI requests)."""
    if spec.task != "chat":
        return None
    seen = reads_clock or [None]
    if any(seen):
        return (
            "the model's chat template reads the clock (strftime_now, e.g. Llama 3.x's 'Today Date'): a row's "
            "prompt changes with the day and its key does not, so this run's answers are not filed in the cache"
        )
    if any(r is None for r in seen):
        return "a shard did not record whether the model's chat template reads the clock (an engine it did not start)"
    return None


def hits_part(out: Storage, plan: Plan, index: int) -> tuple[FileRef, str]:
    """The plan's hits file as one more part of ``results/`` (its record and published name), checked first.

    It must still be what the sealed plan names (size and sha256) and hold the rows the plan counted;
    it is published as ``part-<index>-cache-hits.parquet`` (``index`` = the computed parts before it,
    so it sorts after them).
    """
    cp = plan.cache
    assert cp is not None
    f = cp.hits_file
    if not out.exists(f.path) or out.sha256(f.path, f.bytes) != f.sha256:
        raise CommitError(
            f"{out.uri(f.path)} does not match the plan (missing, or size or sha256 differ); the plan's cache files "
            "must not change: delete the output prefix and rerun the job"
        )
    if f.rows != cp.hits:
        raise CommitError(f"{out.uri(f.path)}: the plan names {f.rows} rows and {cp.hits} hits")
    with out.open(f.path) as fh:
        schema = pq.ParquetFile(fh).schema_arrow
    if not schema.equals(plan.result_schema()):
        raise CommitError(
            f"{out.uri(f.path)} is not in the results schema (a plan of an older version): "
            "delete the output prefix and rerun the job"
        )
    width = max(5, len(str(index)))
    return FileRef(
        path=f.path, bytes=f.bytes, sha256=f.sha256, rows=f.rows
    ), f"part-{index:0{width}d}-cache-hits.parquet"


def append_results(
    out: Storage,
    spec: JobSpec,
    plan: Plan,
    computed: list[str],
    made_by: list[str | None],
    keyring: Keyring,
    filesystems: FileSystems | None = None,
    reads_clock: list[bool | None] | None = None,
    *,
    made_from: Sequence[str],
) -> CacheMergeSummary:
    """This run's ok rows (``computed``: local copies of the published result parts this run's shards made, each
    checked against the run's manifest as it was copied, ``storage.CheckedCopies``) -> this run's entry, sealed;
    then a compaction when the key config has many entries. The entry is made from those copies only: a part
    replaced in the bucket after the merge checked it never reaches the cache.

    ``made_by``: the engine identities the workers sealed into their markers (``engines_differ``); ``reads_clock``:
    whether each worker found that the chat template reads the clock (``prompts_vary``); ``made_from``: the sha256
    of the parts ``computed`` copies, in the results manifest's order (``entry_id``).
    Idempotent: a merge rerun over the same parts finds the commit and appends nothing; one killed before it
    rewrites the part (the same path) and commits. A merge of the run over other parts (its shards run again) files
    them as another entry that supersedes the entries of the run's earlier merges (readers skip those; they are
    removed once the new commit is there), so the cache holds what the run's last merge published, never the answers
    of a merge it replaced. Entry rows: key (from the shards' input files, fetched and checked against the sealed
    plan), source_id, the answer columns, cached_from, computed_at.
    """
    cp = plan.cache
    assert cp is not None
    store = CacheStore(cp.uri, spec.io.storage_options, keyring, filesystems)
    eid = entry_id(plan, spec.io.output_uri, made_from)
    done = store.read_commit(cp.key_hash, eid)
    if done is not None:
        if done.supersedes:  # a merge cut short after its commit: finish removing the earlier merges' entries,
            store.drop(cp.key_hash, done.supersedes)  # else the first compaction taking this one in revives them
        return CacheMergeSummary(
            uri=cp.uri,
            hits=cp.hits,
            appended=done.rows,
            entry_id=eid,
            committed_by="earlier_merge",
            **({"commit_mac": done.seal.mac} if done.seal is not None else {}),
        )
    if not computed:
        return CacheMergeSummary(uri=cp.uri, hits=cp.hits, appended=0)
    wrong = engines_differ(str(cp.key_config.get("engine_identity")), made_by) or prompts_vary(spec, reads_clock)
    origin = spec.io.output_uri.rstrip("/")
    if wrong:
        log.warning("cache %s: not appending run %s: %s", cp.uri, origin, wrong)
        return CacheMergeSummary(uri=cp.uri, hits=cp.hits, appended=0, skipped=wrong)
    idc = _q(spec.prompt.id_column)
    answer = ", ".join(f"s.{_q(c)}" for c in ANSWER_COLUMNS)
    with copies_folder("cache") as tmp:  # swept by the next one when a task killed with SIGKILL leaves it
        inputs = []
        for shard in plan.shards:
            assert shard.input_file is not None  # a cached plan gives every shard its own input file
            local = os.path.join(tmp, "in", f"{shard.shard_id}.parquet")
            f = shard.input_file
            out.fetch_verified(f.path, f.bytes, f.sha256, local)
            inputs.append(local)
        local = os.path.join(tmp, "part.parquet")
        con = duck.connect(out)
        try:
            # a plan of the previous version wrote the keys as hex text: the same 32 bytes
            mkeys = f"read_parquet({duck.local_list(inputs)})"
            ktype = con.execute(f"SELECT typeof({KEY_COLUMN}) FROM {mkeys} LIMIT 1").fetchall()
            key = f"unhex(m.{KEY_COLUMN})" if ktype and ktype[0][0] == "VARCHAR" else f"m.{KEY_COLUMN}"
            # one row per key: rows of equal text (and settings) have one answer; the first id names it
            con.execute(
                f"CREATE TEMP TABLE entry AS SELECT {key} AS key, s.id AS source_id, {answer}, "
                f"'{_sql_str(origin)}' AS {CACHED_FROM}, '{now()}' AS {COMPUTED_AT} "
                f"FROM read_parquet({duck.local_list(computed)}) s "
                f"JOIN {mkeys} m ON s.id = CAST(m.{idc} AS VARCHAR)"
            ).fetchall()
            total, distinct = con.execute("SELECT count(*), count(DISTINCT key) FROM entry").fetchall()[0]
            once = (
                "entry"
                if total == distinct
                else "(SELECT * FROM entry QUALIFY row_number() OVER (PARTITION BY key ORDER BY source_id) = 1)"
            )
            # sorted by key: the plan reads an entry's keys as one sorted run (steps/cache/index.py)
            con.execute(
                f"COPY (SELECT * FROM {once} ORDER BY key) TO '{_sql_str(local)}' (FORMAT parquet, COMPRESSION zstd)"
            ).fetchall()
        finally:
            con.close()
        rows = pq.ParquetFile(local).metadata.num_rows
        if rows == 0:
            return CacheMergeSummary(uri=cp.uri, hits=cp.hits, appended=0)
        # the live entries of this plan's earlier merges (the same output prefix and spec, other parts), published or
        # not: never one the plan read (commits_read), which an earlier plan of this prefix filed before this plan was
        # made and whose answers this run published as hits
        read = set(cp.commits_read)
        earlier = [
            c.entry_id
            for c in store.committed(cp.key_hash, vouched=False)
            if c.source_output_uri == origin
            and c.source_spec_hash == plan.spec_hash
            and c.entry_id != eid
            and c.entry_id not in read
        ]
        made = store.write(
            cp.key_hash,
            eid,
            local,
            rows,
            {
                "output_uri": origin,
                "config_hash": plan.config_hash,
                "spec_hash": plan.spec_hash,
                "engine": str(cp.key_config.get("engine_identity")),
            },
            supersedes=earlier,
        )
        mine = store.read_commit(cp.key_hash, eid)
        if earlier and mine is not None:
            store.drop(cp.key_hash, earlier)
            log.info(
                "cache %s: entry %s supersedes the entries %s of earlier merges of %s", cp.uri, eid, earlier, origin
            )
        log.info(
            "cache %s: entry %s %s with %d rows; it serves later runs once this run is published",
            cp.uri,
            eid,
            "committed" if made else "already committed",
            rows,
        )
        store.sweep(cp.key_hash, keep=eid)  # entries of runs never published, past UNPUBLISHED_KEEP
        compacted = store.compact(cp.key_hash, tmp)
    return CacheMergeSummary(
        uri=cp.uri,
        hits=cp.hits,
        appended=rows,
        entry_id=eid,
        committed_by="this_merge" if made else "earlier_merge",
        **({"commit_mac": mine.seal.mac} if mine is not None and mine.seal is not None else {}),
        **({"compacted_into": compacted} if compacted else {}),
    )


def vouch_published(
    spec: JobSpec,
    plan: Plan,
    merged: MergeSummary,
    keyring: Keyring,
    filesystems: FileSystems | None = None,
) -> str | None:
    """Publish's step: let this run's cache entry serve later runs. ``merged``: the sealed merge summary publish
    checked (``merged.cache`` names the entry and its commit's seal), ``plan``: the sealed plan it was merged under
    (the cache folder and key config). Writes the sealed ``CacheVouch`` (``CacheStore.vouch``: atomic; a publish run
    again writes it again); the entry id vouched for, or None when the merge filed no entry (no cache, nothing
    computed, rows skipped, or a merge summary of a version before ``commit_mac``: that entry never serves), or when
    that commit is no longer in the cache (swept, superseded, written again: no record is written for it). Call it
    only once the run is published (after ``_SUCCESS.json``)."""
    c = merged.cache
    if plan.cache is None or c is None or c.entry_id is None:
        return None
    if c.commit_mac is None:
        log.warning(
            "cache %s: entry %s is not vouched for: the merge summary names no commit seal (merged by an earlier "
            "version); merge the run again, then publish, for its answers to serve later runs",
            plan.cache.uri,
            c.entry_id,
        )
        return None
    store = CacheStore(plan.cache.uri, spec.io.storage_options, keyring, filesystems)
    made = store.read_commit(plan.cache.key_hash, c.entry_id)
    if made is None or made.seal is None or made.seal.mac != c.commit_mac:
        # a record for no commit would vouch for nothing and stay forever in the folder of records (nothing removes
        # it), counted by every plan's bounded listing of that folder
        log.warning(
            "cache %s: entry %s is not vouched for: %s; its answers serve no later run",
            plan.cache.uri,
            c.entry_id,
            "its commit is gone (removed by the sweep of entries not published within UNPUBLISHED_KEEP, or by a "
            "later merge of this output)"
            if made is None
            else "its commit was written again since this run's merge",
        )
        return None
    if not store.vouch(plan.cache.key_hash, c.entry_id, c.commit_mac, "publish", spec.io.output_uri):
        return None  # its commit removed or written again while the record was written (logged)
    log.info("cache %s: entry %s vouched for: it serves later runs", plan.cache.uri, c.entry_id)
    return c.entry_id
