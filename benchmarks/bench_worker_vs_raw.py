#!/usr/bin/env python
"""Shard worker vs raw ``vllm.LLM.chat``: same prompts, model, engine args (vLLM CPU build).

    .venv/bin/python benchmarks/bench_worker_vs_raw.py [--workload classify|generate]
                                                       [--rows N] [--model PATH] [--pairs 2]

Workloads:
  classify  ~120-token chat prompts (system prompt listing 8 labels + "Ticket: {text}"),
            structured choice over the 8 labels, max_tokens 8, temperature 0 (default 600 rows;
            --gpu: 20,000)
  generate  ~500-token chat prompts, max_tokens 200, temperature 0 (default 60 rows; --gpu: 1,000)

The defaults are for the CPU build (slow). ``--gpu`` sets GPU run lengths: >= 20 s of inference per side
on one H200 (Llama-3-8B shape), long enough to tell a regression from run-to-run drift.

    .venv/bin/python benchmarks/bench_worker_vs_raw.py --workload all     # both workloads, one command
    options: --api generate (task generate vs LLM.generate over text prompts; default chat vs
    LLM.chat), --enforce-eager (both sides; faster engine start on the CPU build)

Baseline (raw): a subprocess builds ``vllm.LLM(**engine_kwargs(spec))``, warms up with one
request (as the worker's ``Engine.warm_up``), then times ``llm.chat(conversations,
sampling_params(spec), use_tqdm=False)`` (``--api generate``: ``llm.generate(prompts, ...)``
over the text prompts); engine start is not timed.
Worker: the same rows as a Parquet dataset, one shard planned with ``plan_job``, the real
worker CLI (``worker_command(ShardTask(...))``) as a subprocess; its manifest's
``stats.infer_s`` is the inference time after engine start and warm-up. Also reported:
rows / (wall_s - engine_start_s), i.e. including read, warm-up, chunk writes and commit.

Runs alternate raw, worker, raw, worker (``--pairs``; ``--order abba``: raw, worker, worker,
raw, which cancels a slow drift of the machine's speed); medians and the ratio worker/raw of
rows/s are printed (goal >= 0.98) and one JSON line is appended to benchmarks/results.jsonl.
Model: SmolLM2-135M-Instruct from ``prepare_smollm2(default_cache_dir() / "smollm2-135m-instruct")``.
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
RESULTS_FILE = HERE / "results.jsonl"
GOAL_RATIO = 0.98

LABELS = ["billing", "bug", "account", "shipping", "refund", "feature_request", "security", "other"]
SYSTEM_CLASSIFY = (
    "You are a support ticket classifier. Read the ticket and answer with exactly one label from this list: "
    "billing (charges, invoices, payments), bug (crashes, errors, broken features), account (login, profile, "
    "email), shipping (deliveries, parcels), refund (money back, cancellations), feature_request (ideas, "
    "missing options), security (suspicious access, passwords), other (anything else). Answer with the label only."
)
SYSTEM_GENERATE = (
    "You are a friendly customer support agent. Write a helpful reply to the customer's ticket: "
    "summarise the problem, apologise where appropriate, and list the next steps."
)
WORKLOADS = {
    "classify": {
        "rows": 600,
        "gpu_rows": 20000,
        "max_tokens": 8,
        "sentences": 1,
        "system": SYSTEM_CLASSIFY,
        "structured": True,
    },
    "generate": {
        "rows": 60,
        "gpu_rows": 1000,
        "max_tokens": 200,
        "sentences": 25,
        "system": SYSTEM_GENERATE,
        "structured": False,
    },
}
"""``rows``: CPU defaults (the CPU build is slow). ``gpu_rows`` (``--gpu``): >= 20 s of inference per side
on one H200 with the Llama-3-8B shape (classify ran ~600-900 rows/s: 20,000 rows ~25-35 s; generate ~37 rows/s:
1,000 rows ~27 s). Shorter GPU runs (4,000 classify rows, 5-7 s) were too noisy to tell a regression from drift."""

ENV_SETTINGS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


# A benchmark's own signing key (docs/adr/0007-sealed-records.md): the stages it runs, in this process
# and in the children it starts, seal and check what they write with it. Never a deployment's key.
os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", "benchmark-signing-key-not-for-deployments-0123456789")


def texts_for(workload: str, rows: int, seed: int = 3) -> list[str]:
    import numpy as np

    sys.path.insert(0, str(HERE))
    from bench_dataplane import _templates

    templates, details = _templates()
    rng = np.random.default_rng(seed)
    k = WORKLOADS[workload]["sentences"]
    out = []
    for _ in range(rows):
        ti, di = rng.integers(0, len(templates), k), rng.integers(0, len(details), k)
        out.append(" ".join(f"{templates[a]} {details[b]}" for a, b in zip(ti, di)))
    return out


def make_spec(
    workload: str,
    model: str,
    input_dir: Path,
    out_dir: Path,
    rows: int,
    api: str = "chat",
    enforce_eager: bool = False,
    engine: dict | None = None,
    max_model_len: int = 2048,
):
    from airflow_provider_vllm.core.spec import JobSpec

    w = WORKLOADS[workload]
    sampling = {"temperature": 0, "max_tokens": w["max_tokens"]}
    if w["structured"]:
        sampling["structured"] = {"choice": LABELS}
    # generate: no chat template; the system prompt leads the plain-text prompt
    prompt = (
        {"template": "Ticket: {text}", "system_prompt": w["system"]}
        if api == "chat"
        else {"template": w["system"] + "\n\nTicket: {text}\nAnswer:"}
    )
    return JobSpec.load(
        {
            "name": f"bench-{workload}",
            "task": api,
            "model": {"name": model, "max_model_len": max_model_len},
            "engine": engine if engine is not None else {"cpu_kvcache_space_gb": 1, "enforce_eager": enforce_eager},
            "prompt": prompt,
            "sampling": sampling,
            "io": {"input_uri": str(input_dir), "output_uri": str(out_dir)},
            # the worker's overhead over raw vLLM on the same prompts: every row reaches the engine
            "sharding": {"target_rows": rows, "max_shards": 1, "dedupe": False},
        }
    )


# ---- baseline child: raw vllm.LLM.chat -------------------------------------------------
def raw_child(spec_json: str, texts_file: str) -> None:
    import vllm
    from vllm import SamplingParams

    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.worker.engine import engine_kwargs, sampling_params

    spec = JobSpec.load(spec_json)
    texts = json.loads(Path(texts_file).read_text())
    t0 = time.monotonic()
    llm = vllm.LLM(**engine_kwargs(spec))
    start_s = time.monotonic() - t0
    tok = llm.get_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)[:32]  # as Engine.warm_up
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    params = sampling_params(spec)
    if spec.task == "generate":
        prompts = [spec.prompt.template.format(text=t) for t in texts]
        t0 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        infer_s = time.monotonic() - t0
    else:
        convs = []
        for t in texts:
            msgs = [{"role": "system", "content": spec.prompt.system_prompt}] if spec.prompt.system_prompt else []
            msgs.append({"role": "user", "content": spec.prompt.template.format(text=t)})
            convs.append(msgs)
        t0 = time.monotonic()
        outs = llm.chat(convs, params, use_tqdm=False)
        infer_s = time.monotonic() - t0
    ptok = sum(len(o.prompt_token_ids or ()) for o in outs)
    ctok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        json.dumps(
            {
                "engine_start_s": round(start_s, 3),
                "infer_s": round(infer_s, 3),
                "rows": len(outs),
                "prompt_tokens": ptok,
                "completion_tokens": ctok,
                "vllm": vllm.__version__,
                "outputs": [o.outputs[0].text for o in outs],
            }
        ),
        flush=True,
    )
    # the figures are out: leave like the worker does (exit_hard: kill the engine processes, which
    # would otherwise keep our stdout pipe open, then os._exit; vLLM's teardown at exit can abort)
    from airflow_provider_vllm.worker.exits import exit_hard

    exit_hard(0)


# ---- parent ------------------------------------------------------------------------------
def run_raw(spec, texts_file: Path, env: dict, log: Path) -> dict:
    cmd = [sys.executable, __file__, "--child-raw", spec.model_dump_json(), str(texts_file)]
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"raw baseline failed (exit {proc.returncode}); see {log}")
    r = json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
    r["process_s"] = round(wall, 3)
    return r


def run_worker(spec, env: dict, log: Path) -> dict:
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.task import worker_command

    sys.path.insert(0, str(ROOT))
    from tests.support.data import shard_task, worker_env

    plan = plan_job(spec)
    (shard,) = plan.shards
    cmd = worker_command(shard_task(spec=spec, shard_id=shard.shard_id))
    t0 = time.monotonic()
    with open(log, "w") as err:  # the worker key only, as the local runner hands it over
        proc = subprocess.run(cmd, env=worker_env(env), stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    wall = time.monotonic() - t0
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker failed (exit {proc.returncode}); see {log}")
    m = json.loads(lines[-1])
    if m.get("status") != "committed":
        raise SystemExit(f"worker manifest: {m}")
    outputs = committed_outputs(spec, shard.shard_id)
    st = m["stats"]
    return {
        "rows": m["rows"],
        "ok_rows": m["ok_rows"],
        "error_rows": m["error_rows"],
        "engine_start_s": st["engine_start_s"],
        "infer_s": st["infer_s"],
        "wall_s": st["wall_s"],
        "read_s": st.get("read_s"),
        "rows_per_s_manifest": st.get("rows_per_s"),
        "tokens_per_s_manifest": st.get("tokens_per_s"),
        "prompt_tokens": st["prompt_tokens"],
        "completion_tokens": st["completion_tokens"],
        "peak_rss_mb": st.get("peak_rss_mb"),
        "process_s": round(wall, 3),
        "outputs": outputs,
    }


def committed_outputs(spec, shard_id: str) -> list:
    """The ``output`` column of a committed shard, in row order (the files its marker names)."""
    import pyarrow.parquet as pq

    from airflow_provider_vllm.core.storage import Storage

    out = Storage(spec.io.output_uri)
    marker = json.loads(out.read_bytes(f"shards/{shard_id}/_COMMITTED.json"))
    outputs = []
    for f in marker["files"]:
        with out.open(f["path"]) as fh:
            outputs += pq.read_table(fh, columns=["output"]).column(0).to_pylist()
    return outputs


def derive(r: dict) -> dict:
    r["rows_per_s"] = round(r["rows"] / r["infer_s"], 3)
    r["out_tok_per_s"] = round(r["completion_tokens"] / r["infer_s"], 1)
    r["all_tok_per_s"] = round((r["prompt_tokens"] + r["completion_tokens"]) / r["infer_s"], 1)
    if "wall_s" in r:
        excl = r["wall_s"] - r["engine_start_s"]
        r["rows_per_s_wall_excl_start"] = round(r["rows"] / excl, 3)
    return r


def environment() -> dict:
    """Machine, versions and the package commit under test (the data-plane benchmark's record)."""
    sys.path.insert(0, str(HERE))
    from bench_dataplane import environment as dataplane_environment

    return dataplane_environment()


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child-raw":
        raw_child(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload",
        choices=sorted(WORKLOADS) + ["all"],
        default="classify",
        help="all: classify, then generate, in one command",
    )
    ap.add_argument("--rows", type=int, help="default: 600 (classify) / 60 (generate); with --gpu 20000 / 1000")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="GPU run lengths (>= 20 s of inference per side on an H200): 20000 classify / 1000 "
        "generate rows, unless --rows",
    )
    ap.add_argument("--model", help="model folder (default: SmolLM2 prepared by prepare_smollm2)")
    ap.add_argument("--pairs", type=int, default=2, help="raw/worker pairs, run alternately")
    ap.add_argument(
        "--order",
        choices=["abab", "abba"],
        default="abab",
        help="abab: raw, worker, raw, worker; abba: raw, worker, worker, raw (cancels linear drift)",
    )
    ap.add_argument(
        "--api",
        choices=["chat", "generate"],
        default="chat",
        help="chat: task chat vs LLM.chat (default); generate: task generate vs LLM.generate(text)",
    )
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="engine.enforce_eager on both sides (no torch.compile: engine start ~25 s instead of 65-130 s)",
    )
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "worker_vs_raw")
    ap.add_argument(
        "--engine",
        help="JSON for the spec's engine section (default: CPU build, 1 GiB KV cache); "
        'GPU example: \'{"max_num_seqs": 256, "gpu_memory_utilization": 0.9, "enable_prefix_caching": '
        'true, "engine_kwargs": {"load_format": "dummy"}}\'',
    )
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--results", type=Path, default=RESULTS_FILE, help="JSON lines file to append the record to")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_BATCH_MODEL_CACHE", str(ROOT / ".cache" / "models"))
    if args.model is None:
        from airflow_provider_vllm.testing.local_models import default_cache_dir, prepare_smollm2

        args.model = str(prepare_smollm2(default_cache_dir() / "smollm2-135m-instruct"))
    summary = []
    for workload in sorted(WORKLOADS) if args.workload == "all" else [args.workload]:
        summary.append((workload, run_workload(args, workload)))
    if len(summary) > 1:
        print("\nsummary (ratio worker/raw rows/s, goal >= %.2f):" % GOAL_RATIO)
        for workload, ratio in summary:
            print(f"  {workload:<9} {ratio:.3f} {'met' if ratio >= GOAL_RATIO else 'NOT met'}")
    return 0


