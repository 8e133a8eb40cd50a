"""Post-processing of engine outputs: structured-output checks, the answer's confidence and logprobs."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from airflow_provider_vllm.core.spec import JobSpec


def check_structured(spec: JobSpec, text: str) -> tuple[str | None, str | None, bool | None]:
    """(label, parsed_json, valid) for a structured output; (None, None, None) when unstructured."""
    st = spec.sampling.structured
    if st is None:
        return None, None, None
    if st.choice is not None:
        label = text.strip()
        return (label, None, True) if label in st.choice else (None, None, False)
    if st.json_schema is not None:
        try:
            doc = json.loads(text)
        except ValueError:
            return None, None, False
        try:
            import jsonschema
        except ImportError as e:  # an image without it: no answer may pass as valid unchecked
            raise RuntimeError(
                "sampling.structured.json_schema: the worker cannot check answers against the schema "
                "(the jsonschema package is missing from its image)"
            ) from e
        valid = True
        try:
            jsonschema.validate(doc, st.json_schema)
        except Exception:
            valid = False
        return None, json.dumps(doc, sort_keys=True, ensure_ascii=False), valid
    if st.regex is None:  # the spec allows exactly one of choice, json_schema, regex
        return None, None, None
    return None, None, re.fullmatch(st.regex, text) is not None


def answer_extras(g: Any, request_hash: int | None) -> dict[str, Any]:
    """A finished generation's ``confidence`` (exp of the chosen tokens' summed logprobs, when the engine
    computed them), ``prompt_hash`` (None: a request that samples at random) and ``logprobs`` (OpenAI's
    ``choices[].logprobs`` object as JSON, when the row's request asked for it) row fields."""
    lp = getattr(g, "cumulative_logprob", None)
    tokens = getattr(g, "token_logprobs", None)
    return {
        "confidence": math.exp(lp) if lp is not None and not math.isnan(lp) else None,
        "prompt_hash": request_hash,
        "logprobs": None if tokens is None else json.dumps({"content": tokens}, ensure_ascii=False),
    }
