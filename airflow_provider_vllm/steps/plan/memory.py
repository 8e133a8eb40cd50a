"""GPU memory plan from a model's config.json: do the engine args fit the GPU?

    weights   = parameters x bytes per parameter (or the local *.safetensors sizes)
    KV/token  = 2 (K and V) x layers x kv_heads x head_dim x KV dtype bytes
    KV needed = KV/token x max_model_len x max_num_seqs      (every sequence at full length)
    LoRA      = max_loras x max_lora_rank x layers x (4 hidden + (2 q + 2 kv + 3 intermediate) / TP) x dtype
                (vLLM's LoRA slots on the attention and MLP projections; with LoRA adapters only)
    budget    = gpu_memory_utilization x GPU memory  (per GPU; weights and KV split over TP)

Worked numbers: a Llama-3-8B shape (32 layers, 8 KV heads, head_dim 128, bf16) needs
128 KiB of KV cache per token, a Llama-2-7B shape (32 KV heads) 512 KiB. The plan warns
when max_num_seqs sequences of max_model_len tokens do not fit (vLLM then preempts and
recomputes, losing throughput) or when one does not (vLLM refuses to start), and suggests
the largest max_num_seqs that fits. ``overhead`` stands for activations, CUDA graphs and
the allocator's slack, which vLLM profiles at start; it is an assumption, stated in the plan.
Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

GiB = 1024**3
KiB = 1024
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "float8": 1, "int8": 1}
# bytes per parameter of quantized weights (scales and zeros included, roughly)
QUANT_BYTES = {"awq": 0.53, "gptq": 0.53, "bitsandbytes": 0.53, "fp8": 1.0, "compressed-tensors": None, "gguf": None}
DEFAULT_OVERHEAD_GIB = 2.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# Total memory per device as torch reports it (GiB), for hardware names in history / sharding.hardware.
GPU_MEMORY_GIB = {
    "H200": 139.8,
    "H100": 79.2,
    "A100-SXM4-80GB": 79.2,
    "A100 80GB": 79.2,
    "A100-SXM4-40GB": 39.4,
    "A100 40GB": 39.4,
    "L40S": 44.4,
    "L4": 22.0,
    "A10G": 22.0,
    "A10": 22.0,
    "T4": 14.6,
    "B200": 178.4,
}


def gpu_memory_gib(hardware: str | None) -> float | None:
    """Memory per device for a hardware name such as '1x NVIDIA H200', when the name is known."""
    if not hardware:
        return None
    name = hardware.upper()
    for key in sorted(GPU_MEMORY_GIB, key=len, reverse=True):  # 'A100-SXM4-80GB' before 'A10'
        if key.upper() in name:
            return GPU_MEMORY_GIB[key]
    return None


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs from config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    dtype: str
    max_position: int | None
    architecture: str
    experts: int = 1

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config dict (text config of multimodal models); ValueError names a missing key."""
        cfg = cfg.get("text_config") or cfg
        try:
            layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
        except KeyError as e:
            raise ValueError(f"config.json has no {e.args[0]!r}: cannot plan memory for this model") from None
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        return cls(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
            intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
            vocab=int(cfg.get("vocab_size") or 0),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            max_position=cfg.get("max_position_embeddings"),
            architecture=(cfg.get("architectures") or ["?"])[0],
            experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 1),
        )

    def parameters(self) -> int:
        """Parameter count of a Llama-style decoder (gated MLP, GQA attention); MoE counts every expert."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate * self.experts
        per_layer = attn + mlp + 2 * self.hidden
        embed = self.vocab * self.hidden
        return embed * (1 if self.tie_embeddings else 2) + self.layers * per_layer + self.hidden


def dtype_bytes(dtype: str) -> float:
    d = dtype.replace("torch.", "").lower()
    if d not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[d]


def lora_slot_bytes(shape: ModelShape, rank: int, slots: int, dtype_bytes: float, tp: int = 1) -> int:
    """Per-GPU bytes vLLM preallocates for ``slots`` (max_loras) adapters of up to ``rank`` (max_lora_rank).

    Each LoRA-able projection holds A (rank x in) and B (out x rank) per slot: qkv and gate_up (column
    parallel: A whole on every GPU, B split over TP), o and down (row parallel: A split, B whole).
    """
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = 4 * shape.hidden + (2 * q + 2 * kv + 3 * shape.intermediate * shape.experts) / tp
    return int(math.ceil(slots * rank * shape.layers * per_layer * dtype_bytes))


def kv_bytes_per_token(shape: ModelShape, kv_dtype_bytes: float) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes."""
    return int(2 * shape.layers * shape.kv_heads * shape.head_dim * kv_dtype_bytes)


