"""One storage layer over local paths and fsspec URLs (s3://, gs://, file://, memory://).

Two write primitives carry the commit protocol:

* ``write_atomic``: readers see the old object or the whole new one, never a part
  (local: temp file + rename; object stores: a single PUT is already atomic);
* ``create_only``: write if absent, atomically; returns False when something is there
  (local: temp file + hard link, which fails on an existing name; S3: ``If-None-Match: *``;
  GCS: ``ifGenerationMatch=0``).

Which file system serves a URI: plain fsspec (``url_to_fs(uri, **options)``: the process's own
credentials), or, when a ``FileSystems`` factory is given, whatever it returns for that URI
(the Airflow side passes one built from the deployment's Airflow Connections, see
``airflow_provider_vllm.hooks.filesystems``). The factory is an argument, never global state, and
never travels: a Storage made from it holds a reference to the factory only.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import io
import logging
import os
import posixpath
import re
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.storage_retry import retrying

log = logging.getLogger(__name__)

GLOB_CHARS = "*?["
"""The characters that start a glob in DuckDB's ``read_parquet([...])`` paths and fsspec's ``expand_path``
(``has_magic``): a path that holds one may name other files than itself. ``]`` alone and ``{}`` are read as
themselves (duckdb 2.0.1, tests/unit/core/test_duck.py)."""


def has_glob(path: str) -> bool:
    """Whether ``path`` holds a character of ``GLOB_CHARS``."""
    return any(c in GLOB_CHARS for c in path)


RECORD_MAX_BYTES = 256 << 20
"""The most ``Storage.read_bytes`` reads (its default). The largest files read whole are the plan, the parts
manifests and the merge summary: a few hundred bytes per input file, shard or part (a 10M-row benchmark run:
a 48 KB plan of 100 shards, a 38 KB results manifest of 200 parts), so about a million of them fit. A larger
file is refused, not read: a run folder's other writers cannot exhaust a task's memory with a planted one."""


LISTING_MAX = 100_000
"""The most entries one listing (``listdir``, ``listdir_sizes``, ``walk_files``) takes unless its caller names
another bound: every listing is counted while it is made, page by page on object stores, and one that finds more
stops there with ``ListingTooLarge`` naming the folder and the bound. Whoever else can write a run's, a cache's or a
history's folder could plant millions of objects there; a listing must not take the task minutes and GiBs. Each
caller bounds its folder by what the pipeline writes there (docs/security.md, "Listings")."""

LIST_PAGE = 1000
"""Keys asked for per page of an S3 or GCS listing (both stores' most): each page is counted against the bound
before the next one is asked for."""


FileSystems = Callable[[str, dict[str, Any]], "fsspec.AbstractFileSystem | None"]
"""``(uri, options) -> file system`` for that URI, or None for plain fsspec (``url_to_fs``).

The Airflow side's factory builds object-store file systems from Airflow Connections
(``connections.ConnectionFileSystems``); it owns caching and decides which ``options`` apply.
"""


def parquet_bytes(table: pa.Table, metadata: dict[str, str] | None = None) -> bytes:
    """``table`` as the bytes of a ZSTD Parquet file, ``metadata`` added to its schema's."""
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def gcs_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """gcsfs options with its HTTP session set to hand over the bytes GCS serves as they are. aiohttp's default
    asks for gzip and decompresses: for an object stored with ``Content-Encoding: gzip`` the checked readers would
    hash the decompressed bytes, while readers that let GCS decompress get other ones (a gzip stream can carry more
    than the prefix that was checked)."""
    opts = dict(options or {})
    opts["session_kwargs"] = {**(opts.get("session_kwargs") or {}), "auto_decompress": False}
    return opts


def _open_size(f: Any) -> int | None:
    """The size of an open fsspec file as its store states it (remote: from the HEAD at open; local: fstat)."""
    size = getattr(f, "size", None)
    if isinstance(size, int):
        return size
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _block(size: int | None, n: int) -> int:
    """How much the checked readers ask for next, having read ``n`` bytes of a file whose record names ``size``:
    1 MiB, and never past ``size`` + 1 (the byte that shows the file is larger)."""
    return 1 << 20 if size is None else min(1 << 20, size + 1 - n)


def _listing_error(uri: str, limit: int) -> Exception:
    from airflow_provider_vllm.core.errors import ListingTooLarge

    return ListingTooLarge(
        f"{uri} holds more than {limit} entries, the most listed there: the pipeline never writes that many, so "
        "it is not listed further (another writer of the folder put them there?)",
        uri=uri,
        limit=limit,
    )


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    return set(fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


@dataclass(frozen=True)
class Storage:
    """A folder (prefix) on some filesystem; paths given to methods are relative to it.

    ``filesystems``: optional factory of the file system for ``root`` (see ``FileSystems``);
    ``sub()`` keeps it. Without it, ``fsspec.core.url_to_fs(root, **options)``.

    ``follow_links``: on local disk, whether symbolic links *below* ``root`` are followed. Off (the default, for
    every folder the pipeline writes: output, cache, history), the checked readers and the listings open each
    path component below ``root`` with ``O_NOFOLLOW`` relative to its parent's descriptor, so a link anywhere in
    the path (``shards -> elsewhere``, ``_SUCCESS.json -> /etc/passwd``) is refused naming it, with no window
    between a check and the open. ``root`` itself may be a link (a prefix on a linked volume). On: the user's
    input dataset and adapter folders, whose links are the user's (they are resolved against the allow-list).
    """

    root: str
    options: dict[str, Any] = field(default_factory=dict)
    filesystems: FileSystems | None = field(default=None, compare=False, repr=False)
    follow_links: bool = False

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return _fs_and_path(self.root, self.options, self.filesystems)[0]

    @property
    def base(self) -> str:
        """The root as the filesystem sees it (no protocol)."""
        return _fs_and_path(self.root, self.options, self.filesystems)[1].rstrip("/")

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, rel: str = "") -> str:
        return posixpath.join(self.base, rel) if rel else self.base

    def uri(self, rel: str = "") -> str:
        """Full URI of a relative path (with protocol for remote filesystems)."""
        root = self.root.rstrip("/")
        return f"{root}/{rel}" if rel else root

    def sub(self, rel: str) -> Storage:
        return Storage(self.uri(rel), self.options, self.filesystems, self.follow_links)

    def at(self, root: str) -> Storage:
        """Another folder with the same options and file system factory."""
        return Storage(root, self.options, self.filesystems, self.follow_links)

    def input_at(self, root: str) -> Storage:
        """The user's input folder ``root`` with the same options and file system factory, its links followed
        (``follow_links``): a dataset given as a folder of links is the user's choice, checked by the allow-list."""
        return Storage(root, self.options, self.filesystems, follow_links=True)

    # ---- reads ----------------------------------------------------------------------
    # Reads of remote objects retry transient errors too; local ones fail at once.
    def _call(self, fn, what: str):
        return fn() if self.is_local else retrying(fn, what)

    def exists(self, rel: str) -> bool:
        return self._call(lambda: self.fs.exists(self.path(rel)), f"exists {self.uri(rel)}")

    def read_bytes(self, rel: str, limit: int = RECORD_MAX_BYTES) -> bytes:
        """The whole file ``rel``, read only while it stays within ``limit`` bytes: CommitError naming it and
        the limit when it is larger, after reading at most ``limit`` + 1 bytes; a local path that is no regular
        file is refused unopened (``_open_read``). Whoever else can write a run's folder could plant a file of many
        GB where a record is read; it must not take the task's memory."""
        from airflow_provider_vllm.core.errors import CommitError

        def read() -> bytes | None:  # None: larger than limit
            with self._open_read(rel) as f:
                if (_open_size(f) or 0) > limit:
                    return None  # as stated by the store: not read at all
                blocks: list[bytes] = []
                n = 0
                while n <= limit:  # the size may lie (a file that grows): never more than limit + 1
                    block = f.read(min(1 << 20, limit + 1 - n))
                    if not block:
                        return b"".join(blocks)
                    blocks.append(block)
                    n += len(block)
            return None

        data = self._call(read, f"read {self.uri(rel)}")
        if data is None:
            raise CommitError(
                f"{self.uri(rel)} is larger than {limit} bytes, the most read for it: no file this provider "
                "writes there is that large, so it is refused unread (another writer of the bucket put it there?)"
            )
        return data

    def read_text(self, rel: str, limit: int = RECORD_MAX_BYTES) -> str:
        return self.read_bytes(rel, limit).decode("utf-8")

    def _open_read(self, rel: str) -> Any:
        """``rel`` opened for reading as it is now, by the checked readers (``read_bytes``, ``sha256``,
        ``fetch_verified``). Local: only a regular file (a FIFO another writer of the folder put where a record is
        read would block the open forever, a device such as /dev/zero never ends; so would a link to one): opened
        without blocking, CommitError naming it otherwise. Remote: the file system's cached listing of its folder is
        dropped first, so that the size and ETag the open asks for are the object's now (a listing made before
        another process wrote or replaced it names no object, or the old one's, which s3fs's ``IfMatch`` then
        refuses on every retry)."""
        from airflow_provider_vllm.core.errors import CommitError

        p = self.path(rel)
        if not self.is_local:
            with contextlib.suppress(KeyError):  # another thread dropped the same listing first
                self.fs.invalidate_cache(p)
            f = self.fs.open(p, "rb")
            details = getattr(f, "details", None)
            encoding = details.get("contentEncoding") if isinstance(details, dict) else None  # GCS's object metadata
            if encoding and str(encoding).strip().lower() != "identity":
                f.close()
                raise CommitError(
                    f"{self.uri(rel)} is stored with Content-Encoding {str(encoding)[:40]!r}: no file this provider "
                    "writes is, and readers that let the store decode it would get other bytes than the ones "
                    "checked, so it is refused unread (another writer of the bucket put it there?)"
                )
            return f
        fd = self._open_local(rel, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CommitError(
                    f"{self.uri(rel)} is not a regular file (a FIFO, a device or a socket, or a link to one): no "
                    "file this provider writes is, so it is refused unread (another writer of the folder put it there?)"
                )
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def _open_local(self, rel: str, flags: int, directory: bool = False) -> int:
        """A descriptor of the local path ``rel`` (``flags``; ``directory``: a folder to list). Unless
        ``follow_links``, each component below ``root`` is opened with ``O_NOFOLLOW`` relative to its parent's
        descriptor (``_folder_fd``, as the writes walk it): a symbolic link anywhere below ``root`` is refused
        (``LinkRefused``, naming the path), and one swapped in after a check has no window to be followed.
        ``root`` itself is followed."""
        if self.follow_links:
            return os.open(self.path(rel), flags | (os.O_DIRECTORY if directory else 0))
        done = "refused unopened"
        parts = self._parts(rel)
        dfd = self._folder_fd(parts, max(len(parts) - 1, 0), rel, create=False, done=done)
        if not parts:
            return dfd if directory else _close_and(dfd, IsADirectoryError(self.uri()))
        try:
            want = (os.O_RDONLY | os.O_DIRECTORY) if directory else flags
            try:
                return os.open(parts[-1], want | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP or (
                    e.errno == errno.ENOTDIR and stat.S_ISLNK(os.lstat(parts[-1], dir_fd=dfd).st_mode)
                ):
                    raise self._link_refused(parts, len(parts) - 1, rel, done) from None
                raise
        finally:
            os.close(dfd)

    def _scan(self, rel: str, limit: int, recursive: bool) -> list[tuple[str, int | None]]:
        """``(path under rel, size or None)`` of each entry under ``rel`` (``recursive``: files only, at any depth;
        else names directly under it, folders with None), counted while listed: ``ListingTooLarge`` at entry
        ``limit`` + 1 (local: entries read from the folder, folders walked included; S3 and GCS: keys and
        common prefixes of each page); empty when ``rel`` does not exist."""
        fs = self.fs
        if isinstance(fs, LocalFileSystem):
            return self._scan_local(rel, limit, recursive)
        protocols = _protocols(fs)
        if {"s3", "s3a"} & protocols:
            return self._call(
                lambda: _scan_s3(fs, self.path(rel), limit, recursive, self.uri(rel)), f"list {self.uri(rel)}"
            )
        if {"gs", "gcs"} & protocols:
            return self._call(
                lambda: _scan_gcs(fs, self.path(rel), limit, recursive, self.uri(rel)), f"list {self.uri(rel)}"
            )
        return self._scan_other(rel, limit, recursive)  # memory:// (tests): listed whole, then counted

    def _scan_local(self, rel: str, limit: int, recursive: bool) -> list[tuple[str, int | None]]:
        try:
            top = self._open_local(rel, os.O_RDONLY, directory=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out: list[tuple[str, int | None]] = []
        seen = 0
        stack: list[tuple[int, str]] = [(top, "")]
        try:
            while stack:
                dfd, at = stack.pop()
                try:
                    with os.scandir(dfd) as it:
                        for e in it:
                            seen += 1
                            if seen > limit:
                                raise _listing_error(self.uri(rel), limit)
                            name = f"{at}{e.name}"
                            try:
                                is_dir = e.is_dir(follow_symlinks=False)
                                linked_dir = self.follow_links and e.is_symlink() and e.is_dir(follow_symlinks=True)
                            except OSError:
                                is_dir = linked_dir = False
                            if recursive and linked_dir:
                                continue  # as fsspec's find: a linked folder below the root is not walked
                            if recursive and is_dir:
                                try:
                                    flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0)
                                    stack.append((os.open(e.name, flags, dir_fd=dfd), f"{name}/"))
                                except OSError:
                                    out.append((name, None))
                                continue
                            size: int | None = None
                            with contextlib.suppress(OSError):
                                st = e.stat(follow_symlinks=False)
                                size = st.st_size if stat.S_ISREG(st.st_mode) else None
                            out.append((name, size))
                finally:
                    os.close(dfd)
        finally:
            for dfd, _ in stack:
                os.close(dfd)
        return out

    def _scan_other(self, rel: str, limit: int, recursive: bool) -> list[tuple[str, int | None]]:
        p = self.path(rel)
        try:
            if recursive:
                found = self._call(lambda: self.fs.find(p, detail=True), f"list {self.uri(rel)}")
                entries = list(found.values())
            else:
                entries = self._call(lambda: self.fs.ls(p, detail=True), f"list {self.uri(rel)}")
        except FileNotFoundError:
            return []
        if len(entries) > limit:
            raise _listing_error(self.uri(rel), limit)
        out: list[tuple[str, int | None]] = []
        for e in entries:
            full = str(e.get("name", "")).rstrip("/")
            name = posixpath.relpath(full, p.rstrip("/")) if recursive else posixpath.basename(full)
            size = e.get("size")
            if name and name != ".":
                out.append((name, int(size) if e.get("type") == "file" and isinstance(size, int) else None))
        return out

    def listdir(self, rel: str = "", limit: int = LISTING_MAX) -> list[str]:
        """Names (not paths) directly under rel; empty when rel does not exist; ``ListingTooLarge`` (naming rel and
        ``limit``) when it holds more than ``limit`` entries, found while listing."""
        return sorted(n for n, _ in self._scan(rel, limit, recursive=False))

    def listdir_sizes(self, rel: str = "", limit: int = LISTING_MAX) -> dict[str, int | None]:
        """Names (not paths) directly under rel, each with the size its listing states (None: not a plain file, i.e.
        a folder, a link, a FIFO or a device, or no size stated); empty when rel does not exist. One listing: no
        request per file; bounded as ``listdir``."""
        return dict(sorted(self._scan(rel, limit, recursive=False)))

    def open(self, rel: str, mode: str = "rb"):
        """``rel`` opened through the file system; a local read of a folder the pipeline writes (no
        ``follow_links``) is ``_open_read``'s: a link below the root, a FIFO or a device is refused unopened."""
        if mode == "rb" and not self.follow_links and self.is_local:
            return self._open_read(rel)
        return self.fs.open(self.path(rel), mode)

    def info(self, rel: str) -> dict[str, Any]:
        return self._call(lambda: self.fs.info(self.path(rel)), f"stat {self.uri(rel)}")

    def size(self, rel: str) -> int:
        return int(self._call(lambda: self.fs.size(self.path(rel)), f"size {self.uri(rel)}"))

    def sha256(self, rel: str, size: int | None = None) -> str:
        """The sha256 of ``rel`` as it is now. With ``size`` (the size its record names), a file of another size is
        not read past ``size`` + 1 bytes, nor at all when the store states another size: it gets a value that is
        no sha256 (a planted file of a TB is not hashed for hours)."""

        def digest() -> str:
            h, n = hashlib.sha256(), 0
            with self._open_read(rel) as f:
                stated = _open_size(f)
                if size is not None and stated is not None and stated != size:
                    return f"size {stated}, not {size}"
                while block := f.read(_block(size, n)):
                    h.update(block)
                    n += len(block)
                    if size is not None and n > size:
                        break
            if size is not None and n != size:  # grew or shrank while read: no sha256 of a file of that size
                return f"{'at least ' if n > size else ''}{n} bytes, not {size}"
            return h.hexdigest()

        return self._call(digest, f"checksum {self.uri(rel)}")

    def lstat(self, rel: str) -> os.stat_result | None:
        """Local: the entry ``rel`` as it is (a link not followed), None when it is absent; a link in the path below
        the root is refused (``LinkRefused``), as every local read refuses it. Object stores: not available."""
        if not self.is_local:
            raise NotImplementedError(f"no lstat on {self.uri(rel)}: object stores hold objects only")
        if self.follow_links:
            try:
                return os.lstat(self.path(rel))
            except FileNotFoundError:
                return None
        try:
            with self._local_parent(rel, create=False, done="not read") as (dfd, name):
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def holds(self, rel: str, size: int, sha256: str, same_as: str | None = None) -> bool:
        """Whether ``rel`` is a file this provider could have written with exactly ``size`` bytes and this
        ``sha256``. Local: a regular file only; a link, folder, FIFO, socket or device there (another writer's) is
        not, and is neither followed nor opened (``lstat`` first). ``same_as``: a local file below the root whose
        very inode ``rel`` may be (a hard link of it: kept unread). Object stores: an object of these bytes."""
        if not self.is_local:
            return self.exists(rel) and self.sha256(rel, size) == sha256
        st = self.lstat(rel)
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        if same_as is not None:
            src = self.lstat(same_as)
            if src is not None and stat.S_ISREG(src.st_mode) and (src.st_dev, src.st_ino) == (st.st_dev, st.st_ino):
                return True
        return self.sha256(rel, size) == sha256

    def _fetch(self, rel: str, size: int | None, dest: str) -> tuple[int, str]:
        """Copy ``rel`` to the local file ``dest`` while hashing it: ``(bytes read, sha256 of them)``. With ``size``,
        no more than ``size`` + 1 bytes are read, and none when the store states another size (``(stated, "")``)."""

        def fetch() -> tuple[int, str]:
            h, n = hashlib.sha256(), 0
            with self._open_read(rel) as src, open(dest, "wb") as out:
                stated = _open_size(src)
                if size is not None and stated is not None and stated != size:  # refused unread
                    return stated, ""
                while block := src.read(_block(size, n)):
                    h.update(block)
                    n += len(block)
                    if size is not None and n > size:
                        break
                    out.write(block)
            return n, h.hexdigest()

        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        return self._call(fetch, f"read {self.uri(rel)}")

    def fetch_verified(self, rel: str, size: int | None, sha256: str, dest: str) -> None:
        """Copy ``rel`` to the local file ``dest`` while hashing it; CommitError (and no ``dest``) unless it
        has exactly this ``size`` (None: any) and ``sha256``. Readers then read ``dest``: the bytes that were
        checked (``CheckedCopies``)."""
        from airflow_provider_vllm.core.errors import CommitError

        got, digest = self._fetch(rel, size, dest)
        if (size is not None and got != size) or digest != sha256:
            os.unlink(dest)
            raise CommitError(
                f"{self.uri(rel)} is not the file its sealed record names (size {got} vs {size}, or sha256 "
                "differs): it was changed after it was written; refusing to read it"
            )

    def fetch_pinned(self, rel: str, size: int, dest: str) -> str:
        """Copy ``rel`` to the local file ``dest`` while hashing it, and return the sha256 of the bytes copied: the
        pin of exactly what ``dest`` holds (one read; nothing is read again between the hash and what is checked or
        used). A file of another size than ``size`` (the size listed: it changed since, or while it was read) gets a
        value that is no sha256 and no ``dest``, as ``sha256``; no more than ``size`` + 1 bytes are read."""
        got, digest = self._fetch(rel, size, dest)
        if got != size:
            os.unlink(dest)
            return f"{'at least ' if got > size else ''}{got} bytes, not {size}"
        return digest

    # ---- writes ---------------------------------------------------------------------
    # Local writes below the root (unless ``follow_links``) go through descriptors: each folder below the root is
    # opened with O_NOFOLLOW relative to its parent's (made with mkdirat when missing), and the file is written,
    # renamed, linked or removed relative to its folder's descriptor (openat, renameat, linkat, unlinkat). A link
    # anywhere below the root is refused naming it; one swapped in after a check has no window to be followed.
    def makedirs(self, rel: str = "") -> None:
        if self.is_local:
            parts = self._parts(rel)
            os.close(self._folder_fd(parts, len(parts), rel, create=True, done="not written"))

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write all of data or nothing visible at rel (local: a temp file beside it, fsynced, then a rename).
        Local: ``LinkRefused`` (nothing written) when a component of ``rel`` below the root is a symbolic link."""
        p = self.path(rel)
        if not self.is_local:
            retrying(lambda: self.fs.pipe_file(p, data), f"write {self.uri(rel)}")
            return
        with self._local_parent(rel) as (dfd, name):
            tmp = _temp_at(dfd, f"{name}.tmp-{uuid.uuid4().hex}", lambda f: faults.write(f, data))
            self._replace_at(dfd, tmp, name, rel)

    def create_only(self, rel: str, data: bytes) -> bool:
        """Atomically create rel with data; False (and nothing written) when rel exists. Local: ``LinkRefused``
        (nothing written) when a component of ``rel`` below the root, the last one included, is a symbolic link."""
        p = self.path(rel)
        if not self.is_local:
            return _create_only_remote(self.fs, p, data)
        with self._local_parent(rel) as (dfd, name):
            tmp = _temp_at(dfd, f"{name}.tmp-{uuid.uuid4().hex}", lambda f: faults.write(f, data))
            try:
                # linkat fails on an existing name, a link included (never followed): the create-only primitive
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                return True
            except FileExistsError:
                self._refuse_link_at(dfd, name, rel, "not written")
                return False
            finally:
                os.unlink(tmp, dir_fd=dfd)

    def write_parquet_atomic(
        self, rel: str, table: pa.Table, metadata: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """Write a Parquet file so that readers never see a partial one; returns its size and sha256."""
        data = parquet_bytes(table, metadata)
        self.write_atomic(rel, data)
        return len(data), hashlib.sha256(data).hexdigest()

    def upload(self, local: str, rel: str) -> None:
        """Copy a finished local file to rel (remote: one PUT or multipart upload, visible whole or not at all)."""
        retrying(lambda: self.fs.put_file(local, self.path(rel)), f"upload {self.uri(rel)}")

    def publish(
        self, local: str, rel: str, temp: str | None = None, fault: str | None = None, displace: bool = False
    ) -> None:
        """A finished local file at ``rel``, seen whole or not at all (local: a copy beside it, named ``temp``,
        default ``<name>.tmp-<uuid>``, then a rename; remote: one upload). ``fault``: the drill point hit half way
        through the copy (``faults.partial_copy``). Local: ``LinkRefused`` (nothing written) as ``write_atomic``;
        ``displace``: a link, FIFO or folder at ``rel`` itself is replaced instead (``_replace_at``)."""
        if not self.is_local:
            self.upload(local, rel)
            return
        with self._local_parent(rel) as (dfd, name):

            def fill(f: Any) -> None:
                with open(local, "rb") as src:
                    faults.partial_copy_into(src, f, fault)
                    shutil.copyfileobj(src, f, 1 << 20)

            tmp = _temp_at(dfd, temp or f"{name}.tmp-{uuid.uuid4().hex}", fill, sync=False)
            self._replace_at(dfd, tmp, name, rel, displace)

    def link_or_copy(
        self,
        src: str,
        rel: str,
        temp: str | None = None,
        fault: str | None = None,
        link: bool = True,
        displace: bool = False,
    ) -> None:
        """The file ``src`` (a regular file below the root) visible whole at ``rel``: local, a hard link (a copy on
        a file system without them) made beside it as ``temp``, then a rename; remote, a server-side copy. Local:
        ``LinkRefused`` when a component of either path below the root is a symbolic link; the file linked is the
        one checked (a link made to another one swapped in is removed again, and the file copied through
        ``_open_read`` instead). ``link`` False: always a copy. ``displace``: a link, FIFO or folder at ``rel`` itself
        is replaced, as ``publish``'s."""
        if not self.is_local:
            self.copy(src, rel)
            return
        with (
            self._local_parent(src, create=False, done="not read") as (sdfd, sname),
            self._local_parent(rel) as (dfd, name),
        ):
            self._refuse_link_at(sdfd, sname, src, "not read")
            want = os.stat(sname, dir_fd=sdfd, follow_symlinks=False)
            tmp = temp or f"{name}.tmp-{uuid.uuid4().hex}"
            if fault is not None and faults.active():  # drills: what a copy killed half-way leaves
                with self._open_read(src) as s:
                    _temp_at(dfd, tmp, lambda f: faults.partial_copy_into(s, f, fault), sync=False)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            try:
                linked = link and stat.S_ISREG(want.st_mode)
                try:
                    if linked:  # linkat without AT_SYMLINK_FOLLOW: a link swapped in is linked itself, never followed
                        os.link(sname, tmp, src_dir_fd=sdfd, dst_dir_fd=dfd, follow_symlinks=False)
                        made = os.stat(tmp, dir_fd=dfd, follow_symlinks=False)
                        if (made.st_dev, made.st_ino) != (want.st_dev, want.st_ino):  # swapped since the check
                            os.unlink(tmp, dir_fd=dfd)
                            linked = False
                except OSError as e:  # another filesystem, or one without hard links
                    if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                        raise
                    linked = False
                if not linked:  # a copy, read through O_NOFOLLOW (a link, a FIFO or a device is refused)
                    with self._open_read(src) as s:
                        _temp_at(dfd, tmp, lambda f: shutil.copyfileobj(s, f, 1 << 20), sync=False)
                self._replace_at(dfd, tmp, name, rel, displace)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)

    def copy(self, src: str, rel: str) -> None:
        """Copy ``src`` to ``rel`` on the same filesystem without reading it here (object stores: a
        server-side copy, visible whole or not at all); transient errors retried. Local: ``link_or_copy``."""
        if self.is_local and not self.follow_links:
            self.link_or_copy(src, rel, link=False)
            return
        self._call(lambda: self.fs.copy(self.path(src), self.path(rel)), f"copy {self.uri(src)} -> {self.uri(rel)}")

    def remove(self, rel: str, recursive: bool = False, limit: int = LISTING_MAX) -> None:
        """Remove the file ``rel`` (``recursive``: or the folder, with all it holds); nothing when it is absent.
        A folder is removed only while it holds at most ``limit`` entries at any depth: ``ListingTooLarge`` past
        them, counted while removing locally (what was removed stays removed), listed first on object stores.
        Local: a symbolic link below the root, ``rel`` itself included, is refused (``LinkRefused``, naming it):
        nothing it points to is removed, and a folder's walk never leaves it."""
        if self.is_local and not self.follow_links:
            self._remove_local(rel, recursive, limit)
            return
        p = self.path(rel)
        if recursive and not self.is_local:
            found = self._scan(rel, limit, recursive=True)  # bounded: ListingTooLarge past limit
            if found and {"s3", "s3a", "gs", "gcs"} & _protocols(self.fs):  # exactly the keys listed
                self._call(lambda: self.fs.rm([posixpath.join(p, n) for n, _ in found]), f"remove {self.uri(rel)}")
                return
        try:
            self.fs.rm(p, recursive=recursive)
        except FileNotFoundError:
            pass

    def discard(self, rel: str) -> None:
        """Remove ``rel`` whatever another writer made it: a file, a symbolic link (itself, never what it points to), a
        FIFO or a folder with all it holds (bounded, links inside removed unfollowed); nothing when absent. Local: a
        warning naming it, not an error, when it cannot all be removed (``_discard_at``). Object stores: ``remove``
        with ``recursive``."""
        if not self.is_local or self.follow_links:
            self.remove(rel, recursive=True)
            return
        with self._local_parent(rel, create=False, done="not removed") as (dfd, name):
            self._discard_at(dfd, name, rel)

    def rmdir(self, rel: str) -> None:
        """Remove the folder ``rel`` when it is empty (local; object stores have no folders). ``OSError`` when it
        is not empty; ``LinkRefused`` for a link below the root."""
        if self.is_local:
            with self._local_parent(rel, create=False, done="not removed") as (dfd, name):
                self._refuse_link_at(dfd, name, rel, "not removed")
                os.rmdir(name, dir_fd=dfd)

    def _remove_local(self, rel: str, recursive: bool, limit: int) -> None:
        try:
            with self._local_parent(rel, create=False, done="not removed") as (dfd, name):
                self._refuse_link_at(dfd, name, rel, "not removed")
                try:
                    os.unlink(name, dir_fd=dfd)
                    return
                except IsADirectoryError:
                    pass
                except PermissionError:  # macOS: unlink of a folder
                    if not stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                        raise
                if not recursive:
                    raise IsADirectoryError(errno.EISDIR, "a folder, and recursive is not set", self.uri(rel))
                _remove_tree(dfd, name, [limit], self.uri(rel), limit, 0)
        except FileNotFoundError:
            pass

    def _parts(self, rel: str) -> list[str]:
        from airflow_provider_vllm.core.errors import LinkRefused

        parts = [c for c in rel.split("/") if c not in ("", ".")]
        if ".." in parts:
            raise LinkRefused(f"{self.uri(rel)}: a path with '..' below {self.uri()} is not used")
        return parts

    def _link_refused(self, parts: list[str], i: int, rel: str, done: str) -> Exception:
        from airflow_provider_vllm.core.errors import LinkRefused

        return LinkRefused(
            f"{self.uri('/'.join(parts[: i + 1]))} is a symbolic link: no file or folder this provider writes below "
            f"{self.uri()} is, so {self.uri(rel)} is {done} (another writer of the folder put it there?)"
        )

    def _replace_at(self, dfd: int, tmp: str, name: str, rel: str, displace: bool = False) -> None:
        """Rename the finished temp file ``tmp`` over ``name`` in the folder ``dfd`` (``rel``: for messages), a link
        there refused (``_refuse_link_at``); ``tmp`` is gone afterwards either way.

        ``displace``: whatever another writer put at ``name`` is replaced instead, never followed or opened (only
        ``lstat``). A link, FIFO, socket or device: the rename replaces the entry itself. A folder (a rename cannot
        replace one): first renamed aside, in the same folder, to ``.<name>.displaced-<uuid>``, then removed through
        descriptors opened with O_NOFOLLOW (``_remove_tree``: a link inside is removed, never followed; bounded by
        ``LISTING_MAX`` entries and ``REMOVE_DEPTH`` levels). When that removal fails, what is left of the folder
        stays under the aside name, with a warning naming it: the file is in place either way."""
        aside = None
        try:
            if not displace:
                self._refuse_link_at(dfd, name, rel, "not written")
            elif not self.follow_links:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                        aside = displaced_name(name)
                        os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)  # renameat: the entry, not followed
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            if aside is not None:
                self._discard_at(dfd, aside, posixpath.join(posixpath.dirname(rel), aside))

    def _discard_at(self, dfd: int, name: str, rel: str) -> None:
        """Remove the entry ``name`` of the folder ``dfd`` (one ``_replace_at`` moved aside), links not followed;
        a warning naming it when it cannot be removed (too large, too deep, not permitted)."""
        from airflow_provider_vllm.core.errors import CommitError

        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                _remove_tree(dfd, name, [LISTING_MAX], self.uri(rel), LISTING_MAX, 0)
            else:  # swapped for a file or link since it was moved aside: the entry itself
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except (OSError, CommitError) as e:
            log.warning(
                "%s (what another writer of the folder put where this provider writes a file, moved aside) could "
                "not be removed and is left there: %s",
                self.uri(rel),
                e,
            )

    def _refuse_link_at(self, dfd: int, name: str, rel: str, done: str) -> None:
        """``LinkRefused`` when ``name`` in the folder ``dfd`` is a symbolic link (the last component of ``rel``).
        A rename or link onto it would replace the link, never follow it: this names it instead."""
        if self.follow_links:
            return
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            parts = self._parts(rel)
            raise self._link_refused(parts, len(parts) - 1, rel, done)

    def _folder_fd(self, parts: list[str], n: int, rel: str, create: bool, done: str) -> int:
        """A descriptor of the folder ``parts[:n]`` below the root: unless ``follow_links``, each component opened
        with O_NOFOLLOW relative to its parent's descriptor (made first with mkdirat when ``create``), so a link
        is refused (``LinkRefused`` naming it), never followed. The root itself is followed (and made)."""
        if self.follow_links:
            path = self.path("/".join(parts[:n]))
            if create:
                os.makedirs(path, exist_ok=True)
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        if create:
            os.makedirs(self.base or "/", exist_ok=True)
        dfd = os.open(self.base or "/", os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, part in enumerate(parts[:n]):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=dfd)
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
                except OSError as e:
                    if e.errno == errno.ELOOP or (
                        e.errno == errno.ENOTDIR and stat.S_ISLNK(os.lstat(part, dir_fd=dfd).st_mode)
                    ):
                        raise self._link_refused(parts, i, rel, done) from None
                    raise
                os.close(dfd)
                dfd = nfd
            return dfd
        except BaseException:
            os.close(dfd)
            raise

    @contextlib.contextmanager
    def _local_parent(self, rel: str, create: bool = True, done: str = "not written") -> Iterator[tuple[int, str]]:
        """``(descriptor of the folder that holds rel, rel's last component)``, the folder opened as ``_folder_fd``
        (made when ``create``); closed on exit."""
        parts = self._parts(rel)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the root itself", self.uri())
        dfd = self._folder_fd(parts, len(parts) - 1, rel, create, done)
        try:
            yield dfd, parts[-1]
        finally:
            os.close(dfd)

    def walk_files(self, rel: str = "", limit: int = LISTING_MAX) -> Iterator[str]:
        """Relative paths (to the root) of all files under rel, sorted; ``ListingTooLarge`` when more than
        ``limit`` entries are found (counted while listing, before any is yielded). A linked folder below the root
        is not walked into: unless ``follow_links`` it is listed as a file (readers refuse it); with it, it is left
        out, as fsspec's ``find`` did (links to files are listed, and followed by readers)."""
        found = self._scan(rel, limit, recursive=True)
        for name, _ in sorted(found):
            yield posixpath.join(rel, name) if rel else name


HASH_THREADS = 8  # files hashed side by side: at most this many, and at most one per CPU


def hash_pool(files: int) -> ThreadPoolExecutor:
    """Threads for hashing ``files`` files side by side (hashlib and file reads release the GIL)."""
    return ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, os.cpu_count() or 1, files)))


