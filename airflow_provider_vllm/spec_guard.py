"""What a job spec's values may look like: strict patterns, size limits, no template syntax.

Two layers, both pure:

* ``check_values(doc)`` runs inside ``JobSpec`` validation (so everywhere a spec is loaded:
  ``from_params``, the plan, the worker, merge): identifier-like strings (model, revision,
  columns, labels) match strict patterns, URIs are syntactically canonical (``paths``),
  free text (system prompt, template, stop strings, regex) carries no Jinja delimiters,
  nothing is oversized, no string holds control characters other than tab/newline in text.
* ``check_deployment(spec, allowed)`` adds what depends on the deployment: URIs inside the
  allowed prefixes (symlinks resolved), no secrets in ``io.storage_options`` (they would
  travel in XCom and in the worker's command line), output and input not nested. Called by
  the plan operator before planning, the shard operator before starting a worker, and the
  worker's CLI before touching storage.

Free text is data: the worker passes it to the tokenizer as it is (``str.format`` over plain
``{column}`` names, never a shell, never a second Jinja render), so shell metacharacters in a
prompt are harmless; Jinja delimiters are refused because a value that carries them was
either meant for a template engine or is probing for one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from airflow_provider_vllm.errors import SpecError
from airflow_provider_vllm.paths import canonical_uri, check_local_tree, check_uri, is_under

MAX_LABELS = 256
MAX_LABEL_CHARS = 100
MAX_TEXT_CHARS = 65_536  # system prompt, template
MAX_STRING_CHARS = 4_096  # any other string
MAX_JSON_SCHEMA_BYTES = 65_536
MAX_STOP = 16

JINJA = re.compile(r"{{|}}|{%|%}|{#|#}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # allows \t \n \r in free text
_ANY_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SEG = r"[A-Za-z0-9_.][A-Za-z0-9_.@+=-]*"  # ".." and "." segments are refused separately
MODEL_REF = re.compile(rf"^(?:file://)?/?{_SEG}(?:/{_SEG})*/?$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
QUANTIZATION = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
COLUMN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
LABEL = re.compile(rf"^\w[\w .:/+()-]{{0,{MAX_LABEL_CHARS - 1}}}$")
# Any other string (engine_kwargs and storage_options values, enums): plain words, numbers,
# hosts and URLs; no quotes, no shell or template syntax.
OTHER = re.compile(r"^[\w .,:/@+=~-]*$")

_IDENTIFIERS = {
    "model.name": (MODEL_REF, "a hub id (org/name) or a local path"),
    "model.tokenizer": (MODEL_REF, "a hub id (org/name) or a local path"),
    "model.revision": (REVISION, "a commit sha, tag or branch"),
    "model.quantization": (QUANTIZATION, "a vLLM quantization method name"),
    "prompt.id_column": (COLUMN, "a column name (letters, digits, _ . -)"),
    "prompt.text_columns": (COLUMN, "a column name (letters, digits, _ . -)"),
    "sampling.structured.choice": (LABEL, f"a label of letters, digits, spaces and _ . : / + ( ) - "
                                          f"(at most {MAX_LABEL_CHARS} characters)"),
}
# Sections whose other strings must be plain (OTHER); strings of sections added later (e.g. a
# pod's annotations) get the generic rules only: no Jinja, no control characters, bounded size.
_PLAIN_SECTIONS = frozenset({"name", "task", "model", "engine", "prompt", "sampling", "io", "sharding", "qa"})
_URIS = ("io.input_uri", "io.output_uri", "qa.previous_report_uri")
_FREE_TEXT = {"prompt.system_prompt": MAX_TEXT_CHARS, "prompt.template": MAX_TEXT_CHARS,
              "sampling.stop": 256, "sampling.structured.regex": MAX_STRING_CHARS}
# storage_options keys that hold credentials: the deployment provides them (environment,
# instance roles, Airflow connections), never the job spec.
SECRET_KEYS = re.compile(r"(^|_)(key|secret|token|password|passwd|credentials?|sas|signature)($|_)", re.I)


def check_values(doc: dict[str, Any]) -> None:
    """Raise ValueError naming the field for any value outside the rules above (doc: a spec dump)."""
    choice = (((doc.get("sampling") or {}).get("structured") or {}).get("choice")) or []
    if len(choice) > MAX_LABELS:
        raise ValueError(f"sampling.structured.choice: {len(choice)} labels; at most {MAX_LABELS}")
    stop = (doc.get("sampling") or {}).get("stop") or []
    if len(stop) > MAX_STOP:
        raise ValueError(f"sampling.stop: {len(stop)} stop strings; at most {MAX_STOP}")
    schema = ((doc.get("sampling") or {}).get("structured") or {}).get("json_schema")
    if schema is not None and len(json.dumps(schema)) > MAX_JSON_SCHEMA_BYTES:
        raise ValueError(f"sampling.structured.json_schema: larger than {MAX_JSON_SCHEMA_BYTES} bytes")
    for path, value in _strings(doc, ""):
        _check_string(path, value)


def _strings(node: Any, path: str):
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            if not isinstance(k, str) or len(k) > 256 or _ANY_CONTROL.search(k) or JINJA.search(k):
                raise ValueError(f"{path or '<spec>'}: key {str(k)[:80]!r} is not allowed")
            yield from _strings(v, f"{path}.{k}" if path else k)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _strings(v, path)


def _check_string(path: str, value: str) -> None:
    shown = value if len(value) <= 80 else value[:77] + "..."
    if path in _URIS:
        try:
            canonical_uri(value, path, resolve=False)
        except SpecError as e:
            raise ValueError(str(e)) from None
        return
    limit = _FREE_TEXT.get(path, MAX_LABEL_CHARS if path == "sampling.structured.choice" else MAX_STRING_CHARS)
    if len(value) > limit:
        raise ValueError(f"{path}: {len(value)} characters; at most {limit}")
    if JINJA.search(value):
        raise ValueError(f"{path}={shown!r}: Jinja delimiters ({{{{ }}}}, {{% %}}, {{# #}}) are not allowed; "
                         "values are used verbatim, never rendered")
    if (_CONTROL if path in _FREE_TEXT else _ANY_CONTROL).search(value):
        raise ValueError(f"{path}={shown!r}: control characters are not allowed")
    rule = _IDENTIFIERS.get(path)
    if rule is None and path not in _FREE_TEXT and path.split(".", 1)[0] in _PLAIN_SECTIONS:
        rule = (OTHER, "plain text (letters, digits, spaces and _ . , : / @ + = ~ -)")
    if rule is not None:
        pattern, what = rule
        if not pattern.match(value) or "/../" in f"/{value}/" or "/./" in f"/{value}/":
            raise ValueError(f"{path}={shown!r}: must be {what}")


def check_deployment(spec: Any, allowed: Sequence[str] | None) -> None:
    """Raise SpecError when ``spec`` (a JobSpec) reaches outside what the deployment allows."""
    io = spec.io
    canon_in = check_uri(io.input_uri, allowed, "io.input_uri")
    canon_out = check_uri(io.output_uri, allowed, "io.output_uri")
    if spec.qa.previous_report_uri:
        check_uri(spec.qa.previous_report_uri, allowed, "qa.previous_report_uri")
    check_local_tree(canon_in, allowed, "io.input_uri")
    if is_under(canon_out, canon_in) or is_under(canon_in, canon_out):
        raise SpecError(f"io.output_uri={io.output_uri} and io.input_uri={io.input_uri} overlap; "
                        "write outputs outside the input")
    for path, _ in _keys(io.storage_options, "io.storage_options"):
        if SECRET_KEYS.search(path.rsplit(".", 1)[-1]):
            raise SpecError(f"{path}: credentials do not belong in the job spec (it travels through XCom and "
                            "the worker's command line); give them to the deployment (environment, "
                            "instance role, Airflow connection)")


def _keys(node: Any, path: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{path}.{k}", v
            yield from _keys(v, f"{path}.{k}")
