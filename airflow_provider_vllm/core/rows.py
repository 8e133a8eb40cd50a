"""The per-row output records: the worker's row schema and the two published part schemas.

A worker builds every row of a chunk exactly once as a ``ROW_SCHEMA`` row (``status`` 'ok' or
'error') and writes them as two part files, each already in its published schema: ok rows as
``RESULT_SCHEMA``, error rows as ``ERROR_SCHEMA`` (``split_rows``). Merge publishes those part
files as they are (no decoding), so these two schemas are the schemas of ``results/`` and ``errors/``.
"""

from __future__ import annotations

import hashlib
import json
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
ENGINE_ERROR = "ENGINE_ERROR"  # the engine failed this one row (alone; a probe request ran fine after it)
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
    "engine_version",
    "config_hash",
    "shard_id",
    "attempt_id",
]

ERROR_SCHEMA = pa.schema([ROW_SCHEMA.field(c) for c in ERROR_COLUMNS])


def rows_table(records: list[dict]) -> pa.Table:
    """A chunk table from row dicts (missing keys are null)."""
    return pa.Table.from_pylist(records, schema=ROW_SCHEMA)


def split_rows(table: pa.Table) -> tuple[pa.Table, pa.Table]:
    """A ``ROW_SCHEMA`` table -> (ok rows as ``RESULT_SCHEMA``, error rows as ``ERROR_SCHEMA``), order kept."""
    ok_mask = pc.equal(table.column("status"), "ok")
    ok = table.filter(ok_mask)
    err = table.filter(pc.invert(ok_mask))
    res = pa.Table.from_arrays(
        [ok.column(c) for c in RESULT_COLUMNS[:-1]] + [pa.nulls(ok.num_rows, pa.string())], schema=RESULT_SCHEMA
    )
    return res, pa.Table.from_arrays([err.column(c) for c in ERROR_COLUMNS], schema=ERROR_SCHEMA)


def prompt_hash(token_ids: list[int], overrides: dict[str, Any] | None = None) -> int:
    """The ``prompt_hash`` of an engine request: 64 bits of BLAKE2b over its token ids and its per-row
    sampling settings, as a signed int64 (equal for identical requests, in any process)."""
    h = hashlib.blake2b(len(token_ids).to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())  # fixed width, the count first: no two requests share bytes
    if overrides:
        h.update(json.dumps(overrides, sort_keys=True, default=str).encode())
    return int.from_bytes(h.digest(), "little", signed=True)
