"""The per-row output record: one Arrow schema for worker chunks, and the merged files.

A worker chunk holds every row of its range exactly once, with ``status`` 'ok' or 'error'.
Merge splits them into ``results`` (status ok) and ``errors`` (status error).
"""

from __future__ import annotations

import pyarrow as pa

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
ERROR_CODES = (EMPTY_INPUT, INVALID_ROW, INVALID_JSON, INVALID_REQUEST, UNSUPPORTED_PARAMETER, TEMPLATE_ERROR,
               PROMPT_TOO_LONG, ENGINE_ERROR, ENGINE_OOM)

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
    ]
)

RESULT_COLUMNS = [f.name for f in ROW_SCHEMA if f.name not in ("status", "error_code", "error_message")]
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


def rows_table(records: list[dict]) -> pa.Table:
    """A chunk table from row dicts (missing keys are null)."""
    return pa.Table.from_pylist(records, schema=ROW_SCHEMA)
