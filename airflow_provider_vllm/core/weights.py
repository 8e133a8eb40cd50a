"""A local model or tokenizer folder as the plan read it, and the worker's check that it still holds those bytes.

With the result cache on and ``model.name`` (or ``model.tokenizer``) a local folder, the plan hashes every file
of it for the cache key (``steps/cache/key.py``) and seals each file's name in the folder, size and sha256 in
the plan (``WeightsPin``, ``Plan.weights``). The worker loads the folder itself (weights are many GB: no private
copy as for LoRA adapters, ``core/adapters.py``) and checks it against the pin while it infers
(``worker/weights.py``): a folder changed since the plan fails the shard (``InputChangedError``, terminal)
before anything of that attempt is sealed or committed, so that no answer of other weights is filed in the
cache under the planned weights' key.

``folder_files`` is the one listing both sides use: every file under the folder, symbolic links followed as
vLLM follows them (a hub cache snapshot is links into ``blobs/``), a link back to a folder above read once.
``check_folder`` reads no more than the pin allows: it stops listing at the first name the pin does not hold,
opens only regular files (a FIFO or a device is refused unopened), refuses a file whose size is not the pinned
one unread, and reads at most the pinned size + 1 bytes of each. Pure: no vLLM, no Airflow.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from airflow_provider_vllm.core.adapters import folder_fingerprint
from airflow_provider_vllm.core.errors import InputChangedError
from airflow_provider_vllm.core.records import PinnedFile

_CHUNK = 1 << 20


def local_folder(name: str) -> str:
    """The folder a local ``model.name`` / ``model.tokenizer`` names (``file://`` and ``~`` resolved)."""
    return os.path.expanduser(name.removeprefix("file://"))


class WeightsPin(BaseModel):
    """A local model or tokenizer folder as the plan hashed it (sealed in the plan: ``Plan.weights``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["model", "tokenizer"] = Field(description="model.name or model.tokenizer")
    name: str = Field(description="model.name / model.tokenizer as the spec writes it")
    files: list[PinnedFile] = Field(description="every file of the folder, sorted by path")

    def fingerprint(self) -> str:
        """The key config's ``weights_sha256`` / ``tokenizer_sha256`` of these files."""
        return folder_fingerprint([(f.path, f.bytes, f.sha256) for f in self.files])

    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


def folder_files(folder: str) -> Iterator[tuple[str, str]]:
    """(name in the folder, path) of every file under ``folder`` in walk order, links followed as vLLM reads
    them; a link back to a folder above is not followed (a loop, read once)."""
    for d, dirs, fs in os.walk(folder, followlinks=True):
        parts = os.path.relpath(d, folder).split(os.sep)
        if d != folder and os.path.realpath(d) in {
            os.path.realpath(os.path.join(folder, *parts[:i])) for i in range(len(parts))
        }:
            dirs[:] = []
            continue
        dirs.sort()
        for f in sorted(fs):
            p = os.path.join(d, f)
            yield os.path.relpath(p, folder).replace(os.sep, "/"), p


def _open_regular(path: str) -> int:
    """A read-only descriptor of ``path`` (links followed) when it is a regular file; OSError otherwise.
    Opened without blocking: a FIFO put in its place would block a plain open forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_folder(pin: WeightsPin, stop: Callable[[], bool] = lambda: False) -> None:
    """InputChangedError naming the file unless the pinned folder holds exactly the pin's files with their sizes
    and bytes now. ``stop()`` true: return early (the shard is ending anyway), checked between blocks."""
    folder = local_folder(pin.name)
    where = f"model.{'name' if pin.role == 'model' else 'tokenizer'} {pin.name}"
    replan = (
        "its answers would not be the planned weights'; keep writers off the folder while a run is in flight, "
        "and plan the run again"
    )
    want = {f.path: f for f in pin.files}
    if not os.path.isdir(folder):
        raise InputChangedError(f"{where}: the folder is gone since the plan; {replan}")
    seen: list[str] = []
    for rel, _ in folder_files(folder):
        if rel not in want:  # stop at the first: a planted folder of a million files is not listed further
            raise InputChangedError(f"{where}: {rel} was added since the plan; {replan}")
        seen.append(rel)
    missing = sorted(set(want) - set(seen))
    if missing:
        raise InputChangedError(f"{where}: {missing[0]} was removed since the plan; {replan}")
    for f in pin.files:
        path = os.path.join(folder, *f.path.split("/"))
        try:
            fd = _open_regular(path)
        except OSError as e:
            raise InputChangedError(f"{where}: {f.path} cannot be read as a regular file ({e}); {replan}") from None
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != f.bytes:  # refused unread: a file swapped for a huge (or sparse) one costs nothing
                raise InputChangedError(f"{where}: {f.path} is {size} bytes, the plan hashed {f.bytes}; {replan}")
            h, n = hashlib.sha256(), 0
            while block := fh.read(min(_CHUNK, f.bytes + 1 - n)):  # a growing file: pinned size + 1 at most
                if stop():
                    return
                n += len(block)
                h.update(block)
                if n > f.bytes:
                    break
        if n != f.bytes or h.hexdigest() != f.sha256:
            raise InputChangedError(
                f"{where}: {f.path} is not the file the plan hashed (same size, other bytes: sha256 "
                f"{h.hexdigest()[:12]}, the plan's {f.sha256[:12]}); {replan}"
            )
