"""Two runs writing the same output prefix: one owns it, the other is refused before any shard."""

from __future__ import annotations

import threading

import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task, write_parquet
from tests.support.ledger import record_fault

pytestmark = pytest.mark.reliability


def test_two_runs_racing_for_one_prefix(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "a" / "p.parquet", [f"a{i}" for i in range(40)], [f"text a{i}" for i in range(40)])
    write_parquet(tmp_path / "b" / "p.parquet", [f"b{i}" for i in range(30)], [f"text b{i}" for i in range(30)])
    specs = [make_spec(tmp_path / x, tmp_path / "shared-out") for x in ("a", "b")]
    results: list = [None, None]
    barrier = threading.Barrier(2)

    def plan(i):
        barrier.wait()
        try:
            results[i] = plan_job(specs[i])
        except SpecError as e:
            results[i] = e

    threads = [threading.Thread(target=plan, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    won = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
    lost = [i for i, r in enumerate(results) if isinstance(r, Exception)]
    assert len(won) == 1 and len(lost) == 1, results
    msg = str(results[lost[0]])
    assert "another input or spec" in msg or "not empty" in msg
    winner = specs[won[0]]
    for s in results[won[0]].shards:
        run_shard(shard_task(spec=winner, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    summary = merge(winner).dump()
    # the loser, retried later, is still refused; the winner's outputs are untouched
    with pytest.raises(SpecError):
        plan_job(specs[lost[0]])
    assert merge(winner).dump()["checksums"] == summary["checksums"]
    rows = summary["rows"]
    record_fault("two_runs_one_prefix", rows=rows, lost=rows - summary["ok_rows"] - summary["error_rows"])
    assert rows == (40 if won[0] == 0 else 30)
    assert (tmp_path / "shared-out" / PLAN_FILE).exists()
