"""JSONL inputs: one JSON object per line, a row's id and columns are its fields.

Planned in one pass over every line. A line that is not a JSON object cannot name its id;
it gets the synthetic id ``__line__:<file>:<line number>`` so that it still ends up, exactly
once, in the errors (``INVALID_JSON``). So does a line over ``lines.JSONL_LINE_MAX_BYTES`` or
nested deeper than ``lines.JSON_MAX_DEPTH``, decided from its bytes alike in plan and worker.
A line without a usable id fails the plan: it could not be tracked. So does a file none of whose lines is a
JSON object (pretty-printed objects, lines ended by a lone carriage return, UTF-16): it holds no row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from airflow_provider_vllm.core.errors import DatasetError, InputChangedError
from airflow_provider_vllm.core.formats.base import (
    InputFormat,
    RowBatch,
    Scan,
    is_blank_id,
    is_unicode,
    raise_duplicates,
    row_columns,
)
from airflow_provider_vllm.core.formats.files import REPLAN
from airflow_provider_vllm.core.formats.lines import LineReader, Unreadable, parse_line, too_long
from airflow_provider_vllm.core.storage import Storage

if TYPE_CHECKING:
    from airflow_provider_vllm.core.plan import Segment
    from airflow_provider_vllm.core.spec import JobSpec

_BOM = b"\xef\xbb\xbf"


def _is_blank(raw: bytes) -> bool:
    """A line the plan and the worker skip: only JSON whitespace, after one UTF-8 byte order mark (a file's, or a
    concatenated file's). ``bytes.strip`` of the BOM's bytes would also drop a line of ``\\xbb`` bytes, which is
    an ``INVALID_JSON`` row like any line that is not JSON."""
    return not raw.removeprefix(_BOM).strip(b" \t\r\n")


def invalid_line_id(name: str, line_no: int) -> str:
    return f"__line__:{name}:{line_no}"


@dataclass
class _FileScan:
    """One pass over a JSONL file: per data line its id, byte offset, size and line number."""

    ids: list[str]
    offsets: list[int]  # byte offset of each data line
    lengths: list[int]  # characters of the fields the prompt uses (token estimate)
    line_numbers: list[int]
    invalid: int


class JsonlFormat(InputFormat):
    """JSON objects whose fields are the prompt's columns; subclasses change what a line holds."""

    name = "jsonl"

    # ---- what one line holds (overridden by line formats of another shape) -------------------
    def id_key(self, spec: JobSpec) -> str:
        return spec.prompt.id_column

    def columns(self, spec: JobSpec) -> list[str]:
        """The value columns a read row carries (the worker's prompt inputs, the adapter column)."""
        return [c for c in row_columns(spec) if c != spec.prompt.id_column]

    def row_chars(self, row: dict[str, Any], spec: JobSpec) -> int:
        """Characters of a row's prompt text (the planner's token estimate)."""
        return sum(len(str(row.get(c) or "")) for c in spec.prompt.texts)

    def row_fault(self, row: dict[str, Any]) -> tuple[str, str] | None:  # noqa: ARG002
        """Why a line that parsed is still not a row this format can run (reason code, message), or None."""
        return None

    def row_values(self, row: dict[str, Any], columns: list[str]) -> list[Any]:
        return [row.get(c) for c in columns]

    def checked_id(self, value: Any, name: str, line_no: int, key: str) -> str:
        """A line's id as text; DatasetError naming the file, line and field when it cannot track the row."""
        self.check_id_type(value, name, line_no)
        return _checked_id(value, name, line_no, key)

    def check_id_type(self, value: Any, name: str, line_no: int) -> None:  # noqa: ARG002
        """The format's own rules for an id value, before the common ones (JSONL: none; DatasetError)."""
        return None

    # ---- the interface ----------------------------------------------------------------
    def scan(self, root: Storage, names: list[str], spec: JobSpec, per_row: bool) -> Scan:  # noqa: ARG002
        ids: list[str] = []
        chars, file_rows, offsets, lines = [], [], [], []
        invalid = 0
        for name in names:
            s = self._scan_file(root, name, spec, sizes=True, planning=True)
            ids += s.ids
            chars.append(np.asarray(s.lengths, dtype=np.int64))
            offsets.append(np.asarray(s.offsets, dtype=np.int64))
            lines.append(np.asarray(s.line_numbers, dtype=np.int64))
            file_rows.append(len(s.ids))
            invalid += s.invalid
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
        scan = Scan(chars=cat(chars), file_rows=file_rows, offsets=cat(offsets), lines=cat(lines), invalid=invalid)
        _check_distinct(pa.chunked_array([pa.array(ids, pa.string())]), names, file_rows, cat(lines))
        return scan

    def file_ids(self, root: Storage, name: str, spec: JobSpec) -> list[str]:
        return self._scan_file(root, name, spec, sizes=False).ids

    def read_rows(
        self, root: Storage, name: str, segment: Segment, spec: JobSpec, passthrough: list[str] | None = None
    ) -> RowBatch:
        """``segment.count`` data lines from byte ``segment.offset`` (line number ``segment.line``) on.

        Invalid lines (also one too long or too deeply nested) become rows with a fault (``INVALID_JSON``) and
        their synthetic id, as the plan's scan gave them: both read lines with ``lines.LineReader`` and parse them
        with ``lines.parse_line``. No passthrough
        columns (JSON lines have no column types): the plan refuses ``io.passthrough`` for them.
        """
        if passthrough:
            raise DatasetError(f"{name}: io.passthrough needs Parquet input")
        columns = self.columns(spec)
        key = self.id_key(spec)
        batch = RowBatch(ids=[], values={c: [] for c in columns}, faults=[], lines=[])
        line_no = segment.line - 1
        with root.open(name) as f:
            f.seek(segment.offset)
            reader = LineReader(f)
            while len(batch.ids) < segment.count:
                raw, size = reader.next_line()
                line_no += 1
                if not size:
                    raise InputChangedError(
                        f"{name}: ended before the planned rows (offset {segment.offset}); {REPLAN}"
                    )
                if raw is not None and _is_blank(raw):
                    continue
                parsed = too_long(size) if raw is None else parse_line(raw, line_no == 1)
                batch.lines.append(line_no)
                if not isinstance(parsed, dict):
                    batch.ids.append(invalid_line_id(name, line_no))
                    for c in columns:
                        batch.values[c].append(None)
                    why = (
                        parsed.why
                        if isinstance(parsed, Unreadable)
                        else f"a JSON {type(parsed).__name__}, not an object"
                    )
                    batch.faults.append(("INVALID_JSON", f"line is {why}"))
                    batch.chars.append(0)
                    continue
                batch.ids.append(str(parsed.get(key)))
                batch.faults.append(self.row_fault(parsed))
                for c, v in zip(columns, self.row_values(parsed, columns)):
                    batch.values[c].append(v)
                batch.chars.append(self.row_chars(parsed, spec))
        return batch

    def _scan_file(self, root: Storage, name: str, spec: JobSpec, sizes: bool, planning: bool = False) -> _FileScan:
        """Read every line once; raise DatasetError for a line without an id (it cannot be tracked). ``planning``:
        the plan's scan, which also refuses a file that is one JSON document (later reads of a planned file
        need not)."""
        key = self.id_key(spec)
        ids: list[str] = []
        offsets, lengths, lines = [], [], []
        invalid = 0
        pos = line_no = 0
        first_bad: tuple[int, bytes | None, Any] | None = None  # the first line that is no JSON object
        with root.open(name) as f:
            reader = LineReader(f)
            while True:
                raw, size = reader.next_line()
                if not size:
                    break
                here = pos
                pos += size
                line_no += 1
                if raw is not None and _is_blank(raw):
                    continue
                parsed = too_long(size) if raw is None else parse_line(raw, line_no == 1)
                offsets.append(here)
                lines.append(line_no)
                if not isinstance(parsed, dict):
                    # the first data line: a JSON document (not JSON Lines) starts so too; one too long to read is
                    # larger than JSON_DOCUMENT_MAX_BYTES, not checked
                    if planning and not ids and raw is not None:
                        _refuse_a_json_document(root, name)
                    if first_bad is None:
                        first_bad = (line_no, raw, parsed)
                    ids.append(invalid_line_id(name, line_no))
                    lengths.append(0)
                    invalid += 1
                    continue
                ids.append(self.checked_id(parsed.get(key), name, line_no, key))
                lengths.append(self.row_chars(parsed, spec) if sizes else 0)
        if planning and ids and invalid == len(ids) and first_bad is not None:
            _refuse_no_rows(name, len(ids), *first_bad)
        return _FileScan(ids, offsets, lengths, lines, invalid)


# A file whose first line is not a JSON object is read whole, up to this size, to tell a JSON document from JSON
# Lines with a bad first line. Not larger than lines.JSONL_LINE_MAX_BYTES: a first line too long to parse is in a
# file too large to check.
JSON_DOCUMENT_MAX_BYTES = 64 << 20


def _refuse_a_json_document(root: Storage, name: str) -> None:
    """DatasetError when ``name`` is one JSON value (a pretty-printed object or array: a schema file, an export as
    a JSON array), not JSON Lines: read as lines, each of its lines would be an ``INVALID_JSON`` row. JSON Lines of
    two or more rows never parse as one value; a file too large to check is read as lines."""
    if root.size(name) > JSON_DOCUMENT_MAX_BYTES:
        return
    doc = parse_line(root.read_bytes(name), first=True)
    if isinstance(doc, Unreadable):
        return
    kind = "an object" if isinstance(doc, dict) else "an array" if isinstance(doc, list) else f"a {type(doc).__name__}"
    raise DatasetError(
        f"input file {name} is one JSON document ({kind}), not JSON Lines (one object per line, a row each); "
        "move it out of the input folder, or write its rows as JSON Lines"
    )


def _refuse_no_rows(name: str, lines: int, line_no: int, raw: bytes | None, parsed: Any) -> None:
    """DatasetError for a file in which no line is a JSON object: not JSON Lines at all (the plan would make each of
    its lines an ``INVALID_JSON`` row, a pretty-printed object's every line, or one row for a whole file of rows),
    with the likely cause when its bytes show one."""
    why = parsed.why if isinstance(parsed, Unreadable) else f"a JSON {type(parsed).__name__}, not an object"
    hint = ""
    if raw is not None:
        head = raw.removeprefix(_BOM).lstrip(b" \t\r\n")
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in raw[:4]:
            hint = "; it looks UTF-16 encoded: JSON Lines is UTF-8"
        elif b"\r" in raw.rstrip(b"\r\n"):
            hint = "; its lines end in a carriage return alone (\\r): JSON Lines ends each line with \\n"
        elif head.startswith((b"{", b"[")) and lines > 1:
            hint = (
                "; it looks like JSON values written over several lines each (pretty-printed): write one object a "
                "line (e.g. jq -c)"
            )
        elif head.startswith(b"{"):
            hint = "; several JSON values on one line? JSON Lines puts each on its own line"
    raise DatasetError(
        f"input file {name}: none of its {lines:,} line(s) is a JSON object, so it holds no row to run (line "
        f"{line_no} is {why}){hint}. Fix or remove the file; JSON Lines is one JSON object a line"
    )


def _checked_id(rid: Any, name: str, line_no: int, key: str) -> str:
    if rid is None or isinstance(rid, (dict, list, bool)) or rid == "":
        raise DatasetError(f"{name} line {line_no}: missing or invalid id field {key!r}")
    if isinstance(rid, float):  # 1.10 would be the id "1.1", 1e2 "100.0"; NaN and Infinity are no ids at all
        raise DatasetError(
            f"{name} line {line_no}: id field {key!r} is the number {rid!r}, not a string or an integer "
            "(its text would not be the line's): quote it"
        )
    if is_blank_id(str(rid)):
        raise DatasetError(
            f"{name} line {line_no}: id field {key!r} is {str(rid)!r}, only whitespace; "
            "an id must have a visible character"
        )
    if not is_unicode(str(rid)):
        raise DatasetError(
            f"{name} line {line_no}: id field {key!r} is not valid Unicode (an unpaired surrogate escape)"
        )
    return str(rid)


def _check_distinct(ids: pa.ChunkedArray, names: list[str], file_rows: list[int], lines: np.ndarray) -> None:
    """DatasetError naming duplicate ids and the lines of the first one."""
    n = len(ids)
    if n == 0:
        return
    distinct = pc.count_distinct(ids).as_py()
    if distinct != n:
        import duckdb

        tbl = pa.table({"id": ids})  # noqa: F841 (read by name in the SQL: a DuckDB replacement scan)
        rel = duckdb.sql("SELECT id, count(*) AS n FROM tbl GROUP BY id HAVING n > 1 ORDER BY n DESC, id LIMIT 5")
        assert rel is not None  # a SELECT always gives a relation
        dups = rel.fetchall()
        pos = pc.indices_nonzero(pc.equal(ids, dups[0][0])).to_pylist()[:2]
        starts = np.cumsum([0] + list(file_rows))
        at = [f"{names[int(np.searchsorted(starts, p, side='right')) - 1]} line {int(lines[p])}" for p in pos]
        raise_duplicates(n, distinct, dups, at)
