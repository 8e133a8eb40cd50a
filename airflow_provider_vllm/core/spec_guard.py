"""What a job spec's values may look like: strict patterns, size limits, no template syntax.

Two layers, both pure:

* ``check_values(doc)`` runs inside ``JobSpec`` validation (so everywhere a spec is loaded:
  ``from_params``, the plan, the worker, merge): identifier-like strings (model, revision,
  columns, labels) match strict patterns, URIs are syntactically canonical (``paths``),
  free text (system prompt, template, stop strings, regex) carries no Jinja delimiters,
  nothing is oversized, no string holds control characters other than tab/newline in text.
* ``check_deployment(spec, allowed, allow_any=...)`` adds what depends on the deployment; it
  fails closed: with no allow-list it refuses everything unless the deployment said any
  location is fine. Every location-like field (input, output, ``sharding.history_uri``,
  ``qa.previous_report_uri``, ``qa.reference.golden_uri`` / ``ride_along_uri``, ``cache.uri``,
  ``changes.previous_uri``, a local ``model.name`` / ``model.tokenizer``, a local or object store adapter's
  ``model.adapters[].source``) lies inside the
  allowed prefixes (symlinks resolved); ``io.storage_options`` holds only reviewed data
  options (no credentials, endpoints, hosts, proxies or headers: those come from the
  deployment's Connection or environment, e.g. ``AWS_ENDPOINT_URL``); output and input not
  nested. ``check_remote_code(spec, allowed)`` refuses ``model.trust_remote_code`` and
  code-loading engine options unless the deployment allows remote code. Both are called by
  the plan operator before planning, the shard operator before starting a worker, and the
  worker's CLI before touching storage (there with the settings the operator handed over
  in its environment).

Free text is data: the worker passes it to the tokenizer as it is (``str.format`` over plain
``{column}`` names, never a shell, never a second Jinja render), so shell metacharacters in a
prompt are harmless; Jinja delimiters are refused because a value that carries them was
either meant for a template engine or is probing for one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from airflow_provider_vllm.core.allow_list import (
    canonical_prefixes,
    canonical_uri,
    check_local_tree,
    check_uri,
    overlap,
    redact_userinfo,
)
from airflow_provider_vllm.core.errors import SpecError

MAX_LABELS = 256
MAX_LABEL_CHARS = 100
MAX_TEXT_CHARS = 65_536  # system prompt, template
MAX_STRING_CHARS = 4_096  # any other string
MAX_JSON_SCHEMA_BYTES = 65_536
MAX_STOP = 16  # stop strings of the spec and of a request row (core/formats/openai_requests.py)
MAX_STOP_CHARS = 256  # characters of one stop string

JINJA = re.compile(r"{{|}}|{%|%}|{#|#}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # allows \t \n \r in free text
_ANY_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SEG = r"[A-Za-z0-9_.][A-Za-z0-9_.@+=-]*"  # ".." and "." segments are refused separately
MODEL_REF = re.compile(rf"^(?:file://)?/?{_SEG}(?:/{_SEG})*/?$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
QUANTIZATION = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/@+=-]{0,127}$")
PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]{0,31})?$")
_OBJECT_STORE = ("s3://", "gs://", "gcs://")
COLUMN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
LABEL = re.compile(rf"^\w[\w .:/+()-]{{0,{MAX_LABEL_CHARS - 1}}}$")
# Any other string (engine_kwargs and storage_options values, enums): plain words, numbers,
# hosts and URLs; no quotes, no shell or template syntax.
OTHER = re.compile(r"^[\w .,:/@+=~-]*$")

_IDENTIFIERS = {
    "model.name": (MODEL_REF, "a hub id (org/name) or a local path"),
    "model.tokenizer": (MODEL_REF, "a hub id (org/name) or a local path"),
    "model.revision": (REVISION, "a commit sha, tag or branch"),
    "model.tokenizer_revision": (REVISION, "a commit sha, tag or branch"),
    "model.quantization": (QUANTIZATION, "a vLLM quantization method name"),
    "model.served_model_names": (SERVED_NAME, "a model name (letters, digits and _ . : / @ + = -)"),
    "model.adapters.name": (COLUMN, "an adapter name (letters, digits, _ . -)"),
    "model.adapters.revision": (REVISION, "a commit sha"),
    "model.adapters.source": (MODEL_REF, "a hub id (org/name), a local path or an s3:// / gs:// folder"),
    "model.default_adapter": (COLUMN, "an adapter name (letters, digits, _ . -)"),
    "model.adapter_column": (COLUMN, "a column name (letters, digits, _ . -)"),
    "io.input_table.columns": (COLUMN, "a column name (letters, digits, _ . -)"),
    "io.output_table.date_column": (COLUMN, "a column name (letters, digits, _ . -)"),
    "io.passthrough": (COLUMN, "a column name (letters, digits, _ . -)"),
    "io.passthrough_prefix": (PREFIX, "empty or a column name prefix (letters, digits, _ . -)"),
    "prompt.id_column": (COLUMN, "a column name (letters, digits, _ . -)"),
    "prompt.text_columns": (COLUMN, "a column name (letters, digits, _ . -)"),
    "qa.reference.input_column": (COLUMN, "a column name (letters, digits, _ . -)"),
    "qa.reference.id_column": (COLUMN, "a column name (letters, digits, _ . -)"),
    "qa.reference.label_column": (COLUMN, "a column name (letters, digits, _ . -)"),
    "sampling.structured.choice": (
        LABEL,
        f"a label of letters, digits, spaces and _ . : / + ( ) - (at most {MAX_LABEL_CHARS} characters)",
    ),
}
# Sections whose other strings must be plain (OTHER); strings of sections added later (e.g. a
# pod's annotations) get the generic rules only: no Jinja, no control characters, bounded size.
_PLAIN_SECTIONS = frozenset(
    {"name", "task", "model", "engine", "prompt", "sampling", "io", "sharding", "qa", "cache", "changes"}
)
_URIS = (
    "io.input_uri",
    "io.output_uri",
    "sharding.history_uri",
    "qa.previous_report_uri",
    "qa.reference.golden_uri",
    "qa.reference.ride_along_uri",
    "cache.uri",
    "changes.previous_uri",
)
_FREE_TEXT = {
    "prompt.system_prompt": MAX_TEXT_CHARS,
    "prompt.template": MAX_TEXT_CHARS,
    "sampling.stop": MAX_STOP_CHARS,
    "sampling.structured.regex": MAX_STRING_CHARS,
    "io.input_table.row_filter": MAX_STRING_CHARS,  # quoted literals; parsed by the plan (steps/tables/)
}
# storage_options keys that hold credentials: the deployment provides them (environment,
# instance roles, Airflow connections), never the job spec.
SECRET_KEYS = re.compile(r"(^|_)(key|secret|token|password|passwd|credentials?|sas|signature)($|_)", re.I)


def check_values(doc: dict[str, Any]) -> None:
    """Raise ValueError naming the field for any value outside the rules above (doc: a spec dump)."""
    choice = (((doc.get("sampling") or {}).get("structured") or {}).get("choice")) or []
    if len(choice) > MAX_LABELS:
        raise ValueError(f"sampling.structured.choice: {len(choice)} labels; at most {MAX_LABELS}")
    stop = (doc.get("sampling") or {}).get("stop") or []
    problem = stop_problem(stop)
    if problem:
        raise ValueError(f"sampling.stop: {problem}")
    schema = ((doc.get("sampling") or {}).get("structured") or {}).get("json_schema")
    if schema is not None and len(json.dumps(schema)) > MAX_JSON_SCHEMA_BYTES:
        raise ValueError(f"sampling.structured.json_schema: larger than {MAX_JSON_SCHEMA_BYTES} bytes")
    for path, value in _strings(doc, ""):
        _check_string(path, value)


def stop_problem(stop: list[str]) -> str | None:
    """What is wrong with a list of stop strings, or None: the one rule for the spec's
    ``sampling.stop`` and a request row's ``stop`` (count, empty, length, control characters)."""
    if len(stop) > MAX_STOP:
        return f"{len(stop)} stop strings; at most {MAX_STOP}"
    for s in stop:
        shown = s if len(s) <= 40 else s[:37] + "..."
        if not s:
            return "an empty stop string"
        if len(s) > MAX_STOP_CHARS:
            return f"a stop string of {len(s)} characters ({shown!r}); at most {MAX_STOP_CHARS}"
        if _CONTROL.search(s):
            return f"stop string {shown!r}: control characters are not allowed"
    return None


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
    shown = redact_userinfo(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    if path in _URIS or (path == "model.adapters.source" and value.startswith(_OBJECT_STORE)):
        try:
            canonical_uri(value, path, resolve=False)
        except SpecError as e:
            raise ValueError(str(e)) from None
        return
    limit = _FREE_TEXT.get(path, MAX_LABEL_CHARS if path == "sampling.structured.choice" else MAX_STRING_CHARS)
    if len(value) > limit:
        raise ValueError(f"{path}: {len(value)} characters; at most {limit}")
    if JINJA.search(value):
        raise ValueError(
            f"{path}={shown!r}: Jinja delimiters ({{{{ }}}}, {{% %}}, {{# #}}) are not allowed; "
            "values are used verbatim, never rendered"
        )
    if (_CONTROL if path in _FREE_TEXT else _ANY_CONTROL).search(value):
        raise ValueError(f"{path}={shown!r}: control characters are not allowed")
    rule = _IDENTIFIERS.get(path)
    if rule is None and path not in _FREE_TEXT and path.split(".", 1)[0] in _PLAIN_SECTIONS:
        rule = (OTHER, "plain text (letters, digits, spaces and _ . , : / @ + = ~ -)")
    if rule is not None:
        pattern, what = rule
        if not pattern.match(value) or "/../" in f"/{value}/" or "/./" in f"/{value}/":
            raise ValueError(f"{path}={shown!r}: must be {what}")


NO_ALLOW_LIST = (
    "no allowed locations are configured: set [vllm_batch] allowed_uri_prefixes "
    "(AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES) to the URI prefixes jobs may read and write, or "
    "[vllm_batch] allow_any_location = True to allow any location"
)
# io.storage_options: an allow-list of reviewed fsspec options (s3fs, gcsfs) that change neither
# where requests go, nor who makes them, nor who may read what they write. Anything else is
# refused: endpoint_url, client_kwargs.endpoint_url, host, port, proxy, headers, profile, use_ssl,
# credentials and sessions (the deployment's Connection or environment); anon and requester_pays
# (who is asked, who pays); ACL, Grant*, ObjectOwnership, object lock, SSE-C and KMS key ids
# (access control on objects: bucket policy, Object Ownership, uniform bucket-level access and
# default encryption, all the deployment's). A leaf is None (any plain value), a set of allowed
# values, or a pattern the value must match whole.
S3_REGION = re.compile(r"[a-z]{2}(-[a-z0-9]+){1,3}-[0-9]{1,2}")
STORAGE_OPTIONS_ALLOWED: dict[str, Any] = {
    "default_block_size": None,
    "block_size": None,
    "default_cache_type": None,
    "cache_type": None,
    "default_fill_cache": None,
    "fill_cache": None,
    "version_aware": None,
    "cache_regions": None,
    "use_listings_cache": None,
    "listings_expiry_time": None,
    "max_concurrency": None,
    "fixed_upload_size": None,
    "skip_instance_cache": None,
    "consistency": None,
    "config_kwargs": {
        "retries": {"max_attempts": None, "total_max_attempts": None, "mode": None},
        "read_timeout": None,
        "connect_timeout": None,
        "max_pool_connections": None,
        "tcp_keepalive": None,
        "request_checksum_calculation": None,
        "response_checksum_validation": None,
    },
    "client_kwargs": {"region_name": S3_REGION},
    # encryption with the bucket's own (or the AWS-managed) key, and storage classes readable at once
    "s3_additional_kwargs": {
        "ServerSideEncryption": frozenset({"AES256", "aws:kms", "aws:kms:dsse"}),
        "StorageClass": frozenset(
            {"STANDARD", "STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR", "REDUCED_REDUNDANCY"}
        ),
    },
}
_ENDPOINTISH = re.compile(r"(endpoint|host|port|proxy|proxies|url|uri|headers?|profile|ssl|verify|session|role)", re.I)
_URL_VALUE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|@")
_ACCESSISH = re.compile(r"(acl|grant|owner|anon|requester|payer|access|policy|lock|sse|kms|encryption)", re.I)
# compilation_config keys that are data (sizes, levels, switches). The others (backend,
# inductor_passes, inductor_compile_config, debug_dump_path, cache_dir, ...) import code by
# name or write files: deployment-owned, like trust_remote_code.
COMPILATION_CONFIG_DATA = frozenset(
    {
        "level",
        "mode",
        "cudagraph_mode",
        "use_cudagraph",
        "cudagraph_num_of_warmups",
        "cudagraph_capture_sizes",
        "max_capture_size",
        "max_cudagraph_capture_size",
        "compile_sizes",
        "full_cuda_graph",
        "use_inductor",
        "custom_ops",
        "splitting_ops",
        "pass_config",
        "cudagraph_copy_inputs",
        "use_inductor_graph_partition",
    }
)
TOKENIZER_MODES = frozenset({"auto", "slow", "hf", "mistral"})  # "custom" and others pick code by name


def check_deployment(
    spec: Any, allowed: Sequence[str] | None, *, allow_any: bool = False, no_allow_list: str = NO_ALLOW_LIST
) -> None:
    """Raise SpecError when ``spec`` (a JobSpec) reaches outside what the deployment allows.

    Fails closed: an empty ``allowed`` refuses every spec unless ``allow_any`` (the deployment's
    explicit "any location" setting); ``no_allow_list`` is the message then (it names the setting).
    """
    if not canonical_prefixes(allowed) and not allow_any:
        raise SpecError(no_allow_list)
    io = spec.io
    # a table's data files are checked by the plan, which resolves them (steps/tables/snapshot.py)
    canon_in = check_uri(io.input_uri, allowed, "io.input_uri") if io.input_uri is not None else None
    canon_out = check_uri(io.output_uri, allowed, "io.output_uri")
    # a baseline inside the run's own folder, or holding it, is the run itself (its own merge, an earlier report of
    # its own QA): every id reads unchanged and nothing drifts, a comparison that says nothing
    baselines = (
        ("changes.previous_uri", spec.changes.previous_uri),
        ("qa.previous_report_uri", spec.qa.previous_report_uri),
    )
    for what, uri in baselines:
        if uri and overlap(check_uri(uri, allowed, what), canon_out):
            raise SpecError(
                f"{what}={uri} and io.output_uri={io.output_uri} overlap: the run would be compared with itself (every "
                "id unchanged, no drift); name an earlier run's folder"
            )
    for what in ("golden_uri", "ride_along_uri"):  # plan (ride-along) and QA read them
        if (uri := getattr(spec.qa.reference, what)) is not None:
            check_uri(uri, allowed, f"qa.reference.{what}")
    if spec.sharding.history_uri:  # merge writes (and replaces) files there
        check_uri(spec.sharding.history_uri, allowed, "sharding.history_uri")
    if spec.cache.uri:  # plan reads it, merge appends to it
        check_uri(spec.cache.uri, allowed, "cache.uri")
    for what in ("model.name", "model.tokenizer"):
        local = local_model_path(getattr(spec.model, what.split(".")[1]), what)
        if local is not None:
            check_uri(local, allowed, what)
            check_local_tree(canonical_uri(local, what), allowed, what)
    for a in spec.model.adapters:
        what = f"model.adapters[{a.name}].source"
        if a.kind == "object_store":
            check_uri(a.source, allowed, what)
        elif a.kind == "hub":
            refuse_relative_path(a.source, what)
        elif a.kind == "local":
            local = local_model_path(a.source, what)
            assert local is not None
            check_uri(local, allowed, what)
            check_local_tree(canonical_uri(local, what), allowed, what)
    if canon_in is not None:
        check_local_tree(canon_in, allowed, "io.input_uri")
    if canon_in is not None and overlap(canon_out, canon_in):
        raise SpecError(
            f"io.output_uri={io.output_uri} and io.input_uri={io.input_uri} overlap; write outputs outside the input"
        )
    check_storage_options(io.storage_options)


def local_model_path(name: str | None, what: str = "model.name") -> str | None:
    """The local path a model/tokenizer reference names, or None for a hub id (``org/name``).

    Absolute paths and ``file://`` URIs are local; so is anything vLLM would take for a relative
    path (``./x``, ``.cache/x``, ``~/x``, three or more segments): those are refused, since their
    meaning depends on the process's working directory.
    """
    if not name:
        return None
    if name.startswith("file://") or name.startswith("/"):
        return name
    if name.startswith((".", "~")) or name.count("/") > 1:
        raise SpecError(
            f"{what}={name!r}: a local model path must be absolute (/models/x or file:///models/x); "
            "a hub id is org/name"
        )
    refuse_relative_path(name, what)
    return None


def refuse_relative_path(name: str, what: str) -> None:
    """SpecError when a hub id (``org/name``, ``org``) also names a path relative to the working directory.

    vLLM and transformers try ``Path(name).exists()`` before the hub, so such a name would load that
    folder as local weights, outside the allow-list.
    """
    if os.path.lexists(name):
        raise SpecError(
            f"{what}={name!r} is a hub id but also a path relative to the working directory, which vLLM "
            "would load as local files; give an absolute path inside the allowed prefixes, or a hub id "
            "that names no local path"
        )


def check_storage_options(
    options: dict[str, Any], path: str = "io.storage_options", allowed: dict[str, Any] | None = STORAGE_OPTIONS_ALLOWED
) -> None:
    """Only reviewed keys; no credentials, endpoints, hosts, proxies, headers or URLs with user@."""
    for key, value in options.items():
        where = f"{path}.{key}"
        if SECRET_KEYS.search(str(key)):
            raise SpecError(
                f"{where}: credentials do not belong in the job spec (it travels through XCom and "
                "the worker's command line); give them to the deployment (Airflow connection, "
                "environment, instance role / workload identity)"
            )
        if isinstance(value, str) and _URL_VALUE.search(value):
            raise SpecError(
                f"{where}: URLs (and user@ in any value) are not allowed in storage options; the "
                "endpoint comes from the deployment (Airflow connection, or AWS_ENDPOINT_URL in the "
                "environment)"
            )
        if allowed is None or key not in allowed:
            if _ENDPOINTISH.search(str(key)):
                why = (
                    "endpoints, hosts, proxies and headers come from the deployment (Airflow connection, or "
                    "AWS_ENDPOINT_URL in the worker's environment), never from the job spec"
                )
            elif _ACCESSISH.search(str(key)):
                why = (
                    "access control, identity and billing of objects (ACLs, grants, ownership, object lock, "
                    "encryption keys, anonymous or requester-pays access) are the deployment's: bucket policy, "
                    "Object Ownership / uniform bucket-level access, default encryption, or FSSPEC_S3_* / "
                    "FSSPEC_GCS_* variables in the worker's environment; never the job spec's"
                )
            else:
                why = f"not a reviewed storage option (allowed: {sorted(allowed or {})})"
            raise SpecError(f"{where}: {why}")
        sub = allowed[key]
        if isinstance(sub, dict):
            if not isinstance(value, dict):
                raise SpecError(f"{where}: must be a mapping")
            check_storage_options(value, where, sub)
        elif isinstance(value, (dict, list)):
            raise SpecError(f"{where}: must be a plain value")
        elif isinstance(sub, frozenset) and value not in sub:
            raise SpecError(f"{where}={value!r}: must be one of {sorted(sub)}")
        elif isinstance(sub, re.Pattern) and not (isinstance(value, str) and sub.fullmatch(value)):
            raise SpecError(f"{where}={value!r}: must be a region name like eu-west-1")


def code_loading_options(spec: Any) -> list[str]:
    """The spec's settings that make vLLM run code from the model repo or import code by name."""
    found = ["model.trust_remote_code"] if spec.model.trust_remote_code else []
    kw = spec.engine.engine_kwargs
    cc = kw.get("compilation_config")
    if isinstance(cc, dict):
        found += [f"engine.engine_kwargs.compilation_config.{k}" for k in cc if k not in COMPILATION_CONFIG_DATA]
    elif cc is not None and (isinstance(cc, bool) or not isinstance(cc, int)):
        found.append("engine.engine_kwargs.compilation_config")  # a string is parsed by vLLM as a config
    if "hf_overrides" in kw:
        found += [
            p
            for p, _ in _keys(kw["hf_overrides"], "engine.engine_kwargs.hf_overrides")
            if re.search(r"(auto_map|class|module|remote_code)", p.rsplit(".", 1)[-1], re.I)
        ]
    mode = kw.get("tokenizer_mode")
    if mode is not None and mode not in TOKENIZER_MODES:
        found.append("engine.engine_kwargs.tokenizer_mode")
    return found


# Settings that decide which code runs or with which identity (docs/security.md): the DAG file or
# the deployment config may set them; Variables only with [vllm_batch] deployment_settings_from_variables;
# trigger params never. ``code_loading_options`` adds the code-loading engine options a spec sets.
DEPLOYMENT_OWNED = (
    "model.trust_remote_code",
    "kubernetes.image",
    "kubernetes.image_pull_secrets",
    "kubernetes.namespace",
    "kubernetes.service_account",
    "kubernetes.env",
    "kubernetes.secret_env",
    "kubernetes.env_from_secrets",
    "kubernetes.hf_token_secret",
    "kubernetes.pod_template_file",
    "kubernetes.runtime_class",
    "kubernetes.labels",
    "kubernetes.annotations",
    "kubernetes.run_as_user",
    "kubernetes.run_as_group",
    "kubernetes.seccomp_profile",
    "kubernetes.seccomp_localhost_profile",
    "kubernetes.model_cache_pvc",
    "kubernetes.model_cache_path",
    "kubernetes.model_cache_read_only",
    "kubernetes.data_pvc",
    "kubernetes.data_path",
    # which Iceberg table a run reads, and which one publish commits to (with the deployment's catalog identity)
    # and whether it replaces a date's rows there: within [vllm_batch] allowed_tables, the DAG file's choice
    "io.input_table.identifier",
    "io.output_table.identifier",
    "io.output_table.mode",
)


# With code loading on, the repo and revision vLLM imports Python code from: deployment-owned too (a trigger
# choosing them chooses the code that runs; docs/security.md).
CODE_SOURCE = ("model.name", "model.revision", "model.tokenizer", "model.tokenizer_revision")
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")  # a hub (git) commit: the only revision that cannot move


def owned_paths_set(spec: Any, default_doc: dict[str, Any]) -> list[str]:
    """The deployment-owned paths ``spec`` sets to something other than the default, and its code-loading
    options; with code loading on, also ``CODE_SOURCE`` (whatever their value: which code runs)."""
    doc = spec.model_dump(mode="json")
    found = []
    for path in DEPLOYMENT_OWNED:
        if _get(doc, path) != _get(default_doc, path):
            found.append(path)
    loading = code_loading_options(spec)
    if loading:
        found += [p for p in CODE_SOURCE if p not in found]
    return found + [p for p in loading if p not in found]


def _get(doc: Any, path: str) -> Any:
    for part in path.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def check_remote_code(spec: Any, allowed: bool, setting: str = "[vllm_batch] allow_remote_code = True") -> None:
    """Refuse trust_remote_code and code-loading engine options unless the deployment allows them; when it
    does, a hub model (and a hub tokenizer) must be pinned to a commit: a branch, tag or ``refs/pr/N`` moves
    to whatever code someone pushes there next."""
    found = code_loading_options(spec)
    if found and not allowed:
        raise SpecError(
            f"{', '.join(found)}: make vLLM run code from the model repo or import code by name; "
            f"only the deployment can allow that ({setting})"
        )
    if not found:
        return
    m = spec.model
    # vLLM takes the model's repo and revision for a tokenizer that is not set
    pairs = [("model.name", m.name, "model.revision", m.revision)]
    if m.tokenizer is not None or m.tokenizer_revision is not None:
        pairs.append(
            ("model.tokenizer", m.tokenizer or m.name, "model.tokenizer_revision", m.tokenizer_revision or m.revision)
        )
    for what, ref, rev_what, rev in pairs:
        if local_model_path(ref, what) is None and not (isinstance(rev, str) and COMMIT_SHA.match(rev)):
            raise SpecError(
                f"{rev_what}={rev!r}: with {found[0]} the hub repo {ref!r} runs its own code, so it must be "
                "pinned to a commit (40 hex digits), not a branch, tag or refs/pr/N"
            )


def _keys(node: Any, path: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{path}.{k}", v
            yield from _keys(v, f"{path}.{k}")
