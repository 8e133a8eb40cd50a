"""Input datasets: discovery, fingerprint, and reading row ranges.

Formats: Parquet (a file or a folder of files, any number of row groups), JSONL (one JSON
object per line) and OpenAI batch request JSONL (``custom_id``, ``method``, ``url``,
``body``). Rows are addressed by (file, first row, row count) in the file's own order, so
the planner and the worker agree on a shard's rows without sharing any state but the plan.

A JSONL line that is not valid JSON cannot name its id; it gets the synthetic id
``__line__:<file>:<line number>`` so that it still ends up, exactly once, in the errors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core.errors import DatasetError, InputChangedError
from airflow_provider_vllm.core.storage import FileSystems, Storage

PARQUET_EXT = (".parquet", ".pq", ".parq")
JSONL_EXT = (".jsonl", ".ndjson", ".json")
OPENAI_URLS = ("/v1/chat/completions", "/v1/embeddings")
# An id that is empty or only whitespace cannot name a row: refused by the plan in every format.
# Whitespace is Python's (str.isspace); this RE2 pattern (DuckDB, Parquet ids) matches exactly
# the same characters (tests/unit/steps/test_plan.py checks every code point).
BLANK_ID_PATTERN = r"^[\s\x{0b}\x{1c}-\x{1f}\x{85}\p{Z}]*$"


def is_blank_id(value: str) -> bool:
    """True for '' and for ids made only of whitespace (the JSONL / OpenAI batch side of the rule)."""
    return not value.strip()


@dataclass(frozen=True)
class InputFile:
    """One input file as planned: its path under the input root and what identifies its content."""

    path: str
    size: int
    version: str  # etag / generation / mtime: changes when the content changes

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "version": self.version}


@dataclass
class RowBatch:
    """Rows read from one segment: ids, the needed column values, and per-row read faults."""

    ids: list[str]
    values: dict[str, list[Any]]
    faults: list[tuple[str, str] | None]  # (reason code, message) for rows that could not be read
    lines: list[int | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, other: RowBatch) -> None:
        self.ids += other.ids
        for k, v in other.values.items():
            self.values.setdefault(k, []).extend(v)
        self.faults += other.faults
        self.lines += other.lines


def input_storage(uri: str, options: dict[str, Any],
                  filesystems: FileSystems | None = None) -> tuple[Storage, list[str]]:
    """The folder holding the input and the relative paths of its data files, sorted."""
    whole = Storage(uri, options, filesystems)
    fs = whole.fs
    try:
        is_dir = fs.isdir(whole.base)
    except FileNotFoundError:
        is_dir = False
    if is_dir:
        names = [
            rel
            for rel in whole.walk_files()
            if not any(part.startswith(("_", ".")) for part in rel.split("/"))
            and rel.lower().endswith(PARQUET_EXT + JSONL_EXT)
        ]
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
        info = storage.info(n)
        version = info.get("ETag") or info.get("etag") or info.get("generation") or info.get("mtime") or ""
        out.append(InputFile(path=n, size=int(info.get("size") or 0), version=str(version).strip('"')))
    return out


def fingerprint(files: list[InputFile]) -> str:
    doc = json.dumps([f.to_dict() for f in files], sort_keys=True).encode()
    return hashlib.sha256(doc).hexdigest()


def check_unchanged(storage: Storage, planned: list[InputFile]) -> None:
    """Raise InputChangedError when any planned file's size or version changed since the plan."""
    now = describe_files(storage, [f.path for f in planned])
    for a, b in zip(planned, now):
        if a != b:
            raise InputChangedError(f"input file {a.path} changed since the plan ({a.to_dict()} -> {b.to_dict()})")


