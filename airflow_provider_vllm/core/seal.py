"""Seals: a trusted writer vouches for a record with a key that the bucket's other writers do not have.

A file in a bucket proves nothing about who wrote it: every person and job that may write an
output prefix or the cache folder can write any bytes there. What the pipeline reuses or publishes
(the plan, a chunk, a shard's commit marker, the merge summary, QA's verdict, a cache entry, ``_SUCCESS.json``,
``_PUBLISHING.json``)
therefore carries a *seal*: an HMAC-SHA256 over a domain, a scope (the run's output URI, the cache
folder ...) and the record's canonical JSON, made with the deployment's signing key
(``[vllm_batch] signing_key`` on the Airflow side; ``VLLM_BATCH_SIGNING_KEY`` in the worker's
environment, from a Kubernetes Secret on pods). Whoever lacks the key cannot make a seal that
verifies, cannot move a sealed record to another run or folder (the scope), nor reuse a seal of
one kind of record for another (the domain). Precedence between sealed records is taken only from
sealed fields.

The key text holds one or more keys separated by commas or whitespace, each at least
``MIN_KEY_CHARS`` characters: the first seals, all verify (rotation: put the new key first, keep
the old one until nothing sealed with it is needed). A seal names its key by ``kid``, a hash of
the key (not the key). No key configured: nothing is sealed or accepted (``SealError``, naming
the setting). Pure: no Airflow, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import SealError

MIN_KEY_CHARS = 32
FORMAT = b"vllm-batch-seal/v1"
SETTING = "[vllm_batch] signing_key (AIRFLOW__VLLM_BATCH__SIGNING_KEY)"
HOW_TO_MAKE = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(48))'"
_SPLIT = re.compile(r"[\s,]+")
R = TypeVar("R", bound=BaseModel)

# Domains: one per kind of sealed record, so that a seal of one kind never verifies as another.
PLAN = "plan"
CHUNK = "chunk"
COMMIT = "commit"
MERGED = "merged"
SUCCESS = "success"
CACHE_ENTRY = "cache-entry"
CHANGES = "changes"
COMPILE_CACHE = "compile-cache"
QA = "qa"
HISTORY = "history"
PUBLISHING = "publishing"
DOMAINS = frozenset(
    {PLAN, CHUNK, COMMIT, MERGED, SUCCESS, CACHE_ENTRY, CHANGES, COMPILE_CACHE, QA, HISTORY, PUBLISHING}
)


class Seal(BaseModel):
    """A record's seal: which key (``kid``) and the HMAC-SHA256 (hex) over domain, scope and content."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kid: str = Field(pattern=r"^[0-9a-f]{16}$", description="the sealing key's id: a hash of the key, not the key")
    mac: str = Field(pattern=r"^[0-9a-f]{64}$", description="HMAC-SHA256 over domain, scope and the record's JSON")


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The record's bytes as sealed: JSON with sorted keys, no whitespace, UTF-8."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def kid_of(key: bytes) -> str:
    return hashlib.sha256(b"vllm-batch-kid\x00" + key).hexdigest()[:16]


