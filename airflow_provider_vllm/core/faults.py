"""Fault injection for tests and drills: ``VLLM_BATCH_FAULTS`` names where a process fails.

Syntax: comma-separated items ``POINT[@ROW_ID][#N[+]]=ACTION``, e.g.
``VLLM_BATCH_FAULTS="chunk.mid_file#2=kill,engine.step#3=oom,engine.step@t0007=oom"``.

* ``POINT``: one of ``POINTS`` (the commit steps of worker chunks, the shard commit marker
  and merge outputs, the engine step, the plan load, row reads, the reuse scan and the result cache).
* ``@ROW_ID``: only when that row is among those the hook reports (``engine.step``: the
  requests the FCFS scheduler runs now); a row that brings OOM with it.
* ``#N``: only the N-th matching hit in this process (1-based); ``#N+``: the N-th and every
  later one; no ``#``: every matching hit.
* ``ACTION``: ``kill`` (SIGKILL this process: no clean-up, like a lost node), ``raise``
  (``InjectedFault``), ``hang`` (sleep until killed; signals still run), ``oom`` (an
  out-of-memory error: ``torch.OutOfMemoryError`` where torch is importable), ``dead`` (the
  engine dies: the engine hook kills vLLM's engine core process; elsewhere ``raise``).

Unset (the normal case) every hook is one ``is None`` check. The variable is read at import
and by ``reload()``. The local runner's ``VLLM_BATCH_INJECT_EXIT`` is a different hook: it
replaces a whole Airflow try by map index and try number, which this process cannot know.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from airflow_provider_vllm.core import envs

ENV = envs.FAULTS.name

POINTS = frozenset(
    {
        # a worker chunk's two files (commit.ShardStore.write_chunk): errors part, between, ok part,
        # both parts visible with no seal yet, the seal visible
        "chunk.before_write",
        "chunk.mid_file",
        "chunk.between_parts",
        "chunk.before_seal",
        "chunk.after_write",
        # the shard commit marker (commit.ShardStore.commit): every chunk visible, no marker yet;
        # marker temp file half written; marker visible
        "commit.after_data",
        "commit.mid_marker",
        "commit.after_marker",
        # the changes output (steps.merge.changes.compute_changes): changes.parquet, then _changes.json
        "changes.before_write",
        "changes.mid_file",
        "changes.after_data",
        "changes.mid_marker",
        "changes.after_marker",
        # merge outputs (merge.merge): before any part, a part copy half done, after each part is
        # published, after both _manifest.json files, before / amid / after _MERGED.json
        "merge.before_write",
        "merge.mid_file",
        "merge.between_parts",
        "merge.after_manifests",
        "merge.after_data",
        "merge.mid_marker",
        "merge.after_marker",
        # one engine step (worker.guard.GuardedEngine.step)
        "engine.step",
        # the worker's other phases (worker.shard): before the plan is read, before each input
        # segment is read, before each earlier attempt's chunk seal is read in the reuse scan
        "plan.load",
        "read.segment",
        # the plan step: _plan.json's temp file half written (nothing visible yet)
        "plan.mid_marker",
        "reuse.footer",
        # the result cache (steps.cache.result_cache): in plan, before the hits/misses files and after them (no
        # plan yet); in merge, the entry's part visible with no commit marker, the marker's temp file
        # half written, the marker visible (the merge summary not yet)
        "cache.before_files",
        "cache.after_files",
        "cache.entry_data",
        "cache.mid_commit",
        "cache.after_commit",
        # publish's vouch for the run's cache entry (steps.cache.store.CacheStore.vouch; compaction's too): before the
        # record, its temp file half written
        "cache.before_vouch",
        "cache.mid_vouch",
        # each distinct prompt once (steps.cache.dedupe): the plan's followers file written (no _plan.json yet);
        # merge's follower parts staged under _cache/ (nothing published yet)
        "dedupe.after_followers",
        "dedupe.after_parts",
        # the golden rows that ride along (steps.golden): in plan, before their input file is written; in
        # merge, before golden/results.parquet and golden/errors.parquet, before golden/_golden.json
        "golden.before_file",
        "golden.before_write",
        "golden.before_summary",
    }
)
ACTIONS = frozenset({"kill", "raise", "hang", "oom", "dead"})

_ITEM = re.compile(r"^(?P<point>[a-z_.]+)(?:@(?P<row>[^#=]+))?(?:#(?P<n>\d+)(?P<plus>\+)?)?=(?P<action>[a-z]+)$")


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` action (and ``dead`` outside the engine)."""


@dataclass
class _Item:
    point: str
    row: str | None
    n: int | None
    plus: bool
    action: str
    seen: int = 0

    def fires(self, point: str, rows: Iterable[str]) -> bool:
        if point != self.point or (self.row is not None and self.row not in rows):
            return False
        self.seen += 1
        return self.n is None or self.seen == self.n or (self.plus and self.seen > self.n)


