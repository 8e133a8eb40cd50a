"""Input files: discovery, what identifies their content (the fingerprint), and the format.

Shared by every input format; nothing here reads a row.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from airflow_provider_vllm.core.errors import DatasetError, InputChangedError, ListingTooLarge
from airflow_provider_vllm.core.formats.lines import LineReader, parse_line
from airflow_provider_vllm.core.storage import GLOB_CHARS, FileSystems, Storage, has_glob

PARQUET_EXT = (".parquet", ".pq", ".parq")
JSONL_EXT = (".jsonl", ".ndjson", ".json")
COMPRESSED_DATA = re.compile(r"\.(jsonl|ndjson|json|parquet|pq|parq)\.(gz|gzip|bz2|xz|zst|zstd|lz4|snappy|zip)$")
"""A data file compressed whole (``rows.jsonl.gz``): not read, so an input folder holding one is refused rather
than run without its rows (Parquet compresses its pages inside the file: ``part-0.snappy.parquet`` is read)."""
INPUT_LISTED = 250_000
"""The most entries of an input folder listed (files at any depth and the folders walked, ``_`` and ``.`` ones
included: Spark's ``.crc`` files and ``_SUCCESS`` count). The plan names every input file in ``_plan.json`` (a few
hundred bytes each, ``storage.RECORD_MAX_BYTES``) and asks its size and version once each, so a dataset of this
many files is already slow to plan; a folder holding more fails the plan, naming it and the bound, after listing
no more than that (compact the files, or point ``io.input_uri`` at a subfolder)."""
REPLAN = (
    "the plan pins the input's files (a file added to the folder since is not read either): put the planned "
    "file back as it was, or plan the run again into a new output prefix"
)
"""What to do when a planned input file changed or is gone: the end of every such message."""


class InputFile(BaseModel):
    """One input file as planned (an item of ``_plan.json``'s ``files``): its path under the input root and what
    identifies its content. Equal when path, size and version are equal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="path under the input root")
    size: int = Field(ge=0, description="bytes")
    version: str = Field(description="etag / generation / mtime: changes when the content changes")


def input_storage(
    uri: str, options: dict[str, Any], filesystems: FileSystems | None = None
) -> tuple[Storage, list[str]]:
    """The folder holding the input and the relative paths of its data files, sorted (``checked_names``)."""
    root, names = _listed(uri, options, filesystems)
    return root, checked_names(root, names)


def checked_names(root: Storage, names: list[str]) -> list[str]:
    """``names``; DatasetError naming the first file whose path holds a glob character (``storage.GLOB_CHARS``):
    DuckDB would read the files the pattern matches (``[_]data.parquet``: ``_data.parquet``), not that file."""
    bad = next((n for n in names if has_glob(root.path(n))), None)
    if bad is not None:
        raise DatasetError(
            f"input file {root.uri(bad)}: its path holds a glob character ({' '.join(GLOB_CHARS)}), which DuckDB "
            "and fsspec expand (another file would be read); rename the file or its folder"
        )
    return names


def _listed(uri: str, options: dict[str, Any], filesystems: FileSystems | None) -> tuple[Storage, list[str]]:
    """The input's folder and its data files (``_`` and ``.`` names skipped); DatasetError when there are none."""
    whole = Storage(uri, options, filesystems, follow_links=True)  # the user's links: the allow-list checked them
    fs = whole.fs
    try:
        is_dir = fs.isdir(whole.base)
    except FileNotFoundError:
        is_dir = False
    if is_dir:
        try:
            listed = list(whole.walk_files(limit=INPUT_LISTED))
        except ListingTooLarge:
            raise DatasetError(
                f"input {uri} holds more than {INPUT_LISTED} files and folders, the most an input folder is "
                "listed for: compact its files, or point io.input_uri at a subfolder"
            ) from None
        visible = [rel for rel in listed if not any(p.startswith(("_", ".")) for p in rel.split("/"))]
        compressed = [rel for rel in visible if COMPRESSED_DATA.search(rel.lower())]
        if compressed:
            raise DatasetError(
                f"input {uri}: {len(compressed)} compressed data file(s) ({', '.join(compressed[:3])}"
                f"{', ...' if len(compressed) > 3 else ''}), which the plan does not read: their rows would be left "
                "out of the run. Decompress them (JSON Lines) or rewrite them as Parquet (compressed inside), or "
                "move them out of the input folder"
            )
        names = [rel for rel in visible if rel.lower().endswith(PARQUET_EXT + JSONL_EXT)]
        if not names:
            raise DatasetError(f"input {uri}: no .parquet or .jsonl files in the folder")
        return whole, names
    if not fs.exists(whole.base):
        raise DatasetError(f"input {uri}: not found")
    parent, name = uri.rstrip("/").rsplit("/", 1) if "/" in uri.rstrip("/") else (".", uri)
    return whole.at(parent), [name]


