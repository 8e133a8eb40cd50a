"""Warm engine starts: the pod's compile caches restored from, and published to, a shared folder.

A shard pod compiles its model on every start (torch.compile and Triton kernels: on an H200 the
8B shape starts in 86 s with empty caches and in 37 s with warm ones, docs/BENCHMARKS.md). With
``VLLM_BATCH_COMPILE_CACHE`` naming a folder that the deployment shares between pods (its
compile-cache PVC, ``[vllm_batch] kubernetes_compile_cache_pvc``), the worker:

1. before vLLM starts (``restore``), copies the *snapshot* published under its key into its
   private cache folders (``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``: the
   pod's emptyDir), checking the snapshot's sealed manifest and every file's size and sha256 as it
   copies. A snapshot that fails a check is not used (a cold start, with a warning naming it);
2. after the engine has started and warmed up, when it found no snapshot (``publish``), copies its
   private folders into a new folder under the key named by a random uuid, writes the sealed
   manifest there, and renames that folder to ``snapshot`` in one step. The rename is create-only
   (POSIX ``rename`` onto a non-empty folder fails): the first publisher wins, a later one discards
   its copy. A snapshot never changes once published; a publisher killed half-way leaves a
   ``.publish-*`` folder that no reader opens and a later publisher removes once it is stale.

Engines never share a live cache folder: vLLM 0.25 rewrites ``vllm_compile_cache.py`` in place
(``open(path, "w")``) and torch names its temporary cache files by process id, which repeats across
pods (each pod has its own pid namespace), so two pods compiling into one folder can tear a file
(docs/adr/0008-shared-compile-cache.md).

The key (``cache_key``) hashes everything the artefacts depend on: the worker image the runner started
(``VLLM_BATCH_IMAGE``; one not pinned by digest uses no shared cache: a tag can move), the vLLM, torch and Triton
builds, Python and the CPU architecture, the accelerator (GPU name and compute capability, or the
CPU model), the job's task, model and engine sections, the engine variables of the environment and
the private folders' paths (artefacts name absolute paths). A different vLLM, GPU type, torch or
model never reads another's artefacts. A machine with NVIDIA devices whose name cannot be read
uses no shared cache at all.

Whoever holds the worker key can publish a snapshot (the worker seals the manifest with
``VLLM_BATCH_WORKER_KEY``; snapshots sealed with the deployment's key before per-role keys are not
used); pods that may run code from the model repo mount the cache read-only and never publish
(``VLLM_BATCH_COMPILE_CACHE_PUBLISH=0``; the worker also checks its own spec's
``spec_guard.code_loading_options``, whatever the environment says). Nothing here fails a shard:
an unusable cache means a cold start. No Airflow, no vLLM import.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import Field

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.engine_identity import engine_env, vllm_distribution
from airflow_provider_vllm.core.errors import SealError
from airflow_provider_vllm.core.records import Record
from airflow_provider_vllm.core.seal import COMPILE_CACHE, Keyring, Seal, record_bytes, seal_record, verify_record
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import code_loading_options
from airflow_provider_vllm.worker.hardware import cpu_name

log = logging.getLogger("airflow_provider_vllm.worker")

LAYOUT = 1  # bump when the snapshot's layout or the key's facts change meaning
SNAPSHOT = "snapshot"
MANIFEST = "MANIFEST.json"
PUBLISHING = ".publish-"
STALE_S = 3600.0  # a publish folder this old was left by a killed publisher
KEY_FOLDER_LISTED = 1000
"""The most entries of a key's folder a publisher lists for stale publish folders (it holds the snapshot and the
publish folders of pods killed mid-publish): past it the sweep stops (a warning names the folder and the bound)
and the publish goes on; another writer of the volume cannot make every publishing pod list millions."""
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_COPY_BLOCK = 1 << 20
# Temporary files of the compilers' own atomic writes, caught half-way by a copy: never published.
_SKIP_DIR_PREFIXES = ("tmp.pid_",)  # Triton's FileCacheManager.put
_SKIP_SUFFIXES = (".tmp", ".lock")  # torch's write_atomic, vLLM's AOT save, file locks


def private_dirs(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The pod's private cache folders by snapshot name; None when one is unset or they overlap."""
    dirs = {
        "vllm": envs.VLLM_CACHE_ROOT.get(env),
        "torchinductor": envs.TORCHINDUCTOR_CACHE_DIR.get(env),
        "triton": envs.TRITON_CACHE_DIR.get(env),
    }
    if any(d is None or not os.path.isabs(d) for d in dirs.values()):
        return None
    real = sorted(os.path.realpath(str(d)) for d in dirs.values())
    if any(b == a or b.startswith(a + os.sep) for a, b in zip(real, real[1:])):
        return None  # one inside another: a file would be published twice
    return {k: str(v) for k, v in dirs.items()}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def accelerator() -> str | None:
    """``gpu:<name> (cc <major.minor>)`` for each kind of visible NVIDIA GPU, else ``cpu:<model>``.

    None when NVIDIA devices are present but cannot be named (no shared cache then: a GPU
    must never be keyed as a CPU). Reads ``nvidia-smi`` (never initialises CUDA in this process:
    vLLM's engine processes must be the first to).
    """
    devices = glob.glob("/dev/nvidia[0-9]*")
    names: set[str] = set()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        for line in out.splitlines():
            name, _, cc = (p.strip() for p in line.rpartition(","))
            if name:
                names.add(f"gpu:{name} (cc {cc})")
    except (OSError, subprocess.SubprocessError):
        pass
    if names:
        return ", ".join(sorted(names))
    if devices:
        return None
    return f"cpu:{cpu_name()}"


