"""The dry run: estimates and the GPU memory plan, against worked numbers."""

from __future__ import annotations

import json
import logging
import math

import pytest

from airflow_provider_vllm.cli.dry_run import main
from airflow_provider_vllm.steps.plan.dry_run import (
    ASSUMED_ENGINE_START_S,
    ASSUMED_TOKENS_PER_S,
    DryRunReport,
    dry_run_report,
)
from airflow_provider_vllm.steps.plan.memory import (
    GiB,
    KiB,
    ModelShape,
    gpu_memory_gib,
    kv_bytes_per_token,
    lora_slot_bytes,
    plan_memory,
    safetensors_bytes,
)
from airflow_provider_vllm.steps.plan.planner import build_plan
from airflow_provider_vllm.steps.plan.sizing import HISTORY_VERSION, prompt_overhead_tokens
from tests.support.data import history_line, make_spec, write_parquet

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
}


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
    import numpy as np
    from safetensors.numpy import save_file

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
    assert r.rows == 1000 and r.shards == 4 and not r.sized_from_history
    assert r.est_prompt_tokens == prompt and r.est_output_tokens == 1000 * 8  # max_tokens: upper bound
    infer = (prompt + 8000) / ASSUMED_TOKENS_PER_S
    assert r.est_inference_s == round(infer, 1) and r.throughput_basis == "assumed"
    assert r.est_gpu_hours == round((4 * ASSUMED_ENGINE_START_S + infer) / 3600, 3)
    assert r.memory.available and r.memory.kv_bytes_per_token == 128 * KiB
    assert r.memory.max_model_len == 1024  # the spec's, not the config's 8192
    assert r.dump()["assumptions"] == {"tokens_per_s": ASSUMED_TOKENS_PER_S, "engine_start_s": ASSUMED_ENGINE_START_S}
    assert not (tmp_path / "out").exists()  # nothing written


def test_report_with_history_and_the_cli(tmp_path, capsys):
    _dataset(tmp_path)
    hist = tmp_path / "history"
    spec = make_spec(
        tmp_path / "in", tmp_path / "out", sharding={"target_rows": 300, "history_uri": str(hist), "target_minutes": 10}
    )
    hist.mkdir()
    rec = {
        "version": HISTORY_VERSION,
        "model": "fake",
        "task": "chat",
        "tensor_parallel_size": 1,
        "hardware": "1x NVIDIA H200",
        "config_hash": spec.output_hash(),
        "rows": 600,
        "infer_s": 600.0,
        "prompt_tokens": 60_000,
        "completion_tokens": 1200,
        "engine_start_s": 90.0,
        # the rest of a record as merge writes it (a history line is validated as a ThroughputRecord)
        "recorded_at": "2026-11-28T00:00:00Z",
        "job": "job",
        "spec_hash": "s" * 64,
        "shards": 2,
        "rows_per_s": 1.0,
        "tokens_per_s": 102.0,
        "prompt_tokens_per_row": 100.0,
        "completion_tokens_per_row": 2.0,
    }
    (hist / "20261128T000000Z-a-b.jsonl").write_text(history_line(hist, rec))
    r = dry_run_report(spec, model_config=LLAMA3_8B)
    # 1 row/s from the same job; 10-minute shards, 90 s start -> ceil(1000 / 510) = 2 shards
    assert r.throughput_basis == "history:config" and r.est_inference_s == 1000.0 and r.shards == 2
    assert r.est_output_tokens == 2000 and r.output_tokens_basis == "history"
    assert r.est_gpu_hours == round((2 * 90 + 1000) / 3600, 3)
    assert r.memory.gpu_memory_source == "hardware '1x NVIDIA H200'"
    assert r.dump()["assumptions"] == {} and r.dump()["evidence"]["basis"] == "config"

    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA2_7B))
    assert (
        main(
            [
                str(spec_file),
                "--model-config",
                str(cfg),
                "--gpu-memory-gib",
                "80",
                "--set",
                "engine.max_num_seqs=256",
                "--set",
                "model.max_model_len=4096",
            ]
        )
        == 0
    )
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
    from airflow_provider_vllm.testing.local_models import default_cache_dir, make_tiny_llama

    model = make_tiny_llama(default_cache_dir() / "tiny-llama")
    _dataset(tmp_path, 10)
    spec = make_spec(tmp_path / "in", tmp_path / "out", model={"name": str(model), "max_model_len": 512})
    m = dry_run_report(spec, gpu_memory=24).memory
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    assert m.available and m.weights_source.startswith("size of the checkpoint")
    assert m.kv_bytes_per_token == 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 2


