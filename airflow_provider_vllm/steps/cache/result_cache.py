"""The result cache: input rows whose answer a committed earlier run already computed skip the engine.

* Key (``steps/cache/key.py``: ``key_config``, ``key_sql``): per job a key config hash over everything
  but the row that decides an answer (model, pinned commit or weights fingerprint, tokenizer, dtype,
  quantization, context length, task, the prompt and sampling sections, the engine seed and the
  output-changing ``engine_kwargs``, the engine identity); per row sha256 over that hash and each
  template column's DuckDB type and value text, length-prefixed (equal keys: identical prompts), in DuckDB.
* Store (``CacheStore``): ``<cache.uri>/entries/<entry_id>/part-NNNNN.parquet`` and
  ``<cache.uri>/commits/<entry_id>.json`` (``records.CacheCommit``), the marker written
  create-only and last; readers read only files that a committed marker of this key config
  names, with the size it records (and the sha256 on request). The newest commit wins a key.
* Plan (``plan_cache``): one join of the input's keys against the committed entries; writes
  ``_cache/hits-<sha16>.parquet`` (id + cached answer + cached_from) and
  ``_cache/misses-<sha16>.parquet`` (the rows the shards infer, with their key), named by content
  so that a plan killed or raced before its create-only ``_plan.json`` leaves only orphans.
* Merge: before publishing, ``hits_part`` checks the plan's hits file against the sealed plan (it never
  opens the cache folder) and it is published as one more part of ``results/``; after publishing,
  ``append_results`` enters the cache folder once: the ok rows computed by this run become this run's
  entry (id derived from the run: a rerun finds its commit and stops), then compaction when due.

Parquet input only (``check_cacheable``). No Airflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core.adapters import AdapterRef
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.formats.files import Input
from airflow_provider_vllm.core.plan import CacheFile, CachePlan, Passthrough, Plan, Segment, ShardPlan
from airflow_provider_vllm.core.records import CacheMergeSummary, FileRef
from airflow_provider_vllm.core.rows import RESULT_COLUMNS, RESULT_SCHEMA, result_schema
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage
from airflow_provider_vllm.steps.cache.key import (  # noqa: F401 (the key's names, also reached through this module)
    KEY_ENGINE_KWARGS,
    NON_KEY_ENGINE_KWARGS,
    check_cacheable,
    column_types,
    is_local_model,
    key_columns,
    key_config,
    key_hash,
    key_sql,
    weights_fingerprint,
)
from airflow_provider_vllm.steps.cache.store import COMPUTED_AT, CacheStore, now

log = logging.getLogger(__name__)

CACHE_DIR = "_cache"  # under the run's output prefix
SHARD_INPUTS = f"{CACHE_DIR}/shard-inputs"  # one input file per shard: its miss rows
KEY_COLUMN = "_vllm_cache_key"  # the key in the misses file (beside the input's own columns)
CACHED_FROM = "cached_from"
ANSWER_COLUMNS = [c for c in RESULT_COLUMNS if c not in ("id", CACHED_FROM)]
ENTRY_SCHEMA = pa.schema(
    [pa.field("key", pa.string(), nullable=False), pa.field("source_id", pa.string())]
    + [RESULT_SCHEMA.field(c) for c in ANSWER_COLUMNS]
    + [pa.field(CACHED_FROM, pa.string()), pa.field(COMPUTED_AT, pa.string())]
)
HITS_BATCH_ROWS = 1 << 17
ANSWER_PREFIX = "_vllm_cached_"  # the cached answer's columns beside the input's in the plan's join
MISSES_ROW_GROUP = 4096  # the worker reads the row groups that hold its segment


def _q(col: str) -> str:
    return '"' + col.replace('"', '""') + '"'


def entry_id(plan: Plan, output_uri: str) -> str:
    """The cache entry of one run: the same run (spec hash, output prefix) always gets the same id."""
    return hashlib.sha256(f"{plan.spec_hash}\n{output_uri.rstrip('/')}".encode()).hexdigest()[:32]


# ---- plan -------------------------------------------------------------------------------
class _Joined:
    def __init__(self, con, khash, cfg, commits, rows, hits, hit_tokens) -> None:
        self.con, self.khash, self.cfg, self.commits = con, khash, cfg, commits
        self.rows, self.hits, self.hit_tokens = rows, hits, hit_tokens


def _needed(spec: JobSpec, passthrough: Passthrough | None) -> list[str]:
    """The input columns the plan's join keeps: the id, the key's columns, then the passthrough columns."""
    idc = spec.prompt.id_column
    cols = [idc] + [c for c in key_columns(spec) if c != idc]
    return cols + [c for c in (passthrough.columns if passthrough else []) if c not in cols]


def _join(
    spec: JobSpec,
    found: Input,
    engine_identity: str | None,
    filesystems: FileSystems | None,
    keyring: Keyring,
    workdir: str,
    adapters: list[AdapterRef] | None = None,
    passthrough: Passthrough | None = None,
) -> _Joined:
    """Table ``joined``: the input's rows with their keys, order (``_vllm_f``, ``_vllm_r``), the newest cached answer
    (columns prefixed ``ANSWER_PREFIX``; NULL for a miss) and ``_vllm_hit``.

    Only entries sealed by this deployment's merge are read, from local copies whose bytes were checked
    against the seal (``CacheStore.fetch``); the cache folder is probed for create-only writes first.
    """
    check_cacheable(spec, found.format)
    assert spec.cache.uri is not None
    cfg = key_config(spec, engine_identity, adapters, filesystems)
    khash = key_hash(cfg)
    store = CacheStore(spec.cache.uri, spec.io.storage_options, keyring, filesystems)
    commits, local = store.fetch(store.committed(khash), os.path.join(workdir, "entries"))
    con = duck.connect(found.root)
    needed = _needed(spec, passthrough)
    files = duck.file_list(found.root, found.names)
    source = f"read_parquet({files}, filename = true, file_row_number = true)"
    types = column_types(con, source, spec)  # SpecError for a template column the key cannot encode
    con.execute(
        f"CREATE TEMP TABLE keyed AS SELECT {', '.join(_q(c) for c in needed)}, {key_sql(spec, khash, types)} AS "
        f"{KEY_COLUMN}, list_position({files}, filename) AS _vllm_f, file_row_number AS _vllm_r FROM {source}"
    ).fetchall()
    if local:
        # entries written before a result column existed (adapter, confidence, prompt_hash, ...) lack it: NULL, as
        # their rows had none
        src = f"read_parquet({duck.local_list(local)}, union_by_name = true)"
        have = {str(r[0]) for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
        entry_types = dict(zip(ENTRY_SCHEMA.names, con.from_arrow(ENTRY_SCHEMA.empty_table()).types))
        cols = ", ".join(_q(c) if c in have else f"NULL::{entry_types[c]} AS {_q(c)}" for c in ENTRY_SCHEMA.names)
        con.execute(f"CREATE TEMP VIEW cache_entries AS SELECT {cols} FROM {src}").fetchall()
    else:
        con.register("cache_entries", ENTRY_SCHEMA.empty_table())
    # An entry holds each key once (append_results); a key in several entries (runs that computed
    # it at the same time) keeps the newest answer (the rows' own computed_at, inside the sealed
    # bytes). Distinct 64-bit hashes == rows proves distinct keys, so the window (a sort of every
    # entry) runs only when a key really repeats.
    total, distinct = con.execute("SELECT count(*), count(DISTINCT hash(key)) FROM cache_entries").fetchall()[0]
    entries = "cache_entries"
    if total != distinct:
        con.execute(
            "CREATE TEMP TABLE newest AS SELECT * FROM cache_entries QUALIFY row_number() OVER (PARTITION BY key "
            f"ORDER BY {COMPUTED_AT} DESC, source_id) = 1"
        ).fetchall()
        entries = "newest"
    # One join: every input row with its cached answer (NULL: a miss); the answer columns are
    # prefixed so that an input column named like one (label, output ...) cannot clash.
    answer = ", ".join(f"b.{_q(c)} AS {_q(ANSWER_PREFIX + c)}" for c in [*ANSWER_COLUMNS, CACHED_FROM])
    con.execute(
        f"CREATE TEMP TABLE joined AS SELECT k.*, {answer}, b.key IS NOT NULL AS _vllm_hit FROM keyed k "
        f"LEFT JOIN {entries} b ON k.{KEY_COLUMN} = b.key"
    ).fetchall()
    texts = spec.prompt.texts
    chars = " + ".join(f"coalesce(length(CAST({_q(c)} AS VARCHAR)), 0)" for c in texts) or "0"
    rows, hits, hit_tokens = con.execute(
        f"SELECT count(*), count(*) FILTER (WHERE _vllm_hit), coalesce(sum(ceil(({chars}) / "
        f"{float(spec.sharding.chars_per_token)})) FILTER (WHERE _vllm_hit), 0) FROM joined"
    ).fetchall()[0]
    return _Joined(con, khash, cfg, commits, int(rows), int(hits), int(hit_tokens))


def expected(
    spec: JobSpec,
    found: Input,
    engine_identity: str | None = None,
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
    adapters: list[AdapterRef] | None = None,
) -> dict[str, Any]:
    """Hits and misses the cache would give now (the dry run); nothing written."""
    with tempfile.TemporaryDirectory(prefix="vllm-batch-cache-") as tmp:
        j = _join(spec, found, engine_identity, filesystems, keyring or Keyring.from_env(), tmp, adapters)
        j.con.close()
    return {
        "uri": spec.cache.uri,
        "key_hash": j.khash,
        "commits": len(j.commits),
        "rows": j.rows,
        "hits": j.hits,
        "misses": j.rows - j.hits,
        "hit_est_tokens": j.hit_tokens,
    }


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
) -> tuple[CachePlan, str]:
    """Join the input against the cache; write the hits file under ``_cache/``; the CachePlan and the local
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
    j = _join(spec, found, engine_identity, filesystems, keyring, workdir, adapters, passthrough)
    con = j.con
    idc = spec.prompt.id_column
    needed = _needed(spec, passthrough)
    schema = result_schema(passthrough.arrow_schema() if passthrough else None)
    hits_local, misses_local = os.path.join(workdir, "hits.parquet"), os.path.join(workdir, "misses.parquet")
    try:
        answer = ", ".join(f"{_q(ANSWER_PREFIX + c)} AS {_q(c)}" for c in [*ANSWER_COLUMNS, CACHED_FROM])
        # the passthrough columns come from the input rows themselves, never from the cache entries
        pairs = zip(passthrough.columns, passthrough.names) if passthrough is not None else []
        carried = "".join(f", {_q(c)} AS {_q(n)}" for c, n in pairs)
        # The hits file is published by merge as one more part of results/, by reference: it
        # is written here in exactly the parts' schema (the plan's result schema).
        batches = con.sql(
            f"SELECT CAST({_q(idc)} AS VARCHAR) AS id, {answer}{carried} FROM joined WHERE _vllm_hit "
            "ORDER BY _vllm_f, _vllm_r"
        ).to_arrow_reader(HITS_BATCH_ROWS)
        with pq.ParquetWriter(hits_local, schema, compression="zstd") as w:
            for b in batches:
                w.write_batch(
                    pa.RecordBatch.from_arrays([b.column(i).cast(f.type) for i, f in enumerate(schema)], schema=schema)
                )
        con.execute(
            f"COPY (SELECT {', '.join(_q(c) for c in needed)}, {KEY_COLUMN} FROM joined WHERE NOT _vllm_hit "
            f"ORDER BY _vllm_f, _vllm_r) TO '{_sql_str(misses_local)}' "
            f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {MISSES_ROW_GROUP})"
        ).fetchall()
        faults.hit("cache.before_files")
        hits_file = _put(out, hits_local, f"{CACHE_DIR}/hits", j.hits)
    finally:
        con.close()
    log.info(
        "cache %s: %d of %d rows answered from %d committed entries; %d to infer",
        spec.cache.uri,
        j.hits,
        j.rows,
        len(j.commits),
        j.rows - j.hits,
    )
    cp = CachePlan(
        uri=str(spec.cache.uri),
        key_hash=j.khash,
        key_config=j.cfg,
        commits_read=[c.entry_id for c in j.commits],
        rows=j.rows,
        hits=j.hits,
        misses=j.rows - j.hits,
        hits_file=hits_file,
        misses_root=out.uri(SHARD_INPUTS),
        hit_est_tokens=j.hit_tokens,
    )
    return cp, misses_local


