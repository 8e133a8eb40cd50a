"""The OpenAI logprobs on real vLLM (CPU build, SmolLM2-135M-Instruct).

A structured-choice answer's ``confidence`` against vLLM's own logprobs is checked on the shared SmolLM2 run
(tests/vllm/test_worker_vllm.py, ``test_smollm2_labels_and_confidence_equal_raw_llm_chat``).

* OpenAI batch requests with ``logprobs`` / ``top_logprobs`` come out as ``vllm run-batch`` writes
  them for the same requests: the same tokens, bytes and top entries, logprobs within 1e-4.

float32: in bf16 the worker's batches and LLM.chat's differ enough to move low bits of a logit
(and flip a greedy near-tie now and then); the claims are about what is computed, not about bf16.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.support.data import merge
from tests.vllm.test_worker_vllm import (
    ENV,
    SYSTEM,
    TICKETS,
    spec_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _request(i: int, model: str, **extra) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Ticket: " + TICKETS[i]}],
        "max_tokens": 6,
        "temperature": 0,
        **extra,
    }
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_openai_logprobs_are_what_vllm_run_batch_writes(tmp_path, smollm2, shard_server):
    reqs = [
        _request(0, smollm2, logprobs=True),
        _request(1, smollm2, logprobs=True, top_logprobs=3),
        _request(2, smollm2, logprobs=True, top_logprobs=20),
        _request(3, smollm2),
    ]
    batch = tmp_path / "in" / "batch.jsonl"
    batch.parent.mkdir()
    batch.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    spec = spec_for(smollm2, tmp_path).model_dump(mode="json")
    spec["model"]["dtype"] = "float32"
    spec["io"].update(input_uri=str(batch), output_format="openai_batch")
    spec["sampling"] = {"temperature": 0, "max_tokens": 6}
    spec["prompt"] = {"template": "{text}"}
    from airflow_provider_vllm.core.spec import JobSpec

    job = JobSpec.load(spec)
    (shard,) = plan_job(job).shards
    assert shard_server.run(job, shard.shard_id)["status"] == "committed"
    merge(job).dump()
    ours = {
        x["custom_id"]: x["response"]["body"]["choices"][0]
        for x in map(json.loads, (tmp_path / "out" / "openai" / "output.jsonl").read_text().splitlines())
    }
    theirs_file = tmp_path / "run_batch.jsonl"
    rb = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.run_batch",
            "-i",
            str(batch),
            "-o",
            str(theirs_file),
            "--model",
            smollm2,
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "32",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rb.returncode == 0, rb.stderr[-3000:]
    theirs = {
        x["custom_id"]: x["response"]["body"]["choices"][0]
        for x in map(json.loads, theirs_file.read_text().splitlines())
    }
    assert set(ours) == set(theirs) == {f"req-{i}" for i in range(4)}
    assert ours["req-3"]["logprobs"] is None and theirs["req-3"]["logprobs"] is None
    for cid in ("req-0", "req-1", "req-2"):
        a, b = ours[cid], theirs[cid]
        assert a["message"]["content"] == b["message"]["content"]
        ca, cb = a["logprobs"]["content"], b["logprobs"]["content"]
        assert [(t["token"], t["bytes"]) for t in ca] == [(t["token"], t["bytes"]) for t in cb]
        for x, y in zip(ca, cb):
            assert math.isclose(x["logprob"], y["logprob"], abs_tol=1e-4)
            assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
            assert all(
                math.isclose(p["logprob"], q["logprob"], abs_tol=1e-4)
                for p, q in zip(x["top_logprobs"], y["top_logprobs"])
            )
    assert len(ours["req-2"]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_batch_invariance_is_refused_on_the_cpu_build(tmp_path, tiny_model, shard_server):
    """vLLM 0.32's CPU build has VLLM_BATCH_INVARIANT but not the kernels (its first forward pass fails):
    the worker refuses engine.batch_invariant before it starts an engine, naming the field (in the test process's
    shard server: the worker's own run_shard, vLLM imported)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    doc = spec_for(tiny_model, tmp_path).model_dump(mode="json")
    doc["engine"]["batch_invariant"] = True
    from airflow_provider_vllm.core.spec import JobSpec

    job = JobSpec.load(doc)
    (shard,) = plan_job(job).shards
    started = shard_server.engines_started
    # run_shard raises it (the worker CLI exits with its terminal code): the server answers it as the error
    with pytest.raises(
        AssertionError, match="SpecError: engine.batch_invariant: vLLM 0.32.0's CPU build does not offer"
    ):
        shard_server.run(job, shard.shard_id)
    assert shard_server.engines_started == started