def test_engine_kwargs_load_format_is_limited_to_safe_formats(tmp_path):
    from airflow_provider_vllm.core.errors import SpecError

    ok = make_spec(tmp_path / "in", tmp_path / "out", engine={"engine_kwargs": {"load_format": "dummy"}})
    assert ok.engine.engine_kwargs == {"load_format": "dummy"}  # 8B-shape GPU benchmarks without a checkpoint
    with pytest.raises(SpecError, match="load_format 'pt' not allowed"):
        make_spec(tmp_path / "in", tmp_path / "out", engine={"engine_kwargs": {"load_format": "pt"}})


# ---- the GPU layout ------------------------------------------------------------------------------
LLAMA3_70B = {
    **LLAMA3_8B,
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "intermediate_size": 28672,
}


def _layout(cfg, gib, tp=1, budget=None, **kw):
    from airflow_provider_vllm.steps.plan.memory import choose_layout

    return choose_layout(
        ModelShape.from_config(cfg),
        requested_tp=tp,
        gpu_budget=budget,
        max_model_len=kw.pop("max_model_len", 8192),
        gpu_memory_bytes=int(gib * GiB),
        **kw,
    )


@pytest.mark.parametrize("hardware", ["1x NVIDIA H200", "NVIDIA A100-SXM4-80GB", "H100"])
def test_8b_fits_one_gpu_so_the_layout_is_one_pod_per_gpu(hardware):
    lay = _layout(LLAMA3_8B, gpu_memory_gib(hardware), budget=8)
    assert lay.verdict == "fits" and lay.tensor_parallel_size == lay.fitting_tensor_parallel_size == 1
    assert lay.gpus_per_pod == 1 and lay.max_active_shards == 8 and not lay.refusal and not lay.warnings
    assert lay.weights_gib == round(8_030_261_248 * 2 / GiB, 2)
    text = "\n".join(lay.lines())
    assert text.startswith("layout: 1 GPU per shard pod (TP=1): weights 15.0 GiB") and "1.97x" in text
    assert "1.13x" in text and "max_active_shards: 8" in text


def test_70b_bf16_on_80gib_gpus_needs_tensor_parallel_and_default_tp_1_is_refused():
    lay = _layout(LLAMA3_70B, 79.2, tp=1, budget=8)
    assert lay.verdict == "too_small" and lay.fitting_tensor_parallel_size == 2 and lay.max_active_shards is None
    assert "engine.tensor_parallel_size 1 does not fit" in lay.refusal and "tensor_parallel_size: 2" in lay.refusal
    assert lay.lines()[0].startswith("layout: REFUSED") and "TP=2" in lay.lines()[1]
    two = _layout(LLAMA3_70B, 79.2, tp=2, budget=8)
    assert two.verdict == "fits" and two.gpus_per_pod == 2 and two.max_active_shards == 4 and not two.refusal
    # 65.7 GiB of weights per GPU leave room for only 2 sequences of 8192 tokens: said, with the TP that holds more
    assert two.full_length_seqs == 2 and "set engine.tensor_parallel_size 4" in two.warnings[0]
    assert not _layout(LLAMA3_70B, 79.2, tp=2, max_model_len=2048).warnings  # short context: 2 is plenty
    # on 40 GiB GPUs 70B bf16 at 8192 tokens needs 8 (at 4: 0.6 GiB of KV, less than one 0.62 GiB sequence)
    assert _layout(LLAMA3_70B, 39.4, tp=8).verdict == "fits"
    assert _layout(LLAMA3_70B, 39.4, tp=4).fitting_tensor_parallel_size == 8
    assert _layout(LLAMA3_70B, 39.4, tp=4, max_model_len=4096).verdict == "fits"
    none = _layout(LLAMA3_70B, 39.4, tp=1, budget=2)
    assert none.verdict == "does_not_fit" and none.fitting_tensor_parallel_size is None
    assert "does not fit 2 GPU(s)" in none.refusal
    # 405B-like: nothing up to 8 GPUs of 80 GiB fits; an explicit TP 16 (multi-node) is respected, not refused
    big = {
        **LLAMA3_70B,
        "num_hidden_layers": 126,
        "hidden_size": 16384,
        "num_attention_heads": 128,
        "intermediate_size": 53248,
    }
    assert _layout(big, 79.2, tp=8).verdict == "does_not_fit"
    sixteen = _layout(big, 79.2, tp=16)
    assert sixteen.verdict == "fits" and sixteen.refusal is None and sixteen.gpus_per_pod == 16