def write_shard_inputs(out: Storage, misses_local: str, shards: list[ShardPlan]) -> list[ShardPlan]:
    """One input file per shard under ``_cache/shard-inputs/``: the miss rows its segments select (index 0 of
    the misses file), in order; the shards returned read only it (one segment over the whole file).

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
            f = _put(out, local, f"{SHARD_INPUTS}/{shard.shard_id}", n)
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


def _put(out: Storage, local: str, stem: str, rows: int) -> CacheFile:
    """``<stem>-<sha16>.parquet``: same name, same bytes, so an existing one of the right bytes is kept."""
    h = hashlib.sha256()
    with open(local, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    sha, size = h.hexdigest(), os.path.getsize(local)
    rel = f"{stem}-{sha[:16]}.parquet"
    if not (out.exists(rel) and out.size(rel) == size and out.sha256(rel) == sha):
        out.publish(local, rel)
    return CacheFile(path=rel, bytes=size, sha256=sha, rows=rows)


# ---- merge ------------------------------------------------------------------------------
def engines_differ(key_identity: str, made_by: list[str | None]) -> str | None:
    """Why rows made by these engines (the identities the workers sealed into their commit markers) must not be
    filed under a key that names ``key_identity``; None when they are the key's engine.

    Local runner: the identity must be the key's exactly. Kubernetes: the key names the image (pinned by
    digest, so its own environment with it) and the pod's engine variables; each worker must have seen
    every one of those variables with the key's value.
    """
    want_head, _, want_env = key_identity.partition(" env ")
    want = json.loads(want_env) if want_env else {}
    other = set()
    for got in made_by:
        if got is None:
            other.add("(not recorded)")
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


def hits_part(out: Storage, plan: Plan, index: int) -> tuple[FileRef, str]:
    """The plan's hits file as one more part of ``results/`` (its record and published name), checked first.

    It must still be what the sealed plan names (size and sha256) and hold the rows the plan counted;
    it is published as ``part-<index>-cache-hits.parquet`` (``index`` = the computed parts before it,
    so it sorts after them).
    """
    cp = plan.cache
    assert cp is not None
    f = cp.hits_file
    if not out.exists(f.path) or out.size(f.path) != f.bytes or out.sha256(f.path) != f.sha256:
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
) -> CacheMergeSummary:
    """This run's ok rows (``computed``: the published result parts this run's shards made, their bytes checked
    by the merge) -> this run's entry, sealed; then a compaction when the key config has many entries.

    ``made_by``: the engine identities the workers sealed into their markers (``engines_differ``).
    Idempotent: a merge rerun finds the commit and appends nothing; one killed before it rewrites the
    part (the same path) and commits. Entry rows: key (from the shards' input files, fetched and checked
    against the sealed plan), source_id, the answer columns, cached_from, computed_at.
    """
    cp = plan.cache
    assert cp is not None
    store = CacheStore(cp.uri, spec.io.storage_options, keyring, filesystems)
    eid = entry_id(plan, spec.io.output_uri)
    done = store.read_commit(cp.key_hash, eid)
    if done is not None:
        return CacheMergeSummary(
            uri=cp.uri, hits=cp.hits, appended=done.rows, entry_id=eid, committed_by="earlier_merge"
        )
    if not computed:
        return CacheMergeSummary(uri=cp.uri, hits=cp.hits, appended=0)
    wrong = engines_differ(str(cp.key_config.get("engine_identity")), made_by)
    origin = spec.io.output_uri.rstrip("/")
    if wrong:
        log.warning("cache %s: not appending run %s: %s", cp.uri, origin, wrong)
        return CacheMergeSummary(uri=cp.uri, hits=cp.hits, appended=0, skipped=wrong)
    idc = _q(spec.prompt.id_column)
    answer = ", ".join(f"s.{_q(c)}" for c in ANSWER_COLUMNS)
    with tempfile.TemporaryDirectory(prefix="vllm-batch-cache-") as tmp:
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
            # one row per key: rows of equal text (and settings) have one answer; the first id names it
            con.execute(
                f"CREATE TEMP TABLE entry AS SELECT m.{KEY_COLUMN} AS key, s.id AS source_id, {answer}, "
                f"'{_sql_str(origin)}' AS {CACHED_FROM}, '{now()}' AS {COMPUTED_AT} "
                f"FROM read_parquet({duck.file_list(out, computed)}) s "
                f"JOIN read_parquet({duck.local_list(inputs)}) m ON s.id = CAST(m.{idc} AS VARCHAR)"
            ).fetchall()
            total, distinct = con.execute("SELECT count(*), count(DISTINCT key) FROM entry").fetchall()[0]
            once = (
                "entry"
                if total == distinct
                else "(SELECT * FROM entry QUALIFY row_number() OVER (PARTITION BY key ORDER BY source_id) = 1)"
            )
            con.execute(
                f"COPY (SELECT * FROM {once} ORDER BY source_id) TO '{_sql_str(local)}' "
                "(FORMAT parquet, COMPRESSION zstd)"
            ).fetchall()
        finally:
            con.close()
        rows = pq.ParquetFile(local).metadata.num_rows
        if rows == 0:
            return CacheMergeSummary(uri=cp.uri, hits=cp.hits, appended=0)
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
        )
        log.info("cache %s: entry %s %s with %d rows", cp.uri, eid, "committed" if made else "already committed", rows)
        compacted = store.compact(cp.key_hash, tmp)
    return CacheMergeSummary(
        uri=cp.uri,
        hits=cp.hits,
        appended=rows,
        entry_id=eid,
        committed_by="this_merge" if made else "earlier_merge",
        **({"compacted_into": compacted} if compacted else {}),
    )
