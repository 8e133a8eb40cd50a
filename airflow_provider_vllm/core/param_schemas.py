"""JSON schemas of the DAG params that feed a job spec, shared by the DAGs, the plan and the worker.

Airflow validates a trigger form against ``Param`` schemas before it creates the run; the
DAG templates build their ``Param``s from ``PARAM_SCHEMAS``, the plan operator validates the
params it layers onto the spec against the same schemas again (a run created through the API
or with a changed DAG must not skip them), and the worker validates the spec values those
params became (``check_spec_params``), so a spec forged after the plan meets the same rules.
The patterns are the ones ``spec_guard`` enforces inside ``JobSpec`` validation.
"""

from __future__ import annotations

from typing import Any

from airflow_provider_vllm.core.allow_list import CREDENTIAL_QUERY_NAMES, redact_userinfo
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.spec import MAX_SHARD_ROWS, PARAM_ALIASES
from airflow_provider_vllm.core.spec_guard import (
    COLUMN,
    LABEL,
    MAX_LABEL_CHARS,
    MAX_LABELS,
    MAX_TEXT_CHARS,
    MODEL_REF,
)


def _any_case(word: str) -> str:
    """``word`` as a pattern of either case (JSON schema patterns take no flags)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in word)


# ECMA-262 and Python both read these. No '..' or '.' segments, no percent-encoded dots or
# slashes, no whitespace, no markup or quoting characters (` < > " |: allow_list.canonical_uri), no C1 controls
# or invisible, text-reordering characters (HIDDEN_CHARS: the common ones of what canonical_uri refuses), no
# credentials (user@ or a ':' in the authority, a credential query parameter such as ?X-Amz-Signature=:
# allow_list.CREDENTIAL_QUERY_NAMES); a scheme from paths.SCHEMES or an absolute path.
HIDDEN_CHARS = r"\u0080-\u009f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb\ue000-\uf8ff"
URI_PATTERN = (
    r"^(?![\s\S]*(?:/\.{1,2}(?:/|$)|%2[eEfF]|%5[cC]|%25|\\|[" + HIDDEN_CHARS + r"]))"
    r"(?![\s\S]*[?&;#][A-Za-z0-9_.-]*(?:"
    + "|".join(_any_case(w) for w in CREDENTIAL_QUERY_NAMES)
    + r")[A-Za-z0-9_.-]*=)"
    r"(?:(?:file://)?/|(?:s3|s3a|gs|gcs|memory)://(?![^/]*[@:])[a-z0-9])[^\s`<>|"
    '"]*$'
)
NO_JINJA = r"^(?![\s\S]*(?:\{\{|\}\}|\{%|%\}|\{#|#\}))[\s\S]*$"

PARAM_SCHEMAS: dict[str, dict[str, Any]] = {
    "input_uri": {"type": "string", "pattern": URI_PATTERN, "maxLength": 1024},
    "output_uri": {"type": ["null", "string"], "pattern": URI_PATTERN, "maxLength": 1024},
    "compare_with": {"type": ["null", "string"], "pattern": URI_PATTERN, "maxLength": 1024},
    "model": {"type": ["null", "string"], "minLength": 1, "maxLength": 512, "pattern": MODEL_REF.pattern},
    "labels": {
        "type": "array",
        "minItems": 2,
        "maxItems": MAX_LABELS,
        "uniqueItems": True,
        "items": {"type": "string", "minLength": 1, "maxLength": MAX_LABEL_CHARS, "pattern": LABEL.pattern},
    },
    "system_prompt": {"type": "string", "minLength": 1, "maxLength": MAX_TEXT_CHARS, "pattern": NO_JINJA},
    "template": {"type": "string", "minLength": 1, "maxLength": MAX_TEXT_CHARS, "pattern": NO_JINJA},
    "id_column": {"type": "string", "pattern": COLUMN.pattern},
    "model_revision": {"type": ["null", "string"], "maxLength": 128, "pattern": r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 4096},
    "shard_rows": {"type": "integer", "minimum": 1, "maximum": MAX_SHARD_ROWS},
    "max_shards": {"type": "integer", "minimum": 1, "maximum": 100_000},
    "runner": {"type": ["null", "string"], "enum": [None, "local", "kubernetes"]},
    "dry_run": {"type": "boolean"},
}
# The string params: their spec values are re-checked in the worker (numbers are bounded by JobSpec).
STRING_PARAMS = (
    "input_uri",
    "output_uri",
    "model",
    "labels",
    "system_prompt",
    "template",
    "id_column",
    "model_revision",
    "compare_with",
)


def validate_params(params: dict[str, Any], names: list[str] | None = None) -> None:
    """Validate the named params (default: all known ones present) against PARAM_SCHEMAS.

    ``None`` values are skipped (an empty form field keeps the spec's value). Raises SpecError
    naming the param and the failed rule.
    """
    import jsonschema

    for name in names if names is not None else list(params):
        schema = PARAM_SCHEMAS.get(name)
        value = params.get(name)
        if schema is None or value is None:
            continue
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            where = "".join(f"[{p}]" for p in e.absolute_path)
            shown = redact_userinfo(repr(e.instance))[:120]
            raise SpecError(f"param {name}{where}={shown}: {e.validator} {e.validator_value!r} not satisfied") from None


def check_spec_params(spec_doc: dict[str, Any]) -> None:
    """Validate the spec values that string params map to, as if they had been params."""
    values: dict[str, Any] = {}
    for name in STRING_PARAMS:
        node: Any = spec_doc
        alias = PARAM_ALIASES[name]
        if alias is None:
            continue
        for part in alias.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            values[name] = node
    labels = values.get("labels")
    if labels is not None and len(labels) < 2:
        values.pop("labels")  # one-label choice lists are valid specs, only the form asks for two
    validate_params(values)