def test_explicit_tp_larger_than_needed_is_respected_with_the_measured_cost():
    lay = _layout(LLAMA3_8B, 139.8, tp=2, budget=2)
    assert lay.verdict == "larger_than_needed" and lay.tensor_parallel_size == lay.gpus_per_pod == 2
    assert lay.fitting_tensor_parallel_size == 1 and lay.max_active_shards == 1 and lay.refusal is None
    assert "larger than needed" in lay.warnings[0] and "1.97x" in lay.warnings[0] and "1.13x" in lay.warnings[0]
    over = _layout(LLAMA3_8B, 139.8, tp=4, budget=2)  # more GPUs per engine than the budget holds
    assert over.max_active_shards == 0 and any("budget of 2" in w for w in over.warnings)


@pytest.mark.parametrize(
    "tp, msg",
    [(3, "32 attention heads do not divide over 3 GPUs"), (6, "32 attention heads do not divide over 6 GPUs")],
)
def test_tp_the_heads_do_not_divide_over_is_refused(tp, msg):
    lay = _layout(LLAMA3_8B, 79.2, tp=tp)
    assert lay.verdict == "invalid_tp" and msg in lay.refusal and "tensor_parallel_size 1 fits" in lay.refusal


def test_kv_head_divisibility_limits_the_candidates():
    from airflow_provider_vllm.steps.plan.memory import tp_problem

    # 40 attention heads, 10 KV heads: 2 divides both; 4 and 8 divide the heads but not the KV heads
    odd = ModelShape.from_config({**LLAMA3_70B, "num_attention_heads": 40, "num_key_value_heads": 10, "head_dim": 128})
    assert tp_problem(odd, 2) is None and tp_problem(odd, 4) == "10 KV heads do not divide over 4 GPUs"
    assert tp_problem(odd, 8) == "10 KV heads do not divide over 8 GPUs"
    assert tp_problem(odd, 3) == "40 attention heads do not divide over 3 GPUs"
    gqa = ModelShape.from_config({**LLAMA3_8B, "num_attention_heads": 48, "num_key_value_heads": 12, "head_dim": 128})
    assert tp_problem(gqa, 8) == "12 KV heads do not divide over 8 GPUs" and tp_problem(gqa, 4) is None
    mqa = ModelShape.from_config({**LLAMA3_8B, "num_key_value_heads": 1})
    assert tp_problem(mqa, 8) is None  # one KV head replicated on every GPU
    few = ModelShape.from_config({**LLAMA3_8B, "num_attention_heads": 24, "num_key_value_heads": 3, "head_dim": 128})
    assert tp_problem(few, 4) == "4 GPUs are not a multiple of the 3 KV heads"
    # a 70B-sized model whose heads only split in two: the only TP that fits on 40 GiB GPUs is out of reach
    lay = _layout({**LLAMA3_70B, "num_attention_heads": 40, "num_key_value_heads": 10, "head_dim": 128}, 39.4)
    assert lay.verdict == "does_not_fit" and lay.max_tensor_parallel_size == 8


