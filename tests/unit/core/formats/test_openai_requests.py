"""OpenAI batch request bodies: what the body models accept, refuse, and why (no engine)."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core.formats.openai_requests import (
    MAX_REQUEST_STOP,
    RequestFault,
    parse_chat_body,
    parse_embeddings_body,
)


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
    # neutral means the same value and type: true is not 1, 1.0 is not 1; an empty tools list vLLM refuses
    for bad in ({"n": True}, {"n": 1.0}, {"logprobs": 0}, {"top_logprobs": False}, {"tools": []}):
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


# ---- a row asks for nothing the job spec could not (one rule: the spec's own fields) ----------
SHARED_VALUES = {
    "temperature": [-0.001, 0, 0.7, 2, 2.0001, 1e308],
    "top_p": [-1, 0, 1e-9, 0.5, 1, 1.0001],
    "max_tokens": [-5, 0, 1, 4096, 10**9],
    "seed": [-(2**63) - 1, -(2**63), 0, 2**63 - 1, 2**63, 2**70],
    "stop": [
        [],
        ["a"] * 16,
        ["a"] * 17,
        ["a"] * 10_000,
        ["x" * 256],
        ["x" * 257],
        ["x" * 100_000],
        [""],
        ["\t", "\n\n", "\r\n"],
        ["\x00"],
        ["a\x1bb"],
        ["\x7f"],
        ["END"],
    ],
}


def _spec_takes(field: str, value) -> bool:
    from airflow_provider_vllm.core.spec import JobSpec

    doc = {
        "model": {"name": "fake"},
        "io": {"input_uri": "/data/in", "output_uri": "/data/out"},
        "prompt": {"template": "{text}"},
        "sampling": {field: value},
    }
    try:
        JobSpec.load(doc)
    except ValueError:
        return False
    return True


def _row_takes(field: str, value) -> bool:
    try:
        parse_chat_body({"messages": user(), field: value})
    except RequestFault as e:
        assert e.code == "INVALID_REQUEST" and f"body.{field}" in e.message, e.message
        return False
    return True


@pytest.mark.parametrize("field", sorted(SHARED_VALUES))
def test_a_row_takes_exactly_the_values_the_spec_takes(field):
    """temperature, top_p, max_tokens, seed and stop: the row validator is the spec's own rule."""
    from tests.support.ledger import record_malicious

    for value in SHARED_VALUES[field]:
        # and a request's own bound: at most 4 stop strings (OpenAI's and vLLM's ChatCompletionRequest's)
        takes = _spec_takes(field, value) and (field != "stop" or len(value) <= MAX_REQUEST_STOP)
        assert _row_takes(field, value) == takes, (field, str(value)[:80])
    if field == "max_tokens":  # max_completion_tokens is the same field under OpenAI's newer name
        for value in SHARED_VALUES[field]:
            assert _row_takes("max_completion_tokens", value) == _spec_takes(field, value), value
    refused = [v for v in SHARED_VALUES[field] if not _spec_takes(field, v)]
    record_malicious(f"openai_row_{field}_outside_the_spec", len(refused), len(refused))


def test_ten_thousand_stop_strings_are_one_rows_error_naming_the_rule():
    with pytest.raises(RequestFault) as e:
        parse_chat_body({"messages": user(), "stop": [f"s{i}" for i in range(10_000)]})
    assert e.value.code == "INVALID_REQUEST"
    assert e.value.message.startswith("body.stop: 10000 stop strings; at most 16 (the job spec's sampling.stop rule)")
    with pytest.raises(RequestFault, match="5 stop strings; a request may give at most 4"):
        parse_chat_body({"messages": user(), "stop": list("abcde")})
    assert len(e.value.message) < 200  # the message does not echo the strings


def test_jinja_delimiters_are_data_in_a_row():
    """The spec refuses them (a spec value carrying them was meant for a template engine); a row is
    never rendered, and '}}' is an ordinary stop string for JSON output."""
    assert parse_chat_body({"messages": user(), "stop": ["}}", "{%"]}).sampling()["stop"] == ["}}", "{%"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not importable here")
def test_what_a_row_may_set_vllms_sampling_params_take():
    """The edges the row validator accepts are values vLLM's own SamplingParams accepts: never looser."""
    from vllm import SamplingParams

    edges = [
        {"temperature": 0, "top_p": 1e-9, "max_tokens": 1, "seed": -(2**63)},
        {"temperature": 2, "top_p": 1, "max_tokens": 10**6, "seed": 2**63 - 1},
        {"stop": ["x" * 256] * 3 + ["\t\n"]},
        {"top_k": -1, "min_p": 0, "repetition_penalty": 1e-9, "min_tokens": 0, "presence_penalty": -2},
        {"top_k": 10**9, "min_p": 1, "repetition_penalty": 1e9, "frequency_penalty": 2, "max_completion_tokens": 3},
    ]
    for kw in edges:
        SamplingParams(**parse_chat_body({"messages": user(), **kw}).sampling())


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