def detect_format(storage: Storage, names: list[str], declared: str) -> str:
    """'parquet', 'jsonl' or 'openai_batch'; all files of one input share a format."""
    kinds = {"parquet" if n.lower().endswith(PARQUET_EXT) else "jsonl" for n in names}
    if len(kinds) > 1:
        raise DatasetError(f"input mixes Parquet and JSONL files: {names[:5]}")
    kind = kinds.pop()
    if declared != "auto":
        if (declared == "parquet") != (kind == "parquet"):
            raise DatasetError(f"input_format={declared!r} but the files are {kind}")
        return declared
    if kind == "parquet":
        return "parquet"
    with storage.open(names[0]) as f:
        for raw in f:
            if raw.strip():
                try:
                    first = json.loads(raw.decode("utf-8-sig"))
                except (ValueError, UnicodeDecodeError):
                    return "jsonl"
                if isinstance(first, dict) and "custom_id" in first and "body" in first:
                    return "openai_batch"
                return "jsonl"
    return "jsonl"


# ---- Parquet ------------------------------------------------------------------------
def parquet_metadata(storage: Storage, name: str) -> pq.FileMetaData:
    try:
        with storage.open(name) as f:
            return pq.ParquetFile(f).metadata
    except pa.ArrowInvalid as e:  # storage errors (OSError) stay transient
        raise DatasetError(f"input file {name} is not a readable Parquet file: {e}") from None


def read_parquet_range(storage: Storage, name: str, start: int, count: int, columns: list[str]) -> pa.Table:
    """Rows [start, start+count) of one Parquet file, reading only the row groups that hold them."""
    with storage.open(name) as f:
        pf = pq.ParquetFile(f)
        md = pf.metadata
        groups, first_row, pos = [], None, 0
        for i in range(md.num_row_groups):
            n = md.row_group(i).num_rows
            if pos + n > start and pos < start + count:
                groups.append(i)
                if first_row is None:
                    first_row = pos
            pos += n
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise DatasetError(f"{name}: missing columns {missing}")
        if not groups:
            return pf.schema_arrow.empty_table().select(columns)
        table = pf.read_row_groups(groups, columns=columns)
    return table.slice(start - first_row, count)


def parquet_batch(table: pa.Table, id_column: str, columns: list[str]) -> RowBatch:
    ids_col = table.column(id_column)
    if not pa.types.is_string(ids_col.type) and not pa.types.is_large_string(ids_col.type):
        ids_col = ids_col.cast(pa.string())
    ids = ids_col.to_pylist()
    values = {c: table.column(c).to_pylist() for c in columns if c != id_column}
    if id_column in columns:
        values[id_column] = table.column(id_column).to_pylist()
    return RowBatch(ids=ids, values=values, faults=[None] * len(ids), lines=[None] * len(ids))


