"""This project's OpenAI batch format held against vLLM's own, on the vLLM the tests install.

The request and output models stay this project's (``core/formats/openai_requests.py``,
``core/openai_output.py``); this test feeds one corpus of valid and invalid request lines through
both sides and names the first line on which they disagree, so that a vLLM upgrade that changes a
rule is caught here, not in a run:

* vLLM: ``BatchRequestInput`` (run-batch's line model: a line it refuses stops the whole file), the
  url routing and stream refusal of ``run_batch``, the served-model check of its OpenAI server
  (``BaseServing._is_model_supported``, then its LoRA names), and the chat request's
  ``to_sampling_params`` (which builds, and so validates, the ``SamplingParams``);
* this project: the plan's line checks (``custom_id``; method, url, body), the worker's per-row body
  validation (``PromptBuilder.prepare_openai``) and its ``SamplingParams`` (``worker.engine.sampling_params``).

Verdicts: ``file`` (the file is refused), ``row`` (that line is an error line), ``ok``. Where both run
a line, every sampling field the body sets must reach vLLM's ``SamplingParams`` with vLLM's value.
``DELIBERATE`` lists the lines vLLM runs and this worker refuses, each with its reason; a line the
worker runs and vLLM refuses is never allowed, and a deliberate difference that vLLM closes (it now
refuses the line too) fails the test so that the list stays true. The output side: every line the
worker writes validates as vLLM's ``BatchRequestOutput`` (response bodies as its chat, completion and
embedding responses). No engine starts; importing vLLM's server modules takes ~20 s.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from typing import Any

import pytest

from airflow_provider_vllm.core.errors import DatasetError
from airflow_provider_vllm.core.formats.openai_batch import OpenAIBatchFormat
from airflow_provider_vllm.core.openai_output import error_line, response_line
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.worker.engine import sampling_params
from airflow_provider_vllm.worker.prompts import PromptBuilder

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SERVED = "served-model"
ADAPTER = "billing"
MAX_MODEL_LEN = 2048
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "My invoice shows the wrong VAT number."}]
# the SamplingParams fields a body can set, compared where both sides run the line
COMPARED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "min_tokens",
    "max_tokens",
)


def line(body: Any = None, *, cid: Any = "c", url: str = CHAT, method: str = "POST", **extra: Any) -> dict:
    d = {"custom_id": cid, "method": method, "url": url, "body": {"model": SERVED, "messages": USER} | (body or {})}
    if cid is None:
        del d["custom_id"]
    return d | extra


CORPUS: list[tuple[str, Any]] = [
    # runs on both sides
    ("plain", line()),
    ("no-model", line({"model": None})),
    ("empty-model", line({"model": ""})),
    ("adapter-by-model", line({"model": ADAPTER})),
    ("temperature", line({"temperature": 0.7, "seed": 3})),
    ("top-p", line({"top_p": 0.5, "temperature": 0.8})),
    ("max-tokens", line({"max_tokens": 7})),
    ("max-completion-tokens", line({"max_completion_tokens": 9, "max_tokens": 100})),
    ("stop-string", line({"stop": "."})),
    ("stop-list", line({"stop": [".", "!"]})),
    ("penalties", line({"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2})),
    ("top-k-min-p", line({"top_k": 5, "min_p": 0.1, "temperature": 0.9})),
    ("top-k-zero", line({"top_k": 0, "temperature": 0.9})),
    ("stop-four", line({"stop": ["a", "b", "c", "d"]})),
    ("min-tokens", line({"min_tokens": 2, "max_tokens": 4})),
    ("user-metadata", line({"user": "u1", "metadata": {"k": "v"}})),
    ("neutral-refused-fields", line({"n": 1, "stream": False, "logprobs": False})),
    ("text-parts", line({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})),
    ("system-then-user", line({"messages": [{"role": "system", "content": "Be brief."}, *USER]})),
    ("developer-role", line({"messages": [{"role": "developer", "content": "Be brief."}, *USER]})),
    ("named-message", line({"messages": [{"role": "user", "content": "hi", "name": "ann"}]})),
    # refused on both sides
    ("no-custom-id", line(cid=None)),
    ("custom-id-number", line(cid=7)),
    ("no-body", {"custom_id": "c", "method": "POST", "url": CHAT}),
    ("bad-url", line(url="/bad_url")),
    ("another-model", line({"model": "NonExistModel"})),
    ("stream", line({"stream": True})),
    ("temperature-3", line({"temperature": 3})),
    ("temperature-negative", line({"temperature": -0.5})),
    ("temperature-string", line({"temperature": "hot"})),
    ("top-p-0", line({"top_p": 0})),
    ("top-p-2", line({"top_p": 2})),
    ("max-tokens-0", line({"max_tokens": 0})),
    ("max-tokens-negative", line({"max_tokens": -5})),
    ("presence-penalty-5", line({"presence_penalty": 5})),
    ("frequency-penalty-minus-3", line({"frequency_penalty": -3})),
    ("repetition-penalty-0", line({"repetition_penalty": 0})),
    ("top-k-minus-2", line({"top_k": -2})),
    ("min-p-2", line({"min_p": 2})),
    ("min-tokens-over-max", line({"min_tokens": 9, "max_tokens": 4})),
    ("stop-empty", line({"stop": [""]})),
    ("stop-five", line({"stop": ["a", "b", "c", "d", "e"]})),
    ("stop-seventeen", line({"stop": [f"s{i}" for i in range(17)]})),
    ("tools-empty", line({"tools": []})),
    ("seed-string", line({"seed": "x"})),
    ("messages-missing", line({"messages": None})),
    ("messages-not-list", line({"messages": "hello"})),
    ("content-number", line({"messages": [{"role": "user", "content": 5}]})),
    ("top-logprobs-50", line({"logprobs": True, "top_logprobs": 50})),
    ("logprobs", line({"logprobs": True, "top_logprobs": 2})),  # both run it (results' logprobs column)
    ("n-0", line({"n": 0})),
    # vLLM runs these; this worker refuses them (DELIBERATE)
    ("n-2", line({"n": 2})),
    ("tools", line({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})),
    ("response-format-json", line({"response_format": {"type": "json_object"}})),
    ("logit-bias", line({"logit_bias": {"5": 10}})),
    ("unknown-field", line({"temprature": 0.5})),
    ("role-unknown", line({"messages": [{"role": "wizard", "content": "x"}]})),
    ("method-get", line(method="GET")),
    (
        "image-content",
        line({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ),
    ("messages-empty", line({"messages": []})),
]

DELIBERATE = {
    "n-2": "one completion per request line (send one request per completion)",
    "tools": "tool calling is not supported",
    "response-format-json": "structured output is the job spec's (sampling.structured), not a row's",
    "logit-bias": "logit_bias is not supported",
    "unknown-field": "a field no API has is refused, not ignored (a typo must not pass silently)",
    "role-unknown": "roles other than system, developer, user and assistant are refused, not left to the template",
    "method-get": "a request line must be a POST",
    "image-content": "text-only models and bodies",
    "messages-empty": "an empty conversation is EMPTY_INPUT, not a prompt of the template's prefix alone",
}


@dataclass
class Verdict:
    kind: str  # "file" | "row" | "ok"
    detail: str
    params: Any = None


def _vllm():
    from vllm.entrypoints.launchers import run_batch as rb
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingResponse
    from vllm.entrypoints.serve.engine.serving import BaseServing

    return types.SimpleNamespace(
        rb=rb,
        Chat=ChatCompletionRequest,
        ChatResponse=ChatCompletionResponse,
        CompletionResponse=CompletionResponse,
        EmbeddingResponse=EmbeddingResponse,
        Serving=BaseServing,
    )


def vllm_verdict(v, raw: dict) -> Verdict:
    """What vLLM's run-batch does with the line (its own models and checks, no engine)."""
    try:
        req = v.rb.BatchRequestInput.model_validate_json(json.dumps(raw))
    except Exception as e:  # pydantic's errors, and vLLM's own validators' (VLLMValidationError): run-batch stops
        return Verdict("file", f"BatchRequestInput: {type(e).__name__}: {str(e).splitlines()[0]}")
    if req.url != CHAT:
        return Verdict("row", f"URL {req.url} was used")
    body = req.body
    if not isinstance(body, v.Chat):
        return Verdict("row", f"not a chat request: {type(body).__name__}")
    if body.stream:
        return Verdict("row", "Request must not be sent in stream mode")
    served = types.SimpleNamespace(models=types.SimpleNamespace(is_base_model=lambda name: name == SERVED))
    if not v.Serving._is_model_supported(served, body.model) and body.model != ADAPTER:
        return Verdict("row", f"The model `{body.model}` does not exist.")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        max_tokens = min(x for x in (MAX_MODEL_LEN - 32, requested) if x is not None)
        params = body.to_sampling_params(max_tokens, {})
        if params.logprobs is not None and params.logprobs > 20:  # the engine's max_logprobs (default 20)
            raise ValueError(f"Requested sample logprobs of {params.logprobs}, which is greater than max allowed: 20")
    except Exception as e:  # vLLM's VLLMValidationError and ValueErrors: the line's error
        return Verdict("row", f"{type(e).__name__}: {str(e).splitlines()[0]}")
    return Verdict("ok", "", params)


