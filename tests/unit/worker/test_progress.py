"""Progress lines: bounded rate, figures, summary line (fake clock; no wall-clock assertions)."""

from __future__ import annotations

import json
import logging

import pytest

from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.progress import Progress
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, shard_task, write_parquet


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def ok(p=10, c=2):
    return {"status": "ok", "prompt_tokens": p, "completion_tokens": c}


def err(code):
    return {"status": "error", "error_code": code, "prompt_tokens": None}


def payloads(caplog):
    """The JSON figures at the end of each progress line."""
    out = []
    for r in caplog.records:
        msg = r.getMessage()
        if msg.startswith("progress "):
            out.append((msg, json.loads(msg[msg.index("{") :])))
    return out


def test_rate_is_bounded_whatever_the_row_rate(caplog):
    clock = Clock()
    emitted_at = []
    p = Progress(
        "s", total=10_000, interval=10.0, clock=clock, on_update=lambda prog, final: emitted_at.append((clock.t, final))
    )
    with caplog.at_level(logging.INFO, logger="airflow_provider_vllm.worker"):
        for _ in range(10_000):  # 100 rows/s for 100 s
            clock.t += 0.01
            p.add_row(ok())
        burst = p.lines
        for _ in range(50_000):  # a burst at one instant: no extra lines
            p.add_row(ok())
        assert p.lines == burst
        p.finish()
    times = [t for t, final in emitted_at if not final]
    assert 9 <= len(times) <= 10  # one per 10 s of a 100 s run (float steps may drop the last)
    assert all(b - a >= 10.0 - 1e-6 for a, b in zip(times, times[1:]))
    assert emitted_at[-1][1] is True and p.lines == len(times) + 1
    assert len(payloads(caplog)) == p.lines


def test_finish_only_gives_one_summary_when_rows_outrun_the_interval(caplog):
    clock = Clock()
    p = Progress("s", total=3, interval=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="airflow_provider_vllm.worker"):
        for _ in range(3):
            p.add_row(ok())
        p.finish()
        p.finish()  # idempotent
    (line,) = payloads(caplog)
    assert " done " in line[0] and line[1]["final"] is True and p.lines == 1


def test_figures_rows_tokens_errors_eta(caplog):
    clock = Clock()
    p = Progress("shard-00001-abcdef12", total=100, interval=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="airflow_provider_vllm.worker"):
        clock.t += 1.0
        p.restart()  # engine start and warm-up are not timed
        for i in range(40):
            clock.t += 0.125  # 8 rows/s
            p.add_row(err("EMPTY_INPUT") if i % 10 == 0 else ok(p=30, c=5))
    (msg, s) = payloads(caplog)[0]
    assert s["rows_done"] == 40 and s["rows_total"] == 100 and s["pct"] == 40.0
    assert s["rows_per_s"] == 8.0 and s["errors"] == 4 and s["ok"] == 36
    assert s["errors_by_code"] == {"EMPTY_INPUT": 4}
    assert s["prompt_tokens_per_s"] == 36 * 30 / 5 and s["output_tokens_per_s"] == 36 * 5 / 5
    assert s["tokens_per_s"] == 36 * 35 / 5 and s["eta_s"] == 60 / 8
    assert "rows=40/100 (40.0%)" in msg and "rows/s=8.00" in msg and "errors=4" in msg and "eta=8s" in msg
    assert "(prompt 216.0 + output 36.0)" in msg


def test_summary_line_lists_error_codes(caplog):
    clock = Clock()
    p = Progress("s", total=4, interval=60.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="airflow_provider_vllm.worker"):
        p.add_rows([ok(), err("PROMPT_TOO_LONG"), err("EMPTY_INPUT"), err("EMPTY_INPUT")])
        clock.t += 125.0
        s = p.finish()
    msg, d = payloads(caplog)[-1]
    assert "done rows=4/4 ok=1 errors=3 (EMPTY_INPUT=2, PROMPT_TOO_LONG=1) in 2m05s" in msg
    assert d["eta_s"] == 0.0 and s["errors_by_code"] == {"EMPTY_INPUT": 2, "PROMPT_TOO_LONG": 1}


def test_observer_failure_does_not_stop_rows(caplog):
    def boom(progress, final):
        raise RuntimeError("push gateway down")

    clock = Clock()
    p = Progress("s", total=10, interval=1.0, clock=clock, on_update=boom)
    with caplog.at_level(logging.INFO, logger="airflow_provider_vllm.worker"):
        for _ in range(10):
            clock.t += 1.0
            p.add_row(ok())
        p.finish()
    assert p.done == 10 and any("observer failed" in r.getMessage() for r in caplog.records)


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval"):
        Progress("s", total=1, interval=0)


def test_shard_logs_summary_and_counts_in_marker(tmp_path, fake_engine_factory, caplog):
    texts = [f"ticket {i}" for i in range(50)]
    texts[7] = ""  # EMPTY_INPUT
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(50)], texts)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    (shard,) = plan_job(spec).shards
    with caplog.at_level(logging.INFO, logger="airflow_provider_vllm.worker"):
        m = run_shard(
            shard_task(spec=spec, shard_id=shard.shard_id, progress_interval_s=3600), engine_factory=fake_engine_factory
        )
    lines = payloads(caplog)
    assert len(lines) == 1 == m["stats"]["progress_lines"]  # the interval never elapsed: summary only
    msg, s = lines[0]
    assert s["final"] and s["rows_done"] == s["rows_total"] == 50 and s["errors_by_code"] == {"EMPTY_INPUT": 1}
    assert s["ok"] == m["ok_rows"] == 49
    assert m["stats"]["peak_rss_mb"] > 10 and m["stats"]["resource_samples"] >= 2
