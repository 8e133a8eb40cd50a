#!/usr/bin/env python
"""Scale-out on one host: N shard workers on N GPUs at once vs one worker on one GPU.

    python benchmarks/bench_scaleout.py --model PATH --engine JSON [--rows 20000] [--gpus 2]
                                        [--modes one,two,two,one] [--tp2]

Every run is the real worker CLI (``worker_command(ShardTask(...))``) over shards of ``--rows``
rows each, planned once from one Parquet input (the classification workload of
``bench_worker_vs_raw.py``: chat, structured choice over 8 labels, max_tokens 8, greedy).

Modes (run in the order given; ``one,two,two,one`` is abba and cancels a linear drift):
  one        shard 0 on GPU 0, alone (the baseline, measured in the same call)
  two        shards 0..N-1, one worker per GPU (``CUDA_VISIBLE_DEVICES=i``), started together
  pinned     as ``two``, each worker (and its engine process) bound to its own slice of the
             host's cores (``sched_setaffinity``) with ``OMP_NUM_THREADS`` = slice size
  tp         one worker with ``tensor_parallel_size=N`` over shard 0 (all GPUs visible)

Printed per run: each worker's rows/s over its own inference (``stats.infer_s``), its CPU use
(user+sys of the worker and every process it reaped, from ``os.wait4``, per second of its wall
time: cores busy), and for the parallel modes the aggregate: all rows / (last inference end -
first inference start), which counts any misalignment of the starts against the aggregate.
Ratios: aggregate / median ``one`` rows/s; per-worker rows/s / median ``one``. Outputs of
shard 0 are compared with the ``one`` run's (greedy: they must be identical).
One JSON line per invocation is appended to ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_worker_vs_raw import ENV_SETTINGS, committed_outputs, environment, make_spec, texts_for  # noqa: E402

# A benchmark's own signing key (docs/adr/0007-sealed-records.md): the stages it runs, in this process
# and in the children it starts, seal and check what they write with it. Never a deployment's key.
os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", "benchmark-signing-key-not-for-deployments-0123456789")


def _spec(args, work: Path, out: str, tp: int = 1):
    from airflow_provider_vllm.core.spec import JobSpec

    engine = json.loads(args.engine) if args.engine else None
    base = make_spec(
        "classify",
        args.model,
        work / "in",
        work / out,
        args.rows,
        "chat",
        engine=engine,
        max_model_len=args.max_model_len,
    )
    doc = base.model_dump(mode="json")
    doc["sharding"]["max_shards"] = args.gpus
    if tp > 1:
        doc["engine"]["tensor_parallel_size"] = tp
    return JobSpec.load(doc)


def _cpu_slices(n: int) -> list[set[int]]:
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n)
    return [set(cores[i * per : (i + 1) * per]) for i in range(n)]


_TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu(roots: set[int], seen: dict[int, float]) -> None:
    """Add the latest user+sys seconds of every live process under ``roots`` to ``seen`` (pid -> s)."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                stats[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK)
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = set(roots), True
    while grew:
        grew = False
        for pid, (ppid, _) in stats.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    for pid in tree:
        if pid in stats:
            seen[pid] = max(seen.get(pid, 0.0), stats[pid][1])


def _launch(spec, shard_id: str, env: dict, log: Path, cpus: set[int] | None):
    from airflow_provider_vllm.worker.task import worker_command
    from tests.support.data import shard_task, worker_env

    cmd = worker_command(shard_task(spec=spec, shard_id=shard_id))
    env = worker_env(env)  # the worker key only, as the local runner hands it over
    pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    err = open(log, "w")
    out = open(log.with_suffix(".out"), "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True, cwd=ROOT, preexec_fn=pre)  # noqa: PLW1509 (single-threaded parent)
    proc.out_file = out
    return proc, err, time.monotonic()


def _poll(proc):
    """Like ``Popen.poll`` but keeps the child's rusage (``os.wait4``)."""
    if getattr(proc, "wait_status", None) is not None:
        return proc.wait_status
    pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    proc.wait_status, proc.rusage, proc.t_end = status, ru, time.monotonic()
    return status


def _collect(spec, shard_id: str, proc, err, t0: float) -> dict:
    proc.out_file.seek(0)
    out_text = proc.out_file.read()
    proc.out_file.close()
    status, ru = proc.wait_status, proc.rusage
    end = proc.t_end
    proc.returncode = os.waitstatus_to_exitcode(status)
    err.close()
    lines = [x for x in out_text.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker {shard_id} failed (exit {proc.returncode}); see {err.name}")
    m = json.loads(lines[-1])
    st = m["stats"]
    outputs = committed_outputs(spec, shard_id)
    wall = end - t0
    # Inference ends when the worker writes its manifest, i.e. close to its exit; it starts infer_s before.
    return {
        "shard": shard_id,
        "rows": m["rows"],
        "infer_s": st["infer_s"],
        "engine_start_s": st["engine_start_s"],
        "rows_per_s": round(m["rows"] / st["infer_s"], 2),
        "wall_s": round(wall, 2),
        "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
        "cores_busy": round((ru.ru_utime + ru.ru_stime) / wall, 2),
        "infer_end": end,
        "infer_start": end - st["infer_s"],
        "outputs": outputs,
    }


def run_mode(mode: str, args, work: Path, shard_ids: list[str], env: dict, k: int) -> dict:
    n = args.gpus
    if mode == "tp":
        spec = _spec(args, work, f"out-{mode}-{k}", tp=n)
        plan_ids = _plan(spec)
        jobs = [(plan_ids[0], {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n)))}, None)]
    else:
        spec = _spec(args, work, f"out-{mode}-{k}")
        plan_ids = _plan(spec)
        assert plan_ids == shard_ids, (plan_ids, shard_ids)
        count = 1 if mode == "one" else n
        slices = _cpu_slices(n) if mode == "pinned" else [None] * n
        jobs = []
        for i in range(count):
            e = {**env, "CUDA_VISIBLE_DEVICES": str(i)}
            if slices[i]:
                e["OMP_NUM_THREADS"] = str(len(slices[i]))
            jobs.append((plan_ids[i], e, slices[i]))
    started = [(sid, *_launch(spec, sid, e, work / f"{mode}-{k}-{sid}.log", cpus)) for sid, e, cpus in jobs]
    # CPU seconds of each worker's process tree (worker + engine core + helpers), sampled every 0.5 s
    # (os.wait4 misses the engine processes, which the worker kills rather than reaps).
    cpu: list[dict[int, float]] = [{} for _ in started]
    while any(_poll(p) is None for _, p, _, _ in started):
        for (_, p, _, _), seen in zip(started, cpu):
            _tree_cpu({p.pid}, seen)
        time.sleep(0.5)
    res = [_collect(spec, sid, p, err, t0) for sid, p, err, t0 in started]
    for r, seen in zip(res, cpu):
        r["tree_cpu_s"] = round(sum(seen.values()), 1)
        r["tree_cores_busy"] = round(r["tree_cpu_s"] / r["wall_s"], 2)
    window = max(r["infer_end"] for r in res) - min(r["infer_start"] for r in res)
    overlap = min(r["infer_end"] for r in res) - max(r["infer_start"] for r in res)
    total = sum(r["rows"] for r in res)
    return {
        "mode": mode,
        "workers": res,
        "aggregate_rows_per_s": round(total / window, 2),
        "window_s": round(window, 2),
        "overlap_s": round(max(0.0, overlap), 2),
    }


