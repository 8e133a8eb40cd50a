"""OpenAI batch request bodies: validated per row against the fields this worker supports.

A request line's body is validated here, per row, before anything of it reaches the
engine: a body the worker cannot run exactly as asked becomes that row's error record
(INVALID_REQUEST: a value out of range or of the wrong type; UNSUPPORTED_PARAMETER: a field
of OpenAI's API this worker does not do, or a field no API has). A field the job spec also
has takes the spec's own bounds (``SamplingSpec``'s ranges, ``spec_guard.stop_problem`` for
stop strings: at most 16, each 1-256 characters; and a request at most 4, OpenAI's and vLLM's bound):
a row may not ask for what the DAG author could not. The other ranges are vLLM's (the engine refuses
anything outside them), so a request that passes here is one vLLM accepts
(``tests/vllm/test_openai_conformance_vllm.py`` holds them against vLLM's own request models). The lines
themselves (custom_id, method, url) are the input format's: ``openai_batch``.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

import annotated_types
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from airflow_provider_vllm.core.formats.base import is_unicode
from airflow_provider_vllm.core.rows import EMPTY_INPUT, INVALID_REQUEST, UNSUPPORTED_PARAMETER
from airflow_provider_vllm.core.spec import SamplingSpec
from airflow_provider_vllm.core.spec_guard import stop_problem

CHAT_URL = "/v1/chat/completions"
EMBEDDINGS_URL = "/v1/embeddings"
ROLES = ("system", "developer", "user", "assistant")
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (and vLLM's default max_logprobs)
MAX_REQUEST_STOP = 4  # stop strings of one request: OpenAI's bound, and vLLM's ChatCompletionRequest's

# Fields of OpenAI's chat completions API that are refused, and why. A refused field is
# still accepted with its neutral value (``NEUTRAL``): e.g. ``"stream": false``, ``"n": 1``.
REFUSED_CHAT_FIELDS: dict[str, str] = {
    "n": "one completion per request: n must be 1 (send one request per completion)",
    "stream": "streaming does not apply to batch requests",
    "stream_options": "streaming does not apply to batch requests",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "per-request structured output is not supported; set sampling.structured in the job spec",
    "logit_bias": "logit_bias is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning settings are not supported",
    "store": "stored completions do not apply to batch output files",
    "service_tier": "service tiers do not apply",
}
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "stream": (False,),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
}
REFUSED_MESSAGE_FIELDS: dict[str, str] = {
    "tool_calls": "tool calling is not supported",
    "tool_call_id": "tool calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio is not supported",
    "refusal": "refusal messages are not supported",
}
REFUSED_ROLES: dict[str, str] = {
    "tool": "tool messages are not supported (tool calling is not supported)",
    "function": "function messages are not supported (function calling is not supported)",
}
REFUSED_EMBEDDINGS_FIELDS: dict[str, str] = {
    "encoding_format": "only float embeddings are returned (encoding_format must be 'float')",
    "dimensions": "the model's own dimensions are returned (dimensions is not supported)",
}
NEUTRAL_EMBEDDINGS: dict[str, tuple[Any, ...]] = {"encoding_format": ("float",)}


class RequestFault(Exception):
    """Why one request cannot run: its reason code and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _unsupported(msg: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", msg, ctx or None)


def _invalid(msg: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", msg, ctx or None)


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _invalid("must be a number, got {kind}", kind=type(v).__name__)
    try:
        x = float(v)
    except OverflowError:  # an integer too large for a float
        x = math.inf
    if not math.isfinite(x):
        raise _invalid("must be a finite number, got {value}", value=_short(v))
    return x


def _integer(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _invalid("must be an integer, got {kind}", kind=type(v).__name__)
    return v


def _ranged(lo: float | None, hi: float | None, lo_open: bool = False, integer: bool = False):
    """A validator: a number (or integer) in [lo, hi] (lo excluded when lo_open), vLLM's messages."""

    def check(v: Any) -> Any:
        x = _integer(v) if integer else _number(v)
        low_ok = lo is None or (x > lo if lo_open else x >= lo)
        if not low_ok or (hi is not None and x > hi):
            left = "(" if lo_open else "["
            rng = (
                f"{left}{_fmt_num(lo)}, {_fmt_num(hi)}]"
                if hi is not None
                else f"{'>' if lo_open else '>='} {_fmt_num(lo)}"
            )
            raise _invalid(
                "must be in {rng}, got {value}" if hi is not None else "must be {rng}, got {value}",
                rng=rng,
                value=_fmt_num(x),
            )
        return x

    return check


def _spec_range(field: str, integer: bool = False):
    """The validator of ``sampling.<field>``'s own bounds in the job spec (``SamplingSpec``'s ge/gt/le)."""
    lo: float | None = None
    hi: float | None = None
    lo_open = False
    for m in SamplingSpec.model_fields[field].metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge  # type: ignore[assignment]
        elif isinstance(m, annotated_types.Gt):
            lo, lo_open = m.gt, True  # type: ignore[assignment]
        elif isinstance(m, annotated_types.Le):
            hi = m.le  # type: ignore[assignment]
        elif isinstance(m, (annotated_types.Lt, annotated_types.MultipleOf)):
            raise TypeError(f"sampling.{field}: a bound the row validator does not translate ({m!r})")
    if integer and lo_open and lo is not None:  # an integer > 0 is one >= 1 (vLLM's wording)
        lo, lo_open = int(lo) + 1, False
    return _ranged(lo, hi, lo_open, integer)


def _fmt_num(x: float | int | None) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x)


def _content(v: Any) -> str:
    """A message's content: a string, or a list of text parts (joined with newlines, as vLLM does)."""
    if isinstance(v, str):
        text = v
    elif isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict):
                raise _invalid("content[{j}] must be an object", j=j)
            kind = part.get("type")
            if kind != "text":
                if kind in ("image_url", "input_audio", "file", "image", "audio", "video"):
                    raise _unsupported(
                        "content[{j}] of type {kind} is not supported: only text content is", j=j, kind=repr(kind)
                    )
                raise _invalid("content[{j}].type must be 'text', got {kind}", j=j, kind=_short(kind))
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise _unsupported("content[{j}] fields {extra} are not supported", j=j, extra=", ".join(extra))
            if not isinstance(part.get("text"), str):
                raise _invalid("content[{j}].text must be a string", j=j)
            texts.append(part["text"])
        text = "\n".join(texts)
    else:
        raise _invalid(
            "content must be a string or a list of text parts, got {kind}",
            kind="null" if v is None else type(v).__name__,
        )
    if not is_unicode(text):
        raise _invalid("content is not valid Unicode (an unpaired surrogate)")
    return text


def _role(v: Any) -> str:
    if not isinstance(v, str) or v not in ROLES:
        raise _invalid("{value} is not one of {roles}", value=_short(v), roles=", ".join(ROLES))
    return v


def _stop(v: Any) -> str | list[str]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _invalid("must be a string or a list of strings, got {kind}", kind=type(v).__name__)
    if any(not s for s in items):
        raise _invalid("stop cannot contain an empty string")
    problem = stop_problem(items)
    if problem:
        raise _invalid("{problem} (the job spec's sampling.stop rule)", problem=problem)
    if len(items) > MAX_REQUEST_STOP:
        raise _invalid(
            "{n} stop strings; a request may give at most {most} (OpenAI's and vLLM's limit)",
            n=len(items),
            most=MAX_REQUEST_STOP,
        )
    return v


class ChatMessage(BaseModel):
    """One message of a chat completions request."""

    model_config = ConfigDict(extra="forbid")

    role: Annotated[Any, AfterValidator(_role)]
    content: Annotated[Any, AfterValidator(_content)]
    name: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if isinstance(data.get("role"), str) and data["role"] in REFUSED_ROLES:
                raise _unsupported("role {role}: {why}", role=repr(data["role"]), why=REFUSED_ROLES[data["role"]])
            for k, why in REFUSED_MESSAGE_FIELDS.items():
                if data.get(k) is not None:
                    raise _unsupported("{field}: {why}", field=k, why=why)
            return {k: v for k, v in data.items() if k not in REFUSED_MESSAGE_FIELDS}
        return data


def _opt(check: Any) -> AfterValidator:
    """``Annotated[Any, _opt(check)]``: ``check`` for a value, None left as it is."""
    return AfterValidator(lambda v: None if v is None else check(v))


class ChatCompletionBody(BaseModel):
    """The body of a ``/v1/chat/completions`` request line: the fields this worker runs.

    Sampling fields map one to one onto ``vllm.SamplingParams``, with vLLM's ranges; unset
    (or null) ones keep the job spec's ``sampling`` values. ``model`` picks what answers (the worker's
    ``PromptBuilder.request_adapter``: a served name of the job's model or one of its adapters; another
    name is the row's error unless ``io.ignore_request_model``); ``user`` and ``metadata`` are accepted
    and do not change the output.
    """

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage]
    model: StrictStr | None = None
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    # the job spec's own fields: the spec's bounds (SamplingSpec), so a row asks for nothing the DAG could not
    max_completion_tokens: Annotated[Any, _opt(_spec_range("max_tokens", integer=True))] = None
    max_tokens: Annotated[Any, _opt(_spec_range("max_tokens", integer=True))] = None
    temperature: Annotated[Any, _opt(_spec_range("temperature"))] = None
    top_p: Annotated[Any, _opt(_spec_range("top_p"))] = None
    stop: Annotated[Any, _opt(_stop)] = None
    seed: Annotated[Any, _opt(_spec_range("seed", integer=True))] = None
    # OpenAI's other sampling fields, with vLLM's ranges
    presence_penalty: Annotated[Any, _opt(_ranged(-2, 2))] = None
    frequency_penalty: Annotated[Any, _opt(_ranged(-2, 2))] = None
    # vLLM's extensions (accepted by `vllm run-batch` too)
    top_k: Annotated[Any, _opt(_ranged(-1, None, integer=True))] = None
    min_p: Annotated[Any, _opt(_ranged(0, 1))] = None
    repetition_penalty: Annotated[Any, _opt(_ranged(0, None, lo_open=True))] = None
    min_tokens: Annotated[Any, _opt(_ranged(0, None, integer=True))] = None
    # log probabilities, as `vllm run-batch` returns them (choices[].logprobs.content)
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[Any, _opt(_ranged(0, MAX_TOP_LOGPROBS, integer=True))] = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for k, why in REFUSED_CHAT_FIELDS.items():
            if k not in data or data[k] is None:
                continue
            v = data[k]
            if k == "n":
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise _invalid("must be a positive integer, got {value}", field=k, value=_short(v))
            if any(type(v) is type(ok) and v == ok for ok in NEUTRAL.get(k, ())):
                continue
            raise _unsupported("{value} is not supported: {why}", field=k, value=_short(v), why=why)
        return {k: v for k, v in data.items() if k not in REFUSED_CHAT_FIELDS}

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionBody:
        if self.top_logprobs and not self.logprobs:  # vLLM's and OpenAI's rule
            raise _invalid("when using top_logprobs, logprobs must be set to true", field="top_logprobs")
        return self

    @model_validator(mode="after")
    def _min_max(self) -> ChatCompletionBody:
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.min_tokens is not None and mt is not None and self.min_tokens > mt:
            raise _invalid("{mn} is more than max_tokens {mt}", field="min_tokens", mn=self.min_tokens, mt=mt)
        return self

    def sampling(self) -> dict[str, Any]:
        """The vllm.SamplingParams keyword arguments this request sets (unset ones: the spec's)."""
        out = {
            "max_tokens": self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            # vLLM's SamplingParams.logprobs: the chosen token and this many top ones per position
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
        }
        return {k: v for k, v in out.items() if v is not None}

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [
            {"role": m.role, "content": m.content, **({"name": m.name} if m.name is not None else {})}
            for m in self.messages
        ]


