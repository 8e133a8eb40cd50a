"""The progress watchdog: no progress for ``timeout_s`` -> ``on_stall`` (by default: exit 75).

A hung engine step blocks the main thread inside vLLM or a C extension, where neither an
exception nor a signal handler gets to run; so the watchdog is a daemon thread, and the
default ``on_stall`` ends the process from there (``exits.stalled``): failure manifest,
engine processes killed, ``os._exit(75)``. Every write of the commit protocol is atomic, so
stopping at any instant publishes nothing partial; committed chunks are reused by the retry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("airflow_provider_vllm.worker")


class Watchdog:
    """Calls ``on_stall(idle_seconds)`` once when ``beat`` was not called for ``timeout_s``.

    ``timeout_s=None`` disables it (every method is then a no-op). Time spent inside
    ``paused()`` (engine start or rebuild) does not count.
    """

    def __init__(
        self,
        timeout_s: float | None,
        on_stall: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.timeout_s = timeout_s
        self.on_stall = on_stall or _default_on_stall
        self.clock = clock
        self.last = clock()
        self.fired = False
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.timeout_s is None or self._thread is not None:
            return
        self.beat()
        self._thread = threading.Thread(target=self._run, name="vllm-batch-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        """Progress was made."""
        self.last = self.clock()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.beat()

    def idle(self) -> float:
        return self.clock() - self.last

    def check(self) -> bool:
        """Fire ``on_stall`` if the timeout has passed (the thread calls this); True when it fired."""
        if self.fired or self._paused or self.timeout_s is None:
            return False
        idle = self.idle()
        if idle < self.timeout_s:
            return False
        self.fired = True
        log.error("watchdog: no progress for %.1f s (limit %.1f s); stopping this attempt", idle, self.timeout_s)
        self.on_stall(idle)
        return True

    def _run(self) -> None:
        if self.timeout_s is None:  # start() never starts the thread then
            return
        tick = min(max(self.timeout_s / 10, 0.05), 5.0)
        while not self._stop.wait(tick):
            if self.check():
                return


def _default_on_stall(idle: float) -> None:
    from airflow_provider_vllm.worker.exits import stalled

    stalled(idle)
