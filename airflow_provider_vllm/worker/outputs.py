"""Post-processing of engine outputs: structured-output checks."""

from __future__ import annotations

import json
import re

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
        valid = True
        try:
            import jsonschema

            jsonschema.validate(doc, st.json_schema)
        except ImportError:
            pass
        except Exception:
            valid = False
        return None, json.dumps(doc, sort_keys=True, ensure_ascii=False), valid
    if st.regex is None:  # the spec allows exactly one of choice, json_schema, regex
        return None, None, None
    return None, None, re.fullmatch(st.regex, text) is not None
