"""JSON lines as the plan, the worker and format detection read them: each within a length and a nesting limit.

Both limits are decided from a line's bytes alone, so the plan (inside an Airflow task) and the shard worker (its
own process) always agree on which lines are rows with their own id and which are ``INVALID_JSON`` rows under a
synthetic id. Python's ``json.loads`` alone would not: its nesting limit is the recursion limit counted from the
caller's stack depth, and it reads a line of any length.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

JSONL_LINE_MAX_BYTES = 64 << 20
"""The longest line that is read, decoded and parsed (its line end included); a longer one is an ``INVALID_JSON``
row, skipped in blocks without being held. A row's text is a prompt: a million-token context is about 4 MiB of
text, 24 MiB as JSON ``\\u`` escapes, so no line a model can take is refused. Parsing one costs about three times
its size (bytes, text, objects): at most about 200 MiB of a task's memory per line, beside ``storage``'s
``RECORD_MAX_BYTES`` (256 MiB) for a record. The same bound as ``jsonl.JSON_DOCUMENT_MAX_BYTES``."""

JSON_MAX_DEPTH = 256
"""The deepest nesting of arrays and objects a line may have; a deeper one is an ``INVALID_JSON`` row. Checked on
the bytes before ``json.loads``, whose own limit (Python's recursion limit, 1000 frames, less those the caller's
stack holds) then never applies: 256 levels leave 700 frames to the caller."""

READ_BLOCK = 1 << 20  # bytes asked of the file per read


@dataclass(frozen=True)
class Unreadable:
    """A line that gives no JSON value; ``why`` completes "line is ..." in its error row."""

    why: str


NOT_JSON = Unreadable("not valid UTF-8 JSON")
TOO_DEEP = Unreadable(f"JSON nested deeper than {JSON_MAX_DEPTH} levels (the reader's limit, JSON_MAX_DEPTH)")


def too_long(size: int) -> Unreadable:
    """A line of ``size`` bytes, over the line limit."""
    return Unreadable(
        f"{size:,} bytes long, over the line limit of {JSONL_LINE_MAX_BYTES:,} bytes (JSONL_LINE_MAX_BYTES)"
    )


class LineReader:
    """The lines of a binary file from its current position, each with its size in bytes (line end included).

    A line longer than ``limit`` bytes (default ``JSONL_LINE_MAX_BYTES``) comes as None with its size: read on to
    its line end in blocks of ``READ_BLOCK`` bytes, no more than ``limit`` bytes of it held at once. Reads with
    ``read(n)`` only (fsspec's ``readline`` takes no limit). The plan's scan and the worker read lines with it, so
    both count the same lines and bytes."""

    def __init__(self, f: IO[bytes], limit: int | None = None) -> None:
        self._f = f
        self._limit = JSONL_LINE_MAX_BYTES if limit is None else limit
        self._buf = b""
        self._at = 0  # the next unread byte of _buf

    def next_line(self, read_on: bool = True) -> tuple[bytes | None, int]:
        """The next line and its size; ``(b"", 0)`` at the end of the file, ``(None, size)`` for a long line.
        ``read_on=False``: a long line comes as soon as it is over the limit, its size the bytes read of it (the
        reader is then within that line)."""
        nl = self._buf.find(b"\n", self._at)
        if 0 <= nl < self._at + self._limit:  # the common case: a whole line within the block read
            line, self._at = self._buf[self._at : nl + 1], nl + 1
            return line, len(line)
        parts: list[bytes] | None = []
        size = 0
        while True:
            if self._at >= len(self._buf):
                self._buf, self._at = self._f.read(READ_BLOCK), 0
                if not self._buf:
                    break  # end of the file: the last line has no line end
            nl = self._buf.find(b"\n", self._at)
            end = len(self._buf) if nl < 0 else nl + 1
            size += end - self._at
            if parts is not None:
                if size > self._limit:
                    parts = None  # too long: from here on only counted
                    if not read_on:
                        self._at = end
                        break
                else:
                    parts.append(self._buf[self._at : end])
            self._at = end
            if nl >= 0:
                break
        if parts is None:
            return None, size
        return (parts[0] if len(parts) == 1 else b"".join(parts)), size


_BRACKET_STEPS = bytes(
    1 if c in b"[{" else 0xFF if c in b"]}" else 0 for c in range(256)
)  # per byte: +1 opens, -1 (int8) closes, 0 neither
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def deeper_than(raw: bytes, limit: int = JSON_MAX_DEPTH) -> bool:
    """Whether ``raw`` nests arrays and objects more than ``limit`` levels deep, counting ``[`` and ``{`` outside
    strings (a ``\\"`` is no string's end). Linear in ``raw``, on no stack: the same answer in any caller. Bytes
    that are not JSON get some answer, the same each time (they are not JSON either way)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # most lines: fewer openers than the limit, strings or not
        return False
    return _max_depth(_outside_strings(raw)) > limit


_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)
"""A JSON string (``\\"`` does not end it), or an unterminated one to the end: possessive, so linear."""


def _outside_strings(raw: bytes) -> bytes:
    """The brackets of ``raw`` that are not inside a JSON string, in order."""
    return _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)


def _max_depth(brackets: bytes) -> int:
    """The greatest running count of openers less closers over ``brackets``, in blocks (no array of its size)."""
    steps = brackets.translate(_BRACKET_STEPS)
    depth = deepest = 0
    for start in range(0, len(steps), READ_BLOCK):
        run = np.cumsum(
            np.frombuffer(steps, np.int8, count=min(READ_BLOCK, len(steps) - start), offset=start), dtype=np.int64
        )
        deepest = max(deepest, depth + int(run.max()))
        depth += int(run[-1])
    return deepest


def parse_line(raw: bytes, first: bool) -> Any:
    """The JSON value of a line (``first``: a UTF-8 byte order mark may precede it), or ``NOT_JSON`` or
    ``TOO_DEEP``. The plan, the worker and format detection parse every line here, so they agree."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError:
        return NOT_JSON
    if deeper_than(raw):
        return TOO_DEEP
    try:
        return json.loads(text)
    except ValueError:
        return NOT_JSON
