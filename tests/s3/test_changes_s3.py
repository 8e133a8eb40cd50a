"""The changes output with both runs on an S3-compatible server (moto): DuckDB reads them through
fsspec, the Parquet is one upload, the summary one atomic write; QA shows it."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.changes import CHANGES, SUMMARY, read_changes
from airflow_provider_vllm.steps.merge.merger import RESULTS, result_parts
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task
from tests.support.s3server import MotoServer


@pytest.fixture(scope="module")
def s3():
    with MotoServer() as server:
        server.make_bucket("data")
        yield server


def test_changes_between_two_runs_on_s3(s3, fake_engine_factory, monkeypatch):
    from airflow_provider_vllm.core.spec_guard import check_deployment

    for k, v in s3.deployment_env.items():
        monkeypatch.setenv(k, v)
    n = 80
    day1 = {f"s{i}": f"ticket {i}" for i in range(n)}
    day2 = {k: v + (" edited" if j % 8 == 1 else "") for j, (k, v) in enumerate(day1.items()) if j >= 3}
    day2["s900"] = "a new ticket"

    def run(day, texts, previous):
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": list(texts), "text": list(texts.values())}), buf)
        Storage(f"s3://data/in/{day}", s3.storage_options).write_atomic("part-0.parquet", buf.getvalue())
        spec = make_spec(
            f"s3://data/in/{day}",
            f"s3://data/runs/{day}",
            sharding={"target_rows": 40},
            changes={"previous_uri": previous},
        )
        check_deployment(spec, ["s3://data"])  # changes.previous_uri is held to the allow-list like the others
        for s in plan_job(spec).shards:
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
        merge(spec)
        return qa_run(spec)[0]

    rep1 = run("d1", day1, "s3://data/runs/d0/")  # nothing there: every id added
    assert rep1.metrics["changes"]["previous_state"] == "absent" and rep1.metrics["changes"]["counts"]["added"] == n
    rep2 = run("d2", day2, "s3://data/runs/d1/")
    out = Storage("s3://data/runs/d2", s3.storage_options)
    with out.open(CHANGES) as f:
        rows = {r["id"]: r for r in pq.read_table(f).to_pylist()}

    def labels(day):
        st = Storage(f"s3://data/runs/{day}", s3.storage_options)
        got: dict = {}
        for rel in result_parts(st, RESULTS):
            with st.open(rel) as f:
                got.update(zip(*pq.read_table(f, columns=["id", "label"]).to_pydict().values()))
        return got

    old, new = labels("d1"), labels("d2")
    assert {i for i, r in rows.items() if r["change"] == "changed"} == {i for i in new if i in old and old[i] != new[i]}
    assert {i for i, r in rows.items() if r["change"] == "removed"} == {"s0", "s1", "s2"}
    assert {i for i, r in rows.items() if r["change"] == "added"} == {"s900"}
    s = read_changes(out)
    assert json.loads(out.read_text(SUMMARY))["counts"] == s.counts.model_dump()
    assert s.checksums[CHANGES] == out.sha256(CHANGES) and s.previous_state == "complete"
    assert rep2.metrics["changes"]["in_both"] == n - 3
    assert any(c["name"] == "churn_rate" and c["value"] == s.churn_rate for c in rep2.checks)
