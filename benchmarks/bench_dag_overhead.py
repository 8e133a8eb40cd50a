#!/usr/bin/env python
"""Orchestration overhead: a local DAG run over N shards vs the sum of its workers' inference time.

    .venv/bin/python benchmarks/bench_dag_overhead.py [--shards 8] [--rows-per-shard 5000]
                                                      [--model smollm2|tiny|PATH] [--workdir DIR]

Runs the real ``vllm_nightly_reclassification`` DAG with ``airflow dags test`` (real Airflow,
SQLite, local runner: each mapped shard is a real worker process on vLLM's CPU build) over
``shards x rows-per-shard`` generated tickets, ``vllm_batch_shard_rows = rows-per-shard``.

Baseline: the sum over shards of the workers' ``stats.infer_s`` (time inside the engine loop,
from ``_MERGED.json``), i.e. what the inference alone costs. Figure: the sum of all task
instances' durations (plan, every shard, merge, qa, publish; from the metadata DB), i.e. the
compute the whole run costs. ``airflow dags test`` runs mapped tasks one after another, so
this is the total, not the wall-clock time of a parallel deployment. Ratio = figure / baseline;
overhead = ratio - 1 (goal <= 10%). The breakdown names where the rest goes: engine starts
(model load, compile), the workers' other time (read, warm-up, chunk writes, commit), the
worker process outside run_shard (interpreter, imports) plus the operator, and the
plan/merge/qa/publish tasks. Engine start per shard is what shard sizing trades against (see
``airflow_provider_vllm/steps/plan/sizing.py``): with rows-per-shard too small it dominates.

Model: ``smollm2`` (SmolLM2-135M-Instruct, default) or ``tiny`` (the tiny random Llama, for a
quick check that the script works), or a model folder. The DAG's local engine defaults apply
(enforce_eager, 1 GiB KV cache, max_num_seqs 64). One JSON line goes to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import sqlite3
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS_FILE = HERE / "results.jsonl"
DAG_ID = "vllm_nightly_reclassification"
DAY = "2026-11-20"
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
GOAL_OVERHEAD = 0.10


def _model(name: str) -> str:
    from airflow_provider_vllm.testing.local_models import default_cache_dir, make_tiny_llama, prepare_smollm2

    if name == "smollm2":
        return str(prepare_smollm2(default_cache_dir() / "smollm2-135m-instruct"))
    if name == "tiny":
        return str(make_tiny_llama(default_cache_dir() / "tiny-llama"))
    return name


def _durations(db: Path) -> list[dict]:
    """Task instances of the newest run of DAG_ID (one Airflow home may hold several runs)."""
    con = sqlite3.connect(db)
    try:
        rows = con.execute(
            "SELECT task_id, map_index, state, start_date, end_date FROM task_instance "
            "WHERE dag_id = ? AND run_id = (SELECT run_id FROM dag_run WHERE dag_id = ? "
            "ORDER BY id DESC LIMIT 1)",
            (DAG_ID, DAG_ID),
        ).fetchall()
    finally:
        con.close()
    out = []
    for task_id, map_index, state, start, end in rows:
        secs = None
        if start and end:
            secs = (datetime.fromisoformat(str(end)) - datetime.fromisoformat(str(start))).total_seconds()
        out.append({"task": task_id.split(".")[-1], "map_index": map_index, "state": state, "seconds": secs})
    return out


def airflow_env(
    home: Path,
    data: Path,
    model: str,
    rows_per_shard: int,
    max_shards: int,
    max_tokens: int,
    overrides: dict | None = None,
) -> dict[str, str]:
    """The environment of `airflow` for the nightly DAG over ``data`` (QA never stops the run for a human)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VLLM_BATCH_INJECT"))}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW_VAR_VLLM_BATCH_DATA_ROOT": str(data),
            "AIRFLOW_VAR_VLLM_BATCH_MODEL": model,
            # the deployment's allow-list (docs/security.md): the benchmark's data and the model's folder
            "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES": json.dumps(
                [str(data), *([os.path.dirname(os.path.realpath(model))] if model.startswith("/") else [])]
            ),
            # a signing key of its own (docs/adr/0007) and where its result caches may live
            "AIRFLOW__VLLM_BATCH__SIGNING_KEY": secrets.token_urlsafe(48),
            "AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES": json.dumps([str(data)]),
            "AIRFLOW_VAR_VLLM_BATCH_SHARD_ROWS": str(rows_per_shard),
            "AIRFLOW_VAR_VLLM_BATCH_HUMAN_REVIEW": "false",  # nobody answers a review under `dags test`
            "AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES": json.dumps(
                {
                    "sharding.max_shards": max(max_shards, 1),
                    "sampling.max_tokens": max_tokens,
                    # QA must not stop the run for a human: this measures orchestration, not label quality
                    **{
                        f"qa.{level}_{check}": 1
                        for level in ("warn", "fail")
                        for check in (
                            "error_rate",
                            "invalid_rate",
                            "empty_rate",
                            "truncation_rate",
                            "label_drift",
                            "churn_rate",
                        )
                    },
                    **(overrides or {}),
                }
            ),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def migrate(env: dict[str, str], home: Path) -> None:
    home.mkdir(parents=True, exist_ok=True)
    mig = subprocess.run([AIRFLOW, "db", "migrate"], env=env, cwd=home, capture_output=True, text=True)
    if mig.returncode != 0:
        raise SystemExit(f"airflow db migrate failed:\n{mig.stderr[-3000:]}")