class Keyring:
    """The deployment's signing keys: the first seals, every one verifies."""

    def __init__(self, keys: list[bytes], source: str = SETTING) -> None:
        if not keys:
            raise SealError(f"no signing key: set {source}; {HOW_TO_MAKE}")
        short = [i for i, k in enumerate(keys) if len(k) < MIN_KEY_CHARS]
        if short:
            raise SealError(f"{source}: key #{short[0] + 1} is shorter than {MIN_KEY_CHARS} characters; {HOW_TO_MAKE}")
        self._keys = {kid_of(k): k for k in keys}
        self._signing = keys[0]
        self.source = source

    @classmethod
    def from_text(cls, text: str | None, source: str = SETTING) -> Keyring:
        """Keys separated by commas or whitespace; SealError naming ``source`` when none is given."""
        return cls([k.encode() for k in _SPLIT.split(text or "") if k], source)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Keyring:
        """The worker's keys (``VLLM_BATCH_SIGNING_KEY``)."""
        return cls.from_text(envs.SIGNING_KEY.get(env), f"{envs.SIGNING_KEY.name} (from {SETTING} or its Secret)")

    def text(self) -> str:
        """The keys as one value for a child process's environment (never logged)."""
        return ",".join(k.decode() for k in [self._signing, *(k for k in self._keys.values() if k != self._signing)])

    @property
    def kid(self) -> str:
        return kid_of(self._signing)

    def _mac(self, key: bytes, domain: str, scope: str, doc: Mapping[str, Any]) -> str:
        if domain not in DOMAINS:
            raise ValueError(f"unknown seal domain {domain!r}")
        msg = b"\x00".join([FORMAT, domain.encode(), scope.encode(), canonical(doc)])
        return hmac.new(key, msg, hashlib.sha256).hexdigest()

    def seal(self, domain: str, scope: str, doc: Mapping[str, Any]) -> Seal:
        """The seal of ``doc`` (a record's JSON data without its ``seal``) for ``scope``."""
        return Seal(kid=self.kid, mac=self._mac(self._signing, domain, scope, doc))

    def verify(self, domain: str, scope: str, doc: Mapping[str, Any], seal: Seal | None, what: str) -> None:
        """SealError naming ``what`` unless ``seal`` is a seal of ``doc`` for ``scope`` by one of these keys."""
        if seal is None:
            raise SealError(
                f"{what} carries no seal: it was not written by this deployment's pipeline (or by a version "
                "before seals); refusing to trust it"
            )
        key = self._keys.get(seal.kid)
        if key is None:
            raise SealError(
                f"{what} is sealed with a key this deployment does not hold (kid {seal.kid}); refusing to trust "
                f"it (after a key rotation keep the old key in {self.source} until its records are not needed)"
            )
        if not hmac.compare_digest(self._mac(key, domain, scope, doc), seal.mac):
            raise SealError(
                f"{what}: its seal does not match its content: it was changed after the pipeline wrote it, "
                "or moved from another run or folder; refusing to trust it"
            )


def scope_of(uri: str) -> str:
    """A location as a seal scope: the same folder always gives the same text (no trailing slash; a local
    folder by its real path, so a symbolic link to a run is that run, while a copy is another folder)."""
    uri = uri.rstrip("/")
    if "://" not in uri or uri.startswith("file://"):
        return os.path.realpath(uri.removeprefix("file://"))
    return uri


def seal_of(record: BaseModel) -> Seal | None:
    """The record's ``seal`` field (every sealed record type declares ``seal: Seal | None``)."""
    seal = getattr(record, "seal", None)
    if seal is not None and not isinstance(seal, Seal):
        raise TypeError(f"{type(record).__name__}.seal is not a Seal")
    return seal


def sealed_doc(record: BaseModel) -> dict[str, Any]:
    """What a record's seal covers: its JSON data as written (fields never set left out), without ``seal``."""
    return record.model_dump(mode="json", exclude_unset=True, exclude={"seal"})


def seal_record(keyring: Keyring, domain: str, scope: str, record: R) -> R:
    """``record`` with its seal set (a copy)."""
    return record.model_copy(update={"seal": keyring.seal(domain, scope, sealed_doc(record))})


def verify_record(keyring: Keyring, domain: str, scope: str, record: BaseModel, what: str) -> None:
    """SealError naming ``what`` unless the record's seal is this deployment's seal of it for ``scope``."""
    keyring.verify(domain, scope, sealed_doc(record), seal_of(record), what)


def record_bytes(record: BaseModel) -> bytes:
    """The file bytes of a sealed record: exactly the sealed fields plus ``seal``."""
    doc = sealed_doc(record)
    seal = seal_of(record)
    if seal is not None:
        doc["seal"] = seal.model_dump(mode="json")
    return json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False).encode()
