"""Names read back from files in a bucket, checked before they become paths.

A manifest, a merge summary or a cache commit marker is a file that anyone who can write its
prefix can rewrite, so a name read from one is never joined to a path as it is:

* a part of ``results/`` or ``errors/`` (``PartEntry.name``) is one path segment matching
  ``PART_NAME``: no ``/``, no ``..``, no glob or fsspec/DuckDB special (``* ? [ ] { } ~ : %``);
* a cache entry's file (``CacheFileEntry.path``) is ``entries/<32 hex>/part-NNNNN.parquet``;
* a file a summary lists (``MergeSummary.files``, ``ChangesSummary.files``) is a relative path
  of plain segments (``RUN_FILE``), none starting with a dot;
* on local storage the file must resolve to where its name says (``check_inside``): a symlink
  leaving the run (or the folder) is refused. An object store has no links: a key is a key.

The patterns are ASCII only (``[0-9]``, not ``\\d``, which matches other scripts' digits) and
matched whole (``fullmatch``: ``$`` would accept a trailing newline).
"""

from __future__ import annotations

import os
import re

from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.storage import Storage

PART_NAME = re.compile(r"part-[0-9]+(-[A-Za-z0-9._-]+)?\.parquet")
CACHE_PART_PATH = re.compile(r"entries/[0-9a-f]{32}/part-[0-9]{5}\.parquet")
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def part_name(name: str) -> str:
    """``name`` when it is one part file name (``PART_NAME``); ValueError naming it otherwise."""
    if not PART_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a part name (one file name like part-00000-<shard>-00000.parquet)")
    return name


def cache_part_path(path: str) -> str:
    """``path`` when it is ``entries/<entry_id>/part-NNNNN.parquet``; ValueError naming it otherwise."""
    if not CACHE_PART_PATH.fullmatch(path):
        raise ValueError(f"{path!r} is not a cache entry part (entries/<entry_id>/part-NNNNN.parquet)")
    return path


def run_file(path: str) -> str:
    """``path`` when it is a relative path of plain segments (a folder may end in '/'); ValueError otherwise."""
    segments = path.removesuffix("/").split("/")
    if not all(_SEGMENT.fullmatch(s) for s in segments):
        raise ValueError(f"{path!r} is not a file of the run (relative, plain names, no '..', no glob characters)")
    return path


def check_inside(storage: Storage, rel: str, what: str) -> None:
    """CommitError unless ``rel`` under ``storage`` resolves to itself on local disk (no symlink leaves it).

    ``what`` names the file the name was read from, for the message. Object stores pass: a key
    names one object, and the name itself was checked when its record was read.
    """
    if not storage.is_local:
        return
    expected = os.path.join(os.path.realpath(storage.base), rel)
    if os.path.realpath(storage.path(rel)) != expected.rstrip("/"):
        raise CommitError(
            f"{what} names {rel!r}, which is a symbolic link or lies under one (it must be a file of "
            f"{storage.uri()} itself): refusing to read it"
        )
