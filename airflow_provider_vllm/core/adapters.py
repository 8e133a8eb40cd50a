"""LoRA adapters: what an adapter's files are (its identity) and a private, checked copy of them.

An adapter is a folder in PEFT's layout (``adapter_config.json`` and ``adapter_model.safetensors``), which
vLLM loads with ``LoRARequest(name, int_id, path)``. Its identity, ``AdapterRef``:

* a local or object store folder: a sha256 over every byte of every file (each file's name in the
  folder, its size and the sha256 of all its bytes: the recipe of the weights fingerprint,
  ``steps/cache/key.py``), taken by the plan (``describe_adapter``) and sealed in the plan;
* a hub repo: its full commit sha (``model.adapters[].revision``), which names immutable files.

The worker never hands vLLM the source folder itself: ``fetch_adapter`` copies the files into a folder
of its own, hashing them as they are copied, and uses that copy only when its fingerprint is the plan's
(``InputChangedError`` otherwise: the adapter changed since the plan, and answers under the plan's
identity would be another adapter's). Whoever else can write the folder cannot make either read more than
the plan's sizes: the plan refuses a folder whose stated sizes add up to more than ``MAX_BYTES`` before it
reads a byte, and the copy stops at the plan's total; neither opens anything but a regular file
(``Storage._open_read``). Pure: no vLLM, no Airflow.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Literal

from pydantic import Field

from airflow_provider_vllm.core.errors import CommitError, InputChangedError, ListingTooLarge, SpecError
from airflow_provider_vllm.core.records import SHA256_HEX, Record
from airflow_provider_vllm.core.spec import LORA_RANKS, AdapterSpec, JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage

CONFIG_FILE = "adapter_config.json"
MAX_FILES = 256  # an adapter is a handful of files; more is a folder of something else
MAX_BYTES = 8 * 1024**3  # rank 64 on every layer of a 70B model is ~1.7 GB
_CHUNK = 1 << 20


class AdapterRef(Record):
    """One adapter as the plan found it: the identity the worker must load (sealed in the plan)."""

    name: str = Field(description="the adapter's name in the job (model.adapters[].name)")
    source: str = Field(description="model.adapters[].source")
    kind: Literal["local", "object_store", "hub"] = Field(description="where its files come from")
    revision: str | None = Field(None, description="hub adapters: the commit sha")
    sha256: str | None = Field(
        None, description="local and object store adapters: sha256 over every file's name, size and bytes"
    )
    rank: int | None = Field(None, description="the adapter's LoRA rank (adapter_config.json r / rank_pattern)")
    files: int | None = Field(None, description="files in the folder")
    bytes: int | None = Field(None, description="bytes of those files")

    def identity(self) -> str:
        """What names these exact files: ``sha256:<hex>`` or ``<repo>@<commit>``."""
        return f"sha256:{self.sha256}" if self.sha256 else f"{self.source}@{self.revision}"


def adapter_storage(a: AdapterSpec, options: dict[str, Any], filesystems: FileSystems | None = None) -> Storage:
    """The folder of a local or object store adapter."""
    if a.kind == "hub":
        raise SpecError(f"model.adapters[{a.name}]: a hub adapter has no storage folder")
    root = a.source.removeprefix("file://") if a.kind == "local" else a.source
    # the user's links (a hub cache's snapshot folder is one): the allow-list refused those that leave it
    return Storage(root, options if a.kind == "object_store" else {}, filesystems, follow_links=True)


def folder_fingerprint(entries: list[tuple[str, int, str]]) -> str:
    """sha256 over (name in the folder, size, sha256 of the bytes) of each file, in name order."""
    h = hashlib.sha256()
    for rel, size, digest in sorted(entries):
        h.update(json.dumps([rel, size, digest]).encode() + b"\n")
    return h.hexdigest()


def lora_rank(config: dict[str, Any]) -> int:
    """The largest rank an adapter_config.json asks for (``r`` and its ``rank_pattern``)."""
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    ok = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r >= 1]
    if len(ok) != len(ranks):
        raise ValueError(f"r / rank_pattern must be positive integers, got {ranks}")
    return max(ok)


def engine_max_rank(spec: JobSpec, ranks: list[int | None]) -> int:
    """vLLM's max_lora_rank for the job: engine.max_lora_rank, else the smallest of vLLM's ranks that holds
    the largest adapter rank; SpecError when an adapter is larger (vLLM would refuse to load it)."""
    known = [r for r in ranks if r is not None]
    top = max(known, default=LORA_RANKS[1])
    if spec.engine.max_lora_rank is not None:
        if top > spec.engine.max_lora_rank:
            raise SpecError(
                f"engine.max_lora_rank {spec.engine.max_lora_rank} is below the adapters' largest rank {top}: "
                "vLLM refuses such an adapter; raise it or leave it unset"
            )
        return spec.engine.max_lora_rank
    fit = next((r for r in LORA_RANKS if r >= top), None)
    if fit is None:
        raise SpecError(f"an adapter has rank {top}; vLLM serves ranks up to {LORA_RANKS[-1]}")
    return fit


def _listing(st: Storage, a: AdapterSpec) -> list[str]:
    try:
        names = list(st.walk_files(limit=MAX_FILES * 2))  # its folders count too; stopped there
    except NotADirectoryError:
        names = []
    except ListingTooLarge as e:
        raise SpecError(
            f"model.adapters[{a.name}]: {a.source} holds more than {e.limit} entries; an adapter has a few"
        ) from None
    if CONFIG_FILE not in names:
        held = f"it holds {names[:5]}" if names else "it is missing or empty where this process looks"
        raise SpecError(f"model.adapters[{a.name}]: {a.source} is not a LoRA adapter folder (no {CONFIG_FILE}; {held})")
    if len(names) > MAX_FILES:
        raise SpecError(f"model.adapters[{a.name}]: {a.source} holds {len(names)} files; an adapter has a few")
    return names


def _config(raw: bytes, a: AdapterSpec) -> dict[str, Any]:
    try:
        cfg = json.loads(raw)
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        lora_rank(cfg)
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecError(f"model.adapters[{a.name}]: {a.source}/{CONFIG_FILE} is not a LoRA config: {e}") from None
    return cfg


def describe_adapter(a: AdapterSpec, options: dict[str, Any], filesystems: FileSystems | None = None) -> AdapterRef:
    """The adapter's identity and rank, as the plan records it (every byte of a folder is read and hashed).

    SpecError when the folder is not an adapter, too large, or cannot be read here; hub adapters are named
    by their commit (their rank is read from the local hub cache when it holds them, else left unknown).
    """
    if a.kind == "hub":
        return AdapterRef(name=a.name, source=a.source, kind="hub", revision=a.revision, rank=_hub_rank(a))
    st = adapter_storage(a, options, filesystems)
    try:
        names = _listing(st, a)
        sizes = [(rel, st.size(rel)) for rel in names]
        total = sum(size for _, size in sizes)
        if total > MAX_BYTES:  # as the store states the sizes: nothing read yet (a planted TB is not hashed)
            raise SpecError(f"model.adapters[{a.name}]: {a.source} holds {total} bytes, more than an adapter")
        entries = [(rel, size, st.sha256(rel, size)) for rel, size in sizes]  # no more than size + 1 bytes each
        moved = [f"{rel} ({digest})" for rel, _, digest in entries if not SHA256_HEX.fullmatch(digest)]
        if moved:  # its fingerprint would name no file the workers can find: they would refuse it after the plan
            raise SpecError(
                f"model.adapters[{a.name}]: {a.source} changed while the plan read it: {', '.join(moved)}; plan "
                "again once whatever writes the adapter has finished"
            )
        cfg = _config(st.read_bytes(CONFIG_FILE), a)
    except FileNotFoundError as e:
        raise SpecError(f"model.adapters[{a.name}]: {a.source} cannot be read here: {e}") from None
    return AdapterRef(
        name=a.name,
        source=a.source,
        kind=a.kind,
        sha256=folder_fingerprint(entries),
        rank=lora_rank(cfg),
        files=len(entries),
        bytes=total,
    )


def _hub_rank(a: AdapterSpec) -> int | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers brings it
        return None
    cached = try_to_load_from_cache(a.source, CONFIG_FILE, revision=a.revision)
    if not isinstance(cached, str):
        return None
    with open(cached, "rb") as f:
        return lora_rank(_config(f.read(), a))


def describe_adapters(
    spec: JobSpec, options: dict[str, Any] | None = None, filesystems: FileSystems | None = None
) -> list[AdapterRef]:
    """``describe_adapter`` of each of the job's adapters, in spec order."""
    opts = spec.io.storage_options if options is None else options
    return [describe_adapter(a, opts, filesystems) for a in spec.model.adapters]