DISPLACED_NAME = re.compile(r"^\.(?P<name>.+)\.displaced-[0-9a-f]{32}$")
"""What ``Storage._replace_at`` renames a folder another writer put at a file's name to before removing it: a task
killed in between leaves it (``Storage.discard`` removes it)."""


def displaced_name(name: str) -> str:
    """The name ``name``'s displaced folder gets beside it (``DISPLACED_NAME``)."""
    return f".{name}.displaced-{uuid.uuid4().hex}"


class CheckedCopies:
    """Local copies of files of ``storage``, each checked (exact size and sha256) in the same read that copies it,
    in a private folder (``root``: made by the caller, e.g. ``tempfile.TemporaryDirectory``, mode 0700).

    A check of a file followed by another read of the same path proves nothing about the second read: whoever
    else can write the folder may replace the file in between (and put it back after). What a trusted record
    vouches for (a sealed manifest, marker or plan naming size and sha256) is read from these copies only. Each
    file is fetched once per ``(size, sha256)``; files are fetched side by side (hashlib and reads release the
    GIL)."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage, self.root = storage, root
        self._done: dict[tuple[int | None, str], str] = {}

    def get(self, rel: str, size: int | None, sha256: str) -> str:
        """The local path of a checked copy of ``rel`` (CommitError, naming it, unless it has this sha256 and size,
        when one is given; FileNotFoundError when it is gone). Files of equal size and sha256 (a part and its
        published link) share one copy."""
        key = (size, sha256)
        if key not in self._done:
            dest = os.path.join(self.root, f"{len(self._done):06d}-{uuid.uuid4().hex[:8]}-{posixpath.basename(rel)}")
            self.storage.fetch_verified(rel, size, sha256, dest)
            self._done[key] = dest
        return self._done[key]

    def pin(self, rel: str, size: int) -> tuple[str, str]:
        """``(local path, sha256)`` of a copy of ``rel``, hashed as it was copied (``Storage.fetch_pinned``): the
        digest to pin is of the very bytes the copy holds. A file of another size than ``size``: ``("", a value
        that is no sha256)``, nothing copied."""
        dest = os.path.join(self.root, f"{len(self._done):06d}-{uuid.uuid4().hex[:8]}-{posixpath.basename(rel)}")
        digest = self.storage.fetch_pinned(rel, size, dest)
        if not os.path.exists(dest):
            return "", digest
        self._done.setdefault((size, digest), dest)
        return dest, digest

    def all(self, files: list[tuple[str, int | None, str]]) -> list[str]:
        """``get`` of each ``(rel, size, sha256)``, in their order."""
        if len(files) <= 1:
            return [self.get(*f) for f in files]
        with hash_pool(len(files)) as pool:
            return list(pool.map(lambda f: self.get(*f), files))


STALE_COPIES_S = 24 * 3600  # a folder without an owner lock (an older version's) this old, its process gone: left
OWNER_LOCK = ".lock"  # suffix of the file beside a copies folder whose flock its owner holds for the folder's life
_OWNED = b"owned\n"  # written into the owner lock once its flock is held: an empty one is not yet held
_HELD: set[str] = set()  # this process's live copies folders, never swept by it (a lock emulated by NFS is per process)
_HELD_GUARD = threading.Lock()


@contextlib.contextmanager
def copies_folder(step: str, root: str | None = None) -> Iterator[str]:
    """A private temporary folder (mode 0700, under ``root``, else ``TMPDIR``) for one task's local copies
    (``CheckedCopies``, the plan's misses file, the golden rows' copies, a shard's input file, the adapters),
    removed on exit.

    A task killed with SIGKILL cannot remove its folder, which may hold a run's whole ``results/``. So its owner
    holds an exclusive ``flock`` on a file beside it (``<folder>.lock``) for the folder's whole life: the kernel
    drops it when the process dies, however it dies, and it is seen by every process of the host that shares the
    folder, whatever its pid namespace (another container). Each new folder of a ``step`` first removes the
    folders of that step whose lock it can take without waiting (``_sweep_stale``), at once, whatever their age;
    a folder whose owner lives is kept, whatever its age. A folder without an owner lock (made by an older version,
    or in the instant between its ``mkdir`` and its lock) is removed only when its process is gone and it is older
    than ``STALE_COPIES_S``, as before."""
    root = root or tempfile.gettempdir()
    prefix = f"vllm-batch-{step}-"
    _sweep_stale(root, prefix)
    path, fd = _owned_folder(root, f"{prefix}{os.getpid()}-")
    try:
        yield path
    finally:
        try:
            shutil.rmtree(path, ignore_errors=True)
            if fd >= 0:  # else what is at the lock's name is not ours
                with contextlib.suppress(OSError):
                    os.unlink(path + OWNER_LOCK)  # after the folder: a lock without its folder is never a live one
        finally:
            if fd >= 0:
                os.close(fd)  # the lock goes with it
            with _HELD_GUARD:
                _HELD.discard(path)


def _owned_folder(root: str, prefix: str) -> tuple[str, int]:
    """A new folder ``<prefix>…`` in ``root`` and the descriptor of its owner lock, held (``copies_folder``); -1
    when something else is at the lock's name (planted there by another user of a shared ``TMPDIR`` who saw the
    folder appear, or a lock left at this very name): the folder is then used without a lock of its own rather
    than failing the task, removed on exit as any; one its owner killed with SIGKILL left is kept while that file
    is there (the sweep never removes a folder whose lock's name holds what is not its lock), then removed by the
    rule for a folder without a lock (its process gone and ``STALE_COPIES_S`` old)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    with _HELD_GUARD:
        _HELD.add(path)
    try:
        fd = os.open(path + OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        log.warning("copies folder %s: %s exists and is not its lock; kept without one", path, path + OWNER_LOCK)
        return path, -1
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        with _HELD_GUARD:
            _HELD.discard(path)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a sweeper that took it first finds it empty and lets go at once
        os.write(fd, _OWNED)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(path + OWNER_LOCK)
        os.close(fd)
        with _HELD_GUARD:
            _HELD.discard(path)
        raise
    return path, fd


@contextlib.contextmanager
def _taken(lock: str) -> Iterator[str]:
    """What the owner lock ``lock`` says of its folder: ``"gone"`` when its flock was taken without waiting, the
    lock a regular file of ours written by an owner and still at that name (the flock is held until the context
    ends); ``"made"`` when taken but never written (its owner died before holding it, or is about to hold it);
    else ``"kept"`` (a live owner holds it; absent, a link, a file with another name (hard link), a FIFO, another
    user's, or made anew since opened)."""
    try:  # for writing: NFS and CIFS emulate flock with an fcntl lock, exclusive only on a descriptor that writes
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        fd = -1
    try:
        yield "kept" if fd < 0 else _lock_state(lock, fd)
    finally:
        if fd >= 0:
            os.close(fd)


def _lock_state(lock: str, fd: int) -> str:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
        return "kept"  # a hard link (another name for a file of ours) is no folder's own lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        now = os.lstat(lock)
    except OSError:  # held: its owner lives (or the lock is gone)
        return "kept"
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        return "kept"
    return "gone" if os.read(fd, len(_OWNED)) == _OWNED else "made"


def _sweep_stale(root: str, prefix: str) -> None:
    """Remove the copies folders ``<prefix>…`` in ``root`` whose owner is gone (``copies_folder``), holding each
    one's lock while removing it (two sweepers never remove one folder together), and the owner locks left
    without their folder. Only folders and files of this user; a link at a folder's or a lock's name is neither
    followed nor removed (``shutil.rmtree`` removes the links inside a folder, following none)."""
    now = time.time()
    try:
        names = set(os.listdir(root))
    except OSError:
        return
    for name in sorted(names):
        if not name.startswith(prefix):
            continue
        path = os.path.join(root, name)
        with _HELD_GUARD:
            if path.removesuffix(OWNER_LOCK) in _HELD:
                continue
        if name.endswith(OWNER_LOCK):
            if name.removesuffix(OWNER_LOCK) not in names:  # a lock whose folder's removal was cut short
                with _taken(path) as state:
                    if state != "kept" and not os.path.lexists(path.removesuffix(OWNER_LOCK)):
                        with contextlib.suppress(OSError):
                            os.unlink(path)
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue  # a link, a file, another user's: not ours to remove
        if os.path.lexists(path + OWNER_LOCK):
            with _taken(path + OWNER_LOCK) as state:
                if state == "gone":
                    shutil.rmtree(path, ignore_errors=True)  # follows no link, and removes none at ``path``
                    if not os.path.lexists(path):
                        with contextlib.suppress(OSError):
                            os.unlink(path + OWNER_LOCK)
                if state != "made":
                    continue
        # no owner lock (an older version's folder, or one being made) or one never held: the process id and age
        pid = name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or now - st.st_mtime < STALE_COPIES_S:
            continue
        try:
            os.kill(int(pid), 0)  # alive (or another user's): kept
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            _unlink_own(path + OWNER_LOCK)
        except OSError:
            continue


def _unlink_own(path: str) -> None:
    """Remove ``path`` when it is a regular file of this user (a lock never held, left with its folder)."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            os.unlink(path)
    except OSError:
        pass


_PROCESS: dict[str, tuple[int, str, contextlib.ExitStack]] = {}  # step -> (pid, folder, its exit)
_PROCESS_GUARD = threading.Lock()


def process_copies_folder(step: str) -> str:
    """A ``copies_folder`` of ``step`` under ``TMPDIR`` that lives as long as this process: removed at its exit,
    and by the next one's sweep after a SIGKILL, like any other. For what outlives a call, e.g. the folder DuckDB
    connections spill into (``duck.spill_dir``). One per step and process (a child made by ``fork`` makes its own);
    made anew when ``TMPDIR`` changed or the folder is gone."""
    root = tempfile.gettempdir()
    with _PROCESS_GUARD:
        held = _PROCESS.get(step)
        if held is not None and held[0] == os.getpid():
            if os.path.dirname(held[1]) == root and os.path.isdir(held[1]):
                return held[1]
            held[2].close()
        stack = contextlib.ExitStack()
        path = stack.enter_context(copies_folder(step, root))
        _PROCESS[step] = (os.getpid(), path, stack)
        return path


@atexit.register
def _remove_process_folders() -> None:
    with _PROCESS_GUARD:
        for step, (pid, _, stack) in list(_PROCESS.items()):
            if pid == os.getpid():  # a forked child's exit leaves its parent's to the parent
                del _PROCESS[step]
                stack.close()


_TEMP_SUFFIX = re.compile(r"\.tmp-[0-9a-f]{32}")


def is_temp_copy(name: str, of: str) -> bool:
    """Whether ``name`` is the temp file that ``write_atomic`` / ``create_only`` of ``of`` writes beside it (left
    behind when the writer is killed before its rename or link)."""
    return name.startswith(of) and _TEMP_SUFFIX.fullmatch(name[len(of) :]) is not None


_TEMP_NAME = re.compile(r".+" + _TEMP_SUFFIX.pattern)


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temp file that ``write_atomic`` / ``create_only`` of some file writes beside it
    (``<name>.tmp-<32 hex>``), of whichever file (``is_temp_copy``: of one file)."""
    return _TEMP_NAME.fullmatch(name) is not None


def _close_and(fd: int, error: BaseException) -> int:
    os.close(fd)
    raise error


def _scan_s3(fs: Any, path: str, limit: int, recursive: bool, uri: str) -> list[tuple[str, int | None]]:
    """s3fs: ``list_objects_v2`` page by page (at most ``limit`` + 1 keys and prefixes asked for), stopped at
    ``limit`` + 1."""
    bucket, key, _ = fs.split_path(path)
    prefix = f"{key.rstrip('/')}/" if key else ""

    async def scan() -> list[tuple[str, int | None]]:
        out: list[tuple[str, int | None]] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, **getattr(fs, "req_kw", {})}
        if not recursive:
            kwargs["Delimiter"] = "/"
        seen = 0
        while True:
            page = await fs._call_s3("list_objects_v2", MaxKeys=min(LIST_PAGE, limit + 1 - seen), **kwargs)
            for c in page.get("CommonPrefixes", []) or []:
                seen += 1
                name = c["Prefix"][len(prefix) :].rstrip("/")
                if name:
                    out.append((name, None))
            for c in page.get("Contents", []) or []:
                seen += 1
                name = c["Key"][len(prefix) :]
                if name and not name.endswith("/"):
                    out.append((name, int(c["Size"])))
            if seen > limit:
                raise _listing_error(uri, limit)
            if not page.get("IsTruncated"):
                return out
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    from fsspec.asyn import sync

    return sync(fs.loop, scan)


def _scan_gcs(fs: Any, path: str, limit: int, recursive: bool, uri: str) -> list[tuple[str, int | None]]:
    """gcsfs: its page-by-page listing asked for at most ``limit`` + 1 items and prefixes (it stops there)."""
    from fsspec.asyn import sync

    items, prefixes = sync(
        fs.loop,
        fs._do_list_objects,
        path.rstrip("/"),
        max_results=limit + 1,
        delimiter="" if recursive else "/",
        items_per_call=LIST_PAGE,
    )
    if len(items) + len(prefixes) > limit:
        raise _listing_error(uri, limit)
    bucket, key, _ = fs.split_path(path)
    prefix = f"{key.rstrip('/')}/" if key else ""

    def under(name: str) -> str:  # gcsfs names items with their bucket, prefixes without
        for head in (f"{bucket}/{prefix}", prefix):
            if name.startswith(head):
                return name[len(head) :]
        return ""

    out: list[tuple[str, int | None]] = [(under(str(p)).rstrip("/"), None) for p in prefixes]
    for i in items:
        name = under(str(i.get("name", "")))
        if name and not name.endswith("/"):
            out.append((name, int(i["size"]) if str(i.get("size", "")).isdigit() else None))
    return [(n, s) for n, s in out if n]


def _temp_at(dfd: int, name: str, fill: Callable[[Any], None], sync: bool = True) -> str:
    """``name``, a new file in the folder ``dfd`` (never through a link there: O_EXCL | O_NOFOLLOW), written by
    ``fill`` (and fsynced when ``sync``). Returns ``name``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with contextlib.suppress(FileNotFoundError):  # one a writer killed before its rename left (same process id)
        os.unlink(name, dir_fd=dfd)
    fd = os.open(name, flags, 0o666, dir_fd=dfd)
    with os.fdopen(fd, "wb") as f:  # a fill that fails leaves it, as a writer killed there would (``is_temp_copy``)
        fill(f)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return name


REMOVE_DEPTH = 64
"""The deepest folder ``Storage.remove(..., recursive=True)`` walks into below the folder it removes; the pipeline
writes a few levels (a cache entry's parts), so a deeper tree is another writer's, refused (``CommitError``)."""


def _remove_tree(dfd: int, name: str, budget: list[int], uri: str, limit: int, depth: int) -> None:
    """The folder ``name`` of the folder ``dfd`` and all it holds, removed through descriptors opened with
    O_NOFOLLOW: a link in it is removed, never followed. ``budget``: the entries left to remove, shared by the
    whole walk (``ListingTooLarge`` past them)."""
    from airflow_provider_vllm.core.errors import CommitError

    if depth > REMOVE_DEPTH:
        raise CommitError(
            f"{uri} holds folders more than {REMOVE_DEPTH} deep: the pipeline never writes them, so it is "
            "not removed further (another writer of the folder put them there?)"
        )
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
    try:
        with os.scandir(fd) as it:
            for e in it:
                budget[0] -= 1
                if budget[0] < 0:
                    raise _listing_error(uri, limit)
                if e.is_dir(follow_symlinks=False):
                    _remove_tree(fd, e.name, budget, uri, limit, depth + 1)
                else:
                    os.unlink(e.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


def _fs_and_path(
    uri: str, options: dict[str, Any], filesystems: FileSystems | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    if filesystems is not None:
        fs = filesystems(uri, options)
        if fs is not None:
            return fs, fs._strip_protocol(uri)
    if uri.split("://", 1)[0].lower() in ("gs", "gcs"):
        options = gcs_options(options)
    return _cached_fs(uri, tuple(sorted((k, repr(v)) for k, v in options.items())), options)


_FS_CACHE: dict[tuple, tuple] = {}


def _cached_fs(uri: str, key: tuple, options: dict[str, Any]):
    k = (uri, key)
    hit = _FS_CACHE.get(k)
    if hit is None:
        hit = fsspec.core.url_to_fs(uri, **options)
        _FS_CACHE[k] = hit
    return hit


def _create_only_remote(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "memory" in protocols:  # tests only: single process, check-then-write is enough
        if fs.exists(path):
            return False
        fs.pipe_file(path, data)
        return True
    if not {"s3", "s3a", "gs", "gcs"} & set(protocols):
        raise NotImplementedError(f"no atomic create-only write for protocol {fs.protocol!r}")
    # s3fs sends If-None-Match: * and gcsfs ifGenerationMatch=0: the server decides, atomically.
    try:
        retrying(lambda: fs.pipe_file(path, data, mode="create"), f"create {path}")
    except FileExistsError:
        return False
    except OSError as e:
        if "PreconditionFailed" in str(e) or "412" in str(e):
            return False
        raise
    return True
