"""Dry run: what a job would cost, before anything is launched.

    python -m airflow_provider_vllm.dry_run examples/job.yaml [--set io.input_uri=/data/in/] [--json]
        [--gpu-memory-gib 139.8] [--gpus N] [--model-config path/config.json] [--tokens-per-s N]
        [--engine-start-s S]

Validates the spec and the input (the plan step's checks, nothing written), then prints rows,
estimated prompt and output tokens, shards, estimated inference time and GPU-hours, and a GPU
memory plan from the model's config.json (``memory_plan.py``) with the GPU layout it picks
(``choose_layout``: tensor_parallel_size and GPUs per shard pod, and why; with ``--gpus N``, the
shards to run at once). A spec whose engine.tensor_parallel_size cannot run (too small for the
model on a GPU of known memory, or one the heads do not divide over) is refused. Throughput comes from the
throughput history (``sharding.history_uri``, see ``sizing.py``) when it has records for the
model; otherwise from ``--tokens-per-s`` / ``--engine-start-s``, and the report says so.
Exit status: 0, or 2 on an invalid spec or dataset (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import Any

from airflow_provider_vllm.errors import EXIT_TERMINAL, SpecError, VllmBatchError
from airflow_provider_vllm.memory_plan import (
    GiB,
    ModelShape,
    choose_layout,
    gpu_memory_gib,
    load_model_config,
    plan_memory,
)
from airflow_provider_vllm.planning import build_plan
from airflow_provider_vllm.sizing import estimate_workload, find_evidence, read_history
from airflow_provider_vllm.spec import JobSpec
from airflow_provider_vllm.storage import FileSystems

# Used only without history, and labelled "assumed" in the report.
ASSUMED_TOKENS_PER_S = 2000.0  # prompt + output tokens per second per model replica
ASSUMED_ENGINE_START_S = 60.0
ASSUMED_GPU_MEMORY_GIB = 80.0


def dry_run_report(spec: JobSpec, *, tokens_per_s: float = ASSUMED_TOKENS_PER_S,
                   engine_start_s: float = ASSUMED_ENGINE_START_S, gpu_memory: float | None = None,
                   model_config: dict[str, Any] | None = None, checkpoint_bytes: int | None = None,
                   gpus: int | None = None, filesystems: FileSystems | None = None) -> dict[str, Any]:
    """The dry-run report as a dict (see ``format_report``); raises DatasetError/SpecError like the plan.

    ``gpus``: the GPU budget (GPUs the job may use at once) for ``layout.max_active_shards``. Raises
    SpecError when the layout refuses the spec's engine.tensor_parallel_size. ``filesystems``: how
    object stores are reached (``storage.FileSystems``; default fsspec).
    """
    plan = build_plan(spec, filesystems)
    records = (read_history(spec.sharding.history_uri, spec.io.storage_options, filesystems)
               if spec.sharding.history_uri else [])
    ev = find_evidence(spec, records)
    work = estimate_workload(spec, plan.total_rows, plan.est_tokens, ev, tokens_per_s, engine_start_s)
    shards = len(plan.shards)
    tp = spec.engine.tensor_parallel_size
    gpu_s = (shards * work.engine_start_s + work.infer_s) * tp
    report: dict[str, Any] = {
        "job": spec.name, "task": spec.task, "model": spec.model.name, "input_uri": spec.io.input_uri,
        "rows": plan.total_rows, "invalid_lines": plan.invalid_lines,
        "est_prompt_tokens": work.prompt_tokens, "est_output_tokens": work.completion_tokens,
        "output_tokens_basis": work.completion_basis,
        "shards": shards, "largest_shard_rows": max((s.rows for s in plan.shards), default=0),
        "sized_from_history": plan.sizing is not None,
        "throughput_basis": work.throughput_basis,
        "evidence": asdict(ev) if ev is not None else None,
        "est_inference_s": round(work.infer_s, 1), "engine_start_s": round(work.engine_start_s, 1),
        "est_shard_minutes": round((work.engine_start_s + work.infer_s / shards) / 60, 2) if shards else 0.0,
        "tensor_parallel_size": tp, "est_gpu_hours": round(gpu_s / 3600, 3),
        "assumptions": {} if ev is not None else {"tokens_per_s": tokens_per_s, "engine_start_s": engine_start_s},
    }
    report["memory"] = _memory(spec, work, ev, gpu_memory, model_config, checkpoint_bytes, gpus)
    layout = report["memory"].pop("layout", None)
    report["layout"] = layout
    if layout and layout["refusal"] and (layout["verdict"] == "invalid_tp" or layout["memory_known"]):
        raise SpecError("layout: " + layout["refusal"])
    return report


def _memory(spec: JobSpec, work, ev, gpu_memory: float | None, cfg: dict | None, ckpt: int | None,
            gpus: int | None = None) -> dict[str, Any]:
    source = "given"
    if cfg is None:
        try:
            cfg, ckpt, source = load_model_config(spec.model.name, spec.model.revision)
        except (FileNotFoundError, OSError, ValueError) as e:
            return {"available": False, "reason": str(e)}
    try:
        shape = ModelShape.from_config(cfg)
    except ValueError as e:
        return {"available": False, "reason": str(e)}
    hw = spec.sharding.hardware or (ev.hardware if ev is not None else None)
    gib, gib_src = gpu_memory, "--gpu-memory-gib"
    if gib is None and gpu_memory_gib(hw) is not None:
        gib, gib_src = gpu_memory_gib(hw), f"hardware {hw!r}"
    if gib is None:
        gib, gib_src = ASSUMED_GPU_MEMORY_GIB, "assumed (pass --gpu-memory-gib)"
    max_len = spec.model.max_model_len or shape.max_position or 4096
    expected = math.ceil((work.prompt_tokens + work.completion_tokens) / work.rows) if work.rows else None
    try:
        mp = plan_memory(
            shape, max_model_len=int(max_len), gpu_memory_bytes=int(gib * GiB), max_num_seqs=spec.engine.max_num_seqs,
            gpu_memory_utilization=spec.engine.gpu_memory_utilization,
            tensor_parallel_size=spec.engine.tensor_parallel_size,
            dtype=spec.model.dtype, quantization=spec.model.quantization,
            kv_cache_dtype=spec.engine.engine_kwargs.get("kv_cache_dtype"), weights_bytes=ckpt,
            expected_seq_tokens=expected,
        )
        layout = choose_layout(
            shape, requested_tp=spec.engine.tensor_parallel_size, gpu_budget=gpus, max_model_len=int(max_len),
            gpu_memory_bytes=int(gib * GiB), max_num_seqs=spec.engine.max_num_seqs,
            gpu_memory_utilization=spec.engine.gpu_memory_utilization, dtype=spec.model.dtype,
            quantization=spec.model.quantization, kv_cache_dtype=spec.engine.engine_kwargs.get("kv_cache_dtype"),
            weights_bytes=ckpt,
        )
    except ValueError as e:
        return {"available": False, "reason": str(e)}
    known = not gib_src.startswith("assumed")
    lay = {**asdict(layout), "memory_known": known, "lines": layout.lines()}
    if layout.refusal and not known and layout.verdict != "invalid_tp":
        lay["lines"] = [x.replace("layout: REFUSED:", "layout: WOULD BE REFUSED (GPU memory assumed; set "
                                  "sharding.hardware or pass --gpu-memory-gib):") for x in lay["lines"]]
    return {"layout": lay, "available": True, "config": source, "gpu_memory_gib": gib, "gpu_memory_source": gib_src,
            "architecture": shape.architecture, **asdict(mp), "lines": mp.lines()}


def format_report(r: dict[str, Any]) -> str:
    """Human-readable report."""
    lines = [
        f"dry run: job {r['job']} ({r['task']}), model {r['model']}",
        f"  input            {r['input_uri']}",
        f"  rows             {r['rows']:,}" + (f" (+{r['invalid_lines']} invalid lines)" if r["invalid_lines"] else ""),
        f"  prompt tokens    ~{r['est_prompt_tokens']:,} (planner estimate incl. system prompt)",
        f"  output tokens    ~{r['est_output_tokens']:,} (from {r['output_tokens_basis']})",
        f"  shards           {r['shards']} (largest {r['largest_shard_rows']:,} rows; "
        f"{'sized from throughput history' if r['sized_from_history'] else 'sized by target_rows/target_tokens'})",
    ]
    if r["evidence"]:
        e = r["evidence"]
        lines.append(f"  throughput       {e['rows_per_s']:.2f} rows/s, {e['tokens_per_s']:.0f} tokens/s per replica "
                     f"on {e['hardware']} ({e['records']} record(s), basis: {e['basis']})")
    else:
        a = r["assumptions"]
        lines.append(f"  throughput       ASSUMED {a['tokens_per_s']:.0f} tokens/s and "
                     f"{a['engine_start_s']:.0f} s engine "
                     "start (no history: set sharding.history_uri or pass --tokens-per-s/--engine-start-s)")
    lines += [
        f"  inference        ~{r['est_inference_s'] / 3600:.2f} h in total; engine start {r['engine_start_s']:.0f} s "
        f"per shard; ~{r['est_shard_minutes']:.1f} min per shard",
        f"  GPU-hours        ~{r['est_gpu_hours']:.2f} (tensor_parallel_size {r['tensor_parallel_size']})",
    ]
    if r.get("layout"):
        lines += [f"  {x}" for x in r["layout"]["lines"]]
    m = r["memory"]
    if not m["available"]:
        lines.append(f"  memory plan      not available: {m['reason']}")
    else:
        lines.append(f"  memory plan      {m['architecture']} from {m['config']}; GPU {m['gpu_memory_gib']} GiB "
                     f"({m['gpu_memory_source']})")
        lines += [f"    {x}" for x in m["lines"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m airflow_provider_vllm.dry_run", description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="job spec: YAML file (a 'job:' key or the spec at top level) or JSON file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a spec field (dotted path or DAG param alias); VALUE is JSON or a string")
    ap.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: from sharding.hardware / history)")
    ap.add_argument("--gpus", type=_positive_int,
                    help="GPU budget (GPUs the job may use at once): prints max_active_shards")
    ap.add_argument("--model-config", help="the model's config.json when model.name is neither a folder nor cached")
    ap.add_argument("--tokens-per-s", type=float, default=ASSUMED_TOKENS_PER_S, help="throughput without history")
    ap.add_argument("--engine-start-s", type=float, default=ASSUMED_ENGINE_START_S, help="engine start without history")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        spec = JobSpec.from_yaml(args.spec)
        if args.set:
            spec = JobSpec.from_params(dict(_kv(s) for s in args.set), base=spec)
        cfg = None
        if args.model_config:
            with open(args.model_config, encoding="utf-8") as f:
                cfg = json.load(f)
        report = dry_run_report(spec, tokens_per_s=args.tokens_per_s, engine_start_s=args.engine_start_s,
                                gpu_memory=args.gpu_memory_gib, model_config=cfg, gpus=args.gpus)
    except VllmBatchError as e:
        print(f"dry run failed: {e}", file=sys.stderr)
        return e.exit_code
    except (OSError, ValueError) as e:
        print(f"dry run failed: {e}", file=sys.stderr)
        return EXIT_TERMINAL
    print(json.dumps(report, indent=1, default=str) if args.json else format_report(report))
    return 0


def _positive_int(raw: str) -> int:
    n = int(raw)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _kv(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {item!r}: expected KEY=VALUE")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


if __name__ == "__main__":
    sys.exit(main())
