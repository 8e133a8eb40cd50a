"""Progress lines for container logs, at a bounded rate."""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("airflow_provider_vllm.worker")


class Progress:
    """Logs ``rows done/total, rows/s, tokens/s, ETA`` at most once per ``interval`` seconds."""

    def __init__(self, shard_id: str, total: int, interval: float = 10.0, clock=time.monotonic):
        self.shard_id = shard_id
        self.total = total
        self.interval = interval
        self.clock = clock
        self.t0 = clock()
        self.last = float("-inf")
        self.done = 0
        self.tokens = 0
        self.lines = 0

    def restart(self) -> None:
        """Start timing now (after engine start and warm-up)."""
        self.t0 = self.clock()

    def add(self, rows: int, tokens: int = 0) -> None:
        self.done += rows
        self.tokens += tokens
        now = self.clock()
        if now - self.last >= self.interval or self.done >= self.total:
            self.last = now
            self.emit(now)

    def snapshot(self, now: float | None = None) -> dict:
        now = self.clock() if now is None else now
        dt = max(now - self.t0, 1e-9)
        rps = self.done / dt
        left = self.total - self.done
        return {
            "shard": self.shard_id,
            "rows_done": self.done,
            "rows_total": self.total,
            "pct": round(100.0 * self.done / self.total, 1) if self.total else 100.0,
            "rows_per_s": round(rps, 2),
            "tokens_per_s": round(self.tokens / dt, 1),
            "eta_s": round(left / rps, 1) if rps > 0 else None,
        }

    def emit(self, now: float | None = None) -> None:
        s = self.snapshot(now)
        self.lines += 1
        eta = "?" if s["eta_s"] is None else f"{s['eta_s']:.0f}s"
        log.info(
            "progress %s rows=%d/%d (%.1f%%) rows/s=%.2f tokens/s=%.1f eta=%s %s",
            self.shard_id, s["rows_done"], s["rows_total"], s["pct"], s["rows_per_s"], s["tokens_per_s"],
            eta, json.dumps(s, separators=(",", ":")),
        )