def parse(text: str) -> list[_Item]:
    """The items of a ``VLLM_BATCH_FAULTS`` value; ValueError naming the bad item."""
    items = []
    for raw in re.split(r"[,;]", text):
        raw = raw.strip()
        if not raw:
            continue
        m = _ITEM.match(raw)
        if not m:
            raise ValueError(f"{ENV}: {raw!r} is not POINT[@ROW_ID][#N[+]]=ACTION")
        if m["point"] not in POINTS:
            raise ValueError(f"{ENV}: unknown point {m['point']!r}; points: {sorted(POINTS)}")
        if m["action"] not in ACTIONS:
            raise ValueError(f"{ENV}: unknown action {m['action']!r}; actions: {sorted(ACTIONS)}")
        n = int(m["n"]) if m["n"] else None
        if n == 0:
            raise ValueError(f"{ENV}: {raw!r}: hits count from 1")
        items.append(_Item(m["point"], m["row"], n, bool(m["plus"]), m["action"]))
    return items


_ITEMS: list[_Item] | None = None
_WRITING: contextvars.ContextVar[str | None] = contextvars.ContextVar("vllm_batch_fault_writing", default=None)


def reload(env: dict[str, str] | None = None) -> None:
    """(Re-)read the variable; hit counters start again."""
    global _ITEMS
    raw = envs.FAULTS.get(env) or ""
    _ITEMS = parse(raw) or None if raw else None


def active() -> bool:
    return _ITEMS is not None


def hit(point: str, rows: Iterable[str] = (), handles: Iterable[str] = ()) -> str | None:
    """Count a pass through ``point``; perform the action of a matching item.

    Actions named in ``handles`` are returned for the caller to perform (the engine hook
    handles ``oom``, ``dead``); others are performed here. Returns None when nothing fires.
    """
    if _ITEMS is None:
        return None
    rows = rows if isinstance(rows, (set, frozenset)) else set(rows)
    for item in _ITEMS:
        if item.fires(point, rows):
            print(f"{ENV}: {item.action} at {point} (hit {item.seen})", file=sys.stderr, flush=True)
            if item.action in handles:
                return item.action
            perform(item.action, point)
    return None


def perform(action: str, point: str) -> None:
    """Do ``action`` here (kill, hang and raise never return)."""
    if action == "kill":
        sys.stderr.flush()
        redact = sys.modules.get("airflow_provider_vllm.worker.redact")
        if redact is not None:  # the worker's redacted streams: let what was written reach the log first
            redact.settle()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is asynchronous; never run on
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "oom":
        raise out_of_memory(f"injected at {point}")
    raise InjectedFault(f"{action} injected at {point}")


def out_of_memory(message: str) -> Exception:
    """The exception a real OOM raises: ``torch.OutOfMemoryError`` when torch is importable."""
    try:
        import torch

        return torch.OutOfMemoryError(f"CUDA out of memory ({message})")
    except ImportError:
        return MemoryError(f"out of memory ({message})")


@contextlib.contextmanager
def writing(point: str) -> Iterator[None]:
    """Within the block, ``write`` treats a file as the ``point`` write (a ``*.mid_file``/``*.mid_marker``)."""
    if _ITEMS is None:
        yield
        return
    token = _WRITING.set(point)
    try:
        yield
    finally:
        _WRITING.reset(token)


def write(f, data: bytes) -> None:
    """``f.write(data)``; inside ``writing(point)`` with faults set, half the bytes reach the
    disk (flushed, fsynced) before ``point`` is hit: what a writer killed mid-file leaves."""
    point = _WRITING.get() if _ITEMS is not None else None
    if point is None:
        f.write(data)
        return
    half = len(data) // 2
    f.write(data[:half])
    f.flush()
    os.fsync(f.fileno())
    hit(point)
    f.write(data[half:])


def partial_copy(src: str, dst: str, point: str) -> None:
    """With faults set: half of ``src`` copied to ``dst`` before ``point`` is hit (a move across
    filesystems killed mid-copy); the caller then moves ``src`` over ``dst`` as usual."""
    if _ITEMS is None:
        return
    with open(src, "rb") as s, writing(point), open(dst, "wb") as d:
        write(d, s.read())


def partial_copy_into(src, dst, point: str | None) -> None:
    """``partial_copy`` between open files: with faults set and a ``point``, all of ``src`` written to ``dst``, half
    of it before ``point`` is hit (what a copy killed half-way leaves); nothing otherwise."""
    if _ITEMS is None or point is None:
        return
    with writing(point):
        write(dst, src.read())


reload()
