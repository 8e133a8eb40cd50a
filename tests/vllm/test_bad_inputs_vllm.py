"""The row-fault corpus through the real worker CLI on real vLLM (CPU build, tiny random Llama).

The same expectations as the fake-engine test (tests/unit/test_bad_inputs.py), with a real
tokenizer, chat template and engine: every planted bad row comes back as an error row with
its code, every odd-but-valid row (RTL, emoji, BOM, CRLF, template syntax in the data) as a
result, nothing lost or doubled. The worker runs with secrets in its environment; none of
them appears in anything it prints.
"""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.support.bad_inputs.corpus import jsonl_row_corpus
from tests.support.data import merge
from tests.support.ledger import record_bad_rows
from tests.unit.test_bad_inputs import outcomes, score
from tests.vllm.test_worker_vllm import ENV, LABELS, SYSTEM, manifest, run_worker

pytestmark = [pytest.mark.vllm, pytest.mark.reliability, pytest.mark.timeout(900)]
SECRETS = {
    "HF_TOKEN": "hf_SENTINELtokenQ7w",
    "AWS_SECRET_ACCESS_KEY": "awsSENTINELsecretZ9x",
    "AWS_ACCESS_KEY_ID": "AKIASENTINELKEYID01",
}


def test_row_fault_corpus_on_real_vllm(tmp_path, tiny_model, monkeypatch):
    expected = jsonl_row_corpus(tmp_path / "in")
    spec = JobSpec.load(
        {
            "model": {"name": tiny_model, "max_model_len": 512},
            "engine": {"enforce_eager": True, "max_num_seqs": 16},
            "io": {"input_uri": str(tmp_path / "in"), "output_uri": str(tmp_path / "out")},
            "prompt": {"system_prompt": SYSTEM, "template": "Ticket: {text}", "truncation": "reject"},
            "sampling": {"temperature": 0, "max_tokens": 8, "structured": {"choice": LABELS}},
            "sharding": {"target_rows": 10_000, "chunk_rows": 8},
        }
    )
    (shard,) = plan_job(spec).shards
    for k, v in SECRETS.items():
        ENV[k] = v  # run_worker's environment
    try:
        proc = run_worker(spec, shard.shard_id)
    finally:
        for k in SECRETS:
            ENV.pop(k, None)
    m = manifest(proc)
    assert m["status"] == "committed" and m["rows"] == len(expected)
    merge(spec)
    got = outcomes(tmp_path / "out")
    planted, right = score(expected, got)
    record_bad_rows("jsonl_rows_real_vllm", planted, right)
    assert set(got) == set(expected)
    assert {i: (expected[i], got[i]) for i in expected if got[i] != expected[i]} == {}
    printed = proc.stdout + proc.stderr
    assert all(v not in printed for v in SECRETS.values())
