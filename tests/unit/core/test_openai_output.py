"""OpenAI batch output lines: deterministic ids from custom_id, the shapes OpenAI and vLLM use."""

from __future__ import annotations

from airflow_provider_vllm.core.openai_output import error_line, response_line
from tests.support.data import make_spec


def test_a_chat_result_line_is_deterministic_and_carries_usage(tmp_path):
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    row = {"id": "req-1", "output": "bug", "finish_reason": "stop", "prompt_tokens": 7, "completion_tokens": 2}
    a, b = response_line(row, spec), response_line(dict(row), spec)
    assert a == b  # a re-run writes byte-identical files
    body = a["response"]["body"]
    assert a["custom_id"] == "req-1" and a["error"] is None and a["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "bug"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert a["id"] != response_line({**row, "id": "req-2"}, spec)["id"]


def test_an_embedding_line_and_an_error_line(tmp_path):
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    emb = response_line({"id": "e", "embedding": [0.5, 1.0], "prompt_tokens": 3}, spec)
    assert emb["response"]["body"]["data"][0]["embedding"] == [0.5, 1.0]
    assert emb["response"]["body"]["usage"]["total_tokens"] == 3
    err = error_line({"id": "bad", "error_code": "EMPTY_INPUT", "error_message": "no text"}, spec)
    assert err["custom_id"] == "bad" and err["response"] is None
    assert err["error"] == {"code": "EMPTY_INPUT", "message": "no text"}


def test_a_generate_result_line_is_a_text_completion(tmp_path):
    """Task generate completes a raw prompt: its lines have /v1/completions' shape (choices[].text), which a
    consumer of OpenAI's or vLLM's completions reads, not a chat message."""
    spec = make_spec(tmp_path / "in", tmp_path / "out", task="generate", prompt={"template": "{text}"})
    row = {"id": "g-1", "output": " once upon", "finish_reason": "length", "prompt_tokens": 4, "completion_tokens": 2}
    line = response_line(row, spec)
    body = line["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": " once upon", "logprobs": None, "finish_reason": "length"}]
    assert "message" not in body["choices"][0]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert line == response_line(dict(row), spec)  # deterministic
