"""Known labels from the input column or a golden set, through the whole QA step (plan, shards on the
fake engine, merge, ``qa_run``): QA's accuracy equals pandas' over the published results; a golden
set that cannot be trusted is refused, naming the file and the column."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import LABELS, make_spec, merge, shard_task, write_parquet
from tests.support.fakes import FakeEngine

N = 300


def _run(tmp_path: Path, reference: dict, **extra):
    ids = [f"t{i:03d}" for i in range(N)]
    texts = [f"{LABELS[i % 5]} ticket number {i}" if i % 37 else "" for i in range(N)]  # some empty: error rows
    truth = [LABELS[(i * 7) % 5] if i % 3 else None for i in range(N)]  # sparse: a third unlabelled
    write_parquet(tmp_path / "in" / "a.parquet", ids, texts, truth=truth)
    spec = make_spec(tmp_path / "in", tmp_path / "out", qa={"reference": reference, "sample_size": 20}, **extra)
    plan = plan_job(spec)
    for shard in plan.shards:
        run_shard(
            shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=lambda s: FakeEngine(s, real_vllm=False)
        )
    merge(spec).dump()
    report, _ = qa_run(spec)
    return spec, report, dict(zip(ids, truth))


def _accuracy(out: Path, truth: dict) -> tuple[int, int]:
    res = pq.read_table(out / "results", columns=["id", "label"]).to_pandas()
    err = pq.read_table(out / "errors", columns=["id"]).to_pandas().assign(label=None)
    rows = pd.concat([res, err])
    rows["truth"] = rows["id"].map(truth)
    rows = rows.dropna(subset=["truth"])
    return int((rows["label"] == rows["truth"]).sum()), len(rows)


def test_input_column_labels_are_scored(tmp_path):
    _, report, truth = _run(tmp_path, {"input_column": "truth"})
    q = report.metrics["quality"]
    k, n = _accuracy(tmp_path / "out", truth)
    assert (q["correct"], q["labelled"]) == (k, n) and n == sum(t is not None for t in truth.values())
    assert (
        q["sources"] == {"input_column": q["sources"]["input_column"]}
        and q["sources"]["input_column"]["unmatched"] == 0
    )
    assert q["locations"] == {"input_column": str(tmp_path / "in")}
    assert q["no_answer"] >= 5  # the empty tickets are error rows, scored as wrong


def test_golden_set_joined_by_id(tmp_path):
    golden = tmp_path / "golden.parquet"
    gold = {f"t{i:03d}": LABELS[i % 5] for i in range(0, N, 2)} | {"not-in-run": "bug"}
    pq.write_table(pa.table({"ticket": list(gold), "gold": list(gold.values())}), golden)
    _, report, _ = _run(tmp_path, {"golden_uri": str(golden), "id_column": "ticket", "label_column": "gold"})
    q = report.metrics["quality"]
    k, n = _accuracy(tmp_path / "out", gold)
    assert (q["correct"], q["labelled"]) == (k, n) == (k, N // 2)
    assert q["sources"]["golden_set"]["unmatched"] == 1
    assert any("1 of 151 known labels (golden_set) name ids that are not in this run" in x for x in report.notes)


@pytest.mark.parametrize(
    "table,match",
    [
        ({"id": ["t001", "t001"], "label": ["bug", "bug"]}, r"1 repeated id\(s\) in 'id', e.g. \['t001'\]"),
        ({"id": ["t001", None], "label": ["bug", "bug"]}, r"1 row\(s\) with a null 'id'"),
        ({"id": ["t001"], "answer": ["bug"]}, r"no column 'label' \(the label column\)"),
    ],
)
def test_a_golden_set_that_cannot_be_trusted_is_refused(tmp_path, table, match):
    golden = tmp_path / "golden.parquet"
    pq.write_table(pa.table(table), golden)
    with pytest.raises(SpecError, match=match) as e:
        _run(tmp_path, {"golden_uri": str(golden)})
    assert str(golden) in str(e.value)


def test_a_golden_set_that_is_not_parquet_is_refused(tmp_path):
    (tmp_path / "golden.parquet").write_text("id,label\nt001,bug\n")
    with pytest.raises(SpecError, match="cannot be read as Parquet"):
        _run(tmp_path, {"golden_uri": str(tmp_path / "golden.parquet")})


def test_an_input_column_that_does_not_exist_is_refused_by_the_plan(tmp_path):
    with pytest.raises(SpecError, match=r"qa.reference.input_column 'nope' is not a column of input file a.parquet"):
        _run(tmp_path, {"input_column": "nope"})
    assert not (tmp_path / "out" / "_plan.json").exists()
