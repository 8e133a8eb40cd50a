"""The dry run: estimates and the GPU memory plan, against worked numbers."""

from __future__ import annotations

import json
import math

import pytest

from airflow_provider_vllm.dry_run import ASSUMED_ENGINE_START_S, ASSUMED_TOKENS_PER_S, dry_run_report, main
from airflow_provider_vllm.memory_plan import (
    GiB,
    KiB,
    ModelShape,
    gpu_memory_gib,
    kv_bytes_per_token,
    plan_memory,
    safetensors_bytes,
)
from airflow_provider_vllm.planning import build_plan
from airflow_provider_vllm.sizing import HISTORY_VERSION, prompt_overhead_tokens
from tests.conftest import make_spec, write_parquet

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
             "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
             "max_position_embeddings": 4096, "torch_dtype": "float16"}


def test_kv_cache_per_token_worked_numbers():
    l3, l2 = ModelShape.from_config(LLAMA3_8B), ModelShape.from_config(LLAMA2_7B)
    assert l3.head_dim == 128 and l3.kv_heads == 8 and kv_bytes_per_token(l3, 2) == 128 * KiB
    assert l2.kv_heads == 32 and kv_bytes_per_token(l2, 2) == 512 * KiB  # no num_key_value_heads: MHA
    assert l3.parameters() == 8_030_261_248  # Llama-3-8B's published count
    assert l2.parameters() == 6_738_415_616  # Llama-2-7B's


def test_7b_on_an_80gib_gpu_does_not_fit_256_full_length_sequences():
    shape = ModelShape.from_config(LLAMA2_7B)
    mp = plan_memory(shape, max_model_len=4096, gpu_memory_bytes=80 * GiB, max_num_seqs=256)
    assert mp.weights_bytes == 6_738_415_616 * 2  # ~12.55 GiB
    assert mp.budget_bytes == int(0.9 * 80 * GiB)
    assert mp.kv_bytes_per_token * 4096 == 2 * GiB  # one full-length sequence
    assert mp.kv_needed_bytes == 512 * GiB and not mp.fits
    expected = (int(0.9 * 80 * GiB) - 6_738_415_616 * 2 - 2 * GiB) // (2 * GiB)
    assert mp.suggested_max_num_seqs == expected == 28
    assert any("set engine.max_num_seqs to 28" in w for w in mp.warnings)
    ok = plan_memory(shape, max_model_len=4096, gpu_memory_bytes=80 * GiB, max_num_seqs=28)
    assert ok.fits and not ok.warnings


def test_llama3_8b_on_h200_defaults_and_expected_length():
    shape = ModelShape.from_config(LLAMA3_8B)
    mem = int(gpu_memory_gib("1x NVIDIA H200") * GiB)
    mp = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=mem, expected_seq_tokens=300)
    assert mp.max_num_seqs == 1024 and "default" in mp.max_num_seqs_source  # vLLM's default on >= 70 GiB
    kv_avail = int(0.9 * mem) - 8_030_261_248 * 2 - 2 * GiB
    assert mp.kv_available_bytes == kv_avail and mp.suggested_max_num_seqs == kv_avail // GiB
    assert mp.seqs_at_expected_len == kv_avail // (128 * KiB * 300) and mp.seqs_at_expected_len >= 1024
    assert not mp.fits and "1024 is safe unless rows are much longer" in mp.warnings[0]


def test_tensor_parallel_fp8_kv_and_hopeless_configs():
    shape = ModelShape.from_config(LLAMA3_8B)
    one = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=80 * GiB, max_num_seqs=16)
    two = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=80 * GiB, max_num_seqs=16, tensor_parallel_size=2)
    assert two.weights_bytes == math.ceil(one.weights_bytes / 2) and two.kv_bytes_per_token == 64 * KiB
    fp8 = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=80 * GiB, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == 64 * KiB
    awq = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=80 * GiB, quantization="awq")
    assert awq.weights_bytes < one.weights_bytes / 3
    small = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=16 * GiB)
    assert small.kv_available_bytes < 0 and "do not fit the budget" in small.warnings[0]
    tight = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=int(19.5 * GiB))
    assert 0 < tight.kv_available_bytes < GiB and "refuse to start" in tight.warnings[0]
    with pytest.raises(ValueError, match="no 'num_hidden_layers'"):
        ModelShape.from_config({"hidden_size": 8})


def test_safetensors_bytes_of_the_tiny_model(tmp_path):
    from safetensors.numpy import save_file
    import numpy as np

    save_file({"a": np.zeros((3, 4), np.float16), "b": np.zeros(5, np.float32)}, str(tmp_path / "m.safetensors"))
    assert safetensors_bytes(str(tmp_path)) == 3 * 4 * 2 + 5 * 4
    (tmp_path / "empty").mkdir()
    assert safetensors_bytes(str(tmp_path / "empty")) is None


