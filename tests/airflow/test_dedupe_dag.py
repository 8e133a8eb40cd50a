"""Each distinct prompt once per run, end to end in a real ``airflow dags test`` (fake engine, no vLLM).

40 rows of which 30% repeat an earlier row's text, 2 mapped shards: the fake engines in the worker processes
receive 28 requests (each counted as it is accepted, across processes), every duplicate carries its twin's
label, and QA's report and the published ``_SUCCESS.json`` come out of the same run.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from tests.airflow.test_openlineage import DAG_FILE
from tests.airflow.test_operators import fake_python  # noqa: F401 (fixture)
from tests.support.airflow_env import tail
from tests.support.data import make_spec, write_parquet

DAG_ID = "vllm_dedupe"
N, DISTINCT = 40, 28


def test_a_dag_run_infers_each_distinct_prompt_once(airflow_sandbox, fake_python, tmp_path):  # noqa: F811
    box = airflow_sandbox
    src, out = box.data / "dedupe" / "in", box.data / "dedupe" / "out"
    texts = [f"ticket {i}: please refund my order" for i in range(DISTINCT)]
    texts += [texts[(5 * i) % DISTINCT] for i in range(N - DISTINCT)]
    ids = [f"t{i:03d}" for i in range(N)]
    write_parquet(src / "part-0.parquet", ids, texts)
    spec = make_spec(src, out, sharding={"target_rows": DISTINCT // 2, "chunk_rows": 8})
    dags = tmp_path / "dags"
    dags.mkdir()
    doc = json.dumps(spec.model_dump(mode="json"))
    (dags / "vllm_dedupe.py").write_text(DAG_FILE.format(dag_id=DAG_ID, spec=doc, python=fake_python))
    requests = tmp_path / "requests.txt"
    p = box.dags_test(
        DAG_ID,
        "2026-11-28",
        env={"AIRFLOW__CORE__DAGS_FOLDER": str(dags), "FAKE_ENGINE_REQUESTS": str(requests)},
    )
    assert p.returncode == 0, tail(p)
    assert (out / "_SUCCESS.json").exists(), tail(p)
    plan = json.loads((out / "_plan.json").read_text())
    assert len(plan["shards"]) == 2 and plan["dedupe"]["followers"] == N - DISTINCT
    assert requests.read_text().splitlines() == ["submit"] * DISTINCT  # 70% of the rows reached the engine

    merged = json.loads((out / "_MERGED.json").read_text())
    assert merged["rows"] == N == merged["ok_rows"] + merged["error_rows"]
    assert merged["dedupe"] == {
        "leaders": DISTINCT,
        "followers": N - DISTINCT,
        "ok_rows": N - DISTINCT,
        "error_rows": 0,
    }
    labels = dict(zip(*pq.read_table(out / "results", columns=["id", "label"]).to_pydict().values()))
    assert sorted(labels) == ids
    first: dict[str, str] = {}
    for i, t in zip(ids, texts):
        assert labels[i] == labels[first.setdefault(t, i)], i
    report = json.loads((out / "qa" / "report.json").read_text())
    assert report["metrics"]["dedupe"]["duplicate_rate"] == 0.3
    assert "Repeated prompts" in (out / "qa" / "report.html").read_text()
