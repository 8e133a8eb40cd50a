"""The worker's check of the local model and tokenizer folders it loads against the plan's pins.

The plan seals each file's name, size and sha256 of a local ``model.name`` / ``model.tokenizer`` folder when
the result cache is on (``Plan.weights``, ``core/weights.py``). The engine reads the weights once, when it
starts; ``WeightsCheck`` hashes the folders in background threads while it loads and infers, so the check adds
no engine-start latency: one pass starts just before each engine start (``bracket``) and one right after it,
so that a folder swapped before the load and put back after it is seen by one of them. ``settled`` says
whether every pass started so far has found the planned bytes (a mismatch raises ``InputChangedError``,
terminal, naming the file); the shard seals a chunk only once the passes that bracket its engine have settled
and commits only after ``wait``. What hashing cannot see: a folder changed and restored within one engine's
load, between the two passes' reads of a file (docs/security.md).
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


class WeightsCheck:
    """Background passes of ``check_folder`` over the pins (none: nothing to check, always settled)."""

    def __init__(self, pins: list[WeightsPin]) -> None:
        self.pins = pins
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._blocks = 0  # blocks hashed so far, all passes: progress for the watchdog while ``wait`` waits

    def start(self, when: str) -> None:
        """Start one pass over every pin (``when``: for the log)."""
        if not self.pins:
            return
        t = threading.Thread(target=self._pass, args=(when,), name=f"weights-check-{when}", daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _pass(self, when: str) -> None:
        try:
            for p in self.pins:
                check_folder(p, self._tick)
            if not self._stop.is_set():
                log.info("weights check (%s): %s", when, ", ".join(f"{p.role} {p.name} as planned" for p in self.pins))
        except BaseException as e:  # kept for settled()/wait() to raise in the shard's thread
            with self._lock:
                self._error = self._error or e

    def _tick(self) -> bool:
        """Called by ``check_folder`` between blocks: counts one, and says whether to stop."""
        self._blocks += 1
        return self._stop.is_set()

    def bracket(self, factory: Callable[[JobSpec], Any]) -> Callable[[JobSpec], Any]:
        """``factory`` with a pass started before and after each engine it makes (a restart loads again)."""
        if not self.pins:
            return factory

        def make(spec: JobSpec) -> Any:
            self.start("before load")
            engine = factory(spec)
            self.start("after load")
            return engine

        return make

    def settled(self) -> bool:
        """True when every pass started so far has finished; raises the first pass's mismatch."""
        with self._lock:
            if self._error is not None:
                raise self._error
            return all(not t.is_alive() for t in self._threads)

    def wait(self, beat: Callable[[], None] = lambda: None) -> None:
        """Wait for every pass; raise the first mismatch. ``beat()`` whenever the passes hashed more (the
        worker's watchdog: hashing that moves is progress, a read that hangs is a stall)."""
        seen = self._blocks
        for t in list(self._threads):
            while t.is_alive():
                t.join(0.1)
                if self._blocks != seen:
                    seen = self._blocks
                    beat()
        self.settled()

    def close(self) -> None:
        """Let running passes stop at their next block (the shard is ending)."""
        self._stop.set()
