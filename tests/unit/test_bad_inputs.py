"""The bad-input corpus: row faults become error rows with the right code, nothing is lost;
dataset faults fail the plan with one clear message before any worker starts."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import DatasetError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.bad_inputs.corpus import dataset_fault_cases, jsonl_row_corpus, openai_row_corpus, parquet_row_corpus
from tests.support.data import make_spec, merge, shard_task
from tests.support.ledger import record_bad_rows

pytestmark = pytest.mark.reliability
CORPORA = {"parquet": parquet_row_corpus, "jsonl": jsonl_row_corpus, "openai_batch": openai_row_corpus}


def outcomes(out) -> dict[str, str]:
    """id -> 'ok' or error code, from the merged files; asserts no id twice."""
    res = pq.read_table(out / RESULTS, columns=["id"]).column("id").to_pylist()
    err = pq.read_table(out / ERRORS, columns=["id", "error_code"])
    got = {i: "ok" for i in res}
    for i, code in zip(err.column("id").to_pylist(), err.column("error_code").to_pylist()):
        assert i not in got, f"id {i!r} twice"
        got[i] = code
    assert len(got) == len(res) + err.num_rows
    return got


def score(expected: dict[str, str], got: dict[str, str]) -> tuple[int, int]:
    planted = [i for i, e in expected.items() if e != "ok"]
    return len(planted), sum(got.get(i) == expected[i] for i in planted)


@pytest.mark.parametrize("fmt", sorted(CORPORA))
def test_row_fault_corpus_with_the_fake_engine(tmp_path, fake_engine_factory, fmt):
    expected = CORPORA[fmt](tmp_path / "in")
    over = {
        "sharding": {"target_rows": 7, "chunk_rows": 3},
        "prompt": {"truncation": "reject"},
        "model": {"name": "fake", "max_model_len": 4096},
    }
    if fmt == "openai_batch":
        over["sampling"] = {"max_tokens": 8, "structured": None}
        over["prompt"] = {**over["prompt"], "system_prompt": None}
    spec = make_spec(tmp_path / "in", tmp_path / "out", **over)
    plan = plan_job(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    summary = merge(spec).dump()
    got = outcomes(tmp_path / "out")
    planted, right = score(expected, got)
    record_bad_rows(f"{fmt}_rows", planted, right)
    assert set(got) == set(expected)  # nothing lost, nothing invented
    wrong = {i: (expected[i], got[i]) for i in expected if got[i] != expected[i]}
    assert wrong == {}
    assert summary["rows"] == len(expected)


def test_dataset_faults_fail_the_plan_with_one_clear_message(tmp_path):
    cases = dataset_fault_cases(tmp_path / "cases")
    right = 0
    problems = {}
    for name, (folder, fragments) in cases.items():
        out = tmp_path / "out" / folder.name
        spec = make_spec(folder, out, prompt={"system_prompt": None})  # some are OpenAI batch files
        try:
            plan_job(spec)
            problems[name] = "planned"
            continue
        except DatasetError as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001 - any other exception is a finding
            problems[name] = f"{type(e).__name__}: {e}"
            continue
        missing = [f for f in fragments if f not in msg]
        if missing or "\n" in msg or (out / PLAN_FILE).exists():
            problems[name] = f"{msg!r} lacks {missing}"
        else:
            right += 1
    record_bad_rows("dataset_faults", len(cases), right)
    assert problems == {}
