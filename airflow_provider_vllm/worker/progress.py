"""Per-shard progress lines for container / task logs, at a bounded rate.

``Progress`` is the one place that counts finished rows of an attempt: ok and error rows,
error codes, prompt and output tokens. It logs a line at most once per ``interval`` seconds
however fast rows finish (``add_row`` is cheap: one clock read per row), and one summary line
from ``finish()``. Each line ends with the same figures as compact JSON so that log tooling can
parse them. ``on_update(progress, final)`` is called whenever a line is written (metrics export).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("airflow_provider_vllm.worker")


class Progress:
    """Rows done/total, rows/s, prompt+output tokens/s, errors and ETA of one shard attempt."""

    def __init__(
        self,
        shard_id: str,
        total: int,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        on_update: Callable[[Progress, bool], None] | None = None,
    ):
        if interval <= 0:
            raise ValueError(f"progress interval must be > 0 seconds, got {interval!r}")
        self.shard_id = shard_id
        self.total = total
        self.interval = interval
        self.clock = clock
        self.on_update = on_update
        self.t0 = clock()
        self.last = self.t0  # the first line comes one interval after the start, not with the first row
        self.done = 0
        self.ok = 0
        self.errors = 0
        self.errors_by_code: dict[str, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.lines = 0
        self.finished = False

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def restart(self) -> None:
        """Start timing now (after engine start and warm-up)."""
        self.t0 = self.last = self.clock()

    def add_row(self, row: dict[str, Any]) -> None:
        """Count one finished row record (``status`` ok/error, token counts, ``error_code``)."""
        self._count(row)
        self._tick()

    def add_rows(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self._count(row)
        self._tick()

    def _count(self, row: dict[str, Any]) -> None:
        self.done += 1
        if row.get("status") == "error":
            self.errors += 1
            code = str(row.get("error_code") or "UNKNOWN")
            self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
        else:
            self.ok += 1
        self.prompt_tokens += row.get("prompt_tokens") or 0
        self.completion_tokens += row.get("completion_tokens") or 0

    def _tick(self) -> None:
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self.emit(now)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = self.clock() if now is None else now
        dt = max(now - self.t0, 1e-9)
        rps = self.done / dt
        left = max(self.total - self.done, 0)
        return {
            "shard": self.shard_id,
            "rows_done": self.done,
            "rows_total": self.total,
            "pct": round(100.0 * self.done / self.total, 1) if self.total else 100.0,
            "ok": self.ok,
            "errors": self.errors,
            "errors_by_code": dict(sorted(self.errors_by_code.items())),
            "elapsed_s": round(now - self.t0, 1),
            "rows_per_s": round(rps, 2),
            "prompt_tokens_per_s": round(self.prompt_tokens / dt, 1),
            "output_tokens_per_s": round(self.completion_tokens / dt, 1),
            "tokens_per_s": round(self.tokens / dt, 1),
            "eta_s": 0.0 if left == 0 else (round(left / rps, 1) if rps > 0 else None),
        }

    def emit(self, now: float | None = None) -> None:
        """Write one progress line now (callers normally let ``add_row`` decide)."""
        s = self.snapshot(now)
        self.lines += 1
        eta = "?" if s["eta_s"] is None else _duration(s["eta_s"])
        log.info(
            "progress %s rows=%d/%d (%.1f%%) rows/s=%.2f tokens/s=%.1f (prompt %.1f + output %.1f) errors=%d eta=%s %s",
            self.shard_id,
            s["rows_done"],
            s["rows_total"],
            s["pct"],
            s["rows_per_s"],
            s["tokens_per_s"],
            s["prompt_tokens_per_s"],
            s["output_tokens_per_s"],
            s["errors"],
            eta,
            _json(s),
        )
        self._notify(final=False)

    def finish(self) -> dict[str, Any]:
        """Write the summary line (once, whatever the interval); returns the final snapshot."""
        s = self.snapshot()
        if self.finished:
            return s
        self.finished = True
        self.lines += 1
        codes = ", ".join(f"{k}={v}" for k, v in s["errors_by_code"].items())
        log.info(
            "progress %s done rows=%d/%d ok=%d errors=%d%s in %s rows/s=%.2f tokens/s=%.1f "
            "(prompt %.1f + output %.1f) %s",
            self.shard_id,
            s["rows_done"],
            s["rows_total"],
            s["ok"],
            s["errors"],
            f" ({codes})" if codes else "",
            _duration(s["elapsed_s"]),
            s["rows_per_s"],
            s["tokens_per_s"],
            s["prompt_tokens_per_s"],
            s["output_tokens_per_s"],
            _json({**s, "final": True}),
        )
        self._notify(final=True)
        return s

    def _notify(self, final: bool) -> None:
        if self.on_update is None:
            return
        try:
            self.on_update(self, final)
        except Exception as e:  # observers (metrics export) never stop the shard
            log.warning("progress observer failed: %s", e)


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _json(d: dict[str, Any]) -> str:
    return json.dumps(d, separators=(",", ":"), sort_keys=True)
