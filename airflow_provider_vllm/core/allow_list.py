"""Input/output URIs: canonical form and the deployment's allow-list of prefixes.

Pure (no Airflow, no I/O except resolving local symlinks). ``check_uri(uri, allowed)``
returns the canonical URI or raises ``SpecError`` naming the parameter and the reason:

* schemes: local absolute paths, ``file://``, and the object stores listed in ``SCHEMES``;
  anything else (``http://``, ``ftp://``, ``hdfs://``, ``zip::``, chained ``a::b``) is refused;
* ``..`` and ``.`` segments, their percent-encoded forms (``%2e%2e``, ``%2f``, ``%5c``,
  double-encoded ``%25...``), backslashes, control characters (also Unicode's: bidi overrides, zero-width
  and other invisible format characters, C1 controls, private-use code points, lone surrogates), the markup and
  quoting characters
  `` ` < > " | `` (a location reaches the approval request's Markdown, the report's HTML and
  copied shell lines) and empty segments are refused,
  not resolved: a path that needs cleaning is a path someone is probing with;
* credentials in the authority (``s3://key:secret@bucket``, also a secret holding ``/``, as half of
  AWS secret keys do: ``s3://key:abc/def@bucket``) and in a query string (``?X-Amz-Signature=``,
  ``?sig=``, ``?token=``, ...: ``CREDENTIAL_QUERY_NAMES``) are refused, and the refusal shows the
  URI with them replaced by ``***``: credentials come from an Airflow Connection;
* ``file://`` must be ``file:///abs/path`` (or ``file://localhost/...``); relative local paths
  are refused;
* local paths are resolved with ``realpath``, so a symlink that leads out of an allowed
  prefix is caught (``check_local_tree`` does the same for every file under a folder);
* a prefix matches by whole segments: ``s3://data`` allows ``s3://data/x`` but not
  ``s3://data-other/x``.

``check_uri`` with an empty allow-list checks the syntax only; the deployment checks
(``spec_guard.check_deployment``) fail closed instead: no allow-list and no explicit
"any location" setting -> nothing is read or written. The deployment setting is read by the
Airflow side (``utils/deployment.py``) and handed to the worker through
``ALLOWED_PREFIXES_ENV`` (and ``ALLOW_ANY_LOCATION_ENV``), never through the shard task, so a
forged task cannot widen it.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Iterable, Sequence

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import SpecError

SCHEMES = ("s3", "s3a", "gs", "gcs", "memory", "file")
# Stores fsspec can reach but the commit protocol cannot use: no tested create-only
# (write-if-absent) path here, so a run would plan and then fail at its first commit.
UNSUPPORTED_SCHEMES = {
    s: "Azure storage has no tested create-only (write-if-absent) write in this provider, which the commit "
    "protocol needs"
    for s in ("abfs", "abfss", "az", "adl")
}
ALLOWED_PREFIXES_ENV = envs.ALLOWED_PREFIXES.name
ALLOW_ANY_LOCATION_ENV = envs.ALLOW_ANY_LOCATION.name  # "1": the deployment allows any location
ALLOW_REMOTE_CODE_ENV = envs.ALLOW_REMOTE_CODE.name  # "1": trust_remote_code / code-loading engine options
DEPLOYMENT_ENV = (ALLOWED_PREFIXES_ENV, ALLOW_ANY_LOCATION_ENV, ALLOW_REMOTE_CODE_ENV)
"""The worker's deployment settings, set by the shard operator (last: nothing else may set them)."""
MAX_URI_CHARS = 1024
_ENCODED = re.compile(r"%(2e|2f|5c|25|00)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Unicode characters that show as nothing or reorder the text around them (bidi overrides and isolates, zero-width
# spaces and joiners, the soft hyphen, C1 controls, line and paragraph separators), private-use code points and
# lone surrogates: a location holding one reads as another location in the approval request, the report and logs
# (``s3://data/out/<U+202E>...`` shows its tail reversed), and a lone surrogate cannot be written as UTF-8 at all
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})
# Markup and quoting characters: no object key or folder this pipeline writes needs them, and a URI reaches
# Markdown (the approval request), HTML (the QA report), logs and shell-quoted commands people copy
_MARKUP = re.compile(r'[`<>"|]')  # an apostrophe stays allowed: folder names have it, and SQL quotes it
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,254}$")
# user@ in a URI's authority; Azure's container@account is no credential (and those schemes are refused anyway).
# Also key:secret@ whose secret holds a '/' (half of AWS secret keys do): a ':' in the authority and an '@' after
# it, before any whitespace or quote; no bucket name holds a ':'.
_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.-])(?!(?:abfss?|az|adl)://)([A-Za-z][A-Za-z0-9+.-]*://)"
    r"(?:[^/]*@|[^/@:\s'\"]*:[^@\s'\"]*@)",
    re.I,
)
# Query parameters that carry credentials: presigned S3/GCS URLs (X-Amz-Signature, X-Amz-Credential,
# X-Amz-Security-Token, X-Goog-Signature), SAS (sig), access_token, key, auth ... (any name holding one of these)
CREDENTIAL_QUERY_NAMES = ("sig", "token", "credential", "secret", "passw", "key", "auth")
_QUERY_CREDENTIAL = re.compile(
    r"([?&;#][A-Za-z0-9_.-]*(?:" + "|".join(CREDENTIAL_QUERY_NAMES) + r")[A-Za-z0-9_.-]*=)[^&;#\s'\"]*", re.I
)


