"""A minimal task-instance context for an operator's ``execute()`` without a scheduler or a metadata DB, and a
job whose shards are committed in this process (the worker with the fake engine, no subprocess)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.support.data import shard_task


class FakeTI:
    """What the operators use of a task instance: its map index and try, and ``xcom_push``."""

    def __init__(self, map_index: int = -1, try_number: int = 1, dag_id: str = "d", run_id: str = "r1"):
        self.map_index = map_index
        self.try_number = try_number
        self.dag_id = dag_id
        self.run_id = run_id
        self.xcoms: dict = {}

    def xcom_push(self, key, value):
        self.xcoms[key] = value


class OutletEvents(dict):
    def __missing__(self, key):
        self[key] = SimpleNamespace(extra={})
        return self[key]


def context(params=None, map_index=-1, try_number=1, run_id="r1", dag_id="d") -> dict[str, Any]:
    """A task's context in the DAG run ``dag_id`` / ``run_id`` (default ``d`` / ``r1``)."""
    return {
        "ti": FakeTI(map_index, try_number, dag_id, run_id),
        "params": params or {},
        "outlet_events": OutletEvents(),
        "dag_run": SimpleNamespace(dag_id=dag_id, run_id=run_id),
        "logical_date": None,
    }


def committed_job(tmp_path: Path, factory, n: int = 60, run: list[int] | None = None, empty=(), **spec_over):
    """A job of ``n`` rows planned (shards of 20 rows) with its shards ``run`` (default: all) committed by the
    worker in this process; returns (the spec as the plan task pushes it, the plan)."""
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import make_spec, write_parquet

    texts = [f"ticket number {i}: I was charged twice, please refund" for i in range(n)]
    for i in empty:
        texts[i] = ""
    write_parquet(tmp_path / "in" / "part-0.parquet", [f"t{i:04d}" for i in range(n)], texts)
    spec_over.setdefault("sharding", {"target_rows": 20})
    spec = make_spec(tmp_path / "in", tmp_path / "out", **spec_over)
    plan = plan_job(spec)
    for i, s in enumerate(plan.shards):
        if run is None or i in run:
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    return spec.model_dump(mode="json"), plan


def rerun_a_shard(spec: dict, plan, out: Path, factory) -> None:
    """The first shard run again after its commit marker was deleted: another genuine attempt, so the next merge
    differs from the one before (it names that attempt), whatever the merges' durations (``merge_s``, in ms)."""
    from airflow_provider_vllm.core.commit import MARKER
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.worker.shard import run_shard

    (out / "shards" / plan.shards[0].shard_id / MARKER).unlink()
    run_shard(shard_task(spec=JobSpec.load(spec), shard_id=plan.shards[0].shard_id), engine_factory=factory)