def our_verdict(spec: JobSpec, builder: PromptBuilder, raw: dict) -> Verdict:
    """What this project does with the line: the plan's line checks, then the worker's row."""
    fmt = OpenAIBatchFormat()
    try:
        fmt.checked_id(raw.get("custom_id"), "batch.jsonl", 1, fmt.id_key(spec))
    except DatasetError as e:
        return Verdict("file", str(e))
    fault = fmt.row_fault(raw)
    if fault is not None:
        return Verdict("row", f"{fault[0]}: {fault[1]}")
    prep = builder.prepare_openai(raw)
    if prep.fault is not None:
        return Verdict("row", f"{prep.fault[0]}: {prep.fault[1]}")
    try:
        params = sampling_params(spec, prep.overrides)
    except Exception as e:
        return Verdict("row", f"{type(e).__name__}: {e}")
    return Verdict("ok", "", params)


def compare(label: str, body: dict, ours: Any, theirs: Any) -> str | None:
    """The first sampling field the body sets whose value differs between the two SamplingParams."""
    set_fields = {k for k, v in body.items() if v is not None}
    if "max_completion_tokens" in set_fields:
        set_fields.add("max_tokens")
    greedy = min(ours.temperature, theirs.temperature) < 1e-5  # SamplingParams then drops top_p, top_k, min_p
    for f in COMPARED:
        if f not in set_fields or (greedy and f in ("top_p", "top_k", "min_p")):
            continue
        a, b = getattr(ours, f), getattr(theirs, f)
        if f == "stop":
            a, b = list(a or []), list(b or [])
        if a != b:
            return f"{label}: SamplingParams.{f} is {a!r} here, {b!r} in vLLM"
    return None