def check_refs(spec: JobSpec, refs: list[AdapterRef]) -> dict[str, AdapterRef]:
    """The plan's refs by name; SpecError unless they are exactly the spec's adapters (name, source, revision)."""
    by_name = {r.name: r for r in refs}
    want = [(a.name, a.source, a.kind, a.revision) for a in spec.model.adapters]
    got = [(r.name, r.source, r.kind, r.revision) for r in refs]
    if want != got:
        raise SpecError(f"the plan's adapters {got} are not the spec's {want}; plan the run again")
    return by_name


def fetch_adapter(
    a: AdapterSpec, ref: AdapterRef, dest: str, options: dict[str, Any], filesystems: FileSystems | None = None
) -> str:
    """Copy a local or object store adapter into ``dest`` (a new folder) and return it, after checking that the
    copy's fingerprint is the plan's (``ref.sha256``); InputChangedError when the adapter changed since.

    Each file is read through ``Storage._open_read`` (a FIFO or a device put in place of a file is refused
    unopened: InputChangedError naming it) and the copy stops at the plan's size (``ref.bytes``, all files together):
    a file whose stated size takes the total past it is refused unread, and no more than ``ref.bytes`` + 1 bytes
    are read in all (InputChangedError naming the file)."""
    st = adapter_storage(a, options, filesystems)
    try:
        names = _listing(st, a)
    except FileNotFoundError as e:
        raise InputChangedError(f"model.adapters[{a.name}]: {a.source} is gone since the plan: {e}") from None
    limit = MAX_BYTES if ref.bytes is None else min(ref.bytes, MAX_BYTES)

    def larger(rel: str) -> InputChangedError:
        return InputChangedError(
            f"model.adapters[{a.name}]: {st.uri(rel)} takes the adapter past the {limit} bytes the plan found: "
            "it changed since the plan; plan the run again"
        )

    entries = []
    total = 0
    for rel in names:
        if rel.startswith("/") or ".." in rel.split("/"):
            raise SpecError(f"model.adapters[{a.name}]: file name {rel!r} leaves the folder")
        if total + st.size(rel) > limit:  # as the store states it: refused unread
            raise larger(rel)
        local = os.path.join(dest, *rel.split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        h, size = hashlib.sha256(), 0
        try:
            src = st._open_read(rel)
        except CommitError as e:  # not a regular file (it was one when the plan hashed it)
            raise InputChangedError(f"model.adapters[{a.name}]: {e}; it changed since the plan") from None
        with src, open(local, "wb") as out:
            while block := src.read(min(_CHUNK, limit + 1 - total)):  # the size may lie: limit + 1 at most
                total += len(block)
                if total > limit:
                    raise larger(rel)
                h.update(block)
                out.write(block)
                size += len(block)
        entries.append((rel, size, h.hexdigest()))
    got = folder_fingerprint(entries)
    if got != ref.sha256:
        raise InputChangedError(
            f"model.adapters[{a.name}]: {a.source} changed since the plan (fingerprint {got[:12]}, the plan's "
            f"{(ref.sha256 or '?')[:12]}): its answers would not be the planned adapter's; plan the run again"
        )
    return dest


def max_loras(spec: JobSpec) -> int:
    """Adapters in one engine batch: engine.max_loras, else all of the job's."""
    return spec.engine.max_loras or max(1, len(spec.model.adapters))
