"""OpenAI batch request JSONL inputs: lines of ``custom_id``, ``method``, ``url``, ``body``.

A line is a whole request: the worker gets it as ``values["_request"]`` and validates its
body per row (``openai_requests``). A line that is not a request at all (another method, an
unknown url, a body that is not an object) is that row's ``INVALID_ROW`` error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_provider_vllm.core.errors import DatasetError
from airflow_provider_vllm.core.formats.jsonl import JsonlFormat
from airflow_provider_vllm.core.formats.openai_requests import CHAT_URL, EMBEDDINGS_URL

if TYPE_CHECKING:
    from airflow_provider_vllm.core.spec import JobSpec

OPENAI_URLS = (CHAT_URL, EMBEDDINGS_URL)
REQUEST = "_request"  # the one value column of a row: the parsed request line


class OpenAIBatchFormat(JsonlFormat):
    name = "openai_batch"
    carries_requests = True

    def id_key(self, spec: JobSpec) -> str:  # noqa: ARG002
        return "custom_id"

    def columns(self, spec: JobSpec) -> list[str]:  # noqa: ARG002
        return [REQUEST]

    def row_values(self, row: dict[str, Any], columns: list[str]) -> list[Any]:  # noqa: ARG002
        return [row]

    def check_id_type(self, value: Any, name: str, line_no: int) -> None:
        """``custom_id``, a string as in OpenAI's and vLLM's batch formats (a number is refused, as vLLM does)."""
        if value is None:
            raise DatasetError(
                f"{name} line {line_no}: no 'custom_id': every request line of the OpenAI batch format needs its "
                "own custom_id (the id its output line carries)"
            )
        if not isinstance(value, str):
            raise DatasetError(
                f"{name} line {line_no}: 'custom_id' is {type(value).__name__} {str(value)[:40]!r}; the OpenAI batch "
                "format's custom_id is a string"
            )

    def row_chars(self, row: dict[str, Any], spec: JobSpec) -> int:  # noqa: ARG002
        """Characters of the messages' text contents (chat) or of the input (embeddings)."""
        body = row.get("body")
        if not isinstance(body, dict):
            return 0
        msgs = body.get("messages")
        if isinstance(msgs, list):
            return sum(
                len(m.get("content") or "") for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), str)
            )
        text = body.get("input")
        return len(text) if isinstance(text, str) else 0

    def row_fault(self, row: dict[str, Any]) -> tuple[str, str] | None:
        """Why a request line is not a request at all (method, url, body), or None.

        The body's fields are validated per row by the worker (``openai_requests.parse_chat_body``,
        ``parse_embeddings_body``), against the fields it supports.
        """
        if row.get("method", "POST") != "POST":
            return ("INVALID_ROW", f"method {row.get('method')!r} is not POST")
        url = row.get("url")
        if url not in OPENAI_URLS:
            return ("INVALID_ROW", f"url {url!r} is not one of {list(OPENAI_URLS)}")
        if not isinstance(row.get("body"), dict):
            return ("INVALID_ROW", "body is not an object")
        return None
