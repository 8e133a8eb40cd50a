"""LoRA adapters made for tests: PEFT's folder layout, written by hand (peft is not installed here).

``write_adapter`` writes what ``peft.LoraModel.save_pretrained(..., safe_serialization=True)`` writes for a
Llama: ``adapter_config.json`` and ``adapter_model.safetensors`` with, per layer and target module,
``base_model.model.model.layers.<i>.self_attn.<module>.lora_A.weight`` (rank x in) and ``...lora_B.weight``
(out x rank). PEFT initialises B to zeros (an adapter that changes nothing until trained); these are random
and large enough that greedy answers move away from the base model's. vLLM loads this layout
(``vllm.lora``: ``PEFTHelper`` reads the config, the tensor names map onto its packed modules).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ATTENTION = {
    "q_proj": ("hidden", "q"),
    "k_proj": ("hidden", "kv"),
    "v_proj": ("hidden", "kv"),
    "o_proj": ("q", "hidden"),
}


def write_adapter(
    dest: Path, model_dir: str | Path, seed: int, rank: int = 8, scale: float = 0.5, targets=("q_proj", "v_proj")
) -> Path:
    """A random LoRA adapter for the Llama in ``model_dir`` at ``dest``; deterministic in ``seed``."""
    from safetensors.numpy import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {
        "hidden": cfg["hidden_size"],
        "q": cfg["num_attention_heads"] * head_dim,
        "kv": cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim,
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = (width[w] for w in ATTENTION[module])
            p = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{p}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * scale).astype(np.float32)
            tensors[f"{p}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * scale).astype(np.float32)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest
