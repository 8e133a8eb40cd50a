#!/usr/bin/env python
"""Result cache end to end: the nightly DAG's run 2 (warm cache) vs run 1 (cold), and vs run 2 without the cache.

    .venv/bin/python benchmarks/bench_cache_dag.py [--rows 2000] [--shard-rows 1000]
                                                   [--model smollm2|tiny|PATH] [--workdir DIR]

Issue 16's acceptance figure. Runs the real ``vllm_nightly_reclassification`` DAG (its result cache at
``<data root>/reclassification/_cache/``, changes against the day before) with ``airflow dags test``
(real Airflow, SQLite, local runner, vLLM's CPU build), the helpers of ``bench_dag_overhead.py``:

1. run 1, day D, cold cache: ``--rows`` demo tickets (``scripts/sample_tickets.py``, as ``make demo``);
2. baseline, day D+1 with ``{"cache": {"uri": null}}`` (not ``{"cache.uri": null}``: a null override
   keeps the spec's value), another Airflow home, same data root; its output is then moved aside to
   ``dt=D+1.nocache``: what the night costs without the cache;
3. run 2, day D+1, warm cache: day D with 5% of texts edited, 2% of tickets removed and 5% new ones.

For each: the wall-clock of the whole ``airflow dags test``, the sum of task durations (metadata DB)
and per task, the rows the plan sent to the shards and those the engines inferred (``_MERGED.json``),
the cache hits. Ratios run2/run1 and run2/baseline. One JSON line goes to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import date, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_dag_overhead as dag  # noqa: E402

RESULTS_FILE = HERE / "results.jsonl"
DAY1 = "2026-11-20"
DAY2 = str(date.fromisoformat(DAY1) + timedelta(days=1))
EDITED, NEW, REMOVED = 0.05, 0.05, 0.02


def next_day(day1: list[dict], new: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """Day D+1 from day D: every 20th text edited, every 50th ticket removed (disjoint), ``new`` appended."""
    rows, counts = [], {"edited": 0, "removed": 0, "new": len(new)}
    for i, r in enumerate(day1):
        if i % 50 == 3:  # 2%
            counts["removed"] += 1
            continue
        if i % 20 == 7:  # 5%; i % 10 == 7, never i % 50 == 3
            counts["edited"] += 1
            r = {**r, "text": r["text"] + " It happened again today."}
        rows.append(r)
    return rows + new, counts


def by_task(tis: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for t in tis:
        if t["state"] == "skipped":
            continue
        e = out.setdefault(t["task"], {"seconds": 0.0, "count": 0})
        e["seconds"] = round(e["seconds"] + (t["seconds"] or 0), 3)
        e["count"] += 1
    return out


def task_cell(e: dict | None) -> str:
    if e is None:
        return "-"
    return f"{e['seconds']:.1f}" + (f" x{e['count']}" if e["count"] > 1 else "")


def measure(env: dict[str, str], day: str, out: Path, log: Path, timeout: int) -> dict:
    import json

    wall, tis = dag.dags_test(env, day, log, timeout)
    tasks = by_task(tis)
    plan = json.loads((out / "_plan.json").read_text())
    merged = json.loads((out / "_MERGED.json").read_text())
    stats = merged.get("shard_stats") or []
    cache = plan.get("cache")
    rows = merged["rows"]
    return {
        "dags_test_wall_s": round(wall, 3),
        "all_tasks_s": round(sum(e["seconds"] for e in tasks.values()), 3),
        "tasks": tasks,
        "rows": rows,
        "ok_rows": merged["ok_rows"],
        "shards": merged["shards"],
        "rows_to_shards": cache["misses"] if cache else rows,
        "rows_inferred": sum(s.get("infer_rows") or 0 for s in stats),
        "infer_s": round(sum(s.get("infer_s") or 0 for s in stats), 3),
        "engine_start_s": round(sum(s.get("engine_start_s") or 0 for s in stats), 3),
        "cache_hits": cache["hits"] if cache else None,
        "cache_hit_rate": round(cache["hits"] / cache["rows"], 4) if cache and cache["rows"] else None,
    }


def main() -> int:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2000, help="day D's tickets (default: make demo's 2000)")
    ap.add_argument("--shard-rows", type=int, default=1000, help="vllm_batch_shard_rows (default: make demo's)")
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model folder")
    ap.add_argument("--workdir", type=Path, default=dag.ROOT / ".cache" / "bench" / "cache_dag")
    ap.add_argument("--timeout", type=int, default=3 * 3600)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_BATCH_MODEL_CACHE", str(dag.ROOT / ".cache" / "models"))
    sys.path.insert(0, str(dag.ROOT / "scripts"))
    from sample_tickets import generate, write_tickets

    model = dag._model(args.model)
    work = args.workdir.resolve()
    if work.exists():
        shutil.rmtree(work)
    data, home, home_b = work / "data", work / "airflow_home", work / "airflow_home_nocache"
    recl = data / "reclassification"
    write_tickets(data / "tickets" / f"dt={DAY1}", args.rows, seed=7, truth_dir=work / "truth")
    day1 = pq.read_table(data / "tickets" / f"dt={DAY1}" / "tickets.parquet").to_pylist()
    new = [{k: r[k] for k in ("id", "text", "channel")} for r in generate(round(args.rows * NEW), seed=8)]
    day2, counts = next_day(day1, new)
    (data / "tickets" / f"dt={DAY2}").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(day2), data / "tickets" / f"dt={DAY2}" / "tickets.parquet")

    max_shards = -(-len(day2) // args.shard_rows) + 1
    tokens = 32 if args.model == "tiny" else 16
    env = dag.airflow_env(home, data, model, args.shard_rows, max_shards, tokens)
    env_b = dag.airflow_env(home_b, data, model, args.shard_rows, max_shards, tokens, {"cache": {"uri": None}})
    dag.migrate(env, home)
    home_b.mkdir()
    shutil.copy2(home / "airflow.db", home_b / "airflow.db")  # migrated, no runs yet (airflow.cfg names home's)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=dag.ROOT, capture_output=True, text=True)
    t_start = time.time()

    print(f"run 1: {DAY1}, {len(day1)} rows, cold cache ...", flush=True)
    run1 = measure(env, DAY1, recl / f"dt={DAY1}", work / "run1.log", args.timeout)
    print(f"baseline: {DAY2}, {len(day2)} rows, cache off ...", flush=True)
    base = measure(env_b, DAY2, recl / f"dt={DAY2}", work / "run2_nocache.log", args.timeout)
    (recl / f"dt={DAY2}").rename(recl / f"dt={DAY2}.nocache")
    print(f"run 2: {DAY2}, warm cache ...", flush=True)
    run2 = measure(env, DAY2, recl / f"dt={DAY2}", work / "run2.log", args.timeout)
    changes = json.loads((recl / f"dt={DAY2}" / "changes" / "_changes.json").read_text())

    runs = {"run1": run1, "run2": run2, "run2_nocache": base}
    ratio = lambda a, b, k: round(runs[a][k] / runs[b][k], 4)  # noqa: E731
    ratios = {
        f"{k}_{a}_vs_{b}": ratio(a, b, k)
        for a, b in (("run2", "run1"), ("run2", "run2_nocache"))
        for k in ("dags_test_wall_s", "all_tasks_s")
    }
    print(f"\nbench_cache_dag: day D {len(day1)} rows; D+1 {len(day2)} rows ({counts}); model {model}")
    names = ["plan", "runner", "shard", "merge", "qa", "review", "publish"]
    print(f"{'':<28}" + "".join(f"{n:>14}" for n in runs))
    line = lambda label, f: print(f"{label:<28}" + "".join(f"{f(r):>14}" for r in runs.values()))  # noqa: E731
    line("dags test wall s", lambda r: f"{r['dags_test_wall_s']:.1f}")
    line("sum of task durations s", lambda r: f"{r['all_tasks_s']:.1f}")
    for n in names + sorted({t for r in runs.values() for t in r["tasks"]} - set(names)):
        line(f"  {n}", lambda r, n=n: task_cell(r["tasks"].get(n)))
    line("rows sent to shards", lambda r: r["rows_to_shards"])
    line("rows inferred (workers)", lambda r: r["rows_inferred"])
    line("inference s (sum)", lambda r: f"{r['infer_s']:.1f}")
    line("engine starts s (sum)", lambda r: f"{r['engine_start_s']:.1f}")
    line("cache hits", lambda r: "-" if r["cache_hits"] is None else r["cache_hits"])
    line("cache hit rate", lambda r: "-" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.1%}")
    for k, v in ratios.items():
        print(f"{k:<44} {v:.3f}")
    print(f"run 2 changes: {changes['counts']}")

    from airflow_provider_vllm.testing.local_models import recorded_name

    record = {
        "bench": "cache_dag",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "rows_day1": len(day1),
        "rows_day2": len(day2),
        "day2": counts,
        "shard_rows": args.shard_rows,
        "model": recorded_name(model),
        "runs": runs,
        "ratios": ratios,
        "changes_counts": changes["counts"],
        "env": {
            "git": head.stdout.strip(),
            "machine": platform.machine(),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "load1_at_end": round(os.getloadavg()[0], 2),
        },
    }
    with open(RESULTS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True, default=str) + "\n")
    print(f"appended to {RESULTS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
