"""The result cache's key: equal keys only where the engine would see the same prompt under the same settings.

* ``key_config`` / ``key_hash``: per job, everything but the row that decides an answer (model with a
  pinned commit or the weights' fingerprint, tokenizer likewise, dtype, quantization, context length,
  task, the prompt and sampling sections (a JSON schema also as written: vLLM follows its property order),
  the engine seed and the output-changing ``engine_kwargs``, ``qa.confidence`` where set against the default,
  the engine identity, and each LoRA adapter's identity: every byte, or its hub commit), hashed.
* ``key_sql``: per row, the 32-byte sha256 over that hash and each template column (and ``model.adapter_column``: the
  row's adapter) as its DuckDB type and an injective text of its value. With the cache on the worker renders
  a row from the plan's misses file, which DuckDB writes from the very columns the key reads, so its prompt
  is a function of
  (DuckDB type, value) of every template column: equal keys give byte-identical prompts. A float32
  ``0.1`` and a double ``0.1`` (rendered ``0.10000000149011612`` and ``0.1``), ``true`` and ``'true'``,
  differ in type and so in key. Nested types are refused (``check_key_types``).
* ``check_cacheable``: what the cache refuses (``SpecError`` naming the field): hub model and
  tokenizer revisions that are not full commit hashes, sampling, non-Parquet input, reserved names;
  ``check_engine_identity`` (from ``key_config``): an engine environment that sets a variable the key
  cannot stand for (``VLLM_MODEL_REDIRECT_PATH``).
* ``weights_fingerprint``: sha256 over every byte of a local weights folder, memoised per file by
  its stat (``steps/cache/fingerprint_memo.py``); ``describe_weights``: the same files, one by one, as the plan
  seals them for the worker's check (``core/weights.py``).

A change to what the key means, or to how the worker renders a (type, value) (``worker/prompts.py``
``template_text``) that it rendered before, must bump ``KEY_FORMAT_VERSION``: entries of the older format then
simply stop matching. Rendering values that were every row's error before (dates, times, timestamps, decimals:
only ok rows are cached, so no entry holds such a key) needs no bump. The rendering of those keeps the rule: a
TIMESTAMPTZ is keyed by its instant and rendered as that instant in UTC (never the file's zone); TIMESTAMP_NS is
keyed and rendered to the nanosecond; TIME_NS and TIMETZ are keyed more finely than rendered (pyarrow's time holds
microseconds and no offset): distinct keys that may share a prompt, a miss, never a wrong hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any

import duckdb

from airflow_provider_vllm.core.adapters import AdapterRef, check_refs, describe_adapters, folder_fingerprint
from airflow_provider_vllm.core.engine_identity import identity_env, local_engine_identity
from airflow_provider_vllm.core.errors import SpecError, TransientError
from airflow_provider_vllm.core.formats.base import row_columns
from airflow_provider_vllm.core.records import PinnedFile
from airflow_provider_vllm.core.spec import ENGINE_KWARGS_ALLOWED, JobSpec
from airflow_provider_vllm.core.spec_guard import COMMIT_SHA
from airflow_provider_vllm.core.storage import FileSystems, hash_pool
from airflow_provider_vllm.core.weights import WeightsPin, folder_files, local_folder
from airflow_provider_vllm.steps.cache.fingerprint_memo import FileStat, FingerprintMemo

KEY_FORMAT_VERSION = 2  # 1: CAST(col AS VARCHAR) per column, edge-hashed weights; 2: typed values, every byte

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

# vLLM variables that make it load other files than the key names: the cache is refused while one is set (on the
# plan's engine), and rows of a worker that saw one are not filed (result_cache.engines_differ)
UNKEYED_ENGINE_ENV = {
    "VLLM_MODEL_REDIRECT_PATH": "names a file that maps model names to local folders (vLLM's maybe_model_redirect, "
    "applied to model.name and the tokenizer): vLLM then loads that folder, whose files the key neither names "
    "(model.revision is not used) nor fingerprints, and an edit of the file or the folder keeps the key",
}


# DuckDB types of a template column and the text of a value that the key hashes; each text is
# injective within its type (tests/unit/steps/test_cache_key.py checks every one): shortest
# round-trip text for FLOAT/DOUBLE (-0.0 and 0.0 differ), fixed scale for DECIMAL(p,s), ISO text
# for dates and times (BC dates, infinities), the canonical UUID. CAST(BLOB AS VARCHAR) escapes
# bytes in a way older DuckDB releases did not make injective: hex. TIMESTAMPTZ: microseconds
# since the epoch (its VARCHAR text follows the connection's TimeZone), the text for infinities.
_AS_VARCHAR = frozenset(
    {
        "VARCHAR",
        "JSON",
        "BOOLEAN",
        "TINYINT",
        "SMALLINT",
        "INTEGER",
        "BIGINT",
        "HUGEINT",
        "UTINYINT",
        "USMALLINT",
        "UINTEGER",
        "UBIGINT",
        "UHUGEINT",
        "FLOAT",
        "DOUBLE",
        "DATE",
        "TIME",
        "TIME_NS",
        "TIME WITH TIME ZONE",
        "TIMESTAMP",
        "TIMESTAMP_NS",
        "TIMESTAMP_MS",
        "TIMESTAMP_S",
        "UUID",
        "INTERVAL",
        '"NULL"',  # a column of Parquet's null type: every value is NULL
    }
)
_OWN_TEXT = {
    "BLOB": "hex({c})",
    "TIMESTAMP WITH TIME ZONE": "coalesce(CAST(epoch_us({c}) AS VARCHAR), CAST({c} AS VARCHAR))",
}
_DECIMAL = re.compile(r"^DECIMAL\(\d{1,2},\d{1,2}\)$")
_NESTED = re.compile(r"\[|^(STRUCT|MAP|UNION)\(")


# ---- what the cache refuses ---------------------------------------------------------------
def is_local_model(name: str) -> bool:
    """True for a folder that exists here or a name written as a path (``/``, ``./``, ``~``, ``file:``)."""
    return os.path.isdir(os.path.expanduser(name)) or name.startswith(("/", "./", "../", "~", "file:"))


def _not_a_commit(value: str) -> str:
    """Why ``value`` is not a full commit hash, in words (for the SpecError)."""
    if re.fullmatch(r"[0-9a-fA-F]{40}", value):
        return "has upper-case letters; write the commit hash in lower case"
    if re.fullmatch(r"[0-9a-fA-F]{64}", value):
        return "is 64 hex characters: a sha256 (of a file, say), not a commit of the hub (40 hex characters)"
    if re.fullmatch(r"[0-9a-fA-F]{4,39}", value):
        return f"looks like an abbreviated commit hash ({len(value)} characters): give all 40"
    if len(value) == 40:
        return "is 40 characters but not hexadecimal: a branch or tag name, which can move"
    return "is a branch or tag name, which can move to other files"


def check_revision(field: str, value: str | None, what: str) -> None:
    """SpecError naming ``field`` unless ``value`` is a full, lower-case 40-hex commit hash."""
    how = (
        f"with cache.uri set, {what} must be pinned to its full commit hash (40 hex characters, e.g. "
        "huggingface_hub.HfApi().model_info(repo, revision='main').sha), or a moved name would keep "
        "serving answers made from the old files; or unset cache.uri"
    )
    if value is None:
        raise SpecError(f"{field} is not set: {how}")
    if not COMMIT_SHA.match(value):
        raise SpecError(f"{field} {value!r} {_not_a_commit(value)}: {how}")


def check_cacheable(spec: JobSpec, input_format: str | None = None) -> None:
    """SpecError naming the field when answers of this job cannot be cached safely."""
    if spec.cache.uri is None:
        raise SpecError("cache.uri is not set")
    m = spec.model
    if not is_local_model(m.name):
        check_revision("model.revision", m.revision, f"hub model {m.name!r}")
    tokenizer = m.tokenizer or m.name
    if not is_local_model(tokenizer) and (tokenizer != m.name or m.tokenizer_revision is not None):
        # vLLM loads the tokenizer at tokenizer_revision, or (unset) at model.revision: right only
        # for the model's own repo
        check_revision("model.tokenizer_revision", m.tokenizer_revision, f"hub tokenizer {tokenizer!r}")
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
    cols = {spec.prompt.id_column, *key_columns(spec)}
    reserved = sorted(c for c in cols if c.startswith("_vllm_"))
    if reserved:
        raise SpecError(
            f"prompt: column names starting with '_vllm_' ({reserved}) are reserved by the result cache (cache.uri)"
        )


def check_engine_identity(identity: str) -> None:
    """SpecError naming the variable when the engine's environment sets one the key cannot stand for
    (``UNKEYED_ENGINE_ENV``)."""
    env = identity_env(identity)
    for name, why in UNKEYED_ENGINE_ENV.items():
        if name in env:
            raise SpecError(
                f"cache.uri is set and the engine's environment sets {name} ({env[name]!r}), which {why}; unset "
                f"{name} where the shards' environment is set (name the local folder in model.name instead: the "
                "cache fingerprints it), or unset cache.uri"
            )


# ---- per job ------------------------------------------------------------------------------
_local_folder = local_folder


def weights_fingerprint(folder: str, memo: FingerprintMemo | None = None) -> str:
    """sha256 over every file of the folder: its name in the folder, its size and the sha256 of all its bytes.

    Symbolic links are followed (files and folders, as vLLM reads them) and keyed by their target's
    content under the link's own name; a link to a folder above it (a loop) is not followed. Each file's
    sha256 comes from ``memo`` (default: ``FingerprintMemo.default()``) when its stat is unchanged.
    SpecError for a broken link or an unreadable file; TransientError when a file keeps changing
    while it is read.
    """
    return folder_fingerprint(weights_files(folder, memo))


def weights_files(folder: str, memo: FingerprintMemo | None = None) -> list[tuple[str, int, str]]:
    """(name in the folder, size, sha256) of every file of the folder, sorted (``weights_fingerprint``'s files)."""
    folder = _local_folder(folder)
    memo = FingerprintMemo.default() if memo is None else memo
    files = sorted(folder_files(folder))
    memo.load()
    # hashlib and file reads release the GIL: big weight files are hashed side by side
    with hash_pool(len(files)) as pool:
        sums = list(pool.map(lambda f: _file_sha256(f[1], f[0], folder, memo), files))
    memo.save()
    return [(rel, size, digest) for (rel, _), (size, digest) in zip(files, sums, strict=True)]


def describe_weights(spec: JobSpec, memo: FingerprintMemo | None = None) -> list[WeightsPin]:
    """The pins of the job's local model and tokenizer folders that this process can read (every byte hashed,
    memoised by stat): what the plan seals (``Plan.weights``) and the worker checks (``core/weights.py``)."""
    m = spec.model
    pins = []
    for role, name in (("model", m.name), ("tokenizer", m.tokenizer)):
        if name and is_local_model(name) and os.path.isdir(_local_folder(name)):
            files = [PinnedFile(path=r, bytes=n, sha256=d) for r, n, d in weights_files(name, memo)]
            pins.append(WeightsPin(role=role, name=name, files=files))
    return pins


def _file_sha256(path: str, rel: str, folder: str, memo: FingerprintMemo) -> tuple[int, str]:
    for _ in range(3):
        try:
            before = FileStat.of(path)
        except FileNotFoundError:
            what = "is a broken symbolic link" if os.path.islink(path) else "was removed while the folder was read"
            raise SpecError(f"model folder {folder}: {rel} {what}") from None
        except OSError as e:
            raise SpecError(f"model folder {folder}: cannot read {rel}: {e}") from e
        known = memo.get(before)
        if known is not None:
            return before.size, known
        started = time.time_ns()
        try:
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            raise SpecError(f"model folder {folder}: cannot read {rel}: {e}") from e
        if FileStat.of(path) == before:
            memo.put(before, digest, started)
            return before.size, digest
    raise TransientError(f"model folder {folder}: {rel} kept changing while its fingerprint was taken; retry")


def key_columns(spec: JobSpec) -> list[str]:
    """The row's columns the key hashes: the template columns, then the adapter column (the row's adapter):
    every column of the row the worker reads (``core.formats.base.row_columns``)."""
    return row_columns(spec)


def key_config(
    spec: JobSpec,
    engine_identity: str | None = None,
    adapters: list[AdapterRef] | None = None,
    filesystems: FileSystems | None = None,
    weights: list[WeightsPin] | None = None,
) -> dict[str, Any]:
    """Everything but the row's own values that decides a row's answer (the key config).

    ``weights``: the plan's pins of the local model and tokenizer folders (``describe_weights``, which the
    plan seals); each folder is keyed by its pin's fingerprint (default: the folder hashed here).

    ``adapters``: the plan's identities of the job's LoRA adapters (default: ``describe_adapters``, which reads
    every byte of each local and object store adapter); each adapter is keyed by that identity.
    """
    m = spec.model
    model = m.model_dump(mode="json", exclude={"served_model_names", "adapters", "default_adapter", "adapter_column"})
    if m.adapters:  # absent otherwise: the keys of jobs without adapters stay what they were
        refs = check_refs(spec, adapters if adapters is not None else describe_adapters(spec, filesystems=filesystems))
        model["adapters"] = [
            {"name": a.name, "identity": refs[a.name].identity()} for a in sorted(m.adapters, key=lambda a: a.name)
        ]
        model["default_adapter"] = m.default_adapter
        model["adapter_column"] = m.adapter_column
    pinned = {p.role: p for p in weights or []}
    if is_local_model(m.name):
        folder = _local_folder(m.name)
        if "model" in pinned:
            model["weights_sha256"] = pinned["model"].fingerprint()
        elif os.path.isdir(folder):
            model["weights_sha256"] = weights_fingerprint(folder)
        elif not m.revision:
            raise SpecError(
                f"cache.uri is set and model.name {m.name!r} is a path this process cannot read: the "
                "cache fingerprints the weights folder; make it readable here or pin model.revision "
                "to an identity of those weights"
            )
    if m.tokenizer and is_local_model(m.tokenizer):
        folder = _local_folder(m.tokenizer)
        if "tokenizer" in pinned:
            model["tokenizer_sha256"] = pinned["tokenizer"].fingerprint()
        elif os.path.isdir(folder):
            model["tokenizer_sha256"] = weights_fingerprint(folder)
        elif not m.tokenizer_revision:
            raise SpecError(
                f"cache.uri is set and model.tokenizer {m.tokenizer!r} is a path this process cannot read: "
                "the cache fingerprints the tokenizer folder; make it readable here or pin "
                "model.tokenizer_revision to an identity of that tokenizer"
            )
    identity = engine_identity or local_engine_identity()
    check_engine_identity(identity)
    kwargs = {k: v for k, v in spec.engine.engine_kwargs.items() if k in KEY_ENGINE_KWARGS}
    config: dict[str, Any] = {
        "version": KEY_FORMAT_VERSION,
        "model": model,
        "task": spec.task,
        "prompt": spec.prompt.model_dump(mode="json"),
        "sampling": spec.sampling.model_dump(mode="json"),
        # batch_invariant changes numerics; only when set, so that keys of jobs without it stay as they were
        "engine": {"seed": spec.engine.seed, "engine_kwargs": kwargs}
        | ({"batch_invariant": True} if spec.engine.batch_invariant else {}),
        "engine_identity": identity,
    }
    st = spec.sampling.structured
    if st is not None and st.json_schema is not None:
        # key_hash sorts the config's keys, but vLLM generates an object's properties in the schema's order: the
        # schema's text as written. Only with a schema, so that the keys of other jobs stay as they were
        config["json_schema_text"] = st.json_schema_text()
    if spec.confidence_from_logprobs != spec.confidence_by_default:
        # whether a row carries its confidence (qa.confidence): keyed only where it is set against the job's
        # default, so that the keys of jobs that leave it unset stay as they were
        config["confidence"] = spec.confidence_from_logprobs
    return config


def key_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---- per row ------------------------------------------------------------------------------
def _q(col: str) -> str:
    return '"' + col.replace('"', '""') + '"'


def column_types(con: duckdb.DuckDBPyConnection, source: str, spec: JobSpec) -> dict[str, str]:
    """The DuckDB type of each template column in ``SELECT ... FROM {source}``, checked (``check_key_types``)."""
    cols = key_columns(spec)
    rows = con.execute(f"DESCRIBE SELECT {', '.join(_q(c) for c in cols)} FROM {source}").fetchall()
    types = {str(r[0]): str(r[1]) for r in rows}
    check_key_types(types)
    return types


def check_key_types(types: dict[str, str]) -> None:
    """SpecError naming the first template column whose DuckDB type the key cannot encode injectively."""
    for col, t in types.items():
        if t in _AS_VARCHAR or t in _OWN_TEXT or _DECIMAL.match(t):
            continue
        if _NESTED.search(t):
            raise SpecError(
                f"cache.uri is set but template column {col!r} has the nested type {t}: the result cache keys "
                "a row by its template values and does not encode nested values (and the worker does not render "
                "them either); store the column as text in the input (e.g. a JSON "
                "string), leave it out of prompt.template, or unset cache.uri"
            )
        raise SpecError(
            f"cache.uri is set but template column {col!r} has the type {t}, which the result cache key does "
            "not encode; store it as text (VARCHAR) in the input, leave it out of prompt.template, or unset "
            "cache.uri"
        )


def _text(col: str, duck_type: str) -> str:
    c = _q(col)
    return _OWN_TEXT[duck_type].format(c=c) if duck_type in _OWN_TEXT else f"CAST({c} AS VARCHAR)"


def key_text_sql(spec: JobSpec, khash: str, types: dict[str, str]) -> str:
    """DuckDB expression: the row's key as sha256 hex text over the key hash and, per template column, its type and
    value (how the previous version stored keys; ``key_sql`` is its 32 bytes).

    Each column is ``T<bytes>:<typeof>`` then ``N`` (NULL) or ``S<bytes>:<text>``: prefix-free, so the
    concatenation is injective whenever each ``<text>`` is injective within its type. ``types``:
    ``column_types`` of the same source (it picks the text; the hash takes the type from ``typeof``).
    """
    return f"sha256({key_message_sql(spec, khash, types)})"


def key_message_sql(spec: JobSpec, khash: str, types: dict[str, str]) -> str:
    """DuckDB expression: the text whose sha256 is the row's key (``key_text_sql``): equal texts, equal prompts."""
    parts = [f"'{khash}|'"]
    for col in key_columns(spec):
        c = _q(col)
        v = _text(col, types[col])
        parts.append(f"'T' || CAST(strlen(typeof({c})) AS VARCHAR) || ':' || typeof({c})")
        parts.append(f"(CASE WHEN {c} IS NULL THEN 'N' ELSE 'S' || CAST(strlen({v}) AS VARCHAR) || ':' || {v} END)")
    return " || ".join(parts)


def key_sql(spec: JobSpec, khash: str, types: dict[str, str]) -> str:
    """DuckDB expression: the row's key, the 32-byte sha256 (a BLOB) of ``key_text_sql``'s message: the bytes whose
    hex text the previous version stored, so its entries still match."""
    return f"unhex({key_text_sql(spec, khash, types)})"