def redact_userinfo(text: str) -> str:
    """``text`` with the credentials of every URI in it replaced by ``***``: the userinfo
    (``s3://key:secret@bucket``) and the values of credential query parameters (``?X-Amz-Signature=...``)."""
    return _QUERY_CREDENTIAL.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def canonical_uri(uri: str, what: str = "uri", resolve: bool = True) -> str:
    """The canonical form of ``uri`` (local: absolute real path; remote: ``scheme://bucket/key``).

    ``resolve=False`` skips resolving local symlinks (a syntax check only, no I/O).
    """
    if not isinstance(uri, str) or not uri:
        raise SpecError(f"{what}: must be a non-empty string")
    if _USERINFO.search(uri) or _QUERY_CREDENTIAL.search(uri):  # before any message that shows the URI
        raise SpecError(
            f"{what}={redact_userinfo(uri)[:200]!r}: credentials in URIs are not allowed; use an Airflow Connection"
        )
    if len(uri) > MAX_URI_CHARS:
        raise SpecError(f"{what}: {len(uri)} characters; at most {MAX_URI_CHARS}")
    if _CONTROL.search(uri):
        raise SpecError(f"{what}={uri!r}: control characters are not allowed")
    hidden = next((c for c in uri if unicodedata.category(c) in _HIDDEN_CATEGORIES), None)
    if hidden is not None:  # shown escaped: the message itself must not reorder or hide text
        raise SpecError(
            f"{what}={ascii(uri)}: U+{ord(hidden):04X} ({unicodedata.name(hidden, 'no name')}) is invisible, a "
            "control or reorders the text around it; not allowed in locations"
        )
    if "\\" in uri:
        raise SpecError(f"{what}={uri!r}: backslashes are not allowed")
    if _MARKUP.search(uri):
        raise SpecError(f'{what}={uri!r}: the characters ` < > " | are not allowed in locations')
    if _ENCODED.search(uri):
        raise SpecError(f"{what}={uri!r}: percent-encoded '.', '/', '\\', '%' or NUL are not allowed")
    if "::" in uri:
        raise SpecError(f"{what}={uri!r}: chained fsspec URLs (a::b) are not allowed")
    m = _SCHEME.match(uri)
    if m is None:
        if ":" in uri.split("/", 1)[0]:
            # not shown whole: a mistyped scheme may still carry credentials (s3:/key:secret@bucket)
            shown = "***@" + uri.rsplit("@", 1)[1] if "@" in uri else uri
            raise SpecError(f"{what}={shown!r}: unknown scheme; use one of {list(SCHEMES)} or an absolute path")
        return _local(uri, uri, what, resolve)
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme in UNSUPPORTED_SCHEMES:
        raise SpecError(
            f"{what}={uri!r}: scheme {scheme!r} is not supported: {UNSUPPORTED_SCHEMES[scheme]}; "
            f"use one of {list(SCHEMES)}"
        )
    if scheme not in SCHEMES:
        raise SpecError(f"{what}={uri!r}: scheme {scheme!r} is not allowed; use one of {list(SCHEMES)}")
    if scheme == "file":
        host, sep, path = rest.partition("/")
        if host not in ("", "localhost") or not sep:
            raise SpecError(f"{what}={uri!r}: file URIs must be file:///absolute/path")
        return _local("/" + path, uri, what, resolve)
    bucket, _, key = rest.partition("/")
    if scheme != "memory" and not _BUCKET.match(bucket):
        raise SpecError(f"{what}={uri!r}: {bucket!r} is not a valid bucket name")
    _trailing(key, uri, what)
    segments = _segments(key.rstrip("/"), uri, what) if key.strip("/") else []
    return f"{scheme}://" + "/".join([bucket, *segments])


