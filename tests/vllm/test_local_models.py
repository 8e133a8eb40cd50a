"""Tests of airflow_provider_vllm.testing.local_models (hub-free models)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_provider_vllm.testing import local_models as lm

CHAT = [
    {"role": "system", "content": "Classify the ticket."},
    {"role": "user", "content": "I was charged twice."},
]
CHAT_RENDERED = "<|im_start|>system\nClassify the ticket.<|im_end|>\n<|im_start|>user\nI was charged twice.<|im_end|>\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return lm.make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.name != lm.COMPLETE_MARKER  # holds a timestamp
    }


def test_import_does_not_load_heavy_modules():
    code = (
        "import sys, airflow_provider_vllm.testing.local_models\n"
        "heavy = [m for m in ('torch', 'transformers', 'vllm', 'airflow', 'numpy', 'tokenizers')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tiny_folder_layout_and_config(tiny):
    assert tiny.is_absolute()
    assert lm.is_complete(tiny)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tiny / name).is_file(), name
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] == 128 and cfg["num_attention_heads"] == 2
    assert cfg["head_dim"] == 64 == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg["num_hidden_layers"] == 2
    assert cfg["max_position_embeddings"] == 2048
    assert 256 < cfg["vocab_size"] <= 1000


def test_tiny_config_as_transformers_reads_it(tiny):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(tiny)
    assert cfg.model_type == "llama"
    assert cfg.head_dim == 64
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    assert cfg.vocab_size == len(tok)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )


def test_tiny_weights_have_llama_shapes(tiny):
    from safetensors import safe_open

    cfg = json.loads((tiny / "config.json").read_text())
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [cfg["vocab_size"], 128]
        assert f.get_slice("model.layers.1.self_attn.q_proj.weight").get_shape() == [128, 128]
        assert f.get_slice("model.layers.1.mlp.down_proj.weight").get_shape() == [128, 256]
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
    assert len(names) == 2 + 2 * 9 + 1


def test_tiny_model_runs_in_transformers(tiny):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    assert model.dtype == torch.bfloat16
    logits = model(torch.tensor([[1, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size)
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "I was charged twice for my subscription.",
        "  leading spaces, tabs\tand\nnewlines  ",
        "Unicode: naïve café — 日本語 🚀",
        "",
    ],
)
def test_tiny_tokenizer_round_trips(tiny, text):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny)
    assert hf.decode(hf(text)["input_ids"]) == text


def test_tiny_special_tokens_are_single_ids(tiny):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    ids = tok("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id


def test_tiny_chat_template_renders(tiny):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    assert tok.chat_template
    assert tok.apply_chat_template(CHAT, tokenize=False) == CHAT_RENDERED
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt == CHAT_RENDERED + "<|im_start|>assistant\n"


def test_second_call_is_cached_noop(tmp_path):
    dest = tmp_path / "tiny"
    first = lm.make_tiny_llama(dest)
    marker = (first / lm.COMPLETE_MARKER).read_text()
    inode = (first / "model.safetensors").stat().st_ino
    second = lm.make_tiny_llama(str(dest))  # a str works too
    assert second == first
    assert (first / lm.COMPLETE_MARKER).read_text() == marker
    assert (first / "model.safetensors").stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temp folders left


def test_build_is_deterministic(tmp_path):
    a = lm.make_tiny_llama(tmp_path / "a")
    b = lm.make_tiny_llama(tmp_path / "b")
    assert _digest(a) == _digest(b)


def test_folder_without_marker_is_rebuilt(tmp_path, tiny):
    dest = tmp_path / "tiny"
    dest.mkdir()
    (dest / "config.json").write_text("{half written")
    (dest / "stray.bin").write_bytes(b"x")
    assert not lm.is_complete(dest)
    assert lm.make_tiny_llama(dest) == dest
    assert lm.is_complete(dest)
    assert not (dest / "stray.bin").exists()
    assert _digest(dest) == _digest(tiny)


def test_folder_of_an_older_recipe_is_rebuilt(tmp_path):
    dest = lm.make_tiny_llama(tmp_path / "tiny")
    (dest / lm.COMPLETE_MARKER).write_text(json.dumps({"recipe": "tiny-llama/0"}))
    (dest / "stray.bin").write_bytes(b"x")
    lm.make_tiny_llama(dest)
    assert lm.is_complete(dest, json.loads((dest / lm.COMPLETE_MARKER).read_text())["recipe"])
    assert not (dest / "stray.bin").exists()


def test_corrupt_marker_is_not_complete(tmp_path):
    dest = lm.make_tiny_llama(tmp_path / "tiny")
    (dest / lm.COMPLETE_MARKER).write_text("not json")
    assert not lm.is_complete(dest)
    lm.make_tiny_llama(dest)
    assert lm.is_complete(dest)


def test_failed_build_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    def broken(out: Path) -> dict:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the run were killed mid-way

    monkeypatch.setattr(lm, "_build_tiny", broken)
    with pytest.raises(KeyboardInterrupt):
        lm.make_tiny_llama(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert lm.is_complete(lm.make_tiny_llama(tmp_path / "tiny"))


def test_stale_temp_folders_are_swept(tmp_path):
    import os

    stale = tmp_path / ".tiny.tmp-1-deadbeef"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    fresh = tmp_path / ".tiny.tmp-2-cafecafe"  # maybe a concurrent build: left alone
    fresh.mkdir()
    lm.make_tiny_llama(tmp_path / "tiny")
    assert not stale.exists() and fresh.exists()


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(lm.CACHE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert lm.default_cache_dir() == (tmp_path / ".cache" / "models").resolve()
    monkeypatch.setenv(lm.CACHE_ENV, "rel/models")
    assert lm.default_cache_dir() == (tmp_path / "rel" / "models").resolve()
    assert lm.default_cache_dir().is_absolute()


def test_minilm_path():
    try:
        path = lm.minilm_path()
    except lm.LocalModelError as exc:  # pragma: no cover - package missing
        pytest.skip(str(exc))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] == 384
    assert (path / "model.safetensors").is_file()


def test_missing_package_error_names_the_package():
    with pytest.raises(lm.LocalModelError, match="no-such-model-pkg"):
        lm._package_dir("no_such_model_pkg_xyz", "no-such-model-pkg")


def test_cli_tiny_and_minilm(tmp_path, capsys, monkeypatch):
    assert lm.main(["tiny", "--dest", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "t").resolve())
    monkeypatch.setenv(lm.CACHE_ENV, str(tmp_path / "cache"))
    assert lm.main(["tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cache" / "tiny-llama")
    try:
        expected = lm.minilm_path()
    except lm.LocalModelError:  # pragma: no cover - package missing
        return
    assert lm.main(["minilm"]) == 0
    assert capsys.readouterr().out.strip() == str(expected)


def test_cli_as_module(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.testing.local_models", "tiny", "--dest", str(tmp_path / "t")],
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == str((tmp_path / "t").resolve())
    assert lm.is_complete(tmp_path / "t")


@pytest.mark.vllm
@pytest.mark.slow
def test_prepare_smollm2(smollm2):
    """The SmolLM2 folder the session's tests use, as ``prepare_smollm2`` converted it (from a fresh clone: in
    this session, through the ``smollm2`` fixture; the atomic build itself is the tiny model's tests')."""
    transformers = pytest.importorskip("transformers")
    dest = Path(smollm2)
    assert lm.is_complete(dest)
    # nothing left by this process's build (another test process may be converting its own copy right now)
    assert not [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.tmp-{os.getpid()}-")]
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["head_dim"] == 64
    assert "quantization_config" not in cfg
    assert any(dest.glob("*.safetensors"))
    tok = transformers.AutoTokenizer.from_pretrained(dest)
    assert tok.chat_template
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(CHAT_RENDERED) and prompt.endswith("<|im_start|>assistant\n")

    marker = (dest / lm.COMPLETE_MARKER).read_text()
    weights = {p.name: p.stat().st_ino for p in dest.glob("*.safetensors")}
    assert lm.prepare_smollm2(dest) == dest  # cached: nothing converted or rewritten
    assert (dest / lm.COMPLETE_MARKER).read_text() == marker
    assert {p.name: p.stat().st_ino for p in dest.glob("*.safetensors")} == weights
