"""Seals: a trusted writer vouches for a record with a key that the bucket's other writers do not have.

A file in a bucket proves nothing about who wrote it: every person and job that may write an
output prefix or the cache folder can write any bytes there. What the pipeline reuses or publishes
(the plan, a chunk, a shard's commit marker, the merge summary, QA's verdict, the review's decision on it, a cache
entry and publish's vouch for it, ``_SUCCESS.json``,
``_PUBLISHING.json``)
therefore carries a *seal*: an HMAC-SHA256 over a domain, a scope (the run's output URI, the cache
folder ...) and the record's canonical JSON. Whoever lacks the key cannot make a seal that
verifies, cannot move a sealed record to another run or folder (the scope), nor reuse a seal of
one kind of record for another (the domain). Precedence between sealed records is taken only from
sealed fields.

Keys per role. The deployment's signing key (``[vllm_batch] signing_key``) stays on the Airflow side.
The shard worker runs vLLM, a hub model's tokenizer and chat template, and with ``allow_remote_code``
the model repo's own Python: it holds only the *worker key*, derived from each deployment key
(``worker_key_of``: ``vbw1.`` and an HMAC of a fixed label), from ``VLLM_BATCH_WORKER_KEY``. The
worker's records (``WORKER_DOMAINS``: chunk seals, commit markers, compile cache snapshots) are sealed
and checked with worker keys on both sides; every other domain only with the deployment's keys, which a
worker keyring does not hold (``SealError`` naming the domain). A seal made with the wrong role's key
never verifies.

The key text holds one or more keys separated by commas or whitespace, each at least
``MIN_KEY_CHARS`` characters: the first seals, all verify (rotation: put the new key first, keep
the old one until nothing sealed with it is needed). A seal names its key by ``kid``, a hash of
the key (not the key). No key configured: nothing is sealed or accepted (``SealError``, naming
the setting). Pure: no Airflow, no I/O.
"""

from __future__ import annotations

import base64
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
CACHE_PUBLISHED = "cache-published"
CHANGES = "changes"
COMPILE_CACHE = "compile-cache"
QA = "qa"
HISTORY = "history"
PUBLISHING = "publishing"
REVIEW = "review"
DOMAINS = frozenset(
    {
        PLAN,
        CHUNK,
        COMMIT,
        MERGED,
        SUCCESS,
        CACHE_ENTRY,
        CACHE_PUBLISHED,
        CHANGES,
        COMPILE_CACHE,
        QA,
        HISTORY,
        PUBLISHING,
        REVIEW,
    }
)
WORKER_DOMAINS = frozenset({CHUNK, COMMIT, COMPILE_CACHE})
"""What the shard worker seals and checks, with the worker key; every other domain takes the deployment's key."""

