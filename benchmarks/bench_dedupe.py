"""What "each distinct prompt once per run" costs the plan: plan wall time with ``sharding.dedupe`` on vs off.

Writes ``--rows`` ticket-like rows of which ``--dup`` repeat an earlier row's text (drawn at random), then
plans the same job with the dedupe off and on, alternated (off, on, off, on: ``--repeat`` rounds), each into a
fresh output prefix, and prints each time, the best of each side and their ratio, and the rows the shards
would infer. No engine runs: this is the Airflow-side cost; the GPU side is the rows not inferred.

    python benchmarks/bench_dedupe.py --rows 1000000 --dup 0.3     # working data in .cache/bench/dedupe
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def write_input(folder: Path, rows: int, dup: float) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    distinct = rows - int(rows * dup)
    base = [f"Ticket {i}: I was charged twice for my subscription, please refund the payment." for i in range(distinct)]
    picks = np.random.default_rng(0).integers(0, distinct, rows - distinct)
    texts = base + [base[j] for j in picks]
    table = pa.table({"id": [f"row-{i:09d}" for i in range(rows)], "text": texts})
    pq.write_table(table, folder / "part-0.parquet", row_group_size=100_000)


def spec_for(inp: Path, out: Path, dedupe: bool):
    from airflow_provider_vllm.core.spec import JobSpec

    return JobSpec.load(
        {
            "model": {"name": "bench"},
            "io": {"input_uri": str(inp), "output_uri": str(out)},
            "prompt": {"template": "Ticket: {text}"},
            "sampling": {"temperature": 0, "max_tokens": 8},
            "sharding": {"target_rows": 100_000, "dedupe": dedupe},
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dup", type=float, default=0.3, help="share of rows that repeat an earlier row's text")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--work", default=str(HERE.parent / ".cache" / "bench" / "dedupe"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", "bench-signing-key-" + "k" * 40)
    from airflow_provider_vllm.steps.plan.planner import plan_job

    work = Path(args.work) / f"rows{args.rows}-dup{args.dup}"
    if not (work / "in").exists():
        write_input(work / "in", args.rows, args.dup)
    best: dict[bool, float] = {}
    for r in range(args.repeat):
        for dedupe in (False, True):
            out = work / f"out-{dedupe}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            plan = plan_job(spec_for(work / "in", out, dedupe))
            s = time.perf_counter() - t0
            best[dedupe] = min(best.get(dedupe, s), s)
            inferred = sum(x.rows for x in plan.shards)
            print(f"round {r} dedupe={'on ' if dedupe else 'off'}: plan {s:6.2f} s, rows to infer {inferred:,}")
    print(
        f"rows {args.rows:,} repeated {args.dup:.0%}: plan off {best[False]:.2f} s, on {best[True]:.2f} s, "
        f"ratio {best[True] / best[False]:.2f}"
    )


if __name__ == "__main__":
    main()
