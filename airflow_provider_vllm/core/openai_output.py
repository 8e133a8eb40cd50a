"""The OpenAI Batch API format's output lines (the input side is ``core.formats.openai_batch``).

Output lines work with OpenAI's Batch API and `vllm run-batch` alike, except a ``generate`` job's text
completion lines (``/v1/completions``: OpenAI's Batch API has that route, vLLM 0.25's run-batch does not; their
bodies are vLLM's ``CompletionResponse``). They are deterministic
(no timestamps, ids derived from ``custom_id``) so that a re-run produces byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from airflow_provider_vllm.core.spec import JobSpec


def _rid(custom_id: str, prefix: str) -> str:
    return f"{prefix}-{hashlib.sha256(custom_id.encode()).hexdigest()[:24]}"


def response_line(row: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """One output line for a result row: a chat completion (task chat), a text completion (task generate: the
    shape of ``/v1/completions``, ``choices[].text``) or an embedding. ``body.model`` names what answered, as
    vLLM's server does: the row's LoRA adapter, else the job's first served model name."""
    model = row.get("adapter") or spec.model.served_names[0]
    usage = {
        "prompt_tokens": row.get("prompt_tokens") or 0,
        "completion_tokens": row.get("completion_tokens") or 0,
    }
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if row.get("embedding") is not None:
        body: dict[str, Any] = {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": row["embedding"]}],
            "model": model,
            "usage": usage,
        }
    elif spec.task == "generate":  # a raw prompt's completion: /v1/completions' shape, as vLLM's server answers it
        body = {
            "id": _rid(row["id"], "cmpl"),
            "object": "text_completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": row.get("output"),
                    "logprobs": None,  # per-row logprobs come only from chat request lines (openai_batch input)
                    "finish_reason": row.get("finish_reason"),
                }
            ],
            "usage": usage,
        }
    else:
        body = {
            "id": _rid(row["id"], "chatcmpl"),
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": row.get("output")},
                    "logprobs": json.loads(row["logprobs"]) if row.get("logprobs") else None,
                    "finish_reason": row.get("finish_reason"),
                }
            ],
            "usage": usage,
        }
    return {
        "id": _rid(row["id"], "batch_req"),
        "custom_id": row["id"],
        "response": {"status_code": 200, "request_id": _rid(row["id"], "req"), "body": body},
        "error": None,
    }


def error_line(row: dict[str, Any], spec: JobSpec) -> dict[str, Any]:  # noqa: ARG001
    """One error line for an error row."""
    return {
        "id": _rid(row["id"], "batch_req"),
        "custom_id": row["id"],
        "response": None,
        "error": {"code": row.get("error_code"), "message": row.get("error_message")},
    }
