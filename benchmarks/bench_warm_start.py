#!/usr/bin/env python
"""Engine start of shard pods with and without the shared compile cache (worker/compile_cache.py).

    python benchmarks/bench_warm_start.py --model PATH [--pods empty,populated,off,populated] [--rows 2000]
                                          [--engine JSON] [--batch-invariance 16000]

Each "pod" is the real worker CLI in a fresh process whose private cache folders are a fresh, empty
folder at one fixed path (the pod's emptyDir ``/cache``: ``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``, ``XDG_CACHE_HOME`` and ``HOME`` under it, as ``utils/pod_spec.py`` sets them), run
one after the other:

  off        no shared compile cache (every pod today): a cold start
  empty      the shared folder empty (the first pod): a cold start, then it publishes its snapshot
  populated  the shared folder holds that snapshot (a later pod): restored before vLLM starts

Printed and appended per pod: the worker's ``engine_start_s`` (``import vllm`` + ``LLM()``),
``compile_cache_s`` (restore + publish), the process wall time, and the snapshot's size.

``--batch-invariance N``: then the same classification workload of N rows with and without
``engine.batch_invariant`` (vLLM's ``VLLM_BATCH_INVARIANT=1``), each in the input's order and
reversed (other batch compositions for every row), in the order off, on, on, off; prints the
inference seconds of each and how many rows' answers differ between the two orders of one mode.
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

import bench_worker_vs_raw as wvr  # noqa: E402

GPU_ENGINE = (
    '{"max_num_seqs": 256, "gpu_memory_utilization": 0.9, "enable_prefix_caching": true, '
    '"engine_kwargs": {"load_format": "dummy"}}'
)


def pod_env(base: dict[str, str], private: Path, shared: Path | None) -> dict[str, str]:
    """A shard pod's cache variables: private folders under ``private`` (emptied), the shared one if any."""
    if private.exists():
        shutil.rmtree(private)
    (private / "home").mkdir(parents=True)
    env = {
        **base,
        "HOME": str(private / "home"),
        "XDG_CACHE_HOME": str(private),
        "VLLM_CACHE_ROOT": str(private / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(private / "torchinductor"),
        "TRITON_CACHE_DIR": str(private / "triton"),
        "HF_HOME": str(private / "huggingface"),
    }
    env.pop("VLLM_BATCH_COMPILE_CACHE", None)
    if shared is not None:
        env["VLLM_BATCH_COMPILE_CACHE"] = str(shared)
    return env


def run_pod(spec, env: dict[str, str], log: Path) -> dict:
    """The worker CLI on the spec's one shard; its stats, the process wall time and the committed outputs by id."""
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.task import worker_command

    sys.path.insert(0, str(ROOT))
    from tests.support.data import shard_task, worker_env

    plan = plan_job(spec)
    (shard,) = plan.shards
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.run(
            worker_command(shard_task(spec=spec, shard_id=shard.shard_id)),
            env=worker_env(env),  # the worker key only, as the local runner hands it over
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=ROOT,
        )
    wall = time.monotonic() - t0
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker failed (exit {proc.returncode}); see {log}")
    m = json.loads(lines[-1])
    st = m["stats"]
    return {
        "rows": m["rows"],
        "engine_start_s": st["engine_start_s"],
        "compile_cache": st.get("compile_cache"),
        "compile_cache_s": st.get("compile_cache_s"),
        "infer_s": st["infer_s"],
        "wall_s": st["wall_s"],
        "process_s": round(wall, 3),
        "rows_per_s": st.get("rows_per_s"),
        "outputs": outputs_by_id(spec, shard.shard_id),
        "log": [x.strip()[:300] for x in log.read_text().splitlines() if "compile cache" in x],
    }


def outputs_by_id(spec, shard_id: str) -> dict[str, str]:
    import pyarrow.parquet as pq

    from airflow_provider_vllm.core.storage import Storage

    out = Storage(spec.io.output_uri)
    marker = json.loads(out.read_bytes(f"shards/{shard_id}/_COMMITTED.json"))
    got: dict[str, str] = {}
    for f in marker["files"]:
        with out.open(f["path"]) as fh:
            t = pq.read_table(fh, columns=["id", "output"])
        got.update(zip(t.column(0).to_pylist(), t.column(1).to_pylist()))
    return got


def snapshot_size(shared: Path) -> dict:
    files = [p for p in shared.rglob("*") if p.is_file()]
    return {"files": len(files), "mb": round(sum(p.stat().st_size for p in files) / 1e6, 1)}


def write_input(work: Path, rows: int, reverse: bool = False) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = wvr.texts_for("classify", rows)
    ids = [f"r{i:06d}" for i in range(rows)]
    if reverse:
        texts, ids = texts[::-1], ids[::-1]
    d = work / ("in-reversed" if reverse else "in")
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "text": texts}), d / "data.parquet")
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model folder, e.g. /tmp/models/llama3-8b-dummy")
    ap.add_argument("--pods", default="empty,populated,off,populated", help="pods in order: off, empty, populated")
    ap.add_argument("--rows", type=int, default=2000, help="classification rows per pod (start-up is measured)")
    ap.add_argument("--engine", default=GPU_ENGINE, help="JSON of the spec's engine section")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--batch-invariance", type=int, default=0, metavar="ROWS", help="also the batch-invariance runs")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "warm_start")
    ap.add_argument("--private", type=Path, default=Path("/tmp/vllm-batch-pod-cache"), help="the pods' emptyDir")
    ap.add_argument("--shared", type=Path, help="the shared compile-cache folder (default: WORKDIR/shared; kept)")
    ap.add_argument("--commit", help="the package commit under test, when the copy run is not a git checkout")
    ap.add_argument("--results", type=Path, default=wvr.RESULTS_FILE)
    args = ap.parse_args()

    work = args.workdir.resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shared = (args.shared or work / "shared").resolve()
    shared.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, **wvr.ENV_SETTINGS}
    model_dir = os.path.dirname(os.path.realpath(args.model))
    base["VLLM_BATCH_ALLOWED_PREFIXES"] = json.dumps([str(work), model_dir])
    engine = json.loads(args.engine)
    env_info = wvr.environment()
    if args.commit:
        env_info["git"] = args.commit
    t_start = time.time()

    def spec_for(name: str, rows: int, in_dir: Path, eng: dict):
        return wvr.make_spec(
            "classify",
            args.model,
            in_dir,
            work / f"out-{name}",
            rows,
            "chat",
            engine=eng,
            max_model_len=args.max_model_len,
        )

    in_dir = write_input(work, args.rows)
    pods = []
    for i, kind in enumerate(k for k in args.pods.split(",") if k):
        if kind == "off":
            env = pod_env(base, args.private, None)
        elif kind == "empty":
            shutil.rmtree(shared)
            shared.mkdir()
            env = pod_env(base, args.private, shared)
        elif kind == "populated":
            env = pod_env(base, args.private, shared)
        else:
            raise SystemExit(f"unknown pod kind {kind!r}")
        r = run_pod(spec_for(f"pod{i}-{kind}", args.rows, in_dir, engine), env, work / f"pod{i}-{kind}.log")
        r.pop("outputs")
        r.update(pod=i, kind=kind, snapshot=snapshot_size(shared))
        pods.append(r)
        print(
            f"pod {i} {kind:<9}: engine start {r['engine_start_s']:.1f} s, compile cache {r['compile_cache']} "
            f"{r['compile_cache_s']} s, process {r['process_s']:.1f} s, infer {r['infer_s']:.1f} s; "
            f"shared {r['snapshot']}",
            flush=True,
        )
        for line in r["log"]:
            print("   ", line, flush=True)

    record = {
        "bench": "warm_start",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "model": args.model,
        "engine": args.engine,
        "rows": args.rows,
        "env": env_info,
        "pods": pods,
    }
    by_kind = {k: [p["engine_start_s"] for p in pods if p["kind"] == k] for k in ("off", "empty", "populated")}
    record["median_engine_start_s"] = {k: statistics.median(v) for k, v in by_kind.items() if v}
    print("median engine start:", record["median_engine_start_s"], flush=True)

    if args.batch_invariance:
        rows = args.batch_invariance
        ins = {"in": write_input(work, rows), "rev": write_input(work, rows, reverse=True)}
        runs = {}
        for mode, order in (("off", "in"), ("on", "in"), ("on", "rev"), ("off", "rev")):
            eng = {**engine, "batch_invariant": mode == "on"}
            log = work / f"bi-{mode}-{order}.log"
            try:
                r = run_pod(
                    spec_for(f"bi-{mode}-{order}", rows, ins[order], eng), pod_env(base, args.private, shared), log
                )
            except SystemExit as e:  # say why, and go on with the other runs
                print(f"batch_invariant {mode} order {order}: {e}", flush=True)
                print("\n".join(log.read_text().splitlines()[-25:]), flush=True)
                continue
            runs[(mode, order)] = r
            print(
                f"batch_invariant {mode:<3} order {order:<3}: infer {r['infer_s']:.1f} s, {r['rows_per_s']} rows/s, "
                f"engine start {r['engine_start_s']:.1f} s (compile cache {r['compile_cache']})",
                flush=True,
            )
        diff = {
            mode: sum(
                runs[(mode, "in")]["outputs"][k] != runs[(mode, "rev")]["outputs"][k]
                for k in runs[(mode, "in")]["outputs"]
            )
            for mode in ("off", "on")
        }
        across = sum(
            runs[("off", "in")]["outputs"][k] != runs[("on", "in")]["outputs"][k]
            for k in runs[("off", "in")]["outputs"]
        )
        cost = statistics.mean(runs[("on", o)]["infer_s"] for o in ("in", "rev")) / statistics.mean(
            runs[("off", o)]["infer_s"] for o in ("in", "rev")
        )
        print(f"rows whose answer differs between the two orders: {diff} of {rows}; off vs on (input order): {across}")
        print(f"batch-invariant inference time / default: {cost:.3f}", flush=True)
        record["batch_invariance"] = {
            "rows": rows,
            "runs": [
                {"mode": m, "order": o, **{k: v for k, v in r.items() if k != "outputs"}} for (m, o), r in runs.items()
            ],
            "differ_between_orders": diff,
            "differ_off_vs_on": across,
            "infer_ratio_on_off": round(cost, 3),
        }
    with open(args.results, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
