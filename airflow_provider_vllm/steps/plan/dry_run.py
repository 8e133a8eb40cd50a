"""Dry run: what a job would cost, before anything is launched (the report; the CLI is ``cli.dry_run``).

Validates the spec and the input (the plan step's checks, nothing written) and computes rows,
estimated prompt and output tokens, shards, inference time, GPU-hours and the GPU memory plan
with the layout ``choose_layout`` picks.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from airflow_provider_vllm.core.adapters import engine_max_rank, max_loras
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import FileSystems
from airflow_provider_vllm.steps.plan.memory import (
    GiB,
    ModelShape,
    choose_layout,
    gpu_memory_gib,
    load_model_config,
    plan_memory,
)
from airflow_provider_vllm.steps.plan.planner import build_plan
from airflow_provider_vllm.steps.plan.sizing import estimate_workload, find_evidence, read_history

# Used only without history, and labelled "assumed" in the report.
ASSUMED_TOKENS_PER_S = 2000.0  # prompt + output tokens per second per model replica
ASSUMED_ENGINE_START_S = 60.0
ASSUMED_GPU_MEMORY_GIB = 80.0


def dry_run_report(
    spec: JobSpec,
    *,
    tokens_per_s: float = ASSUMED_TOKENS_PER_S,
    engine_start_s: float = ASSUMED_ENGINE_START_S,
    gpu_memory: float | None = None,
    model_config: dict[str, Any] | None = None,
    checkpoint_bytes: int | None = None,
    gpus: int | None = None,
    filesystems: FileSystems | None = None,
    engine_identity: str | None = None,
    keyring: Keyring | None = None,
) -> dict[str, Any]:
    """The dry-run report as a dict (see ``format_report``); raises DatasetError/SpecError like the plan.

    ``gpus``: the GPU budget (GPUs the job may use at once) for ``layout.max_active_shards``. Raises
    SpecError when the layout refuses the spec's engine.tensor_parallel_size. ``filesystems``: how
    object stores are reached (``storage.FileSystems``; default fsspec). With ``cache.uri``: the
    ``cache`` section (hits and misses the cache gives now, the GPU-hours the hits save; the
    other figures are for the whole input); ``engine_identity`` and ``keyring`` (only sealed cache entries
    count) as for ``plan_job``.
    """
    plan = build_plan(spec, filesystems)
    records = (
        read_history(spec.sharding.history_uri, spec.io.storage_options, filesystems)
        if spec.sharding.history_uri
        else []
    )
    ev = find_evidence(spec, records)
    work = estimate_workload(spec, plan.total_rows, plan.est_tokens, ev, tokens_per_s, engine_start_s)
    shards = len(plan.shards)
    tp = spec.engine.tensor_parallel_size
    gpu_s = (shards * work.engine_start_s + work.infer_s) * tp
    report: dict[str, Any] = {
        "job": spec.name,
        "task": spec.task,
        "model": spec.model.name,
        "input_uri": spec.io.input_uri,
        "rows": plan.total_rows,
        "invalid_lines": plan.invalid_lines,
        "est_prompt_tokens": work.prompt_tokens,
        "est_output_tokens": work.completion_tokens,
        "output_tokens_basis": work.completion_basis,
        "shards": shards,
        "largest_shard_rows": max((s.rows for s in plan.shards), default=0),
        "sized_from_history": plan.sizing is not None,
        "throughput_basis": work.throughput_basis,
        "evidence": asdict(ev) if ev is not None else None,
        "est_inference_s": round(work.infer_s, 1),
        "engine_start_s": round(work.engine_start_s, 1),
        "est_shard_minutes": round((work.engine_start_s + work.infer_s / shards) / 60, 2) if shards else 0.0,
        "tensor_parallel_size": tp,
        "est_gpu_hours": round(gpu_s / 3600, 3),
        "assumptions": {} if ev is not None else {"tokens_per_s": tokens_per_s, "engine_start_s": engine_start_s},
    }
    lora = None
    if plan.adapters:
        lora = {"max_lora_rank": engine_max_rank(spec, [a.rank for a in plan.adapters]), "max_loras": max_loras(spec)}
        report["adapters"] = {
            **lora,
            "default_adapter": spec.model.default_adapter,
            "adapter_column": spec.model.adapter_column,
            "adapters": [
                {"name": a.name, "source": a.source, "identity": a.identity(), "rank": a.rank, "bytes": a.bytes}
                for a in plan.adapters
            ],
        }
    if plan.passthrough is not None:
        p = plan.passthrough
        report["passthrough"] = [{"column": c, "as": n, "type": t} for c, n, t in zip(p.columns, p.names, p.types)]
    if spec.cache.uri is not None:
        report["cache"] = _cache(
            spec, ev, tokens_per_s, engine_start_s, engine_identity, filesystems, keyring, plan.adapters
        )
    report["memory"] = _memory(spec, work, ev, gpu_memory, model_config, checkpoint_bytes, gpus, lora)
    layout = report["memory"].pop("layout", None)
    report["layout"] = layout
    if layout and layout["refusal"] and (layout["verdict"] == "invalid_tp" or layout["memory_known"]):
        raise SpecError("layout: " + layout["refusal"])
    return report


def _cache(
    spec: JobSpec,
    ev,
    tokens_per_s: float,
    engine_start_s: float,
    engine_identity: str | None,
    filesystems: FileSystems | None,
    keyring: Keyring | None = None,
    adapters: list | None = None,
) -> dict[str, Any]:
    """Expected hits and misses (nothing written) and the inference GPU-hours the hits save."""
    from airflow_provider_vllm.core.formats.files import find_input
    from airflow_provider_vllm.steps.cache.result_cache import expected

    found = find_input(spec.io.input_uri, spec.io.storage_options, spec.io.input_format, filesystems)
    exp = expected(spec, found, engine_identity, filesystems, keyring, adapters)
    saved = estimate_workload(spec, exp["hits"], exp["hit_est_tokens"], ev, tokens_per_s, engine_start_s)
    exp["est_inference_s_saved"] = round(saved.infer_s, 3)
    exp["est_gpu_hours_saved"] = round(saved.infer_s * spec.engine.tensor_parallel_size / 3600, 6)
    return exp


def _memory(
    spec: JobSpec,
    work,
    ev,
    gpu_memory: float | None,
    cfg: dict | None,
    ckpt: int | None,
    gpus: int | None = None,
    lora: dict[str, int] | None = None,
) -> dict[str, Any]:
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
    lora_args = {"lora_rank": lora["max_lora_rank"], "lora_slots": lora["max_loras"]} if lora else {}
    try:
        mp = plan_memory(
            shape,
            max_model_len=int(max_len),
            gpu_memory_bytes=int(gib * GiB),
            max_num_seqs=spec.engine.max_num_seqs,
            gpu_memory_utilization=spec.engine.gpu_memory_utilization,
            tensor_parallel_size=spec.engine.tensor_parallel_size,
            dtype=spec.model.dtype,
            quantization=spec.model.quantization,
            kv_cache_dtype=spec.engine.engine_kwargs.get("kv_cache_dtype"),
            weights_bytes=ckpt,
            expected_seq_tokens=expected,
            **lora_args,
        )
        layout = choose_layout(
            shape,
            requested_tp=spec.engine.tensor_parallel_size,
            gpu_budget=gpus,
            max_model_len=int(max_len),
            gpu_memory_bytes=int(gib * GiB),
            max_num_seqs=spec.engine.max_num_seqs,
            gpu_memory_utilization=spec.engine.gpu_memory_utilization,
            dtype=spec.model.dtype,
            quantization=spec.model.quantization,
            kv_cache_dtype=spec.engine.engine_kwargs.get("kv_cache_dtype"),
            weights_bytes=ckpt,
            **lora_args,
        )
    except ValueError as e:
        return {"available": False, "reason": str(e)}
    known = not gib_src.startswith("assumed")
    lay = {**asdict(layout), "memory_known": known, "lines": layout.lines()}
    if layout.refusal and not known and layout.verdict != "invalid_tp":
        lay["lines"] = [
            x.replace(
                "layout: REFUSED:",
                "layout: WOULD BE REFUSED (GPU memory assumed; set sharding.hardware or pass --gpu-memory-gib):",
            )
            for x in lay["lines"]
        ]
    return {
        "layout": lay,
        "available": True,
        "config": source,
        "gpu_memory_gib": gib,
        "gpu_memory_source": gib_src,
        "architecture": shape.architecture,
        **asdict(mp),
        "lines": mp.lines(),
    }


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
        lines.append(
            f"  throughput       {e['rows_per_s']:.2f} rows/s, {e['tokens_per_s']:.0f} tokens/s per replica "
            f"on {e['hardware']} ({e['records']} record(s), basis: {e['basis']})"
        )
    else:
        a = r["assumptions"]
        lines.append(
            f"  throughput       ASSUMED {a['tokens_per_s']:.0f} tokens/s and "
            f"{a['engine_start_s']:.0f} s engine "
            "start (no history: set sharding.history_uri or pass --tokens-per-s/--engine-start-s)"
        )
    lines += [
        f"  inference        ~{r['est_inference_s'] / 3600:.2f} h in total; engine start {r['engine_start_s']:.0f} s "
        f"per shard; ~{r['est_shard_minutes']:.1f} min per shard",
        f"  GPU-hours        ~{r['est_gpu_hours']:.2f} (tensor_parallel_size {r['tensor_parallel_size']})",
    ]
    if r.get("adapters"):
        a = r["adapters"]
        pick = f"column {a['adapter_column']!r}" if a["adapter_column"] else "every row"
        lines.append(
            f"  LoRA adapters    {len(a['adapters'])} ({pick}; default {a['default_adapter'] or 'the base model'}); "
            f"engine max_lora_rank {a['max_lora_rank']}, max_loras {a['max_loras']}"
        )
        for ad in a["adapters"]:
            rank = f"rank {ad['rank']}" if ad["rank"] is not None else "rank unknown (not in the hub cache here)"
            lines.append(f"    {ad['name']}: {ad['source']} ({rank}; {ad['identity']})")
    if r.get("passthrough"):
        cols = ", ".join(
            f"{p['column']}{' as ' + p['as'] if p['as'] != p['column'] else ''} ({p['type']})" for p in r["passthrough"]
        )
        lines.append(f"  passthrough      {cols}")
    if r.get("cache"):
        c = r["cache"]
        lines.append(
            f"  result cache     {c['hits']:,} of {c['rows']:,} rows answered by {c['commits']} committed "
            f"entr{'y' if c['commits'] == 1 else 'ies'}, {c['misses']:,} to infer; saves "
            f"~{c['est_gpu_hours_saved']:.2f} GPU-hours of inference (figures above: whole input)"
        )
    if r.get("layout"):
        lines += [f"  {x}" for x in r["layout"]["lines"]]
    m = r["memory"]
    if not m["available"]:
        lines.append(f"  memory plan      not available: {m['reason']}")
    else:
        lines.append(
            f"  memory plan      {m['architecture']} from {m['config']}; GPU {m['gpu_memory_gib']} GiB "
            f"({m['gpu_memory_source']})"
        )
        lines += [f"    {x}" for x in m["lines"]]
    return "\n".join(lines)