def describe_files(storage: Storage, names: list[str]) -> list[InputFile]:
    out = []
    for n in names:
        if storage.is_local:
            # mtime is anyone's to set (touch -d): the change time is not (os.utime moves it too), so a rewrite of
            # the same size with the old mtime put back, in place or renamed over it, is another version. One stat,
            # the final link followed, as fsspec's info makes it; not fsspec's "created": that is the birth time
            # where the platform has one (macOS), which a rewrite in place keeps. No inode number: the plan and the
            # shards may read one shared volume through two mounts, and a FUSE mount (gcsfuse, Mountpoint for S3)
            # numbers inodes per mount
            st = os.stat(storage.path(n))
            out.append(InputFile(path=n, size=st.st_size, version=f"{st.st_mtime}|ctime {st.st_ctime_ns}"))
            continue
        info = storage.info(n)
        version = info.get("ETag") or info.get("etag") or info.get("generation") or info.get("mtime") or ""
        out.append(InputFile(path=n, size=int(info.get("size") or 0), version=str(version).strip('"')))
    return out


def fingerprint(files: list[InputFile]) -> str:
    doc = json.dumps([f.model_dump() for f in files], sort_keys=True).encode()
    return hashlib.sha256(doc).hexdigest()


def check_unchanged(storage: Storage, planned: list[InputFile]) -> None:
    """Raise InputChangedError when any planned file's size or version changed since the plan, or it is gone."""
    try:
        now = describe_files(storage, [f.path for f in planned])
    except FileNotFoundError as e:
        raise InputChangedError(f"an input file of the plan is gone since the plan: {e}; {REPLAN}") from None
    for a, b in zip(planned, now):
        if a != b:
            raise InputChangedError(
                f"input file {a.path} changed since the plan ({a.model_dump()} -> {b.model_dump()}); {REPLAN}"
            )


def detect_format(storage: Storage, names: list[str], declared: str) -> str:
    """'parquet', 'jsonl' or 'openai_batch'; all files of one input share a format."""
    by_kind: dict[str, list[str]] = {}
    for n in names:
        by_kind.setdefault("parquet" if n.lower().endswith(PARQUET_EXT) else "jsonl", []).append(n)
    if len(by_kind) > 1:
        listed = " and ".join(
            f"{len(found)} {kind} file(s) ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})"
            for kind, found in sorted(by_kind.items(), key=lambda kv: kv[0] != "parquet")
        )
        raise DatasetError(
            f"input {storage.uri('')} mixes Parquet and JSONL files: {listed}; an input is one format (a stray "
            "file such as a schema .json counts): move the others out, or point io.input_uri at one file"
        )
    kind = next(iter(by_kind))
    if declared != "auto":
        if (declared == "parquet") != (kind == "parquet"):
            raise DatasetError(f"io.input_format={declared!r} but the input's files are {kind} ({names[0]}, ...)")
        return declared
    if kind == "parquet":
        return "parquet"
    with storage.open(names[0]) as f:
        reader = LineReader(f)  # a first line over the line limit is not read whole (it is no request: jsonl)
        while True:
            raw, size = reader.next_line(read_on=False)
            if not size or raw is None:
                return "jsonl"
            if raw.strip():
                first = parse_line(raw, first=True)
                # a request line: a body and the request's own fields; custom_id may be the one that is
                # missing (the plan then refuses that line naming custom_id, not the template's id column)
                if isinstance(first, dict) and "body" in first and {"custom_id", "url", "method"} & set(first):
                    return "openai_batch"
                return "jsonl"


@dataclass(frozen=True)
class Input:
    """A job's input as found: where it lives, its files, their fingerprint and their format.

    ``columns``: for a table snapshot, the table's columns the job may read (``io.input_table.columns``, else the
    snapshot's schema): what ``io.passthrough`` 'all' means. A data file read by reference may store more (columns
    dropped from the table since it was written). None: files, whose own columns are the input's."""

    root: Storage
    names: list[str]
    files: list[InputFile]
    fingerprint: str
    format: str
    columns: tuple[str, ...] | None = None


def find_input(uri: str, options: dict[str, Any], declared: str, filesystems: FileSystems | None = None) -> Input:
    """Discover the input's files, describe them and detect their format (DatasetError if unusable)."""
    root, names = input_storage(uri, options, filesystems)
    try:
        files = describe_files(root, names)
    except FileNotFoundError as e:  # listed, then not there: a link to nothing, or removed meanwhile
        raise DatasetError(
            f"input {uri}: a file of its listing cannot be opened ({e}): a symbolic link to a file that does not "
            "exist, or a file removed while the plan listed the folder; remove the link (or wait for the writer to "
            "finish) and plan again"
        ) from None
    return Input(root, names, files, fingerprint(files), detect_format(root, names, declared))