def dags_test(env: dict[str, str], day: str, log: Path, timeout: int) -> tuple[float, list[dict]]:
    """`airflow dags test DAG_ID day`: its wall seconds and task instances; exits unless every task succeeded."""
    home = Path(env["AIRFLOW_HOME"])
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.run(
            [AIRFLOW, "dags", "test", DAG_ID, day],
            env=env,
            cwd=home,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    wall = time.monotonic() - t0
    tis = _durations(home / "airflow.db")
    # the runner branch skips the Kubernetes shard task of a local run; a plan of no shards (every row
    # answered by the result cache) skips the unexpanded shard task
    failed = [
        t
        for t in tis
        if t["state"] != "success"
        and not (t["state"] == "skipped" and (t["task"] == "shard_kubernetes" or t["map_index"] == -1))
    ]
    if proc.returncode != 0 or failed:
        raise SystemExit(f"DAG run failed (exit {proc.returncode}; not successful: {failed}); see {log}")
    return wall, tis


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument(
        "--rows-per-shard",
        type=int,
        default=5000,
        help="default 5000: ~4-6 min of SmolLM2 inference per shard here, >= 9x its ~25-30 s eager "
        "engine start, as sizing.py's default target would choose",
    )
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model folder")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "dag_overhead")
    ap.add_argument("--timeout", type=int, default=4 * 3600)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_BATCH_MODEL_CACHE", str(ROOT / ".cache" / "models"))
    sys.path.insert(0, str(ROOT / "scripts"))
    from sample_tickets import write_tickets

    model = _model(args.model)
    work = args.workdir.resolve()
    if work.exists():
        shutil.rmtree(work)
    home, data = work / "airflow_home", work / "data"
    home.mkdir(parents=True)
    rows = args.shards * args.rows_per_shard
    write_tickets(data / "tickets" / f"dt={DAY}", rows, seed=5, truth_dir=work / "truth")

    env = airflow_env(home, data, model, args.rows_per_shard, args.shards, 32 if args.model == "tiny" else 16)
    migrate(env, home)
    t_start = time.time()
    wall, tis = dags_test(env, DAY, work / "dags_test.log", args.timeout)
    merged = json.loads((data / "reclassification" / f"dt={DAY}" / "_MERGED.json").read_text())
    stats = merged["shard_stats"]
    n_shards = len(stats)
    infer = sum(s["infer_s"] for s in stats)
    start = sum(s["engine_start_s"] for s in stats)
    worker_wall = sum(s["wall_s"] for s in stats)
    shard_tasks = sum(t["seconds"] for t in tis if t["task"] == "shard")
    other_tasks = {t["task"]: t["seconds"] for t in tis if t["task"] != "shard"}
    total = shard_tasks + sum(other_tasks.values())
    ratio = total / infer
    overhead = ratio - 1

    print(f"\nbench_dag_overhead: {rows} rows in {n_shards} shards ({args.rows_per_shard} rows/shard), model {model}")
    print(f"{'part':<52} {'seconds':>9} {'of infer':>9}")
    part = lambda name, s: print(f"{name:<52} {s:>9.1f} {s / infer:>8.1%}")  # noqa: E731
    part("baseline: sum of workers' inference (stats.infer_s)", infer)
    part("engine starts (sum of stats.engine_start_s)", start)
    part("workers' other time (read, warm-up, writes, commit)", worker_wall - infer - start)
    part("shard tasks outside run_shard (process, operator)", shard_tasks - worker_wall)
    for name, s in sorted(other_tasks.items()):
        part(f"task {name}", s)
    part("figure: sum of all task durations", total)
    verdict = "met" if overhead <= GOAL_OVERHEAD else "NOT met"
    print(f"ratio all tasks / inference: {ratio:.3f}; overhead {overhead:.1%} (goal <= {GOAL_OVERHEAD:.0%}: {verdict})")
    print(
        f"excluding engine starts: overhead {(total - start) / infer - 1:.1%}; "
        f"`airflow dags test` wall {wall:.1f} s (serial shards)"
    )

    from airflow_provider_vllm.testing.local_models import recorded_name

    record = {
        "bench": "dag_overhead",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "rows": rows,
        "shards": n_shards,
        "rows_per_shard": args.rows_per_shard,
        "model": recorded_name(model),
        "infer_s": round(infer, 3),
        "engine_start_s": round(start, 3),
        "worker_wall_s": round(worker_wall, 3),
        "shard_tasks_s": round(shard_tasks, 3),
        "other_tasks_s": other_tasks,
        "all_tasks_s": round(total, 3),
        "ratio": round(ratio, 4),
        "overhead": round(overhead, 4),
        "goal_overhead": GOAL_OVERHEAD,
        "dags_test_wall_s": round(wall, 3),
        "per_shard": stats,
        "env": {"machine": platform.machine(), "nproc": os.cpu_count(), "python": platform.python_version()},
    }
    with open(RESULTS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True, default=str) + "\n")
    print(f"appended to {RESULTS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
