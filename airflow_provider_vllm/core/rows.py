"""The per-row output records: the worker's row schema and the two published part schemas.

A worker builds every row of a chunk exactly once as a ``ROW_SCHEMA`` row (``status`` 'ok' or
'error') and writes them as two part files, each already in its published schema: ok rows as
``RESULT_SCHEMA``, error rows as ``ERROR_SCHEMA`` (``split_rows``). Merge publishes those part
files as they are (no decoding), so these two schemas are the schemas of ``results/`` and ``errors/``.

A job with passthrough columns (``io.passthrough``) publishes per-job schemas: the same columns with the
passthrough columns appended, in the input's own types (``result_schema``, ``error_schema``); the plan
records them (``encode_schema``) and every writer of a part (the workers, the plan's cache hits, merge's
empty parts) writes exactly them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import string
from array import array
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

# Reason codes of error rows.
EMPTY_INPUT = "EMPTY_INPUT"  # null / empty / whitespace-only text
INVALID_ROW = "INVALID_ROW"  # wrong type or unusable value; an OpenAI request line that is not POST/url/body
INVALID_JSON = "INVALID_JSON"  # a JSONL line that does not parse
INVALID_REQUEST = "INVALID_REQUEST"  # an OpenAI request body value out of range / of the wrong type, or refused by vLLM
UNSUPPORTED_PARAMETER = "UNSUPPORTED_PARAMETER"  # an OpenAI request field this worker does not do (n > 1, stream,
#                                                  tools, logprobs, ...) or that no API has (unknown fields)
TEMPLATE_ERROR = "TEMPLATE_ERROR"  # the model's chat template refused the row's messages (roles that do not
#                                    alternate, a role the template does not know)
PROMPT_TOO_LONG = "PROMPT_TOO_LONG"  # over the token budget with truncation=reject
ENGINE_ERROR = "ENGINE_ERROR"  # the engine failed this one row (alone; a probe request ran fine after it), or
#                                pooled it into an empty vector or one with NaN / infinity (no answer)
ENGINE_OOM = "ENGINE_OOM"  # out of memory with this row alone in the engine at the lowest limits
ERROR_CODES = (
    EMPTY_INPUT,
    INVALID_ROW,
    INVALID_JSON,
    INVALID_REQUEST,
    UNSUPPORTED_PARAMETER,
    TEMPLATE_ERROR,
    PROMPT_TOO_LONG,
    ENGINE_ERROR,
    ENGINE_OOM,
)

_dict_str = pa.dictionary(pa.int32(), pa.string())

ROW_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),  # 'ok' | 'error'
        pa.field("output", pa.string()),  # generated text (generate/chat)
        pa.field("label", pa.string()),  # the choice, when structured.choice is set
        pa.field("parsed_json", pa.string()),  # canonical JSON, when structured.json_schema is set
        pa.field("valid", pa.bool_()),  # structured output parsed/matched (null: not structured)
        pa.field("embedding", pa.list_(pa.float32())),  # embed task
        pa.field("scores", pa.list_(pa.float32())),  # classify task: class probabilities
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("truncated", pa.bool_()),
        pa.field("latency_ms", pa.float32()),
        pa.field("error_code", pa.string()),
        pa.field("error_message", pa.string()),
        pa.field("model", pa.string()),
        pa.field("model_revision", pa.string()),
        pa.field("adapter", pa.string()),  # the LoRA adapter (model.adapters[].name) that answered; null: the base
        pa.field("engine_version", pa.string()),
        pa.field("config_hash", pa.string()),
        pa.field("shard_id", pa.string()),
        pa.field("attempt_id", pa.string()),
        # Added after the first release: trailing and nullable, so parts written before them read as null.
        # The answer's probability as the engine computed it (structured choice: exp of the sum of the chosen
        # tokens' logprobs, i.e. the chosen label's probability; classify: the top class's probability).
        pa.field("confidence", pa.float32()),
        # 64-bit hash of the engine request (the rendered prompt's token ids and per-row sampling settings):
        # equal hashes, identical requests (QA's consistency, the change set's reasons).
        pa.field("prompt_hash", pa.int64()),
        # OpenAI batch requests that ask for logprobs: the choice's "logprobs" object (JSON, OpenAI's shape).
        pa.field("logprobs", pa.string()),
    ]
)

RESULT_COLUMNS = [f.name for f in ROW_SCHEMA if f.name not in ("status", "error_code", "error_message")]
# ``cached_from``: the output URI of the run that computed a row served from the result cache;
# always null in rows this run's workers computed.
RESULT_SCHEMA = pa.schema([ROW_SCHEMA.field(c) for c in RESULT_COLUMNS] + [pa.field("cached_from", pa.string())])
RESULT_COLUMNS = RESULT_SCHEMA.names
ERROR_COLUMNS = [
    "id",
    "error_code",
    "error_message",
    "prompt_tokens",
    "model",
    "model_revision",
    "adapter",
    "engine_version",
    "config_hash",
    "shard_id",
    "attempt_id",
]

ERROR_SCHEMA = pa.schema([ROW_SCHEMA.field(c) for c in ERROR_COLUMNS])


def rows_table(records: list[dict]) -> pa.Table:
    """A chunk table from row dicts (missing keys are null)."""
    return pa.Table.from_pylist(records, schema=ROW_SCHEMA)


# Names a passthrough column may not take in results/ or errors/ (besides their own columns): the worker's
# row status, and the prefix the result cache reserves for its own columns.
RESERVED_PREFIX = "_vllm_"


def result_schema(passthrough: pa.Schema | None = None) -> pa.Schema:
    """The schema of ``results/``: ``RESULT_SCHEMA``, then the passthrough columns (their output names)."""
    return RESULT_SCHEMA if not passthrough else pa.schema(list(RESULT_SCHEMA) + list(passthrough))


def error_schema(passthrough: pa.Schema | None = None) -> pa.Schema:
    """The schema of ``errors/``: ``ERROR_SCHEMA``, then the passthrough columns (their output names)."""
    return ERROR_SCHEMA if not passthrough else pa.schema(list(ERROR_SCHEMA) + list(passthrough))


# DuckDB binds column names ignoring the case of ASCII letters only (duckdb 2.0.1: ``Д`` and ``д``, the Kelvin
# sign and ``k``, are distinct columns to it; ``ID`` and ``id`` are one name, and it reads the second as ``ID_1``)
_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def duck_name_key(column: str) -> str:
    """``column`` as DuckDB compares names: its ASCII letters lowered, every other character as it is."""
    return column.translate(_ASCII_LOWER)


# the columns of results/ and errors/ (and the worker's row status), by DuckDB's key of their names
_TAKEN = {duck_name_key(c): c for c in [*RESULT_SCHEMA.names, *ERROR_COLUMNS, "status"]}


def passthrough_clash(name: str) -> str | None:
    """Why ``name`` cannot be a passthrough column's output name, or None. Names are compared as DuckDB compares
    them (``duck_name_key``): a ``LABEL`` beside ``label`` would be ``LABEL_1`` to DuckDB."""
    key = duck_name_key(name)
    if key in _TAKEN:
        if _TAKEN[key] == name:
            return "is a column of results/ or errors/"
        return (
            f"equals {_TAKEN[key]!r}, a column of results/ or errors/, ignoring the case of ASCII letters (DuckDB "
            "compares column names so, and would read it as another name)"
        )
    if key.startswith(RESERVED_PREFIX):
        return f"starts with {RESERVED_PREFIX!r} (ignoring case), reserved by the result cache"
    return None


def encode_schema(schema: pa.Schema) -> str:
    """A schema as text for a JSON record (Arrow IPC, base64): every type exactly, nested ones too."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def decode_schema(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def split_rows(table: pa.Table, passthrough: pa.Table | None = None) -> tuple[pa.Table, pa.Table]:
    """A ``ROW_SCHEMA`` table -> (ok rows as ``RESULT_SCHEMA``, error rows as ``ERROR_SCHEMA``), order kept.

    ``passthrough``: one row per row of ``table`` (same order), its columns already named and typed as they are
    published; appended to both parts (``result_schema`` / ``error_schema`` of its schema).
    """
    ok_mask = pc.equal(table.column("status"), "ok")
    ok = table.filter(ok_mask)
    err = table.filter(pc.invert(ok_mask))
    ok_cols = [ok.column(c) for c in RESULT_COLUMNS[:-1]] + [pa.nulls(ok.num_rows, pa.string())]
    err_cols = [err.column(c) for c in ERROR_COLUMNS]
    extra = None
    if passthrough is not None and passthrough.num_columns:
        if passthrough.num_rows != table.num_rows:
            raise ValueError(f"passthrough has {passthrough.num_rows} rows, the chunk {table.num_rows}")
        extra = passthrough.schema
        ok_cols += passthrough.filter(ok_mask).columns
        err_cols += passthrough.filter(pc.invert(ok_mask)).columns
    return (
        pa.Table.from_arrays(ok_cols, schema=result_schema(extra)),
        pa.Table.from_arrays(err_cols, schema=error_schema(extra)),
    )


