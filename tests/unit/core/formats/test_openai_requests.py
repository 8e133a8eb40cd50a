"""OpenAI batch request bodies: what the body models accept, refuse, and why (no engine)."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core.formats.openai_requests import RequestFault, parse_chat_body, parse_embeddings_body


def user(text="hello"):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"messages": user(), "foo": 1}, "unknown field body.foo (accepted: messages, model"),
        ({"messages": user(), "n": 2}, "body.n: 2 is not supported: one completion per request"),
        ({"messages": user(), "stream": True}, "streaming does not apply to batch requests"),
        ({"messages": user(), "tools": [{"type": "function"}]}, "tool calling is not supported"),
        ({"messages": user(), "response_format": {"type": "json_schema"}}, "set sampling.structured in the job spec"),
        ({"messages": [{"role": "tool", "content": "1", "tool_call_id": "x"}]}, "role 'tool': tool messages"),
        (
            {"messages": [{"role": "user", "content": "x", "foo": 1}]},
            "unknown field body.messages[0].foo (accepted: role",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "only text content is"),
    ],
)
def test_refused_fields_say_which_and_why(body, fragment):
    with pytest.raises(RequestFault) as e:
        parse_chat_body(body)
    assert e.value.code == "UNSUPPORTED_PARAMETER" and fragment in e.value.message


def test_neutral_values_of_refused_fields_are_accepted():
    b = parse_chat_body(
        {
            "messages": user(),
            "n": 1,
            "stream": False,
            "logprobs": False,
            "top_logprobs": 0,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "store": False,
            "stream_options": None,
            "model": "gpt-4o-mini",
            "user": "u",
            "metadata": {"k": "v"},
        }
    )
    assert b.sampling() == {}
    # neutral means the same value and type: true is not 1, 1.0 is not 1
    for bad in ({"n": True}, {"n": 1.0}, {"logprobs": 0}, {"top_logprobs": False}):
        with pytest.raises(RequestFault):
            parse_chat_body({"messages": user(), **bad})


def test_text_parts_are_joined_like_vllm_and_max_completion_tokens_wins():
    b = parse_chat_body(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 9,
            "max_completion_tokens": 3,
            "stop": "x",
            "seed": 5,
        }
    )
    assert b.conversation() == [{"role": "user", "content": "a\nb"}]
    assert b.sampling() == {"max_tokens": 3, "stop": "x", "seed": 5}


def test_embeddings_bodies():
    assert parse_embeddings_body({"input": "x", "encoding_format": "float", "model": "m"}).input == "x"
    for body, code in [
        ({"input": ""}, "EMPTY_INPUT"),
        ({"input": "   "}, "EMPTY_INPUT"),
        ({"input": None}, "EMPTY_INPUT"),
        ({"input": ["a", "b"]}, "UNSUPPORTED_PARAMETER"),
        ({"input": 3}, "INVALID_REQUEST"),
        ({"input": "x", "encoding_format": "base64"}, "UNSUPPORTED_PARAMETER"),
        ({"input": "x", "dimensions": 8}, "UNSUPPORTED_PARAMETER"),
        ({}, "INVALID_REQUEST"),
        ({"input": "x", "extra": 1}, "UNSUPPORTED_PARAMETER"),
    ]:
        with pytest.raises(RequestFault) as e:
            parse_embeddings_body(body)
        assert e.value.code == code, (body, e.value.message)


@pytest.mark.parametrize(
    "extra, logprobs",
    [({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5), ({"logprobs": True, "top_logprobs": 20}, 20)],
)
def test_logprobs_map_to_vllms_sampling_logprobs(extra, logprobs):
    """As vLLM's OpenAI server maps them: logprobs true -> SamplingParams.logprobs = top_logprobs (0: the chosen
    token's only)."""
    assert parse_chat_body({"messages": user(), **extra}).sampling() == {"logprobs": logprobs}


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"top_logprobs": 3}, "when using top_logprobs, logprobs must be set to true"),
        ({"logprobs": True, "top_logprobs": 21}, "body.top_logprobs: must be in [0, 20], got 21"),
        ({"logprobs": True, "top_logprobs": -1}, "body.top_logprobs: must be in [0, 20], got -1"),
        ({"logprobs": "yes"}, "body.logprobs"),
    ],
)
def test_logprobs_out_of_range_are_invalid_requests(extra, fragment):
    with pytest.raises(RequestFault) as e:
        parse_chat_body({"messages": user(), **extra})
    assert e.value.code == "INVALID_REQUEST" and fragment in e.value.message