def test_dry_run_prints_the_layout_and_max_active_shards(tmp_path, capsys):
    _dataset(tmp_path)
    spec = make_spec(tmp_path / "in", tmp_path / "out", sharding={"hardware": "1x NVIDIA H200"})
    r = dry_run_report(spec, model_config=LLAMA3_8B, gpus=2)
    assert r.layout.tensor_parallel_size == 1 and r.layout.max_active_shards == 2
    assert r.layout.memory_known and "layout" not in r.dump()["memory"]
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA3_8B))
    assert main([str(spec_file), "--model-config", str(cfg), "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "  layout: 1 GPU per shard pod (TP=1): weights 15.0 GiB" in out and "in 0.9 x 139.8 GiB" in out
    assert "max_active_shards: 2 (GPU budget 2 / TP 1)" in out and "1.97x" in out
    # explicit TP 2: respected, with the warning
    assert (
        main([str(spec_file), "--model-config", str(cfg), "--gpus", "2", "--set", "engine.tensor_parallel_size=2"]) == 0
    )
    out = capsys.readouterr().out
    assert "layout: 2 GPUs per shard pod (TP=2)" in out and "WARNING: engine.tensor_parallel_size 2 is larger" in out
    with pytest.raises(SystemExit):
        main([str(spec_file), "--model-config", str(cfg), "--gpus", "0"])
    assert "--gpus: must be >= 1" in capsys.readouterr().err
    # 70B on the H200 at TP 1: refused, naming the field and the TP that fits
    cfg.write_text(json.dumps(LLAMA3_70B))
    assert main([str(spec_file), "--model-config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "engine.tensor_parallel_size 1 does not fit" in err and "tensor_parallel_size 2 fits" in err
    assert main([str(spec_file), "--model-config", str(cfg), "--set", "engine.tensor_parallel_size=3"]) == 2
    assert "64 attention heads do not divide over 3 GPUs" in capsys.readouterr().err
    assert main([str(spec_file), "--model-config", str(cfg), "--set", "engine.tensor_parallel_size=2"]) == 0
    assert "layout: 2 GPUs per shard pod (TP=2)" in capsys.readouterr().out


def test_dry_run_with_assumed_gpu_memory_reports_instead_of_refusing(tmp_path):
    _dataset(tmp_path)
    spec = make_spec(tmp_path / "in", tmp_path / "out")  # no hardware, no history, no --gpu-memory-gib
    r = dry_run_report(spec, model_config=LLAMA3_70B)
    assert r.memory.gpu_memory_source.startswith("assumed") and not r.layout.memory_known
    assert r.layout.refusal and r.layout.lines[0].startswith("layout: WOULD BE REFUSED (GPU memory assumed")
    with pytest.raises(Exception, match="engine.tensor_parallel_size 1 does not fit"):
        dry_run_report(spec, model_config=LLAMA3_70B, gpu_memory=79.2)
    # the plan operator's dry run (rerun DAG's dry_run param) logs the same lines
    from airflow_provider_vllm.steps.plan.dry_run import format_report

    assert "WOULD BE REFUSED" in format_report(r)


# ---- one pass ------------------------------------------------------------------------------------
@pytest.fixture
def reads(monkeypatch):
    """Counts of the input listings (``describe_files``: a stat of every input file) and history reads."""
    from airflow_provider_vllm.core.formats import files
    from airflow_provider_vllm.steps.plan import dry_run, sizing

    counts = {"listings": 0, "history": 0}

    def counted(fn, key):
        def wrapper(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)

        return wrapper

    monkeypatch.setattr(files, "describe_files", counted(files.describe_files, "listings"))
    history = counted(sizing.read_history, "history")
    monkeypatch.setattr(sizing, "read_history", history)
    monkeypatch.setattr(dry_run, "read_history", history)
    return counts


def _history_spec(tmp_path, **sharding):
    hist = tmp_path / "history"
    spec = make_spec(tmp_path / "in", tmp_path / "out", sharding={"history_uri": str(hist), **sharding})
    hist.mkdir()
    rec = {
        "version": HISTORY_VERSION,
        "model": "fake",
        "task": "chat",
        "tensor_parallel_size": 1,
        "hardware": "1x NVIDIA H200",
        "config_hash": spec.output_hash(),
        "rows": 600,
        "infer_s": 600.0,
        "prompt_tokens": 60_000,
        "completion_tokens": 1200,
        "engine_start_s": 90.0,
        "recorded_at": "2026-11-28T00:00:00Z",
        "job": "job",
        "spec_hash": "s" * 64,
        "shards": 2,
        "rows_per_s": 1.0,
        "tokens_per_s": 102.0,
        "prompt_tokens_per_row": 100.0,
        "completion_tokens_per_row": 2.0,
    }
    (hist / "20261128T000000Z-a-b.jsonl").write_text(history_line(hist, rec))
    return spec


def test_the_dry_run_lists_the_input_and_reads_the_history_once(tmp_path, reads):
    _dataset(tmp_path)
    r = dry_run_report(_history_spec(tmp_path, target_minutes=10), model_config=LLAMA3_8B)
    assert r.sized_from_history and r.evidence.basis == "config" and r.memory.gpu_memory_source.startswith("hardware")
    assert reads == {"listings": 1, "history": 1}


def test_the_dry_run_of_an_empty_input_still_reports_its_evidence_from_one_read(tmp_path, reads):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(
        pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}), tmp_path / "in" / "a.parquet"
    )
    r = dry_run_report(_history_spec(tmp_path), model_config=LLAMA3_8B)
    assert (r.rows, r.shards) == (0, 0) and r.evidence is not None and r.engine_start_s == 90.0  # the history's
    assert reads == {"listings": 1, "history": 1}  # the plan had no rows to size: the dry run read it


def test_an_unreadable_history_fails_the_dry_run_but_not_the_plan(tmp_path, monkeypatch, caplog):
    from airflow_provider_vllm.steps.plan import dry_run, sizing

    _dataset(tmp_path)
    spec = _history_spec(tmp_path)
    calls = []

    def unreadable(uri, *a, **kw):
        calls.append(uri)
        raise PermissionError(f"{uri}: access denied")

    monkeypatch.setattr(sizing, "read_history", unreadable)
    monkeypatch.setattr(dry_run, "read_history", unreadable)
    caplog.set_level(logging.WARNING, logger=sizing.log.name)  # whatever an earlier test left the levels at
    assert build_plan(spec).sizing is None and "cannot read the throughput history" in caplog.text
    with pytest.raises(PermissionError, match="access denied"):
        dry_run_report(spec, model_config=LLAMA3_8B)
    assert len(calls) == 2  # one per call: the dry run did not try again after its plan could not read it


def test_the_report_sections_carry_every_field_of_the_memory_plan_and_the_layout():
    """The typed sections list the dataclasses' fields (extra fields are refused, so a new one must be added)."""
    from dataclasses import fields

    from airflow_provider_vllm.steps.plan.dry_run import LayoutReport, MemoryReport
    from airflow_provider_vllm.steps.plan.memory import GpuLayout, MemoryPlan

    assert set(LayoutReport.model_fields) == {f.name for f in fields(GpuLayout)} | {"memory_known", "lines"}
    extra = {"available", "config", "gpu_memory_gib", "gpu_memory_source", "architecture", "lines"}
    assert set(MemoryReport.model_fields) == {f.name for f in fields(MemoryPlan)} | extra


def test_lora_slots_worked_numbers():
    # Llama-3-8B, rank 16, 4 slots, bf16: per layer 4 x 4096 + 2 x 4096 + 2 x 1024 + 3 x 14336 = 69632 widths
    shape = ModelShape.from_config(LLAMA3_8B)
    assert lora_slot_bytes(shape, 16, 4, 2) == 4 * 16 * 32 * 69632 * 2 == 285_212_672
    # TP 2 splits the B of qkv/gate_up and the A of o/down: 4 x 4096 + (8192 + 2048 + 43008) / 2 = 43008
    assert lora_slot_bytes(shape, 16, 4, 2, tp=2) == 4 * 16 * 32 * 43008 * 2
    base = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=80 * GiB)
    with_lora = plan_memory(shape, max_model_len=8192, gpu_memory_bytes=80 * GiB, lora_rank=16, lora_slots=4)
    assert base.kv_available_bytes - with_lora.kv_available_bytes == with_lora.lora_bytes == 285_212_672
    assert "LoRA: 4 adapter slot(s) (max_loras) of rank 16 (max_lora_rank): 0.27 GiB" in with_lora.lines()


def test_dry_run_shows_the_adapters_passthrough_and_their_memory(tmp_path, capsys):
    from tests.support.lora import write_adapter

    _dataset(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    a = write_adapter(tmp_path / "billing", model, seed=1, rank=16, targets=("q_proj",))
    b = write_adapter(tmp_path / "refunds", model, seed=2, rank=8, targets=("q_proj",))
    spec = make_spec(
        tmp_path / "in",
        tmp_path / "out",
        model={"adapters": [{"name": "billing", "source": str(a)}, {"name": "refunds", "source": str(b)}]},
        io={"passthrough": ["text"], "passthrough_prefix": "input_"},
        sharding={"hardware": "1x NVIDIA H200"},
    )
    r = dry_run_report(spec, model_config=LLAMA3_8B)
    assert r.adapters is not None and r.adapters.max_lora_rank == 16 and r.adapters.max_loras == 2
    assert [x.rank for x in r.adapters.adapters] == [16, 8]
    assert r.memory.lora_bytes == lora_slot_bytes(ModelShape.from_config(LLAMA3_8B), 16, 2, 2)
    assert r.dump()["passthrough"] == [{"column": "text", "as": "input_text", "type": "string"}]
    assert DryRunReport.model_validate(r.dump()) == r  # the XCom reads back through the record
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA3_8B))
    assert main([str(spec_file), "--model-config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "LoRA adapters    2 (every row; default the base model); engine max_lora_rank 16, max_loras 2" in out
    assert f"billing: {a} (rank 16; sha256:" in out and "passthrough      text as input_text (string)" in out
    assert "LoRA: 2 adapter slot(s) (max_loras) of rank 16 (max_lora_rank): 0.13 GiB" in out


# ---- engine start: its share of a shard, warm or cold ------------------------------------------------
def test_the_dry_run_shows_the_engine_start_a_shard_pays_and_its_share(tmp_path, capsys, monkeypatch):
    from airflow_provider_vllm.steps.plan.sizing import ASSUMED_COLD_START_S, ASSUMED_WARM_START_S

    _dataset(tmp_path)
    spec = make_spec(tmp_path / "in", tmp_path / "out", sharding={"target_rows": 250})  # 4 shards
    fast = 5_000.0  # tokens/s: shards of about a second of inference
    warm = dry_run_report(spec, model_config=LLAMA3_8B, tokens_per_s=fast, warm_starts=True)
    cold = dry_run_report(spec, model_config=LLAMA3_8B, tokens_per_s=fast, warm_starts=False)
    assert (warm.engine_start_s, warm.engine_start_basis) == (ASSUMED_WARM_START_S, "assumed:warm")
    assert (cold.engine_start_s, cold.engine_start_basis) == (ASSUMED_COLD_START_S, "assumed:cold")
    assert warm.dump()["assumptions"]["engine_start_s"] == ASSUMED_WARM_START_S
    per_shard = warm.est_inference_s / 4
    assert warm.engine_start_share == pytest.approx(ASSUMED_WARM_START_S / (ASSUMED_WARM_START_S + per_shard), 1e-3)
    assert warm.est_gpu_hours < cold.est_gpu_hours
    # over 10%: the report says how many rows per shard would bring it under, and that many do
    assert warm.engine_start_share > 0.10 and warm.start_warning is not None
    need = int(warm.start_warning.split("at least ")[1].split(" rows")[0].replace(",", ""))
    infer_per_row = warm.est_inference_s / warm.rows
    assert ASSUMED_WARM_START_S / (ASSUMED_WARM_START_S + need * infer_per_row) <= 0.10
    assert need == pytest.approx(9 * ASSUMED_WARM_START_S / infer_per_row, rel=0.02)  # not more than it takes
    big = make_spec(tmp_path / "in", tmp_path / "out", sharding={"target_rows": 250})
    slow = dry_run_report(big, model_config=LLAMA3_8B, tokens_per_s=10.0, warm_starts=True)  # ~10 min per shard
    assert slow.engine_start_share <= 0.10 and slow.start_warning is None

    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    args = [str(spec_file), "--tokens-per-s", str(fast), "--runner", "kubernetes"]
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", "vllm-compile-cache")
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  engine start"))
    assert f"{ASSUMED_WARM_START_S:.0f} s per shard (ASSUMED; warm: the pods restore a shared compile cache)" in line
    assert "% of a shard (goal <= 10%)" in line and "WARNING: engine start is" in out
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC")
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["warm_starts"], doc["engine_start_basis"]) == (False, "assumed:cold")
    assert main([str(spec_file), "--json"]) == 0  # no runner: as before, the stated assumption
    doc = json.loads(capsys.readouterr().out)
    assert (doc["warm_starts"], doc["engine_start_s"]) == (None, ASSUMED_ENGINE_START_S)
