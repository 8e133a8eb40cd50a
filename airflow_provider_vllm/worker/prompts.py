"""Row validation and prompt building: row values -> token ids, or a reason code.

Pure Python over a Hugging Face style tokenizer (``encode``, ``decode``,
``apply_chat_template``); no vLLM import, so it is unit-testable with any tokenizer.
Chat prompts are rendered the way ``vllm.LLM.chat`` renders them (chat template to text,
then tokenized without extra special tokens), so outputs match raw vLLM for the same rows.

Everything here works on one row's own content, so whatever fails here is that row's error
record (``Prepared.fault``): a chat template that refuses the row's messages
(``TEMPLATE_ERROR``), an OpenAI request body outside what the worker supports
(``INVALID_REQUEST``, ``UNSUPPORTED_PARAMETER``: ``openai_batch``), a prompt over its budget
(``PROMPT_TOO_LONG``). A template that refuses even the job's own minimal conversation is the
job's fault, not a row's: ``SpecError`` when the builder is made.

A chat template may read the clock (transformers gives templates ``strftime_now``: Llama 3.x's
"Today Date: ..."): one row then renders another prompt on another day, under one cache key. The
builder renders its probe at two dates (``reads_the_clock``); the worker seals the answer into its
commit marker, and the merge files no row of such a run in the result cache.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_vllm.core import formats
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.formats.base import NanoTimestamp, is_unicode
from airflow_provider_vllm.core.formats.openai_requests import (
    CHAT_URL,
    EMBEDDINGS_URL,
    RequestFault,
    parse_chat_body,
    parse_embeddings_body,
)
from airflow_provider_vllm.core.rows import (
    EMPTY_INPUT,
    INVALID_REQUEST,
    INVALID_ROW,
    PROMPT_TOO_LONG,
    TEMPLATE_ERROR,
)
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.worker.isolation import describe, row_caused

_SCALARS = (str, int, float, bool)
_TRUNCATE_ROUNDS = 4
_PROBE_TEXT = "probe"


@dataclass
class Prepared:
    """A row ready for the engine, or the reason it is not."""

    token_ids: list[int] | None = None
    truncated: bool = False
    fault: tuple[str, str] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # per-row sampling (OpenAI batch bodies)
    adapter: str | None = None  # the LoRA adapter the row runs with (model.adapters[].name); None: the base model


def template_text(v: Any) -> str | None:
    """The text a template column's value is rendered as; None for a value the worker does not render (a row error).

    Text, integers, floats and booleans: ``str``. Parquet's dates, times, timestamps and decimals (as pyarrow gives
    them) render deterministically, each a function of its value alone, so that equal cache keys
    (``steps/cache/key.py``) still give byte-identical prompts:

    * a date: ``2024-03-01``; a time: ``14:05:00`` or ``14:05:00.250000`` (microseconds only when not 0);
    * a timestamp without a time zone: ``2024-03-01 14:05:00[.ffffff]``, nanosecond units ``[.fffffffff]`` when
      the value has nanoseconds (``NanoTimestamp``, as the Parquet reading gives them; pandas' ``Timestamp`` alike);
    * a timestamp with a time zone: its instant in UTC, ``2024-03-01 13:05:00+00:00``, never the file's zone: the
      key of a TIMESTAMPTZ is its instant, so the same instant written in two zones is one key and one prompt;
    * a decimal: fixed point with the column's scale (``12.50`` in a DECIMAL(10,2), ``0.000001``, never ``1E-6``).

    Anything else (bytes, lists, dicts, durations, ...) is None: the plan refuses such Parquet columns
    (``core/formats/parquet.py``), and in JSONL rows an object or array is that row's INVALID_ROW error.
    """
    if isinstance(v, _SCALARS):
        return str(v)
    if isinstance(v, NanoTimestamp):  # as pandas' Timestamp renders: 9 digits only with nanoseconds
        if not v.nanos:
            return template_text(v.at)
        utc = v.at.astimezone(dt.UTC) if v.at.tzinfo is not None else v.at
        text = utc.replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds") + f"{v.nanos:03d}"
        return text + ("+00:00" if v.at.tzinfo is not None else "")
    if isinstance(v, dt.datetime):  # before date: a datetime is a date
        if v.tzinfo is not None:
            v = v.astimezone(dt.UTC)
        return v.isoformat(sep=" ")
    if isinstance(v, (dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return format(v, "f")
    return None


class PromptBuilder:
    """Builds token prompts for one job with one tokenizer.

    ``input_format`` is the plan's (a format that carries requests, ``openai_batch``, brings
    each row's own messages; None: template rows); with a
    chat template in play the builder renders a minimal conversation once, so that a template
    that cannot work for any row fails the job (``SpecError``) instead of every row.
    """

    def __init__(self, spec: JobSpec, tokenizer: Any, max_model_len: int, input_format: str | None = None):
        self.spec = spec
        self.adapters = [a.name for a in spec.model.adapters]
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.openai = input_format is not None and formats.input_format(input_format).carries_requests
        p = spec.prompt
        if spec.task in ("chat", "generate"):
            default_budget = max_model_len - spec.sampling.max_tokens
        else:
            default_budget = max_model_len
        self.budget = min(p.max_prompt_tokens or default_budget, default_budget)
        if self.budget <= 0:  # terminal: every retry fails the same way
            raise SpecError(
                f"sampling.max_tokens={spec.sampling.max_tokens} leaves no room for a prompt in "
                f"max_model_len={max_model_len}"
            )
        self.reads_clock = False  # whether the chat template renders another prompt on another day
        if self.openai and spec.task in ("chat", "generate"):
            self._check_template([{"role": "user", "content": _PROBE_TEXT}], "a one-message conversation")
        elif not self.openai and spec.task == "chat":
            self._check_template(self._conversation(_PROBE_TEXT), "this job's prompt (system prompt + user message)")

    def _check_template(self, messages: list[dict[str, str]], what: str) -> None:
        try:
            self.reads_clock = reads_the_clock(self.tok, messages)
        except Exception as e:
            if not row_caused(e):
                raise
            raise SpecError(f"the model's chat template cannot render {what}: {describe(e)}") from e

    # ---- template rows --------------------------------------------------------------
    def row_adapter(self, values: dict[str, Any]) -> str | None:
        """The row's adapter: its ``model.adapter_column`` value (null or empty: ``model.default_adapter``);
        RequestFault (INVALID_ROW) for a value that is not one of the job's adapters."""
        m = self.spec.model
        col = m.adapter_column
        v = None if col is None else values.get(col)
        if v is None or v == "":
            return m.default_adapter
        if not isinstance(v, str):
            raise RequestFault(
                INVALID_ROW, f"adapter column {col!r} holds {type(v).__name__}, expected an adapter name"
            )
        if v not in self.adapters:
            raise RequestFault(
                INVALID_ROW, f"adapter column {col!r} names {_shown(v)}, not one of the job's adapters {self.adapters}"
            )
        return v

    def request_adapter(self, model: str | None) -> str | None:
        """The adapter an OpenAI request's ``body.model`` picks: an adapter's name -> it; one of the job's served
        names -> the base model; none -> ``model.default_adapter``; anything else is refused (RequestFault,
        INVALID_REQUEST), as ``vllm run-batch`` refuses a model it does not serve, unless
        ``io.ignore_request_model``."""
        m = self.spec.model
        if not model or self.spec.io.ignore_request_model:  # vLLM too: an empty name is the default model
            return m.default_adapter
        if model in self.adapters:
            return model
        if model in m.served_names:
            return None
        raise RequestFault(
            INVALID_REQUEST,
            f"body.model: the model {_shown(model)} does not exist in this job, which serves "
            f"{m.served_names + self.adapters} (model.served_model_names, model.adapters; io.ignore_request_model: "
            "true answers every request with the job's model)",
        )

    def prepare(self, values: dict[str, Any]) -> Prepared:
        """Validate one row's column values and build its prompt."""
        try:
            adapter = self.row_adapter(values)
        except RequestFault as f:
            return Prepared(fault=(f.code, f.message))
        prep = self._prepare(values)
        prep.adapter = adapter
        return prep

    def _prepare(self, values: dict[str, Any]) -> Prepared:
        p = self.spec.prompt
        texts = set(p.texts)
        row: dict[str, str] = {}
        for col in p.columns:
            v = values.get(col)
            if col in texts:
                if v is None or (isinstance(v, str) and not v.strip()):
                    return Prepared(fault=(EMPTY_INPUT, f"column {col!r} is empty"))
                if not isinstance(v, str):
                    return Prepared(fault=(INVALID_ROW, f"column {col!r} holds {type(v).__name__}, expected text"))
                if "\x00" in v:
                    return Prepared(fault=(INVALID_ROW, f"column {col!r} contains a NUL character"))
                if not is_unicode(v):
                    return Prepared(fault=(INVALID_ROW, f"column {col!r} is not valid Unicode (unpaired surrogate)"))
            elif v is None:
                v = ""
            else:
                shown = template_text(v)
                if shown is None:
                    return Prepared(fault=(INVALID_ROW, f"column {col!r} holds {type(v).__name__}, expected a scalar"))
                v = shown
            row[col] = v
        try:
            return self._fit(row)
        except RequestFault as f:
            return Prepared(fault=(f.code, f.message))

    def _conversation(self, text: str) -> list[dict[str, str]]:
        msgs = []
        if self.spec.prompt.system_prompt:
            msgs.append({"role": "system", "content": self.spec.prompt.system_prompt})
        msgs.append({"role": "user", "content": text})
        return msgs

    def _render(self, row: dict[str, str]) -> list[int]:
        try:
            text = self.spec.prompt.template.format(**row)
        except Exception as e:
            if not row_caused(e):
                raise
            raise RequestFault(TEMPLATE_ERROR, f"prompt.template could not be filled: {describe(e)}") from e
        if self.spec.task == "chat":
            return self.chat_ids(self._conversation(text))
        return self._encode(text)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation; RequestFault (TEMPLATE_ERROR) when the chat template refuses it."""
        try:
            rendered = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            if not row_caused(e):
                raise
            raise RequestFault(TEMPLATE_ERROR, f"the model's chat template refused the messages: {describe(e)}") from e
        if not isinstance(rendered, str):
            raise RequestFault(TEMPLATE_ERROR, f"the chat template gave {type(rendered).__name__}, not text")
        return self._encode(rendered, add_special_tokens=False)

    def _encode(self, text: str, **kw: Any) -> list[int]:
        try:
            return list(self.tok.encode(text, **kw))
        except Exception as e:
            if not row_caused(e):
                raise
            raise RequestFault(INVALID_ROW, f"the tokenizer could not encode the prompt: {describe(e)}") from e

    def _fit(self, row: dict[str, str]) -> Prepared:
        ids = self._render(row)
        if not ids:
            return Prepared(fault=(EMPTY_INPUT, "the prompt has no tokens"))
        if len(ids) <= self.budget:
            return Prepared(token_ids=ids)
        if self.spec.prompt.truncation == "reject":
            return Prepared(fault=(PROMPT_TOO_LONG, f"prompt has {len(ids)} tokens; budget is {self.budget}"))
        # Cut the longest text column by the excess (plus a margin for re-tokenisation) and retry.
        for _ in range(_TRUNCATE_ROUNDS):
            excess = len(ids) - self.budget
            col = max(self.spec.prompt.texts, key=lambda c: len(row[c]))
            col_ids = self._encode(row[col], add_special_tokens=False)
            keep = len(col_ids) - excess - max(2, math.ceil(excess * 0.02))
            if keep <= 0:
                break
            row = {**row, col: self.tok.decode(col_ids[:keep], skip_special_tokens=True)}
            ids = self._render(row)
            if len(ids) <= self.budget:
                return Prepared(token_ids=ids, truncated=True)
        return Prepared(fault=(PROMPT_TOO_LONG, f"prompt does not fit {self.budget} tokens even after truncation"))

    # ---- OpenAI batch requests ------------------------------------------------------
    def prepare_openai(self, request: dict[str, Any]) -> Prepared:
        """Validate one request line's body (``openai_batch``), render and tokenise it."""
        try:
            return self._prepare_openai(request)
        except RequestFault as f:
            return Prepared(fault=(f.code, f.message))

    def _prepare_openai(self, request: dict[str, Any]) -> Prepared:
        url, body = request["url"], request["body"]
        pooling = self.spec.task in ("embed", "classify")
        if (url == CHAT_URL) == pooling:
            return Prepared(
                fault=(
                    INVALID_ROW,
                    f"url {url!r} does not match this job's task {self.spec.task!r} "
                    f"({CHAT_URL} for chat/generate, {EMBEDDINGS_URL} for embed/classify)",
                )
            )
        adapter = None
        if url == EMBEDDINGS_URL:
            emb = parse_embeddings_body(body)
            self.request_adapter(emb.model)  # pooling tasks take no adapter: only the served names check
            ids = self._encode(emb.input)
            overrides: dict[str, Any] = {}
            budget = self.max_model_len
        else:
            chat = parse_chat_body(body)
            adapter = self.request_adapter(chat.model)
            overrides = chat.sampling()
            mt = overrides.get("max_tokens", self.spec.sampling.max_tokens)
            if mt >= self.max_model_len:
                return Prepared(
                    fault=(
                        INVALID_REQUEST,
                        f"body.max_tokens: {mt} leaves no room for a prompt in "
                        f"max_model_len {self.max_model_len} "
                        f"(at most {self.max_model_len - 1})",
                    )
                )
            if overrides.get("min_tokens", 0) > mt:
                return Prepared(
                    fault=(INVALID_REQUEST, f"body.min_tokens: {overrides['min_tokens']} is more than max_tokens {mt}")
                )
            ids = self.chat_ids(chat.conversation())
            budget = self.max_model_len - mt
        if not ids:
            return Prepared(fault=(EMPTY_INPUT, "the prompt has no tokens"))
        if len(ids) > budget:
            why = "" if url == EMBEDDINGS_URL else f" (max_model_len {self.max_model_len} - max_tokens {mt})"
            return Prepared(
                fault=(PROMPT_TOO_LONG, f"prompt has {len(ids)} tokens; budget is {budget}{why}"), adapter=adapter
            )
        return Prepared(token_ids=ids, overrides=overrides, adapter=adapter)


_PROBE_DAYS = (dt.datetime(2001, 2, 3, 4, 5, 6), dt.datetime(2012, 11, 10, 9, 8, 7))  # every field differs


def reads_the_clock(tokenizer: Any, messages: list[dict[str, str]]) -> bool:
    """Whether ``tokenizer``'s chat template renders ``messages`` differently at two dates (the clock its
    ``strftime_now`` reads, transformers' ``chat_template_utils.datetime``, set to each in turn); False for a
    transformers that gives templates no clock. Raises what the template raises."""
    ctu: Any = None
    try:
        import transformers.utils.chat_template_utils as found

        ctu = found
    except ImportError:  # no transformers: no strftime_now
        pass
    real = getattr(ctu, "datetime", None)
    if not isinstance(real, type) or not issubclass(real, dt.datetime):
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return False
    renders = []
    for day in _PROBE_DAYS:

        class Clock(real):  # type: ignore[misc, valid-type]
            @classmethod
            def now(cls, tz: dt.tzinfo | None = None, _day: dt.datetime = day) -> dt.datetime:
                return _day.replace(tzinfo=tz)

        ctu.datetime = Clock
        try:
            renders.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        finally:
            ctu.datetime = real
    return renders[0] != renders[1]


def _shown(v: str) -> str:
    return repr(v if len(v) <= 80 else v[:77] + "...")