# ---- JSONL --------------------------------------------------------------------------
def is_unicode(text: str) -> bool:
    """False for strings JSON can carry but UTF-8 cannot (unpaired surrogates from ``\ud800`` escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def invalid_line_id(name: str, line_no: int) -> str:
    return f"__line__:{name}:{line_no}"


@dataclass
class JsonlScan:
    """One pass over a JSONL file: per data line its id, byte offset and length."""

    ids: list[str]
    offsets: list[int]  # byte offset of each data line
    lengths: list[int]  # bytes of the fields the prompt uses (token estimate)
    line_numbers: list[int]
    invalid: list[bool]
    end: int  # byte size scanned


def scan_jsonl(storage: Storage, name: str, fmt: str, id_field: str, text_fields: list[str]) -> JsonlScan:
    """Read every line once; raise DatasetError for a line without an id (it cannot be tracked)."""
    ids, offsets, lengths, lines, invalid = [], [], [], [], []
    pos = 0
    with storage.open(name) as f:
        for line_no, raw in enumerate(f, start=1):
            here = pos
            pos += len(raw)
            if not raw.strip(b" \t\r\n\xef\xbb\xbf"):
                continue
            parsed = _parse_line(raw, line_no == 1)
            offsets.append(here)
            lines.append(line_no)
            if parsed is None or not isinstance(parsed, dict):
                ids.append(invalid_line_id(name, line_no))
                lengths.append(0)
                invalid.append(True)
                continue
            key = "custom_id" if fmt == "openai_batch" else id_field
            rid = parsed.get(key)
            if rid is None or isinstance(rid, (dict, list, bool)) or rid == "":
                raise DatasetError(f"{name} line {line_no}: missing or invalid id field {key!r}")
            if is_blank_id(str(rid)):
                raise DatasetError(f"{name} line {line_no}: id field {key!r} is {str(rid)!r}, only whitespace; "
                                   "an id must have a visible character")
            if not is_unicode(str(rid)):
                raise DatasetError(f"{name} line {line_no}: id field {key!r} is not valid Unicode "
                                   "(an unpaired surrogate escape)")
            ids.append(str(rid))
            lengths.append(row_chars(parsed, fmt, text_fields))
            invalid.append(False)
    return JsonlScan(ids, offsets, lengths, lines, invalid, pos)


def row_chars(parsed: dict[str, Any] | None, fmt: str, text_fields: list[str]) -> int:
    """Characters of a JSONL row's prompt text (the planner's token estimate; 0 if unreadable)."""
    if not isinstance(parsed, dict):
        return 0
    if fmt == "openai_batch":
        body = parsed.get("body")
        if not isinstance(body, dict):
            return 0
        msgs = body.get("messages")
        if isinstance(msgs, list):
            return sum(len(m.get("content") or "") for m in msgs if isinstance(m, dict)
                       and isinstance(m.get("content"), str))
        return len(body.get("input")) if isinstance(body.get("input"), str) else 0
    return sum(len(str(parsed.get(c) or "")) for c in text_fields)


def line_chars(batch: RowBatch, i: int, fmt: str, text_fields: list[str]) -> int:
    """row_chars for row i of a batch read by read_jsonl_range."""
    if batch.faults[i] is not None and batch.faults[i][0] == "INVALID_JSON":
        return 0
    if fmt == "openai_batch":
        return row_chars(batch.values["_request"][i], fmt, text_fields)
    return row_chars({c: batch.values[c][i] for c in text_fields}, fmt, text_fields)


def _parse_line(raw: bytes, first: bool) -> Any:
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
        return json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def read_jsonl_range(
    storage: Storage,
    name: str,
    fmt: str,
    id_field: str,
    columns: list[str],
    offset: int,
    count: int,
    first_line: int,
) -> RowBatch:
    """``count`` data lines from byte ``offset`` (line number ``first_line``) on.

    Invalid lines become rows with a fault and their synthetic id.
    """
    batch = RowBatch(ids=[], values={c: [] for c in columns}, faults=[], lines=[])
    line_no = first_line - 1
    with storage.open(name) as f:
        f.seek(offset)
        while len(batch.ids) < count:
            raw = f.readline()
            line_no += 1
            if not raw:
                raise InputChangedError(f"{name}: ended before the planned rows (offset {offset})")
            if not raw.strip(b" \t\r\n\xef\xbb\xbf"):
                continue
            parsed = _parse_line(raw, line_no == 1)
            batch.lines.append(line_no)
            if not isinstance(parsed, dict):
                batch.ids.append(invalid_line_id(name, line_no))
                for c in columns:
                    batch.values[c].append(None)
                why = "not valid UTF-8 JSON" if parsed is None else f"a JSON {type(parsed).__name__}, not an object"
                batch.faults.append(("INVALID_JSON", f"line is {why}"))
                continue
            if fmt == "openai_batch":
                batch.ids.append(str(parsed.get("custom_id")))
                fault = openai_request_fault(parsed)
                batch.faults.append(fault)
                for c in columns:
                    batch.values[c].append(parsed if c == "_request" else None)
            else:
                batch.ids.append(str(parsed.get(id_field)))
                batch.faults.append(None)
                for c in columns:
                    batch.values[c].append(parsed.get(c))
    return batch


def openai_request_fault(req: dict[str, Any]) -> tuple[str, str] | None:
    """Why an OpenAI batch request line is not a request at all (method, url, body), or None.

    The body's fields are validated per row by the worker (``openai_batch.parse_chat_body``,
    ``parse_embeddings_body``), against the fields it supports.
    """
    if req.get("method", "POST") != "POST":
        return ("INVALID_ROW", f"method {req.get('method')!r} is not POST")
    url = req.get("url")
    if url not in OPENAI_URLS:
        return ("INVALID_ROW", f"url {url!r} is not one of {list(OPENAI_URLS)}")
    body = req.get("body")
    if not isinstance(body, dict):
        return ("INVALID_ROW", "body is not an object")
    return None
