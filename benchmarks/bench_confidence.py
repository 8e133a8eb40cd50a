#!/usr/bin/env python
"""What the answer's confidence costs the worker: the same classification shard with the chosen
tokens' logprobs asked for (``qa.confidence`` default for structured choice) and without
(``qa.confidence: false``), on vLLM's CPU build with SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/bench_confidence.py [--rows 600] [--pairs 1]

Rows: the demo's synthetic support tickets (``scripts/sample_tickets.py``), the demo's job
(``dags/vllm_dag_defaults.ticket_spec``: chat, the 5 labels as a structured choice, max_tokens 16,
temperature 0, eager mode, max_num_seqs 64). Each run is the real worker CLI over one shard in a
fresh output folder; its manifest's ``stats.infer_s`` (after engine start and warm-up) gives
rows/s. Runs go off, on, on, off per pair (ABBA: a slow drift of the machine cancels); the ratio
on/off of the summed inference seconds is printed, and one JSON line goes to benchmarks/results.jsonl.
The answers of both sides are compared (logprobs do not change what is sampled).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "dags")]
RESULTS_FILE = HERE / "results.jsonl"


def run_side(spec_doc: dict, out: Path, confidence: bool) -> dict:
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.task import worker_command
    from tests.support.data import shard_task, worker_env

    shutil.rmtree(out, ignore_errors=True)
    doc = json.loads(json.dumps(spec_doc))
    doc["io"]["output_uri"] = str(out)
    doc["qa"]["confidence"] = None if confidence else False
    spec = JobSpec.load(doc)
    assert spec.confidence_from_logprobs == confidence
    (shard,) = plan_job(spec).shards
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.update(VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    # the deployment's allow-list, as the shard operator hands it over: the work folder and the model
    env["VLLM_BATCH_ALLOWED_PREFIXES"] = json.dumps([str(out.parent), spec.model.name])
    proc = subprocess.run(
        worker_command(shard_task(spec=spec, shard_id=shard.shard_id)),
        env=worker_env(env),
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        sys.exit(f"worker failed ({proc.returncode}): {proc.stderr[-3000:]}")
    m = json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
    import pyarrow.parquet as pq

    labels = {}
    for p in sorted((out / "shards").rglob("chunk-*.parquet")):
        if not p.name.endswith(".errors.parquet"):
            t = pq.read_table(p, columns=["id", "label", "confidence"])
            labels.update(zip(t.column("id").to_pylist(), t.column("label").to_pylist()))
            assert (t.column("confidence").null_count == 0) == confidence
    return {"infer_s": m["stats"]["infer_s"], "rows": m["rows"], "labels": labels}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--workdir", default=str(ROOT / ".cache" / "bench_confidence"))
    args = ap.parse_args()
    from sample_tickets import write_tickets
    from vllm_dag_defaults import ticket_spec

    from airflow_provider_vllm.testing.local_models import default_cache_dir, prepare_smollm2

    work = Path(args.workdir)
    tickets = work / "tickets"
    if not (tickets / "tickets.parquet").exists():
        write_tickets(tickets, args.rows, seed=11)
    model = str(prepare_smollm2(default_cache_dir() / "smollm2-135m-instruct"))
    doc = ticket_spec("bench-confidence", str(tickets / "tickets.parquet"), str(work / "out"))
    doc["model"]["name"] = model
    doc["sharding"] = {"target_rows": 10 * args.rows, "chunk_rows": 256}
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.pairs):
        for confidence in (False, True, True, False):
            r = run_side(doc, work / f"out-{int(confidence)}", confidence)
            runs[confidence].append(r)
            print(f"confidence={'on ' if confidence else 'off'} {r['rows'] / r['infer_s']:7.2f} rows/s", flush=True)
    off = sum(r["infer_s"] for r in runs[False])
    on = sum(r["infer_s"] for r in runs[True])
    same = all(r["labels"] == runs[False][0]["labels"] for r in runs[True] + runs[False])
    rows = runs[False][0]["rows"]
    print(f"inference seconds: off {off:.1f}, on {on:.1f}; on/off = {on / off:.3f}; same answers: {same}")
    record = {
        "bench": "confidence",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
        "pairs": args.pairs,
        "rows_per_s": {
            "off": [round(r["rows"] / r["infer_s"], 3) for r in runs[False]],
            "on": [round(r["rows"] / r["infer_s"], 3) for r in runs[True]],
        },
        "ratio_on_off_seconds": round(on / off, 4),
        "same_answers": same,
        "env": {
            "machine": platform.machine(),
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "git": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip(),
            "load1": round(os.getloadavg()[0], 2),
        },
    }
    with open(RESULTS_FILE, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