WORKER_KEY_PREFIX = "vbw1."
_WORKER_LABEL = b"vllm-batch-worker-key/v1"
HOW_TO_PRINT_WORKER_KEY = (
    "print the worker key of the deployment's [vllm_batch] signing_key with: "
    "python -m airflow_provider_vllm.cli.worker_key"
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


def worker_key_of(key: bytes) -> bytes:
    """The worker key of one deployment key: ``vbw1.`` and the URL-safe base64 of HMAC-SHA256(key, a fixed label).
    Deterministic (every Airflow task and the Secret agree), and it does not give the deployment key back."""
    mac = hmac.new(key, _WORKER_LABEL, hashlib.sha256).digest()
    return WORKER_KEY_PREFIX.encode() + base64.urlsafe_b64encode(mac).rstrip(b"=")


class _Ring:
    """Keys of one role: the first seals, every one verifies (by ``kid``)."""

    def __init__(self, keys: list[bytes]) -> None:
        self.signing = keys[0]
        self.by_kid = {kid_of(k): k for k in keys}


class Keyring:
    """Signing keys of one role: the deployment's (``worker=False``: the Airflow side) or a worker's.

    A deployment keyring seals and checks the worker's domains (``WORKER_DOMAINS``) with the worker keys derived from
    its keys, every other domain with its own keys. A worker keyring holds worker keys only and refuses every
    domain but the worker's. In each role the first key seals and every key verifies (rotation)."""

    def __init__(self, keys: list[bytes], source: str = SETTING, *, worker: bool = False) -> None:
        how = HOW_TO_PRINT_WORKER_KEY if worker else HOW_TO_MAKE
        if not keys:
            raise SealError(f"no {'worker' if worker else 'signing'} key: set {source}; {how}")
        short = [i for i, k in enumerate(keys) if len(k) < MIN_KEY_CHARS]
        if short:
            raise SealError(f"{source}: key #{short[0] + 1} is shorter than {MIN_KEY_CHARS} characters; {how}")
        prefix = WORKER_KEY_PREFIX.encode()
        if worker:
            wrong = [i for i, k in enumerate(keys) if not k.startswith(prefix)]
            if wrong:
                raise SealError(
                    f"{source}: key #{wrong[0] + 1} is not a worker key (worker keys start with "
                    f"{WORKER_KEY_PREFIX!r}): it is the deployment's own signing key, which a shard worker must "
                    f"never hold (code in the worker could seal any record with it); put the worker key there "
                    f"instead: {how}"
                )
        else:
            wrong = [i for i, k in enumerate(keys) if k.startswith(prefix)]
            if wrong:
                raise SealError(
                    f"{source}: key #{wrong[0] + 1} is a worker key (it starts with {WORKER_KEY_PREFIX!r}), not a "
                    f"deployment signing key; set the deployment's own key here ({HOW_TO_MAKE}) and give the shard "
                    "workers its worker key"
                )
        self.worker = worker
        self._own = None if worker else _Ring(keys)
        self._workers = _Ring(keys if worker else [worker_key_of(k) for k in keys])
        self.source = source

    @classmethod
    def from_text(cls, text: str | None, source: str = SETTING, *, worker: bool = False) -> Keyring:
        """Keys separated by commas or whitespace; SealError naming ``source`` when none is given."""
        return cls([k.encode() for k in _SPLIT.split(text or "") if k], source, worker=worker)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Keyring:
        """The deployment's keys from ``VLLM_BATCH_SIGNING_KEY``: the steps' default outside Airflow (scripts, tests);
        never a worker's."""
        return cls.from_text(envs.SIGNING_KEY.get(env), f"{envs.SIGNING_KEY.name} (the deployment's {SETTING})")

    @classmethod
    def worker_from_env(cls, env: Mapping[str, str] | None = None) -> Keyring:
        """The shard worker's keys (``VLLM_BATCH_WORKER_KEY``): worker keys only."""
        source = (
            f"{envs.WORKER_KEY.name} (the local runner sets it; pods: the Secret named by "
            "[vllm_batch] kubernetes_signing_secret)"
        )
        return cls.from_text(envs.WORKER_KEY.get(env), source, worker=True)

    def worker_keyring(self) -> Keyring:
        """The keyring a shard worker of this deployment holds: the worker keys, in the same order."""
        return Keyring(list(self._workers.by_kid.values()), f"the worker keys of {self.source}", worker=True)

    def worker_text(self) -> str:
        """The worker keys as one value for a worker's environment or its Secret (the first seals; never logged)."""
        ring = self._workers
        return ",".join(k.decode() for k in [ring.signing, *(k for k in ring.by_kid.values() if k != ring.signing)])

    def derives_from(self, text: str) -> bool:
        """Whether ``text`` (a value of any variable, keys separated by commas or whitespace) holds a deployment key
        whose worker key this keyring holds: how a worker finds the deployment's key under any name."""
        return any(
            len(k) >= MIN_KEY_CHARS and kid_of(worker_key_of(k.encode())) in self._workers.by_kid
            for k in _SPLIT.split(text)
            if k and not k.startswith(WORKER_KEY_PREFIX)
        )

    @property
    def kid(self) -> str:
        """The id of the key that seals this role's own records (a worker's: its worker key)."""
        return kid_of((self._own or self._workers).signing)

    def _ring(self, domain: str) -> _Ring:
        if domain not in DOMAINS:
            raise ValueError(f"unknown seal domain {domain!r}")
        if domain in WORKER_DOMAINS:
            return self._workers
        if self._own is None:
            raise SealError(
                f"a shard worker's key cannot seal or check {domain!r} records: only the Airflow side's tasks hold "
                "the deployment's signing key"
            )
        return self._own

    def _mac(self, key: bytes, domain: str, scope: str, doc: Mapping[str, Any]) -> str:
        msg = b"\x00".join([FORMAT, domain.encode(), scope.encode(), canonical(doc)])
        return hmac.new(key, msg, hashlib.sha256).hexdigest()

    def seal(self, domain: str, scope: str, doc: Mapping[str, Any]) -> Seal:
        """The seal of ``doc`` (a record's JSON data without its ``seal``) for ``scope``."""
        key = self._ring(domain).signing
        return Seal(kid=kid_of(key), mac=self._mac(key, domain, scope, doc))

    def verify(self, domain: str, scope: str, doc: Mapping[str, Any], seal: Seal | None, what: str) -> None:
        """SealError naming ``what`` unless ``seal`` is a seal of ``doc`` for ``scope`` by one of these keys."""
        ring = self._ring(domain)
        if seal is None:
            raise SealError(
                f"{what} carries no seal: it was not written by this deployment's pipeline (or by a version "
                "before seals); refusing to trust it"
            )
        key = ring.by_kid.get(seal.kid)
        if key is None:
            raise SealError(
                f"{what} is sealed with a key this deployment does not hold for {domain!r} records (kid {seal.kid}); "
                f"refusing to trust it (after a key rotation keep the old key in {self.source} until its records are "
                "not needed; records of a shard worker are sealed with the worker key, never the deployment's)"
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