@pytest.fixture(scope="module")
def vllm_side():
    return _vllm()


@pytest.fixture(scope="module")
def ours(tiny_model):
    from transformers import AutoTokenizer

    spec = JobSpec.load(
        {
            "task": "chat",
            "model": {
                "name": tiny_model,
                "max_model_len": MAX_MODEL_LEN,
                "served_model_names": [SERVED],
                "adapters": [{"name": ADAPTER, "source": "/adapters/billing"}],
            },
            "io": {"input_uri": "/in/batch.jsonl", "output_uri": "/out", "input_format": "openai_batch"},
            "prompt": {"template": "{text}"},
            "sampling": {"max_tokens": 16},
        }
    )
    tok = AutoTokenizer.from_pretrained(tiny_model)
    return spec, PromptBuilder(spec, tok, MAX_MODEL_LEN, "openai_batch")


def test_the_corpus_covers_both_sides():
    labels = [label for label, _ in CORPUS]
    assert len(labels) == len(set(labels)) >= 50 and set(DELIBERATE) <= set(labels)


def test_request_lines_agree_with_vllm_or_differ_only_deliberately(vllm_side, ours):
    spec, builder = ours
    disagreements: list[str] = []
    for label, raw in CORPUS:
        theirs = vllm_verdict(vllm_side, raw)
        mine = our_verdict(spec, builder, raw)
        if label in DELIBERATE:
            if theirs.kind != "ok":
                disagreements.append(
                    f"{label}: vLLM now refuses this line too ({theirs.detail}); drop it from DELIBERATE"
                )
            elif mine.kind == "ok":
                disagreements.append(f"{label}: this worker now runs the line; drop it from DELIBERATE")
            continue
        # file or row: both refuse (vLLM stops the whole file at a malformed line, this project makes it that
        # row's error, except a line without a usable custom_id, which it cannot track)
        if (theirs.kind == "ok") != (mine.kind == "ok") or (mine.kind == "file") > (theirs.kind == "file"):
            disagreements.append(
                f"{label}: vLLM says {theirs.kind} ({theirs.detail or 'runs it'}), this project says "
                f"{mine.kind} ({mine.detail or 'runs it'}); line {json.dumps(raw)[:200]}"
            )
        elif theirs.kind == "ok":
            why = compare(label, raw["body"], mine.params, theirs.params)
            if why:
                disagreements.append(why)
    print("\n".join(disagreements))
    assert not disagreements, f"first disagreement: {disagreements[0]} ({len(disagreements)} in all)"