def key_facts(spec: JobSpec, dirs: dict[str, str], accel: str, image: str | None = None) -> dict[str, Any]:
    """What the compiled artefacts of ``spec``'s engine depend on (hashed by ``cache_key``); ``image``: the
    worker image the runner started (``VLLM_BATCH_IMAGE``: the CUDA, compiler and library builds that the
    package versions do not name)."""
    return {
        "layout": LAYOUT,
        "image": image,
        "vllm": vllm_distribution(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "python": ".".join(platform.python_version_tuple()[:2]),
        "machine": platform.machine(),
        "accelerator": accel,
        "task": spec.task,
        "model": spec.model.model_dump(mode="json"),
        "engine": spec.engine.model_dump(mode="json"),
        "engine_env": engine_env(),
        "dirs": dirs,
    }


def cache_key(facts: dict[str, Any]) -> str:
    """The snapshot's folder name: 32 hex of the sha256 of the facts' canonical JSON."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


class SnapshotFile(Record):
    """One file of a snapshot: its path under the snapshot (``<folder name>/<path in it>``), size, sha256."""

    path: str = Field(description="relative POSIX path; its first part names a private folder (vllm, triton, ...)")
    size: int = Field(ge=0, description="bytes")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the content")


class SnapshotManifest(Record):
    """``<key>/snapshot/MANIFEST.json``: what a snapshot holds, sealed for its key (domain ``compile-cache``)."""

    version: int = Field(description="LAYOUT of the publisher")
    key: str = Field(pattern=r"^[0-9a-f]{32}$", description="the key the snapshot was published under")
    facts: dict[str, Any] = Field(description="what the key hashes (for people reading the folder)")
    files: list[SnapshotFile] = Field(description="every file of the snapshot")
    bytes: int = Field(description="total bytes of the files")
    published_at: str = Field(description="UTC time of the publication")
    publisher: str = Field(description="shard and attempt that published it")
    seal: Seal | None = Field(None, description="the deployment's seal over the other fields")


def _scope(key: str) -> str:
    return f"compile-cache/{key}"


class SnapshotInvalid(Exception):
    """A published snapshot fails a check (seal, layout, a file's path, size or hash)."""


@dataclass
class CompileCache:
    """The shared compile cache as one worker sees it: restore before the engine starts, publish after."""

    root: Path
    key: str
    facts: dict[str, Any]
    dirs: dict[str, str]
    keyring: Keyring
    may_publish: bool
    state: Literal["warm", "cold"] = "cold"
    seconds: float = 0.0
    restored_files: int = 0
    restored_bytes: int = 0
    published: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        return self.root / self.key

    def stats(self) -> dict[str, Any]:
        """The ``ShardStats`` fields of the compile cache."""
        return {"compile_cache": self.state, "compile_cache_s": round(self.seconds, 3)}

    # ---- reading -------------------------------------------------------------------------
    def restore(self) -> str:
        """Copy the key's snapshot into the private folders; returns the state, ``warm`` or ``cold``."""
        t0 = time.monotonic()
        try:
            snap = self.folder / SNAPSHOT
            if not snap.is_dir():
                log.info("compile cache %s: no snapshot yet, a cold start (this pod publishes one)", self.folder)
                return self.state
            manifest = self._manifest(snap)
            done: list[Path] = []
            try:
                for f in manifest.files:
                    if self._restore_file(snap, f, done):
                        self.restored_files += 1
                        self.restored_bytes += f.size
            except (SnapshotInvalid, OSError) as e:
                for p in done:  # leave no half-restored set behind: the engine compiles from scratch
                    p.unlink(missing_ok=True)
                raise SnapshotInvalid(str(e)) from None
            self.state = "warm"
            log.info(
                "compile cache %s: restored %d files, %.1f MB in %.1f s",
                self.folder,
                self.restored_files,
                self.restored_bytes / 1e6,
                time.monotonic() - t0,
            )
        except (SnapshotInvalid, SealError, OSError, ValueError) as e:
            self.may_publish = False  # the name is taken: a publish could not replace it anyway
            self.notes.append(f"snapshot not used: {e}")
            log.warning(
                "compile cache %s: the snapshot is not used (%s); a cold start. Remove the folder %s to let the "
                "next pod publish a new one",
                self.folder,
                e,
                self.folder / SNAPSHOT,
            )
        finally:
            self.seconds += time.monotonic() - t0
        return self.state

    def _manifest(self, snap: Path) -> SnapshotManifest:
        raw = _read_regular(snap / MANIFEST, snap, MAX_MANIFEST_BYTES)
        manifest = SnapshotManifest.model_validate_json(raw)
        verify_record(self.keyring, COMPILE_CACHE, _scope(self.key), manifest, f"compile cache snapshot {snap}")
        if manifest.key != self.key or manifest.version != LAYOUT:
            raise SnapshotInvalid(f"its manifest is for key {manifest.key} layout {manifest.version}")
        return manifest

    def _restore_file(self, snap: Path, f: SnapshotFile, done: list[Path]) -> bool:
        name, rel = _split(f.path, self.dirs)
        dest = Path(self.dirs[name], *rel.parts)
        if dest.exists() or dest.is_symlink():
            return False  # this pod's own file (a restarted container keeps its emptyDir): keep it
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{uuid.uuid4().hex}.restore")
        src = snap / f.path
        try:
            size, digest = _copy(src, tmp, snap, expect=f.size)
        except Exception:  # refused or unreadable: no temporary stays in the private folder
            tmp.unlink(missing_ok=True)
            raise
        if size != f.size or digest != f.sha256:
            tmp.unlink(missing_ok=True)
            raise SnapshotInvalid(f"{f.path} does not match its manifest entry (size {size}, sha256 {digest[:12]})")
        os.replace(tmp, dest)
        done.append(dest)
        return True

    # ---- writing -------------------------------------------------------------------------
    def publish(self, publisher: str) -> bool:
        """After a cold start: publish the private folders as the key's snapshot; True when this pod's won."""
        if self.state == "warm" or not self.may_publish:
            return False
        t0 = time.monotonic()
        tmp: Path | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not _own_folder(self.folder, self.root):  # before anything is written or removed through it
                raise OSError(f"{self.folder} is not a folder of {self.root} (a symbolic link put there?)")
            self._remove_stale()
            if (self.folder / SNAPSHOT).exists():
                log.info("compile cache %s: another pod published first", self.folder)
                return False
            tmp = self.folder / f"{PUBLISHING}{uuid.uuid4().hex}"
            tmp.mkdir()
            files = []
            for name, src_root in sorted(self.dirs.items()):
                for src, rel in _walk(Path(src_root)):
                    dest = tmp / name / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    if not _inside(dest, tmp):  # a folder of the copy swapped for a link while it is written
                        raise OSError(f"{dest} lies outside {tmp}")
                    size, digest = _copy(src, dest, Path(src_root))
                    files.append(SnapshotFile(path=f"{name}/{rel.as_posix()}", size=size, sha256=digest))
            manifest = SnapshotManifest(
                version=LAYOUT,
                key=self.key,
                facts=self.facts,
                files=files,
                bytes=sum(f.size for f in files),
                published_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                publisher=publisher,
            )
            (tmp / MANIFEST).write_bytes(
                record_bytes(seal_record(self.keyring, COMPILE_CACHE, _scope(self.key), manifest))
            )
            try:
                os.rename(tmp, self.folder / SNAPSHOT)  # atomic and create-only: the first publisher wins
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                log.info("compile cache %s: another pod published first", self.folder)
                return False
            tmp = None
            self.published = True
            log.info(
                "compile cache %s: published %d files, %.1f MB in %.1f s",
                self.folder,
                len(files),
                manifest.bytes / 1e6,
                time.monotonic() - t0,
            )
            return True
        except (OSError, ValueError) as e:
            self.notes.append(f"publish failed: {e}")
            log.warning("compile cache %s: publishing failed (%s); later pods start cold too", self.folder, e)
            return False
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            self.seconds += time.monotonic() - t0

    def _remove_stale(self) -> None:
        now = time.time()
        stale: list[Path] = []
        with os.scandir(self.folder) as it:
            for n, e in enumerate(it):
                if n >= KEY_FOLDER_LISTED:
                    log.warning(
                        "compile cache %s: holds more than %d entries, the most listed for stale publish folders "
                        "(another writer of the volume put them there?): not listed further",
                        self.folder,
                        KEY_FOLDER_LISTED,
                    )
                    break
                if e.name.startswith(PUBLISHING):
                    stale.append(Path(e.path))
        for p in stale:
            try:
                if now - p.lstat().st_mtime > STALE_S:
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                continue


def _split(path: str, dirs: dict[str, str]) -> tuple[str, PurePosixPath]:
    """A manifest path as (private folder name, relative path); SnapshotInvalid for anything else."""
    p = PurePosixPath(path)
    parts = p.parts
    if p.is_absolute() or len(parts) < 2 or parts[0] not in dirs or any(x in ("", ".", "..") for x in parts):
        raise SnapshotInvalid(f"manifest path {path!r} is not a file inside one of {sorted(dirs)}")
    if "\\" in path or "\x00" in path or p.as_posix() != path:
        raise SnapshotInvalid(f"manifest path {path!r} is not a plain POSIX path")
    return parts[0], PurePosixPath(*parts[1:])


def _own_folder(folder: Path, root: Path) -> bool:
    """Whether ``folder`` is a real folder directly in ``root``, not a symbolic link to another place (the
    volume's other writers could plant one, and the publisher would write and delete through it)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    real = os.path.realpath(folder)
    return stat.S_ISDIR(st.st_mode) and real == os.path.join(os.path.realpath(root), folder.name)


def _inside(path: Path, root: Path) -> bool:
    real, base = os.path.realpath(path.parent), os.path.realpath(root)
    return real == base or real.startswith(base + os.sep)


def _open_regular(path: Path, root: Path) -> int:
    """A read-only descriptor of a regular file under ``root`` (no symbolic link on the way, no FIFO)."""
    if not _inside(path, root):
        raise SnapshotInvalid(f"{path} lies outside {root} (a symbolic link on its way)")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SnapshotInvalid(f"{path} is not a regular file")
    return fd


def _read_regular(path: Path, root: Path, limit: int) -> bytes:
    fd = _open_regular(path, root)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise SnapshotInvalid(f"{path} is larger than {limit} bytes")
    return data


def _copy(src: Path, dest: Path, root: Path, expect: int | None = None) -> tuple[int, str]:
    """Copy a regular file, returning its size and sha256 as read (one pass).

    ``expect``: the size a sealed manifest names. A file of another size is refused before a byte is read,
    and the copy stops one byte past it (a file grown or swapped for a huge or sparse one by the volume's
    other writers never fills the pod's emptyDir, which would get the pod evicted instead of a cold start).
    """
    h = hashlib.sha256()
    size = 0
    fd = _open_regular(src, root)
    if expect is not None and (found := os.fstat(fd).st_size) != expect:
        os.close(fd)
        raise SnapshotInvalid(f"{src} does not match its manifest entry (size {found}, not {expect})")
    limit = None if expect is None else expect + 1
    with os.fdopen(fd, "rb") as fin, open(dest, "xb") as fout:
        while block := fin.read(_COPY_BLOCK if limit is None else min(_COPY_BLOCK, limit - size)):
            h.update(block)
            fout.write(block)
            size += len(block)
    return size, h.hexdigest()


def _walk(root: Path):
    """(path, path relative to root) of the regular files under root; links and compiler temporaries skipped."""
    if not root.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(_SKIP_DIR_PREFIXES))
        for name in sorted(filenames):
            p = Path(dirpath, name)
            if name.endswith(_SKIP_SUFFIXES) or name.startswith(".") or not stat.S_ISREG(p.lstat().st_mode):
                continue
            yield p, p.relative_to(root)


def from_env(spec: JobSpec, keyring: Keyring, env: dict[str, str] | None = None) -> CompileCache | None:
    """The shared compile cache of this worker (``VLLM_BATCH_COMPILE_CACHE``), or None when there is none
    or it cannot be keyed safely (logged)."""
    root = envs.COMPILE_CACHE.get(env)
    if not root:
        return None
    dirs = private_dirs(env)
    if dirs is None:
        log.warning(
            "%s is set but VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR are not three separate "
            "absolute folders: the shared compile cache is not used",
            envs.COMPILE_CACHE.name,
        )
        return None
    if not os.path.isdir(root):
        log.warning("%s=%s is not a folder: the shared compile cache is not used", envs.COMPILE_CACHE.name, root)
        return None
    image = envs.WORKER_IMAGE.get(env)
    if image is not None and "@sha256:" not in image:
        log.warning(
            "%s=%s is not pinned by digest: a tag can be moved to another build, whose pods would read this one's "
            "compiled artefacts; the shared compile cache is not used (pin the image: repo/name:tag@sha256:...)",
            envs.WORKER_IMAGE.name,
            image,
        )
        return None
    accel = accelerator()
    if accel is None:
        log.warning("NVIDIA devices are present but nvidia-smi cannot name them: the shared compile cache is not used")
        return None
    facts = key_facts(spec, dirs, accel, image)
    loading = code_loading_options(spec)
    if loading:  # the runner also mounts the cache read-only and says so; this holds whatever the environment says
        log.info("compile cache: %s may run model-repo code, so this worker never publishes", ", ".join(loading))
    publish = envs.COMPILE_CACHE_PUBLISH.get(env) != "0" and os.access(root, os.W_OK) and not loading
    return CompileCache(Path(root), cache_key(facts), facts, dirs, keyring, may_publish=publish)
