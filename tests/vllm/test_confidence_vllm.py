"""The answer's confidence and the OpenAI logprobs on real vLLM (CPU build, SmolLM2-135M-Instruct).

* A structured-choice answer's ``confidence`` in the results equals exp(sum of the chosen tokens'
  logprobs) of vLLM's own output (``LLM.chat`` with ``logprobs=0`` over the same prompts) within 1e-5.
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

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.steps.merge.merger import merge
from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.support.data import write_parquet
from tests.vllm.test_worker_vllm import (
    ENV,
    LABELS,
    LEAVE,
    SYSTEM,
    TICKETS,
    manifest,
    run_worker,
    spec_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

RAW_CHAT_LOGPROBS = (
    LEAVE
    + r"""
import json, math, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], max_model_len=512, enforce_eager=True, max_num_seqs=32, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=0,
                        structured_outputs=StructuredOutputsParams(choice=a["labels"]))
    convs = [[{"role": "system", "content": a["system"]}, {"role": "user", "content": "Ticket: " + t}]
             for t in a["texts"]]
    res = []
    for o in llm.chat(convs, sp, use_tqdm=False):
        c = o.outputs[0]
        chosen = [step[tid].logprob for tid, step in zip(c.token_ids, c.logprobs)]
        res.append([c.text, math.exp(sum(chosen)), len(chosen)])
    print("RAW " + json.dumps(res), flush=True)
    leave(0)
"""
)


def test_confidence_is_exp_of_vllms_chosen_token_logprobs(tmp_path, smollm2):
    n = 40
    ids = [f"t{i:04d}" for i in range(n)]
    texts = [TICKETS[i % len(TICKETS)] + f" (ref {i})" for i in range(n)]
    write_parquet(tmp_path / "in" / "a.parquet", ids, texts)
    spec = spec_for(smollm2, tmp_path)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"dtype": "float32"})})
    assert spec.confidence_from_logprobs  # structured choice: on by default
    (shard,) = plan_job(spec).shards
    assert manifest(run_worker(spec, shard.shard_id))["ok_rows"] == n
    merge(spec).dump()
    ours = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results").to_pylist()}

    raw = subprocess.run(
        [
            sys.executable,
            "-c",
            RAW_CHAT_LOGPROBS,
            json.dumps({"model": smollm2, "labels": LABELS, "system": SYSTEM, "texts": texts}),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert raw.returncode == 0, raw.stderr[-3000:]
    expected = json.loads(next(x for x in raw.stdout.splitlines() if x.startswith("RAW "))[4:])
    for i, (text, prob, n_tokens) in zip(ids, expected):
        row = ours[i]
        assert row["output"] == text and row["completion_tokens"] == n_tokens
        assert abs(row["confidence"] - prob) <= 1e-5, (i, row["confidence"], prob)
    confs = [r["confidence"] for r in ours.values()]
    assert all(0 < c <= 1 for c in confs) and max(confs) - min(confs) > 0.05  # a real spread, not a constant


def _request(i: int, model: str, **extra) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Ticket: " + TICKETS[i]}],
        "max_tokens": 6,
        "temperature": 0,
        **extra,
    }
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_openai_logprobs_are_what_vllm_run_batch_writes(tmp_path, smollm2):
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
    manifest(run_worker(job, shard.shard_id))
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


def test_batch_invariance_is_refused_on_the_cpu_build(tmp_path):
    """vLLM 0.32's CPU build has VLLM_BATCH_INVARIANT but not the kernels (its first forward pass fails):
    the worker refuses engine.batch_invariant before it starts an engine, naming the field."""
    doc = spec_for("/nonexistent-model", tmp_path).model_dump(mode="json")
    doc["engine"]["batch_invariant"] = True
    script = (
        "import json, sys\nfrom airflow_provider_vllm.core.errors import SpecError\n"
        "from airflow_provider_vllm.core.spec import JobSpec\nfrom airflow_provider_vllm.worker.engine import Engine\n"
        "try:\n    Engine(JobSpec.load(json.loads(sys.argv[1])))\nexcept SpecError as e:\n    print('REFUSED', e)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script, json.dumps(doc)], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert "REFUSED engine.batch_invariant: vLLM 0.32.0's CPU build does not offer" in p.stdout, p.stderr[-2000:]
