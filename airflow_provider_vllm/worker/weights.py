"""The worker's check of the local model and tokenizer folders it loads against the plan's pins.

The plan seals each file's name, size and sha256 of a local ``model.name`` / ``model.tokenizer`` folder when
the result cache is on (``Plan.weights``, ``core/weights.py``). The engine reads the weights when it starts
(again at each rebuild after an out-of-memory error); ``WeightsCheck`` hashes the folders in background
threads (a pass: every pinned file, one after another) while it loads and infers, so the check adds no
engine-start latency. ``settled`` says whether every pass asked for so far has ended having found the planned
bytes (a mismatch raises ``InputChangedError``, terminal, naming the file); the shard seals a chunk only once
the passes asked for up to then have settled (so those covering its engine's load) and commits only after
``wait``.

Which passes (``bracket``), for each engine the factory makes:

- after its load returns, a pass is asked for (``start``): it starts then, or, while ``MAX_PASSES`` (2) run,
  when one of them ends. Either way it reads every file after the load; it is never skipped nor replaced by
  a pass that started earlier. Requests queued together share one pass, which starts after all of them.
- before its load, a pass starts only when none is running. A pass still running then (it started before
  this load: the previous engine's after pass, say) reads the files it has not read yet while the engine
  loads, as a fresh one would; the files it already read are read next by the after pass.

So a shard whose engine is rebuilt r times while a pass runs makes at most 1 + (1 + r) passes, never more
than 2 at once (a rebuild that finds every pass ended starts a fresh one before its load, as the first engine
does: 2 x (1 + r) at the most, spread out).

What hashing cannot see: a file the engine read while it held other bytes, but which held the planned bytes at
each of the check's reads of it (changed after the check's last read of it before the engine's and put back
before its next one). A change still there when the after pass reads the file (a re-sync to another version)
is always found. docs/security.md calls this a folder changed and restored within one engine's load, between
two passes' reads of a file; it was never exactly within the load (the before pass reads the files one after
another, the engine in its own order: a file changed before the load and put back before that pass reached it
went unseen too). Coalescing widens it in two ways, both still a change put back before a read made after the
load: (1) for a rebuilt engine whose load starts while a pass runs, a file that pass had already read was last
read before the load began (after that pass started) where a fresh pass would have read it during the load, so
a change made between that read and the load, put back after the engine read the file and before the after
pass does, goes unseen; (2) an after pass queued behind two running ones reads later than one started at once,
so a change has longer to be put back. Only a read-only mount closes the class.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import Plan
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.weights import WeightsPin, check_folder

log = logging.getLogger("airflow_provider_vllm.worker")


def check_pins(spec: JobSpec, plan: Plan) -> list[WeightsPin]:
    """The plan's pins, checked against the spec: each names the spec's folder for its role, and a key config
    that fingerprints a folder has its pin (a plan without one was made before the pins: plan again).
    SpecError otherwise."""
    names = {"model": spec.model.name, "tokenizer": spec.model.tokenizer}
    for p in plan.weights:
        if names[p.role] != p.name:
            raise SpecError(f"the plan pins model.{p.role} {p.name!r}, the spec names {names[p.role]!r}; plan again")
    if plan.cache is not None:
        keyed = plan.cache.key_config.get("model", {})
        pinned = {p.role: p for p in plan.weights}
        for role, field in (("model", "weights_sha256"), ("tokenizer", "tokenizer_sha256")):
            if field not in keyed:
                continue
            if role not in pinned or pinned[role].fingerprint() != keyed[field]:
                raise SpecError(
                    f"the plan keys the cache by the {role} folder's fingerprint but pins no files of it that make it "
                    "(a plan made before the pins): the worker cannot check the folder it loads; plan the run again"
                )
    return list(plan.weights)


MAX_PASSES = 2  # passes hashing at once per check: a third waits for one of them to end


class WeightsCheck:
    """Background passes of ``check_folder`` over the pins (none: nothing to check, always settled).

    At most ``MAX_PASSES`` run at once; a pass asked for while they run is queued and starts when one of them
    ends (several queued requests share that one pass: it starts after each of them was asked for)."""

    def __init__(self, pins: list[WeightsPin]) -> None:
        self.pins = pins
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when a pass ends
        self._running = 0  # passes started and not ended
        self._queued: str | None = None  # the log label of the pass to start when a running one ends
        self._cut = False  # a pass was stopped by close() before it read every file, or a queued one never started
        self._blocks = 0  # blocks hashed so far, all passes: progress for the watchdog while ``wait`` waits
        self._blocks_lock = threading.Lock()  # the passes' threads count side by side: one increment at a time

    def start(self, when: str) -> None:
        """Start a pass over every pin (``when``: for the log): now, or when a running one ends while
        ``MAX_PASSES`` run. Either way its reads all begin after this call."""
        if not self.pins:
            return
        with self._lock:
            if self._running >= MAX_PASSES:
                self._queued = when if self._queued is None else f"{self._queued}, {when}"
                return
            self._running += 1
        self._spawn(when)

    def _spawn(self, when: str) -> None:
        """Start the thread of a pass already counted in ``_running``."""
        try:
            threading.Thread(target=self._pass, args=(when,), name=f"weights-check-{when}", daemon=True).start()
        except BaseException as e:  # no thread: the pass never ends by itself, and the check cannot vouch
            with self._lock:
                self._running -= 1
                self._error = self._error or e
                self._changed.notify_all()
            raise

    def _cover_load(self) -> None:
        """Before an engine loads: a pass that reads the files while it loads. One still running (it started
        earlier) does, for the files it has not read yet (module docstring); else a fresh one."""
        with self._lock:
            if self._running:
                log.info("weights check (before load): a pass still running covers this load")
                return
        self.start("before load")

    def _pass(self, when: str) -> None:
        try:
            for p in self.pins:
                check_folder(p, self._tick)
            if self._stop.is_set():  # stopped at a block by close(): it vouches for nothing
                with self._lock:
                    self._cut = True
            else:
                log.info("weights check (%s): %s", when, ", ".join(f"{p.role} {p.name} as planned" for p in self.pins))
        except BaseException as e:  # kept for settled()/wait() to raise in the shard's thread
            with self._lock:
                self._error = self._error or e
        finally:
            with self._lock:
                queued, self._queued = self._queued, None
                if queued is not None and (self._error is not None or self._stop.is_set()):
                    # the shard fails or ends anyway; a pass asked for that never runs vouches for nothing
                    self._cut = self._cut or self._error is None
                    queued = None
                if queued is None:
                    self._running -= 1
                self._changed.notify_all()
            if queued is not None:  # this pass's slot goes to it
                self._spawn(queued)

    def _tick(self) -> bool:
        """Called by ``check_folder`` between blocks: counts one, and says whether to stop. Passes run in threads
        side by side: the count's read and write are one step under its own lock (not ``_lock``, so that counting a
        block never waits on ``start``, ``settled`` or ``wait``), else a switch between them loses a count."""
        with self._blocks_lock:
            self._blocks += 1
        return self._stop.is_set()

    def bracket(self, factory: Callable[[JobSpec], Any]) -> Callable[[JobSpec], Any]:
        """``factory`` with a pass covering each engine's load and one started after it (a restart loads again)."""
        if not self.pins:
            return factory

        def make(spec: JobSpec) -> Any:
            self._cover_load()
            engine = factory(spec)
            self.start("after load")
            return engine

        return make

    def settled(self) -> bool:
        """True when every pass asked for so far has ended having read every file (none running or queued, none
        cut short by ``close`` nor kept by it from starting); raises the first pass's mismatch."""
        with self._lock:
            if self._error is not None:
                raise self._error
            return self._running == 0 and self._queued is None and not self._cut

    def wait(self, beat: Callable[[], None] = lambda: None) -> None:
        """Wait for every pass, queued ones included; raise the first mismatch. ``beat()`` whenever the passes
        hashed more (the worker's watchdog: hashing that moves is progress, a read that hangs is a stall)."""
        seen = self._blocks
        while True:
            with self._changed:
                if self._running == 0 and self._queued is None:
                    break
                self._changed.wait(0.1)
            if self._blocks != seen:
                seen = self._blocks
                beat()
        self.settled()

    def close(self) -> None:
        """Let running passes stop at their next block and start no queued one (the shard is ending)."""
        self._stop.set()
