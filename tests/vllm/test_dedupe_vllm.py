"""Each distinct prompt once per run, with the real worker process on real vLLM (CPU build) and the tiny model.

40 rows of which 30% repeat an earlier row's text, cut into 2 shards of leaders: the engines receive 28
requests (70% of the rows), counted inside vLLM itself (``LLMEngine.add_request``, wrapped in the worker
process by a ``sitecustomize`` this test writes), not from the plan; every duplicate carries its twin's
answer; merge's exactly-once accounting holds (every id once in results or errors).
"""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.support.data import merge, write_parquet
from tests.support.shard_server import ShardServer
from tests.vllm.test_cache_vllm import ENV, LABELS, TICKETS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

N, DISTINCT = 40, 28
# Every request vLLM's engine accepts, one JSON line each: what the engine received, whoever sent it.
COUNTER = """
import importlib.abc, importlib.util, json, os, sys
_OUT = os.environ["DEDUPE_TEST_REQUESTS"]
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.v1.engine.llm_engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            add = module.LLMEngine.add_request
            def counted(self, request_id, prompt, params, *a, **k):
                if isinstance(prompt, dict):
                    ids = prompt.get("prompt_token_ids")
                else:
                    ids = getattr(prompt, "prompt_token_ids", None)
                line = {"max_tokens": getattr(params, "max_tokens", None), "ids": list(ids or [])}
                with open(_OUT, "a") as f:
                    f.write(json.dumps(line) + "\\n")
                return add(self, request_id, prompt, params, *a, **k)
            module.LLMEngine.add_request = counted
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Finder())
"""


def test_thirty_percent_duplicates_send_seventy_percent_of_the_rows_to_the_engine(tmp_path, tiny_model):
    texts = [TICKETS[i % len(TICKETS)] + f" (ref {i})" for i in range(DISTINCT)]
    texts += [texts[(7 * i) % DISTINCT] for i in range(N - DISTINCT)]  # 12 rows repeat an earlier text
    ids = [f"d{i:03d}" for i in range(N)]
    write_parquet(tmp_path / "in" / "a.parquet", ids, texts, row_group_size=16)
    spec = JobSpec.load(
        {
            "model": {"name": tiny_model, "max_model_len": 512},
            "engine": {"enforce_eager": True, "max_num_seqs": 16},
            "io": {"input_uri": str(tmp_path / "in"), "output_uri": str(tmp_path / "out")},
            "prompt": {"system_prompt": "Classify the ticket.", "template": "Ticket: {text}"},
            "sampling": {"temperature": 0, "max_tokens": 8, "structured": {"choice": LABELS}},
            "sharding": {"target_rows": DISTINCT // 2, "chunk_rows": 8},
        }
    )
    plan = plan_job(spec)
    assert (plan.dedupe.leaders, plan.dedupe.followers, len(plan.shards)) == (DISTINCT, N - DISTINCT, 2)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTER)
    requests = tmp_path / "requests.jsonl"
    env = {
        **ENV,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), ENV["PYTHONPATH"]]),
        "DEDUPE_TEST_REQUESTS": str(requests),
    }
    server = ShardServer(tmp_path / "shard-server.log", env)  # one worker process, one engine, both shards
    try:
        for shard in plan.shards:
            assert server.run(spec, shard.shard_id)["status"] == "committed"
    finally:
        server.close()
    seen = [json.loads(x) for x in requests.read_text().splitlines()]
    rows = [r for r in seen if r["max_tokens"] == 8]
    assert len(seen) - len(rows) == len(plan.shards)  # one warm-up request (max_tokens 1) per shard
    assert len(rows) == DISTINCT == 0.7 * N  # the engine saw each distinct prompt once: 70% of the rows
    assert len({tuple(r["ids"]) for r in rows}) == DISTINCT

    summary = merge(spec)
    assert (summary.rows, summary.ok_rows + summary.error_rows) == (N, N)
    assert summary.dedupe.followers == N - DISTINCT
    res = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results").to_pylist()}
    err = pq.read_table(tmp_path / "out" / "errors").column("id").to_pylist()
    assert sorted([*res, *err]) == ids  # exactly once
    first: dict[str, str] = {}
    for i, t in zip(ids, texts):
        twin = res[first.setdefault(t, i)]
        assert (res[i]["output"], res[i]["label"], res[i]["prompt_hash"]) == (
            twin["output"],
            twin["label"],
            twin["prompt_hash"],
        ), i