def samples_at_random(temperature: Any, seed: Any) -> bool:
    """Whether a generation request with these sampling settings draws its tokens at random: a temperature
    other than 0 (unset included: vLLM's default is 1) without a per-request seed. Two identical such requests
    may get different answers by design: the worker gives their rows no ``prompt_hash`` (QA's consistency and
    the changes' reasons compare only requests whose answer the request decides), and plan does not dedupe them.
    """
    return seed is None and not (type(temperature) in (int, float) and temperature == 0)


def prompt_hash(token_ids: list[int], overrides: dict[str, Any] | None = None, adapter: str | None = None) -> int:
    """The ``prompt_hash`` of an engine request: 64 bits of BLAKE2b over its token ids, its per-row
    sampling settings and its LoRA adapter (``model.adapters[].name``; None: the base model, hashed as
    before adapters existed), as a signed int64 (equal for identical requests, in any process). The worker
    writes it for requests whose answer the request decides (pooling, greedy or seeded: not
    ``samples_at_random``)."""
    h = hashlib.blake2b(len(token_ids).to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())  # fixed width, the count first: no two requests share bytes
    if overrides:
        h.update(json.dumps(overrides, sort_keys=True, default=str).encode())
    if adapter is not None:  # a tagged, length-prefixed field: no sampling settings' JSON can spell it
        h.update(b"\x00adapter" + len(adapter.encode()).to_bytes(4, "little") + adapter.encode())
    return int.from_bytes(h.digest(), "little", signed=True)