def run_workload(args, workload: str) -> float:
    """One workload: alternate raw and worker runs, print and record them; returns the ratio of medians."""
    rows = args.rows or WORKLOADS[workload]["gpu_rows" if getattr(args, "gpu", False) else "rows"]
    env = {**os.environ, **ENV_SETTINGS}

    import pyarrow as pa
    import pyarrow.parquet as pq

    work = (args.workdir / workload).resolve()
    if work.exists():
        shutil.rmtree(work)
    (work / "in").mkdir(parents=True)
    texts = texts_for(workload, rows)
    ids = [f"r{i:06d}" for i in range(rows)]
    pq.write_table(pa.table({"id": ids, "text": texts}), work / "in" / "data.parquet")
    texts_file = work / "texts.json"
    texts_file.write_text(json.dumps(texts))
    # the worker refuses to run without the deployment's allow-list (docs/security.md): this workload's
    # folder and the model's (a hub id needs none)
    model_dir = os.path.dirname(os.path.realpath(args.model)) if args.model.startswith("/") else None
    env["VLLM_BATCH_ALLOWED_PREFIXES"] = json.dumps([str(work), *([model_dir] if model_dir else [])])

    t_start = time.time()
    env_info = environment()  # at the start: the package commit under test
    seq = ("rw" * args.pairs) if args.order == "abab" else ("rwwr" * args.pairs)[: 2 * args.pairs]
    raws, workers, runs = [], [], []
    for pos, side in enumerate(seq):
        n_side = sum(1 for x in seq[:pos] if x == side)
        spec = make_spec(
            workload,
            args.model,
            work / "in",
            work / f"out-{pos}",
            rows,
            args.api,
            args.enforce_eager,
            engine=json.loads(args.engine) if args.engine else None,
            max_model_len=args.max_model_len,
        )
        load = os.getloadavg()[0]
        if side == "r":
            r = derive(run_raw(spec, texts_file, env, work / f"raw-{n_side}.log"))
            r["load1_before"] = round(load, 2)
            raws.append(r)
            print(
                f"raw    #{n_side}: {r['rows_per_s']:.2f} rows/s, {r['out_tok_per_s']:.1f} out tok/s "
                f"(infer {r['infer_s']:.2f}s, engine start {r['engine_start_s']:.1f}s, load1 {load:.2f})",
                flush=True,
            )
        else:
            r = derive(run_worker(spec, env, work / f"worker-{n_side}.log"))
            r["load1_before"] = round(load, 2)
            workers.append(r)
            print(
                f"worker #{n_side}: {r['rows_per_s']:.2f} rows/s, {r['out_tok_per_s']:.1f} out tok/s "
                f"(infer {r['infer_s']:.2f}s, engine start {r['engine_start_s']:.1f}s, "
                f"wall-excl-start {r['rows_per_s_wall_excl_start']:.2f} rows/s, load1 {load:.2f})",
                flush=True,
            )
        runs.append((side, r))

    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    raw_rps, wk_rps = med(raws, "rows_per_s"), med(workers, "rows_per_s")
    raw_tps, wk_tps = med(raws, "out_tok_per_s"), med(workers, "out_tok_per_s")
    wk_wall_rps = med(workers, "rows_per_s_wall_excl_start")
    ratio = wk_rps / raw_rps
    same = [sum(a == b for a, b in zip(r["outputs"], w["outputs"])) for r, w in zip(raws, workers)]
    # each worker run against the raw run(s) next to it in time (cancels slow drift of the machine)
    adjacent = []
    for i, (side, r) in enumerate(runs):
        if side != "w":
            continue
        near = [runs[j][1]["rows_per_s"] for j in (i - 1, i + 1) if 0 <= j < len(runs) and runs[j][0] == "r"]
        adjacent.append(round(r["rows_per_s"] / statistics.mean(near), 4) if near else None)
    ptoks = (raws[0]["prompt_tokens"], workers[0]["prompt_tokens"])

    print(
        f"\nbench_worker_vs_raw: workload {workload}, {rows} rows, model {args.model}, "
        f"{args.pairs} pairs, order {seq}; prompt tokens raw {ptoks[0]} / worker {ptoks[1]} "
        f"(avg {ptoks[0] / rows:.0f}/row)"
    )
    print(f"{'side':<28} {'rows/s':>8} {'out tok/s':>10} {'completion toks':>16}")
    print(f"{'raw LLM.chat (baseline)':<28} {raw_rps:>8.2f} {raw_tps:>10.1f} {med(raws, 'completion_tokens'):>16.0f}")
    print(f"{'worker (stats.infer_s)':<28} {wk_rps:>8.2f} {wk_tps:>10.1f} {med(workers, 'completion_tokens'):>16.0f}")
    print(f"{'worker (wall - engine start)':<28} {wk_wall_rps:>8.2f}")
    verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
    print(
        f"ratio worker/raw rows/s: {ratio:.3f} (goal >= {GOAL_RATIO}: {verdict}); "
        f"wall-excl-start ratio {wk_wall_rps / raw_rps:.3f}; out tok/s ratio {wk_tps / raw_tps:.3f}"
    )
    print(f"per worker run, ratio to the adjacent raw run(s): {adjacent}")
    print(f"identical outputs worker vs raw per pair: {same} of {rows}")

    import vllm

    strip = lambda d: {k: v for k, v in d.items() if k != "outputs"}  # noqa: E731
    from airflow_provider_vllm.testing.local_models import recorded_name

    record = {
        "bench": "worker_vs_raw",
        "workload": workload,
        "api": args.api,
        "enforce_eager": args.enforce_eager,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "rows": rows,
        "model": recorded_name(args.model),
        "engine": args.engine,
        "max_model_len": args.max_model_len,
        "pairs": args.pairs,
        "order": args.order,
        "sequence": seq,
        "env": {**env_info, "vllm": vllm.__version__},
        "raw": [strip(r) for r in raws],
        "worker": [strip(w) for w in workers],
        "median": {
            "raw_rows_per_s": raw_rps,
            "worker_rows_per_s": wk_rps,
            "worker_rows_per_s_wall_excl_start": wk_wall_rps,
            "raw_out_tok_per_s": raw_tps,
            "worker_out_tok_per_s": wk_tps,
        },
        "ratio": round(ratio, 4),
        "goal": GOAL_RATIO,
        "met": ratio >= GOAL_RATIO,
        "ratio_to_adjacent_raw": adjacent,
        "identical_outputs": same,
    }
    with open(args.results, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    print(f"appended to {args.results}")
    return ratio


if __name__ == "__main__":
    sys.exit(main())