def _plan(spec) -> list[str]:
    from airflow_provider_vllm.steps.plan.planner import plan_job

    return [s.shard_id for s in plan_job(spec).shards]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", help="JSON for the spec's engine section (see bench_worker_vs_raw.py --engine)")
    ap.add_argument("--rows", type=int, default=20000, help="rows per shard (>= 20 s of inference on an H200)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--modes", default="one,two,two,one")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "scaleout")
    ap.add_argument("--results", type=Path, default=HERE / "results.jsonl")
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq

    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "in").mkdir(parents=True)
    total = args.rows * args.gpus
    pq.write_table(
        pa.table({"id": [f"r{i:08d}" for i in range(total)], "text": texts_for("classify", total)}),
        work / "in" / "data.parquet",
        row_group_size=max(1, args.rows // 4),
    )
    env = {**os.environ, **ENV_SETTINGS}
    shard_ids = _plan(_spec(args, work, "out-probe"))
    if len(shard_ids) != args.gpus:
        raise SystemExit(f"planned {len(shard_ids)} shards, wanted {args.gpus}")
    info = environment()
    t_start = time.time()
    runs = []
    for k, mode in enumerate(args.modes.split(",")):
        r = run_mode(mode, args, work, shard_ids, env, k)
        runs.append(r)
        ws = ", ".join(
            f"{w['rows_per_s']:.1f} rows/s (infer {w['infer_s']:.1f}s, start {w['engine_start_s']:.0f}s, "
            f"{w['tree_cores_busy']:.2f} cores)"
            for w in r["workers"]
        )
        print(
            f"{mode:<7} #{k}: aggregate {r['aggregate_rows_per_s']:.1f} rows/s over {r['window_s']:.1f}s "
            f"(overlap {r['overlap_s']:.1f}s); workers: {ws}",
            flush=True,
        )

    one = [r["workers"][0]["rows_per_s"] for r in runs if r["mode"] == "one"]
    base = statistics.median(one) if one else None
    ref = next((r["workers"][0]["outputs"] for r in runs if r["mode"] == "one"), None)
    print(f"\nbench_scaleout: {args.rows} rows/shard, {args.gpus} GPUs, model {args.model}, modes {args.modes}")
    summary = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        agg = statistics.median(r["aggregate_rows_per_s"] for r in runs if r["mode"] == mode)
        per = [w["rows_per_s"] for r in runs if r["mode"] == mode for w in r["workers"]]
        same = (
            [sum(a == b for a, b in zip(ref, r["workers"][0]["outputs"])) for r in runs if r["mode"] == mode]
            if ref
            else []
        )
        summary[mode] = {
            "aggregate_median": agg,
            "ratio_to_one": round(agg / base, 3) if base else None,
            "per_worker_ratio": [round(p / base, 3) for p in per] if base else None,
            "identical_to_one_shard0": same,
        }
        print(
            f"{mode:<7} aggregate median {agg:8.1f} rows/s  ratio to one GPU {summary[mode]['ratio_to_one']}  "
            f"per worker {summary[mode]['per_worker_ratio']}  identical outputs (shard 0) {same} of {args.rows}"
        )
    import vllm

    strip = [
        {
            **r,
            "workers": [
                {k: v for k, v in w.items() if k not in ("outputs", "infer_end", "infer_start")} for w in r["workers"]
            ],
        }
        for r in runs
    ]
    from airflow_provider_vllm.testing.local_models import recorded_name

    record = {
        "bench": "scaleout",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "rows_per_shard": args.rows,
        "gpus": args.gpus,
        "model": recorded_name(args.model),
        "engine": args.engine,
        "modes": args.modes,
        "env": {**info, "vllm": vllm.__version__, "host_cores": os.cpu_count()},
        "runs": strip,
        "summary": summary,
    }
    with open(args.results, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