class EmbeddingsBody(BaseModel):
    """The body of a ``/v1/embeddings`` request line: one input string per request."""

    model_config = ConfigDict(extra="forbid")

    input: Any
    model: StrictStr | None = None
    user: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for k, why in REFUSED_EMBEDDINGS_FIELDS.items():
            v = data.get(k)
            if v is None or any(type(v) is type(ok) and v == ok for ok in NEUTRAL_EMBEDDINGS.get(k, ())):
                continue
            raise _unsupported("{value} is not supported: {why}", field=k, value=_short(v), why=why)
        return {k: v for k, v in data.items() if k not in REFUSED_EMBEDDINGS_FIELDS}

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> str:
        if isinstance(v, list):
            raise _unsupported("a list of inputs is not supported: send one input string per request line")
        if not isinstance(v, str):
            raise _invalid("must be a string, got {kind}", kind="null" if v is None else type(v).__name__)
        if not is_unicode(v):
            raise _invalid("is not valid Unicode (an unpaired surrogate)")
        return v


CHAT_FIELDS = tuple(ChatCompletionBody.model_fields)
MESSAGE_FIELDS = tuple(ChatMessage.model_fields)
EMBEDDINGS_FIELDS = tuple(EmbeddingsBody.model_fields)


def _short(v: Any) -> str:
    s = json.dumps(v, default=str, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _fault(e: ValidationError, accepted: tuple[str, ...]) -> RequestFault:
    """One RequestFault for a body's validation errors: UNSUPPORTED_PARAMETER when any error is
    an unsupported or unknown field (those listed first), else INVALID_REQUEST."""
    unsupported, unknown, invalid = [], [], []
    for err in e.errors(include_url=False):
        path = list(err["loc"])
        if not path and (err.get("ctx") or {}).get("field"):
            path = [err["ctx"]["field"]]
        loc = "body" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        if err["type"] == "extra_forbidden":
            unknown.append((loc, MESSAGE_FIELDS if path[0] == "messages" else accepted))
        elif err["type"] == "unsupported_parameter":
            unsupported.append(f"{loc}: {err['msg']}")
        elif err["type"] == "missing":
            invalid.append(f"{loc}: required")
        else:
            invalid.append(f"{loc}: {err['msg']}")
    for fields in dict.fromkeys(acc for _, acc in unknown):
        locs = [loc for loc, acc in unknown if acc == fields]
        unsupported.append(
            f"unknown field{'s' if len(locs) > 1 else ''} {', '.join(locs[:5])}"
            f"{' ...' if len(locs) > 5 else ''} (accepted: {', '.join(fields)})"
        )
    code = UNSUPPORTED_PARAMETER if unsupported else INVALID_REQUEST
    parts = unsupported + invalid
    text = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more" if len(parts) > 3 else "")
    return RequestFault(code, text[:1000])


def parse_chat_body(body: dict[str, Any]) -> ChatCompletionBody:
    """The validated body, or RequestFault (EMPTY_INPUT for an empty message list)."""
    if body.get("messages") == []:
        raise RequestFault(EMPTY_INPUT, "body.messages is empty")
    try:
        return ChatCompletionBody.model_validate(body)
    except ValidationError as e:
        raise _fault(e, CHAT_FIELDS) from None


def parse_embeddings_body(body: dict[str, Any]) -> EmbeddingsBody:
    """The validated body, or RequestFault (EMPTY_INPUT for an empty or blank input)."""
    inp = body.get("input")
    if inp is None and "input" in body or isinstance(inp, str) and not inp.strip():
        raise RequestFault(EMPTY_INPUT, "body.input is empty")
    try:
        return EmbeddingsBody.model_validate(body)
    except ValidationError as e:
        raise _fault(e, EMBEDDINGS_FIELDS) from None
