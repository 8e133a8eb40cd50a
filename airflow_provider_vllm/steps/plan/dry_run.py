"""Dry run: what a job would cost, before anything is launched (the report; the CLI is ``cli.dry_run``).

Validates the spec and the input (the plan step's checks, nothing written) and computes rows,
estimated prompt and output tokens, shards, inference time, GPU-hours and the GPU memory plan
with the layout ``choose_layout`` picks. One pass over what the plan reads: the input listing and
the throughput history come from ``build_plan_with_inputs``, never read a second time.

The report is a typed record (``DryRunReport``): the plan task pushes ``dump()`` as its ``dry_run``
XCom and the CLI prints it (``--json``) or ``format_report``'s text.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from airflow_provider_vllm.core.adapters import AdapterRef, engine_max_rank, max_loras
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import Evidence
from airflow_provider_vllm.core.records import Record
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
from airflow_provider_vllm.steps.plan.planner import PlanInputs, build_plan_with_inputs
from airflow_provider_vllm.steps.plan.sizing import (
    START_SHARE,
    History,
    Workload,
    estimate_workload,
    find_evidence,
    read_history,
    start_estimate,
)

# Used only without history, and labelled "assumed" in the report.
ASSUMED_TOKENS_PER_S = 2000.0  # prompt + output tokens per second per model replica
ASSUMED_ENGINE_START_S = 60.0
ASSUMED_GPU_MEMORY_GIB = 80.0


# ---- the report ---------------------------------------------------------------------------------
class Assumptions(Record):
    """The figures assumed for want of history (none are set when the report rests on evidence)."""

    tokens_per_s: float | None = Field(None, description="assumed prompt + output tokens/s per model replica")
    engine_start_s: float | None = Field(None, description="assumed engine start per shard, seconds")


class CacheReport(Record):
    """What the result cache would answer now (``cache.uri`` set); nothing written."""

    uri: str = Field(description="the cache folder")
    key_hash: str = Field(description="hash of the key config the entries must share")
    commits: int = Field(description="committed, sealed entries of that key config")
    rows: int = Field(description="input rows")
    hits: int = Field(description="rows an entry answers")
    misses: int = Field(description="rows to infer")
    hit_est_tokens: int = Field(description="estimated prompt tokens of the hit rows")
    est_inference_s_saved: float = Field(description="inference seconds the hits save")
    est_gpu_hours_saved: float = Field(description="GPU-hours of inference the hits save")


class DedupeReport(Record):
    """Each distinct prompt once per run (sharding.dedupe): what it would save on this input now; nothing written."""

    applied: bool = Field(description="False: every row is inferred (reason says why)")
    reason: str | None = Field(None, description="why the rows are not deduplicated")
    rows: int | None = Field(None, description="input rows")
    distinct: int | None = Field(None, description="distinct rendered prompts: the rows to infer (before the cache)")
    duplicates: int | None = Field(None, description="rows that repeat an earlier row's prompt: not inferred")
    duplicate_rate: float | None = Field(None, description="duplicates / rows")
    duplicate_est_tokens: int | None = Field(None, description="estimated prompt tokens of the duplicates")
    est_inference_s_saved: float | None = Field(None, description="inference seconds the duplicates save")
    est_gpu_hours_saved: float | None = Field(None, description="GPU-hours of inference the duplicates save")


class AdapterReport(Record):
    """One LoRA adapter as the plan found it."""

    name: str
    source: str
    identity: str = Field(description="sha256:<hex> of its files, or <hub repo>@<commit>")
    rank: int | None = Field(description="its LoRA rank (None: a hub adapter not in the hub cache here)")
    bytes: int | None = Field(description="bytes of its files (None: a hub adapter)")


class AdaptersReport(Record):
    """The job's LoRA adapters and what the engine reserves for them (only with model.adapters)."""

    max_lora_rank: int = Field(description="vLLM's max_lora_rank for the job")
    max_loras: int = Field(description="vLLM's max_loras for the job")
    default_adapter: str | None
    adapter_column: str | None
    adapters: list[AdapterReport]


