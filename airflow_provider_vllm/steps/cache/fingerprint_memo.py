"""A local memo of weights files' sha256, so that the cache key's weights fingerprint reads every byte once.

One JSON file (``MemoFile``; ``$VLLM_BATCH_FINGERPRINT_MEMO``, default
``<$XDG_CACHE_HOME or ~/.cache>/airflow-provider-vllm/weights-fingerprints.json``, ``off``: none)
maps a file's stat (real path, size, mtime_ns, ctime_ns, inode, device: ``FileStat``) to the sha256
of its bytes. A hash is used only for exactly the stat it was taken at: any write changes the
ctime, which no user can set back (``os.utime`` sets mtime and atime, and itself moves the ctime).

What is not trusted: a memo that does not parse, is of another format, fails its checksum (a hand
edit), is larger than ``MAX_BYTES``, or is not owned by this user or is writable by others, is
ignored whole (a warning) and rewritten. A file changed within ``RACY_NS`` before it was hashed is
not memoised (a second write in the same timestamp tick could keep its stat: "racy git"). The memo
is as trustworthy as this user's own files: whoever can write as this user could also change the
code that reads it. Writes are atomic (temp file + rename); a memo that cannot be written is
skipped with a warning, never an error.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import tempfile
from dataclasses import asdict, dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airflow_provider_vllm.core import envs

log = logging.getLogger(__name__)

MEMO_FORMAT = "airflow-provider-vllm/weights-fingerprints/1"
RACY_NS = 2_000_000_000  # coarse file-system timestamps (FAT: 2 s) and the kernel's coarse clock
MAX_ENTRIES = 100_000
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class FileStat:
    """What identifies one version of a file without reading it."""

    path: str  # the real path (symbolic links resolved)
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: str) -> FileStat:
        """The stat of the file ``path`` names (links followed); OSError (ENOENT, EINVAL for a non-regular file)."""
        real = os.path.realpath(path)
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return cls(real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


class MemoEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1)
    size: int = Field(ge=0)
    mtime_ns: int
    ctime_ns: int
    inode: int = Field(ge=0)
    device: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    def stat(self) -> FileStat:
        return FileStat(self.path, self.size, self.mtime_ns, self.ctime_ns, self.inode, self.device)


class MemoFile(BaseModel):
    """The memo on disk: its format, the entries and a checksum over them."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["airflow-provider-vllm/weights-fingerprints/1"]
    entries: list[MemoEntry]
    checksum: str = Field(description="sha256 of the entries' canonical JSON: a hand edit makes the memo ignored")

    @staticmethod
    def checksum_of(entries: list[MemoEntry]) -> str:
        doc = [e.model_dump() for e in entries]
        return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def default_path() -> str | None:
    """Where the memo lives (None: ``off``)."""
    chosen = envs.FINGERPRINT_MEMO.get()
    if chosen is not None:
        return None if chosen.lower() == "off" else os.path.expanduser(chosen)
    base = envs.XDG_CACHE_HOME.get() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "airflow-provider-vllm", "weights-fingerprints.json")


class FingerprintMemo:
    """sha256 by ``FileStat``, loaded from ``path`` on first use; ``save`` writes what ``put`` added."""

    def __init__(self, path: str | None, racy_ns: int = RACY_NS) -> None:
        self.path = path
        self.racy_ns = racy_ns
        self._known: dict[FileStat, str] | None = None
        self._new: dict[FileStat, str] = {}

    @classmethod
    def default(cls) -> FingerprintMemo:
        return cls(default_path())

    def load(self) -> None:
        """Read the memo now (else at the first ``get``)."""
        if self._known is None:
            self._known = self._read()

    def get(self, st: FileStat) -> str | None:
        self.load()
        assert self._known is not None
        return self._new.get(st) or self._known.get(st)

    def put(self, st: FileStat, sha256: str, hashed_from_ns: int) -> None:
        """Remember ``sha256`` for ``st`` unless the file changed less than ``racy_ns`` before ``hashed_from_ns``."""
        if max(st.mtime_ns, st.ctime_ns) < hashed_from_ns - self.racy_ns:
            self._new[st] = sha256

    def _read(self) -> dict[FileStat, str]:
        if self.path is None:
            return {}
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    log.warning(
                        "ignoring the fingerprint memo %s: not owned by this user, or writable by others", self.path
                    )
                    return {}
                raw = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.warning("ignoring the fingerprint memo %s: %s", self.path, e)
            return {}
        if len(raw) > MAX_BYTES:
            log.warning("ignoring the fingerprint memo %s: larger than %d bytes", self.path, MAX_BYTES)
            return {}
        try:
            memo = MemoFile.model_validate_json(raw)
        except (ValidationError, ValueError) as e:
            log.warning("ignoring the fingerprint memo %s: not a memo of this version: %s", self.path, str(e)[:200])
            return {}
        if memo.checksum != MemoFile.checksum_of(memo.entries):
            log.warning("ignoring the fingerprint memo %s: its checksum does not match (edited by hand?)", self.path)
            return {}
        return {e.stat(): e.sha256 for e in memo.entries}

    def save(self) -> None:
        """Write the memo: the new hashes plus the entries on disk whose file still has their stat."""
        if self.path is None or not self._new:
            return
        keep = dict(self._new)
        for st, sha in self._read().items():  # re-read: another process may have written since
            if len(keep) >= MAX_ENTRIES:
                break
            try:
                if st not in keep and FileStat.of(st.path) == st:
                    keep[st] = sha
            except OSError:
                continue  # gone or changed: drop it
        entries = [MemoEntry(**asdict(st), sha256=sha) for st, sha in sorted(keep.items(), key=lambda x: x[0].path)]
        doc = MemoFile(format=MEMO_FORMAT, entries=entries, checksum=MemoFile.checksum_of(entries))
        folder = os.path.dirname(self.path) or "."
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".weights-fingerprints.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(doc.model_dump_json().encode())
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("could not write the fingerprint memo %s: %s", self.path, e)
            return
        self._known = {**(self._known or {}), **self._new}
        self._new = {}