def test_a_line_without_custom_id_is_refused_naming_custom_id(ours):
    spec, _ = ours
    fmt = OpenAIBatchFormat()
    with pytest.raises(DatasetError, match="no 'custom_id'"):
        fmt.checked_id(None, "batch.jsonl", 1, fmt.id_key(spec))
    with pytest.raises(DatasetError, match="'custom_id' is int"):
        fmt.checked_id(7, "batch.jsonl", 1, fmt.id_key(spec))


def test_output_lines_are_vllms_batch_output(vllm_side, ours):
    spec, _ = ours
    ok = {
        "id": "req-1",
        "output": "billing",
        "finish_reason": "stop",
        "prompt_tokens": 12,
        "completion_tokens": 2,
        "adapter": ADAPTER,
    }
    for out in (
        response_line(ok, spec),
        response_line({**ok, "adapter": None}, spec),
        response_line({"id": "e1", "embedding": [0.1, 0.2], "prompt_tokens": 3}, spec),
        error_line({"id": "req-2", "error_code": "INVALID_REQUEST", "error_message": "body.temperature"}, spec),
    ):
        parsed = vllm_side.rb.BatchRequestOutput.model_validate_json(json.dumps(out))
        assert parsed.custom_id == out["custom_id"]
        if out["response"] is not None:
            body = out["response"]["body"]
            model = vllm_side.EmbeddingResponse if body["object"] == "list" else vllm_side.ChatResponse
            model.model_validate(body)
    # task generate: a raw prompt's completion, as vLLM's /v1/completions answers it (OpenAI's Batch API has the
    # route; vLLM's run-batch has none, so its envelope is checked with the body apart)
    generate = spec.model_copy(update={"task": "generate"})
    line = response_line({**ok, "adapter": None}, generate)
    envelope = {**line, "response": {**line["response"], "body": None}}
    vllm_side.rb.BatchRequestOutput.model_validate_json(json.dumps(envelope))
    completion = vllm_side.CompletionResponse.model_validate(line["response"]["body"])
    assert completion.object == "text_completion" and completion.choices[0].text == "billing"
    assert response_line(ok, spec)["response"]["body"]["model"] == ADAPTER  # as vLLM's server names a LoRA answer
    assert response_line({**ok, "adapter": None}, spec)["response"]["body"]["model"] == SERVED
