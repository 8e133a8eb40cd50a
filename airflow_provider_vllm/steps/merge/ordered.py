"""Exactly-once by order: each shard's committed rows, position by position, against its own input rows.

The plan gives every shard a list of input row ranges (``Segment``: file, start, count) and the shards' ranges
tile the input files (checked here against the files' footers: no row in two shards, none in no shard). A
worker reads its ranges in order and writes every row exactly once, in that order, into its chunks, each chunk
split into an ok part and an error part that keep the order (``core.rows.split_rows``). So, per shard, with
``S`` its input ids in order, ``OK`` the ids of its ok parts and ``ERR`` those of its error parts (marker order):

    S with the rows whose id is in ERR removed   ==  OK,  element by element
    S with only those rows                       ==  ERR, element by element

Both equalities together pair every input row with exactly one committed row of the same id and leave no
committed row unpaired: a missing, duplicated, foreign, reordered or moved row, or a row of another shard's
range, breaks one of them. The check is exact string comparison (the membership test only picks which
side a row is compared on; a wrong pick fails a comparison, it cannot hide a row). It streams shard by
shard: memory is a few shards' ids and the input row groups they overlap, never a hash table of the run.

It applies when every shard reads its rows from the input itself in plan order (Parquet input, no result
cache, no dedupe followers, no length buckets): ``why_not``. Merge uses the id semi-join otherwise, and when
this check fails, to count duplicates and name ids (``steps/merge/merger.py``).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from airflow_provider_vllm.core.formats.parquet import parquet_metadata
from airflow_provider_vllm.core.plan import Plan, ShardPlan
from airflow_provider_vllm.core.storage import Storage

THREADS = 4  # shards checked side by side (Parquet decoding and the compute kernels release the GIL)
EXAMPLES = 5  # shards named in a failure


def why_not(plan: Plan) -> str | None:
    """Why the order-based check does not apply to this plan (merge uses the id semi-join), or None."""
    if plan.format != "parquet":
        return f"the input is {plan.format}"
    if plan.cache is not None:
        return "result cache hits are published from their own part, in the cache's order"
    if plan.dedupe is not None and plan.dedupe.followers_file is not None:
        return "repeated prompts: shards read their leaders' file, followers get their own part"
    for s in plan.shards:
        if s.input_file is not None:
            return f"shard {s.shard_id} reads its own input file"
        if s.bucket != "all":
            return f"shard {s.shard_id} holds only its segments' {s.bucket} rows"
    return None


@dataclass
class ShardParts:
    """One shard's committed parts, in its marker's chunk order (paths under the output prefix), the rows of
    each that merge drops as identical duplicates (positions in the part), and, for the parts in ``local``, the
    local file to read instead of the output prefix (a copy checked against the part's sealed marker)."""

    ok: list[str]
    errors: list[str]
    drop: dict[str, list[int]] = field(default_factory=dict)
    local: dict[str, str] = field(default_factory=dict)


def check(
    out: Storage, in_root: Storage, plan: Plan, id_column: str, parts: dict[str, ShardParts], threads: int = THREADS
) -> list[str]:
    """What breaks exactly-once-in-order, one finding per failing shard (first ``EXAMPLES``); [] when proven.

    ``parts``: shard id -> its committed parts (every shard of ``plan`` must have an entry, even an empty one).
    A finding names the shard, the part and row, the input file and row, and the ids on both sides.
    """
    names = [f.path for f in plan.files]
    metas = [parquet_metadata(in_root, n) for n in names]
    tiling = _tiling(plan, [m.num_rows for m in metas], names)
    if tiling:
        return tiling
    unknown = sorted(set(parts) - {s.shard_id for s in plan.shards})
    if unknown:
        return [f"parts of shard(s) {unknown[:EXAMPLES]} that are not in the plan"]
    source = _InputIds(in_root, names, metas, id_column, plan.shards)
    findings: list[str] = []

    def one(shard: ShardPlan) -> str | None:
        try:
            return _check_shard(out, shard, source.ids(shard), parts.get(shard.shard_id, ShardParts([], [])), names)
        finally:
            source.release(shard)

    n = max(1, min(threads, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=n) as pool:
        # a bounded window of shards in flight: memory stays a few shards' ids and the row groups they overlap
        pending = []
        for shard in plan.shards:
            pending.append(pool.submit(one, shard))
            if len(pending) >= 2 * n:
                if (f := pending.pop(0).result()) is not None:
                    findings.append(f)
        for fut in pending:
            if (f := fut.result()) is not None:
                findings.append(f)
    return findings[:EXAMPLES] + (
        [f"... and {len(findings) - EXAMPLES} more shard(s)"] if len(findings) > EXAMPLES else []
    )


def _tiling(plan: Plan, file_rows: list[int], names: list[str]) -> list[str]:
    """The shards' segments cover every row of every input file exactly once, and add up to the plan's rows."""
    found: list[str] = []
    per_file: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for s in plan.shards:
        if sum(seg.count for seg in s.segments) != s.rows:
            found.append(f"shard {s.shard_id}: its segments hold {sum(g.count for g in s.segments)} rows, it {s.rows}")
        for seg in s.segments:
            if not 0 <= seg.file < len(names) or seg.start < 0 or seg.count < 0:
                found.append(f"shard {s.shard_id}: segment {seg.model_dump()} is outside the input")
                continue
            if seg.count:
                per_file[seg.file].append((seg.start, seg.count, s.shard_id))
    for fid, rows in enumerate(file_rows):
        pos, last = 0, "no shard"
        for start, count, sid in sorted(per_file.get(fid, [])):
            if start < pos:
                end = min(pos, start + count)
                found.append(f"input file {names[fid]} rows [{start}, {end}) are in shard {last} and in shard {sid}")
            elif start > pos:
                found.append(f"input file {names[fid]} rows [{pos}, {start}) are in no shard")
            if start + count >= pos:
                pos, last = start + count, sid
        if pos != rows:
            found.append(f"input file {names[fid]} has {rows} rows; the shards' segments end at row {pos}")
    if sum(file_rows) != plan.total_rows:
        found.append(f"the input files hold {sum(file_rows)} rows, the plan {plan.total_rows}")
    return found[:EXAMPLES]


class _InputIds:
    """The input's id column (as text, as the worker casts it), one row group at a time, shared by the shards that
    overlap it and dropped after the last of them."""

    def __init__(self, root: Storage, names: list[str], metas: list, id_column: str, shards: list[ShardPlan]) -> None:
        self.root, self.names, self.metas, self.id_column = root, names, metas, id_column
        self.starts = []  # per file: first row of each row group, then the file's rows
        for m in metas:
            rg = [m.row_group(g).num_rows for g in range(m.num_row_groups)]
            self.starts.append(np.concatenate([[0], np.cumsum(rg, dtype=np.int64)]).tolist())
        self.lock = threading.Lock()
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.refs: dict[tuple[int, int], int] = defaultdict(int)
        for s in shards:
            for key in self._groups(s):
                self.refs[key] += 1

    def _groups(self, shard: ShardPlan) -> list[tuple[int, int]]:
        keys: list[tuple[int, int]] = []
        for seg in shard.segments:
            if not seg.count:
                continue
            b = self.starts[seg.file]
            first = bisect.bisect_right(b, seg.start) - 1
            last = bisect.bisect_right(b, seg.start + seg.count - 1) - 1
            keys += [(seg.file, g) for g in range(first, last + 1) if (seg.file, g) not in keys]
        return keys

    def ids(self, shard: ShardPlan) -> pa.Array:
        """The shard's input ids in plan order (its segments, one after the other)."""
        pieces = []
        for seg in shard.segments:
            if not seg.count:
                continue
            b = self.starts[seg.file]
            g = bisect.bisect_right(b, seg.start) - 1
            pos = seg.start
            while pos < seg.start + seg.count:
                col = self._group(seg.file, g)
                lo, hi = pos - b[g], min(seg.start + seg.count, b[g + 1]) - b[g]
                pieces.append(col.slice(lo, hi - lo))
                pos = b[g + 1]
                g += 1
        return pa.concat_arrays(pieces) if pieces else pa.array([], pa.string())

    def release(self, shard: ShardPlan) -> None:
        with self.lock:
            for key in self._groups(shard):
                self.refs[key] -= 1
                if self.refs[key] <= 0:
                    self.slots.pop(key, None)

    def _group(self, fid: int, g: int) -> pa.Array:
        key = (fid, g)
        with self.lock:
            slot = self.slots.get(key)
            mine = slot is None
            if mine:
                slot = self.slots[key] = _Slot()
        assert slot is not None
        if mine:
            try:
                with self.root.open(self.names[fid]) as fh:
                    col = pq.ParquetFile(fh, metadata=self.metas[fid]).read_row_group(g, columns=[self.id_column])
                slot.value = _text(col.column(0))
            except BaseException as e:
                slot.error = e
                raise
            finally:
                slot.done.set()
        slot.done.wait()
        if slot.error is not None:
            raise slot.error
        assert slot.value is not None
        return slot.value


@dataclass
class _Slot:
    done: threading.Event = field(default_factory=threading.Event)
    value: pa.Array | None = None
    error: BaseException | None = None


def _text(col: pa.ChunkedArray) -> pa.Array:
    """Ids as the worker writes them (``core.formats.parquet.parquet_batch``: Arrow's cast to string)."""
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return arr if arr.type == pa.string() else arr.cast(pa.string())


def _part_ids(out: Storage, rel: str, drop: list[int] | None, local: str | None = None) -> pa.Array:
    if local is not None or out.is_local:
        ids = pq.ParquetFile(local if local is not None else out.path(rel)).read(columns=["id"]).column(0)
    else:
        with out.open(rel) as fh:
            ids = pq.ParquetFile(fh).read(columns=["id"]).column(0)
    arr = _text(ids)
    if drop:
        keep = np.ones(len(arr), dtype=bool)
        keep[[p for p in drop if 0 <= p < len(arr)]] = False
        arr = arr.filter(pa.array(keep))
    return arr


def _check_shard(out: Storage, shard: ShardPlan, expected: pa.Array, parts: ShardParts, names: list[str]) -> str | None:
    """None when the shard's parts hold its input rows in order, each once; else a finding naming the first break."""
    streams = {}
    for kind, rels in (("results", parts.ok), ("errors", parts.errors)):
        arrays = [_part_ids(out, r, parts.drop.get(r), parts.local.get(r)) for r in rels]
        streams[kind] = (rels, arrays)
    ok = _concat([a for a in streams["results"][1]])
    err = _concat([a for a in streams["errors"][1]])
    if len(err):
        on_err = pc.fill_null(pc.is_in(expected, value_set=err), False)
    else:
        on_err = pa.array(np.zeros(len(expected), dtype=bool))
    for kind, got, mask in (("results", ok, pc.invert(on_err)), ("errors", err, on_err)):
        want = expected if kind == "results" and not len(err) else expected.filter(mask)
        i = _first_difference(want, got)
        if i is None:
            continue
        rels, arrays = streams[kind]
        where_in = _input_row(shard, np.flatnonzero(np.asarray(mask))[i] if i < len(want) else None, names)
        if i < len(got):
            part, row = _locate(arrays, i)
            found = f"{kind} part {rels[part]} row {row} holds id {got[i].as_py()!r}"
            if i < len(want):
                return (
                    f"shard {shard.shard_id}: {found} where its input row {where_in} (id {want[i].as_py()!r}) "
                    f"comes in input order (a row missing, duplicated, reordered, or not this shard's)"
                )
            return f"shard {shard.shard_id}: {found} after its last input row of that kind (an extra row)"
        return (
            f"shard {shard.shard_id}: input row {where_in} (id {want[i].as_py()!r}) has no row in its {kind} parts "
            f"(they end after {len(got)} rows)"
        )
    return None


def _concat(arrays: list[pa.Array]) -> pa.Array:
    return pa.concat_arrays(arrays) if arrays else pa.array([], pa.string())


def _first_difference(a: pa.Array, b: pa.Array) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts at the shorter's end), or None."""
    m = min(len(a), len(b))
    if m:
        eq = pc.fill_null(pc.equal(a.slice(0, m), b.slice(0, m)), False)
        if not pc.all(eq).as_py():
            return int(pc.index(eq, False).as_py())
    return None if len(a) == len(b) else m


def _locate(arrays: list[pa.Array], i: int) -> tuple[int, int]:
    """(part index, row in the part) of position ``i`` of the parts' ids one after the other."""
    for n, a in enumerate(arrays):
        if i < len(a):
            return n, i
        i -= len(a)
    raise IndexError(i)


def _input_row(shard: ShardPlan, i: int | None, names: list[str]) -> str:
    """'<file> row <n>' of the shard's ``i``-th input row."""
    if i is None:
        return "(none left)"
    for seg in shard.segments:
        if i < seg.count:
            return f"{names[seg.file]} row {seg.start + i}"
        i -= seg.count
    return f"(beyond the shard's {shard.rows} rows)"
