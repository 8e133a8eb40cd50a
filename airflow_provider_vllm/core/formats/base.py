"""The input-format interface: what the planner and the worker ask of a format.

``InputFormat.scan`` checks a whole input once for the planner (ids present, valid and
distinct; per-row prompt sizes; row counts); ``InputFormat.read_rows`` is the one call the
worker reads a segment of its shard with. Rows are addressed by (file, first row, row count)
in the file's own order (JSONL also by byte offset and line number), so the planner and the
worker agree on a shard's rows without sharing any state but the plan.
"""

from __future__ import annotations

import datetime as dt
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from airflow_provider_vllm.core.errors import DatasetError
from airflow_provider_vllm.core.storage import Storage

if TYPE_CHECKING:
    from airflow_provider_vllm.core.plan import Segment
    from airflow_provider_vllm.core.spec import JobSpec

# An id that is empty or only whitespace cannot name a row: refused by the plan in every format.
# Whitespace is Python's (str.isspace); this RE2 pattern (DuckDB, Parquet ids) matches exactly
# the same characters (tests/unit/steps/plan/test_plan_refusals.py checks every code point).
BLANK_ID_PATTERN = r"^[\s\x{0b}\x{1c}-\x{1f}\x{85}\p{Z}]*$"


def is_blank_id(value: str) -> bool:
    """True for '' and for ids made only of whitespace (the JSONL / OpenAI batch side of the rule)."""
    return not value.strip()