@dataclass
class MemoryPlan:
    """Per-GPU bytes and the verdict."""

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
    expected_seq_tokens: int | None = None
    seqs_at_expected_len: int | None = None
    lora_bytes: int = 0
    lora_rank: int | None = None
    lora_slots: int = 0
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        tp = f" per GPU (tensor_parallel_size {self.tensor_parallel_size})" if self.tensor_parallel_size > 1 else ""
        out = [
            f"weights{tp}: {g(self.weights_bytes)} ({self.weights_source})",
            f"KV cache per token{tp}: {self.kv_bytes_per_token / KiB:.0f} KiB; per sequence of max_model_len "
            f"{self.max_model_len}: {g(self.kv_bytes_per_token * self.max_model_len)}",
            *(
                [
                    f"LoRA: {self.lora_slots} adapter slot(s) (max_loras) of rank {self.lora_rank} (max_lora_rank)"
                    f"{tp}: {g(self.lora_bytes)}"
                ]
                if self.lora_slots
                else []
            ),
            f"budget: gpu_memory_utilization {self.gpu_memory_utilization} x {g(self.gpu_memory_bytes)} = "
            f"{g(self.budget_bytes)}; minus weights{', LoRA' if self.lora_slots else ''} and "
            f"{g(self.overhead_bytes)} assumed overhead (activations, CUDA graphs) leaves "
            f"{g(self.kv_available_bytes)} for the KV cache",
            f"KV needed for max_num_seqs {self.max_num_seqs} ({self.max_num_seqs_source}) x max_model_len "
            f"{self.max_model_len}: {g(self.kv_needed_bytes)} -> {'fits' if self.fits else 'DOES NOT FIT'}",
            f"largest max_num_seqs with every sequence at max_model_len: {self.suggested_max_num_seqs}",
        ]
        if self.expected_seq_tokens:
            out.append(
                f"sequences that fit at this job's expected length (~{self.expected_seq_tokens} tokens): "
                f"{self.seqs_at_expected_len}"
            )
        return out + [f"WARNING: {w}" for w in self.warnings]