class PassthroughColumn(Record):
    """One input column copied into results/ and errors/ (only with io.passthrough)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    column: str = Field(description="the input column")
    as_: str = Field(alias="as", description="its name in results/ and errors/")
    type: str = Field(description="its Arrow type")


class LayoutReport(Record):
    """The GPU layout (``memory.GpuLayout``'s fields), whether the GPU memory behind it is known, and its lines."""

    tensor_parallel_size: int
    fitting_tensor_parallel_size: int | None
    max_tensor_parallel_size: int
    gpu_memory_gib: float
    gpu_memory_utilization: float
    weights_gib: float
    kv_one_seq_gib: float
    kv_available_gib: float
    full_length_seqs: int
    gpus_per_pod: int
    gpu_budget: int | None
    max_active_shards: int | None
    verdict: Literal["fits", "larger_than_needed", "too_small", "invalid_tp", "does_not_fit"]
    reasons: list[str]
    warnings: list[str]
    refusal: str | None
    memory_known: bool = Field(description="False: the GPU memory was assumed (a refusal is then only reported)")
    lines: list[str] = Field(description="the layout as the text report prints it")


class MemoryReport(Record):
    """The GPU memory plan (``memory.MemoryPlan``'s fields) and where its inputs came from."""

    available: Literal[True]
    config: str = Field(description="where the model's config.json came from")
    gpu_memory_gib: float
    gpu_memory_source: str
    architecture: str
    weights_bytes: int
    weights_source: str
    kv_bytes_per_token: int
    max_model_len: int
    max_num_seqs: int
    max_num_seqs_source: str
    tensor_parallel_size: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    overhead_bytes: int
    budget_bytes: int
    kv_available_bytes: int
    kv_needed_bytes: int
    fits: bool
    suggested_max_num_seqs: int
    expected_seq_tokens: int | None
    seqs_at_expected_len: int | None
    lora_bytes: int = 0
    lora_rank: int | None = None
    lora_slots: int = 0
    warnings: list[str]
    lines: list[str] = Field(description="the plan as the text report prints it")


class MemoryUnavailable(Record):
    """No memory plan: the model's config could not be found or read."""

    available: Literal[False]
    reason: str


class DryRunReport(Record):
    """What a job would cost: the dry run's report (``dump()``: the ``dry_run`` XCom and ``--json``)."""

    job: str
    task: str
    model: str
    input_uri: str
    rows: int = Field(description="input rows (valid)")
    invalid_lines: int = Field(description="JSONL lines that are not rows")
    est_prompt_tokens: int = Field(description="planner estimate, system prompt and template included")
    est_output_tokens: int
    output_tokens_basis: str = Field(description="history, or max_tokens as an upper bound")
    shards: int
    largest_shard_rows: int
    sized_from_history: bool
    throughput_basis: str = Field(description="history:config, history:model or assumed")
    evidence: Evidence | None = Field(description="the throughput history behind the figures (None: assumed)")
    est_inference_s: float
    engine_start_s: float
    engine_start_basis: str = Field(
        "assumed",
        description="history:warm / history:cold (recorded starts with and without a restored compile cache), "
        "history (all recorded starts), assumed:warm / assumed:cold / assumed",
    )
    warm_starts: bool | None = Field(
        None,
        description="True: the shard pods reuse a shared compile cache ([vllm_batch] kubernetes_compile_cache_pvc); "
        "False: every pod compiles; None: unknown (the local runner)",
    )
    engine_start_share: float = Field(0.0, description="engine start / a shard's wall time (goal <= 0.10)")
    start_warning: str | None = Field(None, description="set when engine start is over 10% of a shard")
    est_shard_minutes: float
    tensor_parallel_size: int
    est_gpu_hours: float
    assumptions: Assumptions
    adapters: AdaptersReport | None = Field(None, description="only with model.adapters")
    passthrough: list[PassthroughColumn] | None = Field(None, description="only with io.passthrough")
    cache: CacheReport | None = Field(None, description="only with cache.uri; the figures above are the whole input")
    dedupe: DedupeReport | None = Field(
        None, description="each distinct prompt once per run (sharding.dedupe); the figures above are the whole input"
    )
    memory: Annotated[MemoryReport | MemoryUnavailable, Field(discriminator="available")]
    layout: LayoutReport | None = Field(description="None when there is no memory plan")

    def dump(self) -> dict[str, Any]:
        """As ``Record.dump``, fields under their aliases (a passthrough column's ``as``)."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)


# ---- building it ------------------------------------------------------------------------------
def dry_run_report(
    spec: JobSpec,
    *,
    tokens_per_s: float = ASSUMED_TOKENS_PER_S,
    engine_start_s: float | None = None,
    gpu_memory: float | None = None,
    model_config: dict[str, Any] | None = None,
    checkpoint_bytes: int | None = None,
    gpus: int | None = None,
    filesystems: FileSystems | None = None,
    engine_identity: str | None = None,
    keyring: Keyring | None = None,
    warm_starts: bool | None = None,
) -> DryRunReport:
    """The dry-run report (see ``format_report``); raises DatasetError/SpecError like the plan.

    ``warm_starts``: whether the shard pods reuse a shared compile cache (``sizing.start_estimate``: which engine
    start a shard is expected to pay); ``engine_start_s``: the start assumed for want of history (None: the
    measured warm / cold figure, or ``ASSUMED_ENGINE_START_S`` when ``warm_starts`` is None).

    ``gpus``: the GPU budget (GPUs the job may use at once) for ``layout.max_active_shards``. Raises
    SpecError when the layout refuses the spec's engine.tensor_parallel_size. ``filesystems``: how
    object stores are reached (``storage.FileSystems``; default fsspec). With ``cache.uri``: the
    ``cache`` section (hits and misses the cache gives now, the GPU-hours the hits save; the
    other figures are for the whole input); ``engine_identity`` and ``keyring`` (only sealed cache entries
    count) as for ``plan_job``. An unreadable throughput history fails the dry run (the plan itself would
    go on without it).
    """
    plan, read = build_plan_with_inputs(spec, filesystems, keyring=keyring, warm_starts=warm_starts)
    ev = find_evidence(spec, _history(spec, read, filesystems, keyring).records)
    assumed_start = engine_start_s if engine_start_s is not None or warm_starts is not None else ASSUMED_ENGINE_START_S
    start = start_estimate(ev, warm_starts, assumed_start)
    work = estimate_workload(spec, plan.total_rows, plan.est_tokens, ev, tokens_per_s, 0.0, start.seconds)
    shards = len(plan.shards)
    tp = spec.engine.tensor_parallel_size
    gpu_s = (shards * work.engine_start_s + work.infer_s) * tp
    adapters, lora = None, None
    if plan.adapters:
        lora = {"max_lora_rank": engine_max_rank(spec, [a.rank for a in plan.adapters]), "max_loras": max_loras(spec)}
        adapters = AdaptersReport(
            **lora,
            default_adapter=spec.model.default_adapter,
            adapter_column=spec.model.adapter_column,
            adapters=[
                AdapterReport(name=a.name, source=a.source, identity=a.identity(), rank=a.rank, bytes=a.bytes)
                for a in plan.adapters
            ],
        )
    passthrough = None
    if plan.passthrough is not None:
        p = plan.passthrough
        passthrough = [PassthroughColumn(column=c, as_=n, type=t) for c, n, t in zip(p.columns, p.names, p.types)]
    cache = None
    if spec.cache.uri is not None:
        cache = _cache(
            spec, read, ev, tokens_per_s, start.seconds, engine_identity, filesystems, keyring, plan.adapters
        )
    dedupe = _dedupe(spec, read, ev, tokens_per_s, start.seconds)
    memory, layout = _memory(spec, work, ev, gpu_memory, model_config, checkpoint_bytes, gpus, lora)
    shard_s = work.engine_start_s + work.infer_s / shards if shards else 0.0
    share = work.engine_start_s / shard_s if shard_s else 0.0
    report = DryRunReport(
        job=spec.name,
        task=spec.task,
        model=spec.model.name,
        input_uri=plan.input_uri,
        rows=plan.total_rows,
        invalid_lines=plan.invalid_lines,
        est_prompt_tokens=work.prompt_tokens,
        est_output_tokens=work.completion_tokens,
        output_tokens_basis=work.completion_basis,
        shards=shards,
        largest_shard_rows=max((s.rows for s in plan.shards), default=0),
        sized_from_history=plan.sizing is not None,
        throughput_basis=work.throughput_basis,
        evidence=ev,
        est_inference_s=round(work.infer_s, 1),
        engine_start_s=round(work.engine_start_s, 1),
        engine_start_basis=start.basis,
        warm_starts=warm_starts,
        engine_start_share=round(share, 4),
        start_warning=_start_warning(spec, work, shards, share),
        est_shard_minutes=round(shard_s / 60, 2),
        tensor_parallel_size=tp,
        est_gpu_hours=round(gpu_s / 3600, 3),
        assumptions=Assumptions(
            **({"tokens_per_s": tokens_per_s} if ev is None else {}),
            **({"engine_start_s": start.seconds} if start.basis.startswith("assumed") else {}),
        ),
        **({"adapters": adapters} if adapters is not None else {}),
        **({"passthrough": passthrough} if passthrough is not None else {}),
        **({"cache": cache} if cache is not None else {}),
        dedupe=dedupe,
        memory=memory,
        layout=layout,
    )
    if layout and layout.refusal and (layout.verdict == "invalid_tp" or layout.memory_known):
        raise SpecError("layout: " + layout.refusal)
    return report


def _start_warning(spec: JobSpec, work: Workload, shards: int, share: float) -> str | None:
    """A line when engine start is over 10% of a shard and fewer, larger shards would bring it down."""
    if share <= START_SHARE or shards <= 1 or spec.sharding.target_minutes is not None or not work.infer_s:
        return None
    rows = math.ceil(work.engine_start_s * (1 - START_SHARE) / START_SHARE * work.rows / work.infer_s)
    return (
        f"engine start is {share:.0%} of a shard: shards of at least {rows:,} rows keep it <= "
        f"{START_SHARE:.0%} (sharding.target_rows; or sharding.history_uri, which sizes shards so)"
    )


def _history(
    spec: JobSpec, read: PlanInputs, filesystems: FileSystems | None, keyring: Keyring | None = None
) -> History:
    """The throughput history the plan read (read here only when the plan had no rows to size with it)."""
    if not spec.sharding.history_uri:
        return History([])
    if read.history is None:
        return History(read_history(spec.sharding.history_uri, spec.io.storage_options, filesystems, keyring))
    if read.history.error is not None:
        raise read.history.error
    return read.history


def _cache(
    spec: JobSpec,
    read: PlanInputs,
    ev: Evidence | None,
    tokens_per_s: float,
    engine_start_s: float,
    engine_identity: str | None,
    filesystems: FileSystems | None,
    keyring: Keyring | None = None,
    adapters: list[AdapterRef] | None = None,
) -> CacheReport:
    """Expected hits and misses (nothing written) and the inference GPU-hours the hits save."""
    from airflow_provider_vllm.steps.cache.result_cache import expected

    exp = expected(spec, read.found, engine_identity, filesystems, keyring, adapters)
    saved = estimate_workload(spec, exp["hits"], exp["hit_est_tokens"], ev, tokens_per_s, engine_start_s)
    return CacheReport(
        **exp,
        est_inference_s_saved=round(saved.infer_s, 3),
        est_gpu_hours_saved=round(saved.infer_s * spec.engine.tensor_parallel_size / 3600, 6),
    )


def _dedupe(spec: JobSpec, read: PlanInputs, ev: Evidence | None, tokens_per_s: float, start_s: float) -> DedupeReport:
    """The duplicates the dedupe would not infer, and the inference GPU-hours that saves."""
    from airflow_provider_vllm.steps.cache.dedupe import expected

    exp = expected(spec, read.found)
    if not exp["applied"]:
        return DedupeReport(**exp)
    saved = estimate_workload(spec, exp["duplicates"], exp["duplicate_est_tokens"], ev, tokens_per_s, start_s)
    return DedupeReport(
        **exp,
        est_inference_s_saved=round(saved.infer_s, 3),
        est_gpu_hours_saved=round(saved.infer_s * spec.engine.tensor_parallel_size / 3600, 6),
    )


def _memory(
    spec: JobSpec,
    work: Workload,
    ev: Evidence | None,
    gpu_memory: float | None,
    cfg: dict | None,
    ckpt: int | None,
    gpus: int | None = None,
    lora: dict[str, int] | None = None,
) -> tuple[MemoryReport | MemoryUnavailable, LayoutReport | None]:
    source = "given"
    if cfg is None:
        try:
            cfg, ckpt, source = load_model_config(spec.model.name, spec.model.revision)
        except (FileNotFoundError, OSError, ValueError) as e:
            return MemoryUnavailable(available=False, reason=str(e)), None
    try:
        shape = ModelShape.from_config(cfg)
    except ValueError as e:
        return MemoryUnavailable(available=False, reason=str(e)), None
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
        return MemoryUnavailable(available=False, reason=str(e)), None
    known = not gib_src.startswith("assumed")
    lines = layout.lines()
    if layout.refusal and not known and layout.verdict != "invalid_tp":
        lines = [
            x.replace(
                "layout: REFUSED:",
                "layout: WOULD BE REFUSED (GPU memory assumed; set sharding.hardware or pass --gpu-memory-gib):",
            )
            for x in lines
        ]
    memory = MemoryReport(
        available=True,
        config=source,
        gpu_memory_gib=gib,
        gpu_memory_source=gib_src,
        architecture=shape.architecture,
        **asdict(mp),
        lines=mp.lines(),
    )
    return memory, LayoutReport(**asdict(layout), memory_known=known, lines=lines)


def _start_source(r: DryRunReport) -> str:
    how = {
        True: "warm: the pods restore a shared compile cache",
        False: "cold: every pod compiles; [vllm_batch] kubernetes_compile_cache_pvc shares the compiled artefacts",
        None: "compile caches unknown",
    }[r.warm_starts]
    source = {"history:warm": "recorded warm starts", "history:cold": "recorded cold starts", "history": "recorded"}
    return f"{source.get(r.engine_start_basis, 'ASSUMED')}; {how}"


def format_report(r: DryRunReport) -> str:
    """Human-readable report."""
    lines = [
        f"dry run: job {r.job} ({r.task}), model {r.model}",
        f"  input            {r.input_uri}",
        f"  rows             {r.rows:,}" + (f" (+{r.invalid_lines} invalid lines)" if r.invalid_lines else ""),
        f"  prompt tokens    ~{r.est_prompt_tokens:,} (planner estimate incl. system prompt)",
        f"  output tokens    ~{r.est_output_tokens:,} (from {r.output_tokens_basis})",
        f"  shards           {r.shards} (largest {r.largest_shard_rows:,} rows; "
        f"{'sized from throughput history' if r.sized_from_history else 'sized by target_rows/target_tokens'})",
    ]
    if r.evidence:
        e = r.evidence
        lines.append(
            f"  throughput       {e.rows_per_s:.2f} rows/s, {e.tokens_per_s:.0f} tokens/s per replica "
            f"on {e.hardware} ({e.records} record(s), basis: {e.basis})"
        )
    else:
        a = r.assumptions
        lines.append(
            f"  throughput       ASSUMED {a.tokens_per_s:.0f} tokens/s and "
            f"{a.engine_start_s:.0f} s engine "
            "start (no history: set sharding.history_uri or pass --tokens-per-s/--engine-start-s)"
        )
    lines += [
        f"  inference        ~{r.est_inference_s / 3600:.2f} h in total; ~{r.est_shard_minutes:.1f} min per shard",
        f"  engine start     {r.engine_start_s:.0f} s per shard ({_start_source(r)}): "
        f"{r.engine_start_share:.1%} of a shard (goal <= {START_SHARE:.0%})",
    ]
    if r.start_warning:
        lines.append(f"  WARNING: {r.start_warning}")
    lines.append(f"  GPU-hours        ~{r.est_gpu_hours:.2f} (tensor_parallel_size {r.tensor_parallel_size})")
    if r.adapters:
        lo = r.adapters
        pick = f"column {lo.adapter_column!r}" if lo.adapter_column else "every row"
        lines.append(
            f"  LoRA adapters    {len(lo.adapters)} ({pick}; default {lo.default_adapter or 'the base model'}); "
            f"engine max_lora_rank {lo.max_lora_rank}, max_loras {lo.max_loras}"
        )
        for ad in lo.adapters:
            rank = f"rank {ad.rank}" if ad.rank is not None else "rank unknown (not in the hub cache here)"
            lines.append(f"    {ad.name}: {ad.source} ({rank}; {ad.identity})")
    if r.passthrough:
        cols = ", ".join(f"{p.column}{' as ' + p.as_ if p.as_ != p.column else ''} ({p.type})" for p in r.passthrough)
        lines.append(f"  passthrough      {cols}")
    if r.cache:
        c = r.cache
        lines.append(
            f"  result cache     {c.hits:,} of {c.rows:,} rows answered by {c.commits} committed "
            f"entr{'y' if c.commits == 1 else 'ies'}, {c.misses:,} to infer; saves "
            f"~{c.est_gpu_hours_saved:.2f} GPU-hours of inference (figures above: whole input)"
        )
    if r.dedupe is not None:
        d = r.dedupe
        if d.applied:
            lines.append(
                f"  dedupe           {d.duplicates:,} of {d.rows:,} rows ({d.duplicate_rate:.1%}) repeat an earlier "
                f"row's prompt: {d.distinct:,} to infer; saves ~{d.est_gpu_hours_saved or 0:.2f} GPU-hours of inference"
            )
        else:
            lines.append(f"  dedupe           off, every row is inferred: {d.reason}")
    if r.layout:
        lines += [f"  {x}" for x in r.layout.lines]
    m = r.memory
    if isinstance(m, MemoryUnavailable):
        lines.append(f"  memory plan      not available: {m.reason}")
    else:
        lines.append(
            f"  memory plan      {m.architecture} from {m.config}; GPU {m.gpu_memory_gib} GiB ({m.gpu_memory_source})"
        )
        lines += [f"    {x}" for x in m.lines]
    return "\n".join(lines)