def is_unicode(text: str) -> bool:
    """False for strings JSON can carry but UTF-8 cannot (unpaired surrogates from ``\\ud800`` escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class NanoTimestamp:
    """A value of a nanosecond timestamp column, as the worker reads it (``parquet._values``), whether pandas is
    installed or not (pyarrow gives pandas' ``Timestamp`` then, else a ``datetime`` or, for a value with nanoseconds
    past its microseconds, a ValueError for the whole batch): ``at`` to the microsecond (a time zone's in UTC) and the
    ``nanos`` (0-999) past it."""

    at: dt.datetime
    nanos: int


@dataclass
class RowBatch:
    """Rows read from one segment: ids, the needed column values, per-row read faults and sizes."""

    ids: list[str]
    values: dict[str, list[Any]]
    faults: list[tuple[str, str] | None]  # (reason code, message) for rows that could not be read
    lines: list[int | None] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)  # characters of each row's prompt text (as the plan counts)
    # the passthrough columns (io.passthrough) of these rows, as read: never turned into Python values
    passthrough: pa.Table | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, other: RowBatch) -> None:
        self.ids += other.ids
        for k, v in other.values.items():
            self.values.setdefault(k, []).extend(v)
        self.faults += other.faults
        self.lines += other.lines
        self.chars += other.chars
        if other.passthrough is not None:
            self.passthrough = (
                other.passthrough
                if self.passthrough is None
                else pa.concat_tables([self.passthrough, other.passthrough])
            )

    def select(self, keep: np.ndarray) -> RowBatch:
        """The rows where ``keep`` (one bool per row) is true, in order."""
        pick = lambda xs: [x for x, k in zip(xs, keep) if k]  # noqa: E731
        return RowBatch(
            ids=pick(self.ids),
            values={c: pick(v) for c, v in self.values.items()},
            faults=pick(self.faults),
            lines=pick(self.lines),
            chars=pick(self.chars),
            passthrough=None
            if self.passthrough is None
            else self.passthrough.filter(pa.array(np.asarray(keep, dtype=bool))),
        )


@dataclass
class RowRuns:
    """Per-row values as runs: ``counts[i]`` consecutive rows hold ``values[i]`` (footer estimates)."""

    values: np.ndarray
    counts: np.ndarray

    def expand(self) -> np.ndarray:
        return np.repeat(np.asarray(self.values, np.int64), np.asarray(self.counts, np.int64))


@dataclass
class RowGroups:
    """Consecutive groups of rows, in input order, each within one file; their per-row characters on demand.

    ``counts``: rows per group; ``files``: the groups of each file, in order (a list of group indices);
    ``chars(g)``: per row of group ``g``, the characters of its prompt text; ``chars_of_file(f)``: the
    (group, chars) of file ``f``'s groups in order (one open file).
    """

    counts: np.ndarray
    files: list[list[int]]
    chars: Callable[[int], np.ndarray]
    chars_of_file: Callable[[int], Iterator[tuple[int, np.ndarray]]]


def array_groups(chars: np.ndarray, file_rows: list[int], rows_per_group: int = 1 << 20) -> RowGroups:
    """Row groups over a per-row array already in memory (line-addressed formats): slices, no copies."""
    bounds: list[tuple[int, int]] = []
    files: list[list[int]] = []
    pos = 0
    for n in file_rows:
        mine = []
        for a in range(pos, pos + n, rows_per_group):
            mine.append(len(bounds))
            bounds.append((a, min(pos + n, a + rows_per_group)))
        files.append(mine)
        pos += n
    counts = np.asarray([b - a for a, b in bounds], np.int64)

    def one(g: int) -> np.ndarray:
        a, b = bounds[g]
        return chars[a:b]

    return RowGroups(counts, files, one, lambda f: ((g, one(g)) for g in files[f]))


class Scan:
    """What the planner needs of a whole input: per-row sizes and where each file's rows are.

    ``chars``: per row, the characters of the prompt text (the token estimate's basis). A
    format that sizes rows from footers gives ``runs`` instead (one value per row group): the
    planner then never builds a per-row array; ``chars`` expands the runs when asked.
    ``groups``: exact per-row sizes read group by group on demand (Parquet row groups,
    ``RowGroups``), never all in memory. ``offsets`` / ``lines``: per row, the byte offset
    and line number of its line (line-addressed formats); ``invalid``: lines that are not a JSON object
    (they become error rows).
    """

    def __init__(
        self,
        chars: np.ndarray | None = None,
        file_rows: list[int] | None = None,
        offsets: np.ndarray | None = None,
        lines: np.ndarray | None = None,
        invalid: int = 0,
        runs: RowRuns | None = None,
        groups: RowGroups | None = None,
    ) -> None:
        if sum(x is not None for x in (chars, runs, groups)) != 1:
            raise ValueError("Scan: give exactly one of chars (per row), runs or groups")
        self._chars, self.runs, self.groups = chars, runs, groups
        self.file_rows = list(file_rows or [])
        self.offsets, self.lines, self.invalid = offsets, lines, invalid

    @property
    def chars(self) -> np.ndarray:
        if self.groups is not None:  # every group read: only for small inputs (tests)
            parts = [self.groups.chars(g) for g in range(len(self.groups.counts))]
            return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        if self._chars is None:
            assert self.runs is not None
            return self.runs.expand()
        return self._chars


class InputFormat(ABC):
    """One input format. Instances are stateless; get them with ``core.formats.input_format``."""

    name: str
    #: rows are whole requests (the worker prepares ``values["_request"]``), not template columns
    carries_requests: bool = False

    @abstractmethod
    def scan(self, root: Storage, names: list[str], spec: JobSpec, per_row: bool) -> Scan:
        """Check the input (DatasetError for a fault no row error can carry) and size its rows.

        ``per_row``: exact per-row sizes are needed (a format may estimate them otherwise).
        """

    @abstractmethod
    def read_rows(
        self, root: Storage, name: str, segment: Segment, spec: JobSpec, passthrough: list[str] | None = None
    ) -> RowBatch:
        """The segment's rows of file ``name``, with the columns the spec's prompt needs (the template's, the
        adapter column) and, as an Arrow table in ``RowBatch.passthrough``, the ``passthrough`` columns.

        Rows that cannot be read carry a fault (reason code, message) instead of values.
        """

    @abstractmethod
    def file_ids(self, root: Storage, name: str, spec: JobSpec) -> list[str]:
        """Every row id of one file, in order (the merge's independent check of the output)."""


def row_columns(spec: JobSpec) -> list[str]:
    """The columns of a row the worker reads besides its id: the template's, then the adapter column."""
    cols = list(spec.prompt.columns)
    ac = spec.model.adapter_column
    return cols + [ac] if ac is not None and ac not in cols else cols


def raise_duplicates(n: int, distinct: int, dups: list[tuple], first_at: list[str]) -> None:
    """DatasetError naming the duplicate ids (``dups``: (id, count), most frequent first) and where."""
    examples = ", ".join(f"{str(r[0])!r} x{r[1]}" for r in dups)
    raise DatasetError(
        f"{n - distinct} duplicate id(s) in the input ({n} rows, {distinct} distinct); e.g. "
        f"{examples}; {str(dups[0][0])!r} is at {' and '.join(first_at)}"
    )