def plan_memory(
    shape: ModelShape,
    *,
    max_model_len: int,
    gpu_memory_bytes: int,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    weights_bytes: int | None = None,
    overhead_bytes: int = int(DEFAULT_OVERHEAD_GIB * GiB),
    expected_seq_tokens: int | None = None,
    lora_rank: int | None = None,
    lora_slots: int = 0,
) -> MemoryPlan:
    """The memory plan of one model replica; ``weights_bytes`` (whole model) overrides the parameter estimate.
    ``lora_rank`` / ``lora_slots``: vLLM's max_lora_rank and max_loras when the job has LoRA adapters."""
    warnings: list[str] = []
    act_dtype = shape.dtype if dtype == "auto" else dtype
    act_bytes = dtype_bytes(act_dtype)
    if act_bytes == 4 and dtype == "auto":
        act_bytes = 2  # vLLM serves float32 checkpoints as 16-bit unless dtype says float32
    if weights_bytes is not None:
        w_total, w_src = weights_bytes, "size of the checkpoint's *.safetensors files"
        ckpt = dtype_bytes(shape.dtype)
        if not quantization and ckpt != act_bytes:  # e.g. a float32 checkpoint served in bfloat16
            w_total = int(weights_bytes * act_bytes / ckpt)
            w_src += f", {shape.dtype} -> {act_bytes:g} bytes/parameter"
    else:
        params = shape.parameters()
        per = act_bytes
        if quantization:
            q = QUANT_BYTES.get(quantization.lower())
            if q is None:
                warnings.append(
                    f"quantization {quantization!r}: weight size not modelled; assumed {act_bytes} "
                    "bytes/parameter (an upper bound)"
                )
            else:
                per = q
        w_total = int(params * per)
        w_src = f"{params / 1e9:.2f}B parameters x {per:g} bytes"
        if shape.experts > 1:
            w_src += f", {shape.experts} experts"
    tp = tensor_parallel_size
    weights = math.ceil(w_total / tp)
    kv_b = 1 if kv_cache_dtype and "fp8" in kv_cache_dtype else act_bytes
    kv_heads_per_gpu = max(1, math.ceil(shape.kv_heads / tp))  # KV heads are split (or replicated) over TP
    per_token = int(2 * shape.layers * kv_heads_per_gpu * shape.head_dim * kv_b)
    util = gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    if max_num_seqs is None:
        # vLLM's offline (LLM class) default: 1024 on >= 70 GiB GPUs except A100, else 256
        seqs, seqs_src = (
            (1024, "vLLM default for >= 70 GiB GPUs") if gpu_memory_bytes >= 70 * GiB else (256, "vLLM default")
        )
    else:
        seqs, seqs_src = max_num_seqs, "engine.max_num_seqs"
    budget = int(util * gpu_memory_bytes)
    lora = lora_slot_bytes(shape, lora_rank, lora_slots, act_bytes, tp) if lora_rank and lora_slots else 0
    kv_avail = budget - weights - lora - overhead_bytes
    per_seq = per_token * max_model_len
    needed = per_seq * seqs
    suggested = max(0, kv_avail // per_seq) if per_seq else 0
    fits = kv_avail >= needed
    if kv_avail <= 0:
        warnings.append(
            f"the weights ({weights / GiB:.2f} GiB) and overhead do not fit the budget "
            f"({budget / GiB:.2f} GiB): use more GPUs (tensor_parallel_size), quantization or a "
            "larger gpu_memory_utilization"
        )
    elif kv_avail < per_seq:
        warnings.append(
            f"not even one sequence of max_model_len {max_model_len} fits the KV cache "
            f"({kv_avail / GiB:.2f} GiB): vLLM will refuse to start; lower max_model_len to "
            f"{kv_avail // per_token} or less"
        )
    at_expected = None
    if expected_seq_tokens and per_token:
        at_expected = max(0, kv_avail // (per_token * expected_seq_tokens))
    if kv_avail >= per_seq and not fits:
        msg = (
            f"max_num_seqs {seqs} x max_model_len {max_model_len} needs {needed / GiB:.1f} GiB of KV cache, "
            f"{kv_avail / GiB:.1f} GiB fit: when sequences run long vLLM preempts and recomputes; set "
            f"engine.max_num_seqs to {suggested} (or lower max_model_len)"
        )
        if at_expected is not None and at_expected >= seqs:
            msg += (
                f"; at this job's expected ~{expected_seq_tokens} tokens per sequence {at_expected} "
                f"sequences fit, so {seqs} is safe unless rows are much longer than estimated"
            )
        warnings.append(msg)
    return MemoryPlan(
        weights_bytes=weights,
        weights_source=w_src,
        kv_bytes_per_token=per_token,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        max_num_seqs_source=seqs_src,
        tensor_parallel_size=tp,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=util,
        overhead_bytes=overhead_bytes,
        budget_bytes=budget,
        kv_available_bytes=kv_avail,
        kv_needed_bytes=needed,
        fits=fits,
        suggested_max_num_seqs=int(suggested),
        expected_seq_tokens=expected_seq_tokens,
        seqs_at_expected_len=None if at_expected is None else int(at_expected),
        lora_bytes=lora,
        lora_rank=lora_rank if lora else None,
        lora_slots=lora_slots if lora else 0,
        warnings=warnings,
    )


# ---- reading a model's config ---------------------------------------------------------
def load_model_config(name: str, revision: str | None = None) -> tuple[dict[str, Any], int | None, str]:
    """(config dict, checkpoint bytes or None, where it came from) for a local folder or a cached hub model.

    Raises FileNotFoundError when neither a folder nor the local Hugging Face cache has config.json
    (nothing is downloaded).
    """
    if os.path.isdir(name):
        path = os.path.join(name, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{name} has no config.json")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        return cfg, safetensors_bytes(name), path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers brings it
        raise FileNotFoundError(f"{name}: not a folder and huggingface_hub is not installed") from None
    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    if not isinstance(cached, str):
        raise FileNotFoundError(
            f"{name}: config.json is not a local folder nor in the Hugging Face cache; "
            "pass its config.json (dry run: --model-config)"
        )
    with open(cached, encoding="utf-8") as f:
        return json.load(f), safetensors_bytes(os.path.dirname(cached)), cached


def safetensors_bytes(folder: str) -> int | None:
    """Bytes of the tensors in the folder's *.safetensors files (headers excluded), or None when there are none."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        return None
    total = 0
    for fname in files:
        with open(os.path.join(folder, fname), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


# ---- GPU layout: tensor parallel only when the model does not fit one GPU -------------------
TP_SIZES = (1, 2, 4, 8)
FEW_FULL_LENGTH_SEQS = 4  # fewer max_model_len sequences than this at the chosen TP: a warning
MEASURED_SCALEOUT = (
    "measured on 2 H200s (docs/BENCHMARKS.md section 5): two shards, one per GPU, 1.97x one "
    "GPU; tensor_parallel_size 2 over the same two GPUs 1.13x"
)


def tp_problem(shape: ModelShape, tp: int) -> str | None:
    """Why vLLM cannot split ``shape`` over ``tp`` GPUs, or None.

    vLLM needs the attention heads to divide evenly over TP; KV heads divide evenly too, or,
    with more GPUs than KV heads, TP must be a multiple of them (each KV head is replicated).
    """
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    if shape.heads % tp:
        return f"{shape.heads} attention heads do not divide over {tp} GPUs"
    if tp <= shape.kv_heads and shape.kv_heads % tp:
        return f"{shape.kv_heads} KV heads do not divide over {tp} GPUs"
    if tp > shape.kv_heads and tp % shape.kv_heads:
        return f"{tp} GPUs are not a multiple of the {shape.kv_heads} KV heads"
    return None


@dataclass(frozen=True)
class GpuLayout:
    """Which tensor-parallel size and pod layout a job runs with, and why.

    Data parallel is the layout: one shard pod (one engine) per TP group of GPUs, i.e. one
    pod per GPU at TP 1; Kubernetes places the pods and Airflow maps the shards, so a node
    of G GPUs runs G / TP shards at once (``max_active_shards``). TP > 1 only when one GPU
    cannot hold the model (weights + overhead + the KV cache of one max_model_len sequence,
    vLLM's condition to start): on a model that fits, TP costs throughput (MEASURED_SCALEOUT).
    """

    tensor_parallel_size: int  # what the job runs with: the spec's (respected when it fits)
    fitting_tensor_parallel_size: int | None  # smallest TP that fits; None: none up to max_tensor_parallel_size
    max_tensor_parallel_size: int
    gpu_memory_gib: float
    gpu_memory_utilization: float
    weights_gib: float  # per GPU, at tensor_parallel_size
    kv_one_seq_gib: float  # one max_model_len sequence, per GPU, at tensor_parallel_size
    kv_available_gib: float  # per GPU, at tensor_parallel_size
    full_length_seqs: int  # max_model_len sequences the KV cache holds at tensor_parallel_size
    gpus_per_pod: int  # == tensor_parallel_size: the pod's GPU request
    gpu_budget: int | None
    max_active_shards: int | None  # gpu_budget // tensor_parallel_size
    verdict: str  # "fits" | "larger_than_needed" | "too_small" | "invalid_tp" | "does_not_fit"
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    refusal: str | None = None  # set when the spec's tensor_parallel_size cannot run

    def summary(self) -> str:
        tp = self.tensor_parallel_size
        gpu = "1 GPU" if tp == 1 else f"{tp} GPUs"
        return f"{gpu} per shard pod (TP={tp})"

    def lines(self) -> list[str]:
        if self.refusal:
            alt = self.fitting_tensor_parallel_size
            return (
                [f"layout: REFUSED: {self.refusal}"]
                + (
                    [
                        f"layout that fits: {alt} GPU{'s' if alt > 1 else ''} per shard pod (TP={alt}), "
                        "shards in parallel "
                        f"over the TP groups"
                    ]
                    if alt
                    else []
                )
                + [f"WARNING: {w}" for w in self.warnings]
            )
        out = [f"layout: {self.summary()}: " + "; ".join(self.reasons)]
        if self.max_active_shards is not None:
            out.append(
                f"max_active_shards: {self.max_active_shards} (GPU budget {self.gpu_budget} / TP "
                f"{self.tensor_parallel_size}): run that many shards at once, one pod per TP group"
            )
        else:
            out.append(
                f"max_active_shards: GPUs / {self.tensor_parallel_size} for the GPUs the job may use at once "
                "(--gpus N prints it; builder's max_active_shards)"
            )
        return out + [f"WARNING: {w}" for w in self.warnings]


def choose_layout(
    shape: ModelShape, *, requested_tp: int = 1, gpu_budget: int | None = None, **plan_kwargs: Any
) -> GpuLayout:
    """The GPU layout for ``shape``; ``plan_kwargs`` are ``plan_memory``'s (not tensor_parallel_size).

    Tries TP 1, 2, 4, 8 (those the heads divide over, up to ``gpu_budget``) and takes the
    smallest at which one max_model_len sequence fits next to the weights and the overhead.
    The spec's TP (``requested_tp``) is respected when it fits: larger than needed is a
    warning with the measured cost, smaller than needed (or one vLLM cannot split the model
    over) is a refusal naming engine.tensor_parallel_size and the TP that fits.
    """
    plan_kwargs.pop("tensor_parallel_size", None)
    max_tp = min(TP_SIZES[-1], gpu_budget) if gpu_budget else TP_SIZES[-1]
    plans = {
        t: plan_memory(shape, tensor_parallel_size=t, **plan_kwargs)
        for t in TP_SIZES
        if t <= max_tp and tp_problem(shape, t) is None
    }

    def starts(mp: MemoryPlan) -> bool:
        return mp.kv_available_bytes >= mp.kv_bytes_per_token * mp.max_model_len > 0

    fitting = next((t for t, mp in plans.items() if starts(mp)), None)
    bad = tp_problem(shape, requested_tp)
    mp_req = plans.get(requested_tp) or (
        None if bad else plan_memory(shape, tensor_parallel_size=requested_tp, **plan_kwargs)
    )
    use = (
        mp_req
        or plans.get(fitting or 0)
        or next(iter(plans.values()), None)
        or plan_memory(shape, tensor_parallel_size=1, **plan_kwargs)
    )
    tp = use.tensor_parallel_size
    g = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    gib = use.gpu_memory_bytes / GiB
    util = use.gpu_memory_utilization
    one_seq = use.kv_bytes_per_token * use.max_model_len
    lora = f" + LoRA {g(use.lora_bytes)}" if use.lora_bytes else ""
    fit_line = (
        f"weights {g(use.weights_bytes)}{lora} + {g(use.overhead_bytes)} overhead + KV {g(one_seq)} "
        f"(one sequence of {use.max_model_len} tokens) per GPU"
    )
    reasons: list[str] = []
    warnings: list[str] = []
    refusal = None
    where = f"{util:g} x {gib:.1f} GiB"
    if bad:
        verdict = "invalid_tp"
        tp = requested_tp
        refusal = f"engine.tensor_parallel_size {requested_tp}: {bad}; " + (
            f"tensor_parallel_size {fitting} fits"
            if fitting
            else f"valid sizes: {', '.join(str(t) for t in plans) or 'none up to ' + str(max_tp)}"
        )
        reasons.append(refusal)
    elif fitting is None and not (mp_req and starts(mp_req)):  # (a TP above 8 that fits is respected)
        verdict = "does_not_fit"
        tp = requested_tp
        reasons.append(f"{fit_line} do not fit in {where} at any tensor_parallel_size up to {max_tp}")
        refusal = (
            f"the model does not fit {max_tp} GPU(s) of {gib:.1f} GiB at any tensor_parallel_size "
            f"(engine.tensor_parallel_size {requested_tp}): use larger GPUs, quantization, a lower "
            "model.max_model_len or more GPUs per pod"
        )
    elif (fitting is not None and requested_tp < fitting) or not starts(use):
        verdict = "too_small"
        reasons.append(f"{fit_line} do not fit in {where}")
        refusal = (
            f"engine.tensor_parallel_size {requested_tp} does not fit: weights {g(use.weights_bytes)} + "
            f"overhead {g(use.overhead_bytes)} + KV {g(one_seq)} for one {use.max_model_len}-token sequence "
            f"exceed {where} per GPU; tensor_parallel_size {fitting} fits "
            f"(set engine.tensor_parallel_size: {fitting})"
        )
    else:
        seqs = use.kv_available_bytes // one_seq
        reasons.append(f"{fit_line} fit in {where} ({seqs} full-length sequences)")
        if tp == 1:
            verdict = "fits"
            reasons.append("run shards in parallel, one per GPU (" + MEASURED_SCALEOUT + ")")
        elif fitting is None or tp == fitting:
            verdict = "fits"
            reasons.append(
                f"the model does not fit tensor_parallel_size {_prev(plans, tp)}: one engine per "
                f"{tp} GPUs, shards in parallel over the TP groups"
            )
        else:
            verdict = "larger_than_needed"
            reasons.append(f"engine.tensor_parallel_size {tp} respected")
            warnings.append(
                f"engine.tensor_parallel_size {tp} is larger than needed: the model fits "
                f"tensor_parallel_size {fitting}; expect more throughput from {tp // fitting} shards at "
                f"TP={fitting} on the same GPUs ({MEASURED_SCALEOUT})"
            )
        bigger = [t for t in plans if t > tp]
        if verdict != "larger_than_needed" and seqs < FEW_FULL_LENGTH_SEQS and bigger:
            more = plans[bigger[0]]
            warnings.append(
                f"only {seqs} sequence(s) of max_model_len {use.max_model_len} fit the KV cache at "
                f"TP={tp}: long rows will run few at a time; lower model.max_model_len if rows are "
                f"short, or set engine.tensor_parallel_size {bigger[0]} "
                f"({more.kv_available_bytes // (more.kv_bytes_per_token * more.max_model_len)} fit)"
            )
    if gpu_budget is not None and tp > gpu_budget:
        warnings.append(f"tensor_parallel_size {tp} needs more GPUs than the budget of {gpu_budget}: no shard can run")
    full = max(0, use.kv_available_bytes // one_seq) if one_seq else 0
    return GpuLayout(
        tensor_parallel_size=tp,
        fitting_tensor_parallel_size=fitting,
        max_tensor_parallel_size=max_tp,
        gpu_memory_gib=round(gib, 2),
        gpu_memory_utilization=util,
        weights_gib=round(use.weights_bytes / GiB, 2),
        kv_one_seq_gib=round(one_seq / GiB, 3),
        kv_available_gib=round(use.kv_available_bytes / GiB, 2),
        full_length_seqs=int(full),
        gpus_per_pod=tp,
        gpu_budget=gpu_budget,
        max_active_shards=(gpu_budget // tp) if gpu_budget and not refusal else None,
        verdict=verdict,
        reasons=tuple(reasons),
        warnings=tuple(warnings),
        refusal=refusal,
    )


def _prev(plans: dict[int, MemoryPlan], tp: int) -> int:
    smaller = [t for t in plans if t < tp]
    return smaller[-1] if smaller else 1