def _segments(path: str, uri: str, what: str) -> list[str]:
    parts = path.split("/")
    for p in parts:
        if p in ("..", "."):
            raise SpecError(f"{what}={uri!r}: '{p}' path segments are not allowed")
        if p == "":
            raise SpecError(f"{what}={uri!r}: empty path segments ('//') are not allowed")
    return parts


def _trailing(path: str, uri: str, what: str) -> None:
    # one trailing slash marks a folder; more is an empty last segment, e.g. a template whose last part
    # rendered empty (".../reruns/{{ x }}/"): taken as the parent, it would be another run's folder
    if path.endswith("//") and path.strip("/"):
        raise SpecError(f"{what}={uri!r}: empty path segments ('//') are not allowed")


def _local(path: str, uri: str, what: str, resolve: bool) -> str:
    if not path.startswith("/"):
        raise SpecError(f"{what}={uri!r}: local paths must be absolute")
    _trailing(path, uri, what)
    body = path.rstrip("/")
    if body:
        _segments(body[1:], uri, what)
    if not resolve:
        return body or "/"
    return os.path.realpath(path)  # resolves symlinks, so an escape shows in the result


def is_under(uri: str, prefix: str) -> bool:
    """True when canonical ``uri`` equals canonical ``prefix`` or lies below it (whole segments)."""
    prefix = prefix.rstrip("/")
    return uri == prefix or uri.startswith(prefix + "/") or (prefix == "" and uri.startswith("/"))


# fsspec's second names of one store: ``s3a://`` is s3fs as ``s3://`` is, ``gcs://`` gcsfs as ``gs://`` is
STORE_ALIASES = {"s3a": "s3", "gcs": "gs"}


def store_form(canon: str) -> str:
    """Canonical ``canon`` with a store's second name replaced by its first (``s3a://b/k`` -> ``s3://b/k``).

    The form that rules keeping two locations *apart* compare (a scheduled prefix, a run and its baseline, input
    and output), so that a second spelling of one location cannot pass for another. Allow-lists compare the
    canonical form itself: a prefix lets in only the spelling it names (fail closed)."""
    scheme, sep, rest = canon.partition("://")
    return f"{STORE_ALIASES.get(scheme, scheme)}://{rest}" if sep else canon


def overlap(a: str, b: str) -> bool:
    """True when canonical ``a`` and ``b`` are one location or one holds the other, whatever store name each
    spells (``store_form``)."""
    a, b = store_form(a), store_form(b)
    return is_under(a, b) or is_under(b, a)


def enclosing_folders(canon: str, allowed: Sequence[str] | None) -> list[str]:
    """The folders that hold canonical ``canon``, nearest first, up to and including the longest allowed
    prefix it lies under (none given or none matching: up to the bucket, or ``/``). Pure: no I/O."""
    prefixes = [p for p in canonical_prefixes(allowed) if is_under(canon, p)]
    stop = max(prefixes, key=len) if prefixes else None
    m = _SCHEME.match(canon)
    root = f"{m.group(1)}://{m.group(2).split('/', 1)[0]}" if m else "/"
    found = []
    here = canon
    while here != (stop or root) and "/" in here.removeprefix(f"{m.group(1)}://" if m else ""):
        here = here.rsplit("/", 1)[0] or "/"
        if stop is not None and not is_under(here, stop):
            break
        found.append(here)
        if here == root:
            break
    return found


