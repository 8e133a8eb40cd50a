"""LoRA adapters on real vLLM (CPU build): the worker's answers are vLLM's own.

Two adapters written in PEFT's layout for the tiny test model (tests/support/lora.py; peft itself is not
installed here), three rows per ticket: one per adapter (the ``which`` column) and one with none. The
worker CLI answers them in one engine with ``enable_lora``; vLLM's own ``LLM(enable_lora=True).chat``
with the same ``LoRARequest`` per prompt must give the same text, every adapter's answer must differ
from the base model's, and the rows without an adapter must get the base model's answer (vLLM's answers
with no adapter in the batch). That last one needs the worker's spare LoRA slot on the CPU build
(``worker/engine.py`` ``cpu_spare_lora_slot``): with ``max_loras`` equal to the adapters, vLLM 0.32's CPU
ops answer a base-model row next to adapter rows with the adapter in the last slot (seen here: the base rows
got the second adapter's answers). Then the result cache: a second run is answered from the cache (each row by its
own adapter's answer), and after one adapter's weights change no row is (the key covers every byte).
float32 and greedy, like the other equality tests: the claim is about the requests, not about bf16
near-ties.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.support.data import merge, vouch_cache
from tests.support.lora import write_adapter
from tests.vllm.test_worker_vllm import ENV, LEAVE, TICKETS, manifest, run_worker

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

ADAPTERS = ("billing", "refunds")
CHOICES = (*ADAPTERS, None)

RAW_LORA = (
    LEAVE
    + r"""
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], max_model_len=256, enforce_eager=True, max_num_seqs=16, dtype="float32",
              enable_lora=True, max_lora_rank=8, max_loras=a["max_loras"], max_cpu_loras=a["max_loras"])
    loras = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(a["adapters"].items())}
    sp = SamplingParams(temperature=0, max_tokens=8)
    convs = [[{"role": "user", "content": t}] for t in a["texts"]]
    outs = llm.chat(convs, sp, lora_request=[loras.get(w) for w in a["which"]], use_tqdm=False)
    print("RAW " + json.dumps([o.outputs[0].text for o in outs]), flush=True)
    alone = llm.chat(convs, sp, use_tqdm=False)  # no adapter on any request: the base model's answers
    print("BASE " + json.dumps([o.outputs[0].text for o in alone]), flush=True)
    leave(0)
"""
)


def write_rows(path: Path, texts: list[str]) -> list[dict]:
    rows = [{"id": f"t{i:02d}-{w or 'base'}", "text": t, "which": w} for i, t in enumerate(texts) for w in CHOICES]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist(
            rows, schema=pa.schema([("id", pa.string()), ("text", pa.string()), ("which", pa.string())])
        ),
        path,
    )
    return rows


def lora_spec(model: str, tmp_path: Path, adapters: dict[str, Path], run: str) -> JobSpec:
    return JobSpec.load(
        {
            "task": "chat",
            "model": {
                "name": model,
                "max_model_len": 256,
                "dtype": "float32",
                "adapters": [{"name": n, "source": str(p)} for n, p in adapters.items()],
                "adapter_column": "which",
            },
            "engine": {"enforce_eager": True, "max_num_seqs": 16},
            "io": {"input_uri": str(tmp_path / f"in-{run}"), "output_uri": str(tmp_path / f"out-{run}")},
            "prompt": {"template": "{text}"},
            "sampling": {"temperature": 0, "max_tokens": 8},
            "sharding": {"target_rows": 10_000, "chunk_rows": 4},
            "cache": {"uri": str(tmp_path / "cache")},
        }
    )


def results(spec: JobSpec) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(Path(spec.io.output_uri) / "results").to_pylist()}


def test_adapters_answer_as_vllms_own_lora_and_the_cache_keys_their_bytes(tmp_path, tiny_model):
    adapters = {n: write_adapter(tmp_path / "adapters" / n, tiny_model, seed=i + 1) for i, n in enumerate(ADAPTERS)}
    texts = TICKETS[:4]
    rows = write_rows(tmp_path / "in-a" / "part-0.parquet", texts)
    spec = lora_spec(tiny_model, tmp_path, adapters, "a")
    plan = plan_job(spec)
    (shard,) = plan.shards
    assert [a.name for a in plan.adapters] == list(ADAPTERS) and all(a.rank == 8 for a in plan.adapters)
    m = manifest(run_worker(spec, shard.shard_id))
    assert m["status"] == "committed" and m["ok_rows"] == len(rows) and m["error_rows"] == 0
    merge(spec)
    vouch_cache(spec)  # publish's step for the cache: the entry serves later runs
    got = results(spec)
    assert {i: r["adapter"] for i, r in got.items()} == {r["id"]: r["which"] for r in rows}

    raw = subprocess.run(
        [
            sys.executable,
            "-c",
            RAW_LORA,
            json.dumps(
                {
                    "model": tiny_model,
                    "adapters": {n: str(p) for n, p in adapters.items()},
                    "texts": [r["text"] for r in rows],
                    "which": [r["which"] for r in rows],
                    "max_loras": len(ADAPTERS) + 1,  # the worker's spare slot on the CPU build (cpu_spare_lora_slot)
                }
            ),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert raw.returncode == 0, raw.stderr[-3000:]
    raw_out = json.loads(next(x for x in raw.stdout.splitlines() if x.startswith("RAW "))[4:])
    base_out = json.loads(next(x for x in raw.stdout.splitlines() if x.startswith("BASE "))[5:])
    mine = [got[r["id"]]["output"] for r in rows]
    table = json.dumps([[r["id"], a, b, c] for r, a, b, c in zip(rows, mine, raw_out, base_out)], indent=0)
    assert [b for r, b in zip(rows, base_out) if r["which"] is None] == [
        b for r, b in zip(rows, raw_out) if r["which"] is None
    ], "base-model rows differ with and without adapter rows in the batch: " + table
    assert mine == raw_out, "worker, vLLM with LoRARequest, vLLM without: " + table  # request for request
    for i in range(len(texts)):
        base = got[f"t{i:02d}-base"]["output"]
        answers = [got[f"t{i:02d}-{n}"]["output"] for n in ADAPTERS]
        assert all(a != base for a in answers) and answers[0] != answers[1], (i, base, answers)
        # one prompt, three requests: the adapter is part of the request's identity (QA's consistency)
        assert len({got[f"t{i:02d}-{w or 'base'}"]["prompt_hash"] for w in CHOICES}) == 3

    # the cache: the same rows again are all answered from run a, each by its own adapter's answer
    write_rows(tmp_path / "in-b" / "part-0.parquet", texts)
    spec_b = lora_spec(tiny_model, tmp_path, adapters, "b")
    plan_b = plan_job(spec_b)
    assert plan_b.cache.hits == len(rows) and plan_b.shards == []
    merge(spec_b)
    assert {i: (r["output"], r["adapter"]) for i, r in results(spec_b).items()} == {
        i: (r["output"], r["adapter"]) for i, r in got.items()
    }
    # one adapter's weights change (same files, same sizes, other values): no row is a hit any more
    write_adapter(adapters["refunds"], tiny_model, seed=99)
    write_rows(tmp_path / "in-c" / "part-0.parquet", texts)
    plan_c = plan_job(lora_spec(tiny_model, tmp_path, adapters, "c"))
    assert plan_c.cache.hits == 0 and plan_c.cache.misses == len(rows)
    assert plan_c.adapters[1].sha256 != plan.adapters[1].sha256 and plan_c.adapters[0] == plan.adapters[0]
