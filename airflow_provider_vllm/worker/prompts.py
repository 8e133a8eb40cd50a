"""Row validation and prompt building: row values -> token ids, or a reason code.

Pure Python over a Hugging Face style tokenizer (``encode``, ``decode``,
``apply_chat_template``); no vLLM import, so it is unit-testable with any tokenizer.
Chat prompts are rendered the way ``vllm.LLM.chat`` renders them (chat template to text,
then tokenized without extra special tokens), so outputs match raw vLLM for the same rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_vllm.errors import SpecError
from airflow_provider_vllm.datasets import is_unicode
from airflow_provider_vllm.rows import EMPTY_INPUT, INVALID_ROW, PROMPT_TOO_LONG
from airflow_provider_vllm.spec import JobSpec

_SCALARS = (str, int, float, bool)
_TRUNCATE_ROUNDS = 4


@dataclass
class Prepared:
    """A row ready for the engine, or the reason it is not."""

    token_ids: list[int] | None = None
    truncated: bool = False
    fault: tuple[str, str] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # per-row sampling (OpenAI batch bodies)


class PromptBuilder:
    """Builds token prompts for one job with one tokenizer."""

    def __init__(self, spec: JobSpec, tokenizer: Any, max_model_len: int):
        self.spec = spec
        self.tok = tokenizer
        self.max_model_len = max_model_len
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

    # ---- template rows --------------------------------------------------------------
    def prepare(self, values: dict[str, Any]) -> Prepared:
        """Validate one row's column values and build its prompt."""
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
            elif not isinstance(v, _SCALARS):
                return Prepared(fault=(INVALID_ROW, f"column {col!r} holds {type(v).__name__}, expected a scalar"))
            row[col] = str(v)
        return self._fit(row)

    def _render(self, row: dict[str, str]) -> list[int]:
        text = self.spec.prompt.template.format(**row)
        if self.spec.task == "chat":
            msgs = []
            if self.spec.prompt.system_prompt:
                msgs.append({"role": "system", "content": self.spec.prompt.system_prompt})
            msgs.append({"role": "user", "content": text})
            return self.chat_ids(msgs)
        return self.tok.encode(text)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        rendered = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tok.encode(rendered, add_special_tokens=False)

    def _fit(self, row: dict[str, str]) -> Prepared:
        ids = self._render(row)
        if len(ids) <= self.budget:
            return Prepared(token_ids=ids)
        if self.spec.prompt.truncation == "reject":
            return Prepared(fault=(PROMPT_TOO_LONG, f"prompt has {len(ids)} tokens; budget is {self.budget}"))
        # Cut the longest text column by the excess (plus a margin for re-tokenisation) and retry.
        for _ in range(_TRUNCATE_ROUNDS):
            excess = len(ids) - self.budget
            col = max(self.spec.prompt.texts, key=lambda c: len(row[c]))
            col_ids = self.tok.encode(row[col], add_special_tokens=False)
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
        body = request["body"]
        overrides = {
            k: body[k]
            for k in ("temperature", "top_p", "seed", "stop")
            if k in body and body[k] is not None
        }
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if mt is not None:
            if not isinstance(mt, int) or mt <= 0:
                return Prepared(fault=(INVALID_ROW, f"max_tokens {mt!r} must be a positive integer"))
            overrides["max_tokens"] = mt
        if request["url"] == "/v1/embeddings":
            ids = self.tok.encode(body["input"])
        else:
            ids = self.chat_ids(body["messages"])
        budget = self.max_model_len - overrides.get("max_tokens", self.spec.sampling.max_tokens) \
            if request["url"] != "/v1/embeddings" else self.max_model_len
        if len(ids) > budget:
            return Prepared(fault=(PROMPT_TOO_LONG, f"prompt has {len(ids)} tokens; budget is {budget}"))
        return Prepared(token_ids=ids, overrides=overrides)