def check_uri(uri: str, allowed: Sequence[str] | None, what: str = "uri") -> str:
    """Canonical ``uri``, or SpecError when it is malformed or under none of ``allowed``."""
    canon = canonical_uri(uri, what)
    prefixes = canonical_prefixes(allowed)
    if prefixes and not any(is_under(canon, p) for p in prefixes):
        shown = canon if canon == uri.rstrip("/") else f"{uri} (= {canon})"
        raise SpecError(f"{what}={shown} is outside the allowed prefixes {prefixes}")
    return canon


def check_cache_location(uri: str, cache_prefixes: Sequence[str], setting: str) -> str:
    """Canonical ``cache.uri``, or SpecError when the deployment allows no cache there (none configured: nowhere).

    Where caches live is the deployment's choice, so that one team's job cannot read or fill another's.
    """
    canon = canonical_uri(uri, "cache.uri")
    if not cache_prefixes:
        raise SpecError(
            f"cache.uri={uri} is set, but the deployment allows no result cache: {setting} is empty "
            "(name the prefixes result caches may live under, or unset cache.uri)"
        )
    if not any(is_under(canon, p) for p in cache_prefixes):
        raise SpecError(
            f"cache.uri={uri} is outside the deployment's cache locations {list(cache_prefixes)} ({setting})"
        )
    return canon


def check_local_tree(canon: str, allowed: Sequence[str] | None, what: str = "uri") -> None:
    """Every file under a local folder resolves inside ``allowed`` (catches symlinks inside it)."""
    prefixes = canonical_prefixes(allowed)
    if not prefixes or not canon.startswith("/") or not os.path.isdir(canon):
        return
    for dirpath, dirnames, filenames in os.walk(canon, followlinks=False):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                real = os.path.realpath(p)
                if not any(is_under(real, q) for q in prefixes):
                    raise SpecError(f"{what}: {p} is a symlink to {real}, outside the allowed prefixes {prefixes}")


def canonical_prefixes(allowed: Iterable[str] | None) -> list[str]:
    """The allow-list in canonical form; raises SpecError on a malformed entry (a deployment error)."""
    return [canonical_uri(p, "allowed prefix") for p in (allowed or []) if p and p.strip()]


def parse_list_setting(raw: str | Sequence[str] | None, setting: str) -> list[str]:
    """A deployment setting that lists strings: a JSON list of strings, a comma/newline-separated string, or a
    list. Blank items are dropped; anything else (a JSON list holding a number or null, JSON that is not a list)
    is a SpecError naming ``setting``: a setting that widens access is read strictly, not coerced."""
    if raw is None:
        return []
    if isinstance(raw, str):
        text = raw.strip()
        if not text:
            return []
        if text.startswith("["):
            try:
                items = json.loads(text)
            except ValueError as e:
                raise SpecError(f"{setting} is not a JSON list: {e}") from None
        else:
            items = re.split(r"[,\n]", text)
    else:
        items = list(raw)
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise SpecError(f"{setting} must be a list of strings")
    return [i.strip() for i in items if i.strip()]


def parse_prefixes(raw: str | Sequence[str] | None, setting: str = "allowed prefixes") -> list[str]:
    """An allow-list of URI prefixes (``parse_list_setting``)."""
    return parse_list_setting(raw, setting)


def prefixes_from_env(env: dict[str, str] | None = None) -> list[str]:
    """The allow-list the worker was started with (``ALLOWED_PREFIXES_ENV``)."""
    return parse_prefixes(envs.ALLOWED_PREFIXES.get(env))


def flag_from_env(name: str, env: dict[str, str] | None = None) -> bool:
    """A deployment flag the worker was started with ("1"/"true"/"yes" -> True; anything else False)."""
    return envs.by_name()[name].flag(env)