# ---- the report --------------------------------------------------------------------------------
def _dataset(tmp_path, n=1000):
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:05d}" for i in range(n)], ["x" * 40] * n)


def test_report_without_history_uses_stated_assumptions(tmp_path):
    _dataset(tmp_path)
    spec = make_spec(tmp_path / "in", tmp_path / "out", model={"name": "fake"}, sharding={"target_rows": 300})
    r = dry_run_report(spec, model_config=LLAMA3_8B, gpu_memory=79.2)
    plan = build_plan(spec)
    prompt = plan.est_tokens + 1000 * prompt_overhead_tokens(spec)
    assert r["rows"] == 1000 and r["shards"] == 4 and not r["sized_from_history"]
    assert r["est_prompt_tokens"] == prompt and r["est_output_tokens"] == 1000 * 8  # max_tokens: upper bound
    infer = (prompt + 8000) / ASSUMED_TOKENS_PER_S
    assert r["est_inference_s"] == round(infer, 1) and r["throughput_basis"] == "assumed"
    assert r["est_gpu_hours"] == round((4 * ASSUMED_ENGINE_START_S + infer) / 3600, 3)
    assert r["memory"]["available"] and r["memory"]["kv_bytes_per_token"] == 128 * KiB
    assert r["memory"]["max_model_len"] == 1024  # the spec's, not the config's 8192
    assert not (tmp_path / "out").exists()  # nothing written


def test_report_with_history_and_the_cli(tmp_path, capsys):
    _dataset(tmp_path)
    hist = tmp_path / "history"
    spec = make_spec(tmp_path / "in", tmp_path / "out",
                     sharding={"target_rows": 300, "history_uri": str(hist), "target_minutes": 10})
    hist.mkdir()
    rec = {"version": HISTORY_VERSION, "model": "fake", "task": "chat", "tensor_parallel_size": 1,
           "hardware": "1x NVIDIA H200", "config_hash": spec.output_hash(), "rows": 600, "infer_s": 600.0,
           "prompt_tokens": 60_000, "completion_tokens": 1200, "engine_start_s": 90.0}
    (hist / "20261128T000000Z-a-b.jsonl").write_text(json.dumps(rec) + "\n")
    r = dry_run_report(spec, model_config=LLAMA3_8B)
    # 1 row/s from the same job; 10-minute shards, 90 s start -> ceil(1000 / 510) = 2 shards
    assert r["throughput_basis"] == "history:config" and r["est_inference_s"] == 1000.0 and r["shards"] == 2
    assert r["est_output_tokens"] == 2000 and r["output_tokens_basis"] == "history"
    assert r["est_gpu_hours"] == round((2 * 90 + 1000) / 3600, 3)
    assert r["memory"]["gpu_memory_source"] == "hardware '1x NVIDIA H200'"

    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA2_7B))
    assert main([str(spec_file), "--model-config", str(cfg), "--gpu-memory-gib", "80",
                 "--set", "engine.max_num_seqs=256", "--set", "model.max_model_len=4096"]) == 0
    out = capsys.readouterr().out
    assert "rows             1,000" in out and "GPU-hours" in out and "512 KiB" in out
    assert "set engine.max_num_seqs to 28" in out
    assert main([str(spec_file), "--json", "--model-config", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 2


def test_cli_bad_dataset_exits_2_with_the_reason(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "in" / "a.parquet")
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(make_spec(tmp_path / "in", tmp_path / "out").model_dump(mode="json")))
    assert main([str(spec_file)]) == 2
    assert "missing column(s) ['id']" in capsys.readouterr().err
    assert main([str(spec_file), "--set", "sampling.max_tokens=-1"]) == 2
    assert "sampling.max_tokens" in capsys.readouterr().err


def test_memory_plan_of_a_local_model_folder(tmp_path):
    from airflow_provider_vllm.local_models import default_cache_dir, make_tiny_llama

    model = make_tiny_llama(default_cache_dir() / "tiny-llama")
    _dataset(tmp_path, 10)
    spec = make_spec(tmp_path / "in", tmp_path / "out", model={"name": str(model), "max_model_len": 512})
    m = dry_run_report(spec, gpu_memory=24)["memory"]
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    assert m["available"] and m["weights_source"].startswith("size of the checkpoint")
    assert m["kv_bytes_per_token"] == 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 2


def test_engine_kwargs_load_format_is_limited_to_safe_formats(tmp_path):
    from airflow_provider_vllm.errors import SpecError

    ok = make_spec(tmp_path / "in", tmp_path / "out", engine={"engine_kwargs": {"load_format": "dummy"}})
    assert ok.engine.engine_kwargs == {"load_format": "dummy"}  # 8B-shape GPU benchmarks without a checkpoint
    with pytest.raises(SpecError, match="load_format 'pt' not allowed"):
        make_spec(tmp_path / "in", tmp_path / "out", engine={"engine_kwargs": {"load_format": "pt"}})
