"""Quality measured on real vLLM (CPU build): SmolLM2-135M-Instruct classifying the demo's tickets.

* Known labels from the input column and golden rows that ride along: QA's accuracy, macro-F1 and
  confusion matrix equal scikit-learn's over the published rows; the gate warns as configured on a
  model this weak; a second night with a worse system prompt is reported as a real drop.
* A worker of the golden rows killed with SIGKILL mid-chunk: the retry commits, merge reconciles the
  input's rows and the golden rows apart.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

from airflow_provider_vllm.core.spec import RESERVED_ID_PREFIX, JobSpec
from airflow_provider_vllm.steps.golden import RESULTS_FILE
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.accuracy import NO_ANSWER
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.worker.task import worker_command
from tests.conftest import worker_environ
from tests.support.data import merge
from tests.support.ledger import record_fault
from tests.support.reconcile import reconcile
from tests.support.shard_server import ShardServer
from tests.vllm.test_worker_vllm import ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "dags"), str(ROOT / "scripts")]  # the demo's labels and prompt, its tickets
from vllm_dag_defaults import LABELS, SYSTEM_PROMPT  # noqa: E402

from tests.support.data import shard_task  # noqa: E402

WORSE = (
    "You sort support tickets. Nearly every ticket is 'other'. Answer 'other' unless the ticket asks "
    "for a refund, then answer 'billing'. Answer with the category name only."
)


def _data(tmp_path: Path) -> tuple[Path, Path]:
    from sample_tickets import write_tickets

    paths = write_tickets(tmp_path / "in", 60, seed=3)
    tickets = pq.read_table(paths["tickets"])
    truth = pq.read_table(paths["labels"])
    assert tickets.column("id") == truth.column("id")
    pq.write_table(tickets.append_column("truth", truth.column("label")), paths["tickets"])
    paths["labels"].unlink()
    gold = write_tickets(tmp_path / "golden-src", 150, seed=99)
    g = pq.read_table(gold["tickets"]).append_column("label", pq.read_table(gold["labels"]).column("label"))
    pq.write_table(g, tmp_path / "golden.parquet")
    return paths["tickets"], tmp_path / "golden.parquet"


def _spec(model: str, tmp_path: Path, night: str, system: str, previous: str | None) -> JobSpec:
    return JobSpec.load(
        {
            "model": {"name": model, "max_model_len": 1024, "dtype": "float32"},
            "engine": {"enforce_eager": True, "max_num_seqs": 32},
            "io": {"input_uri": str(tmp_path / "in" / "tickets.parquet"), "output_uri": str(tmp_path / night)},
            "prompt": {"system_prompt": system, "template": "Ticket: {text}", "truncation": "truncate"},
            "sampling": {"temperature": 0, "max_tokens": 16, "structured": {"choice": LABELS}},
            "sharding": {"target_rows": 1000, "chunk_rows": 32},
            "qa": {
                "reference": {"input_column": "truth", "ride_along_uri": str(tmp_path / "golden.parquet")},
                "warn_accuracy_below": 0.9,
                "fail_accuracy_below": 0.05,
                "previous_report_uri": previous,
                "sample_size": 20,
            },
        }
    )


def _night(spec: JobSpec, server: ShardServer):
    plan = plan_job(spec)
    for s in plan.mapped_shards():
        assert server.run(spec, s.shard_id)["status"] == "committed"
    merge(spec).dump()
    report, _ = qa_run(spec)
    return plan, report


def _independent(out: Path, tickets: Path, golden: Path):
    """(y_true, y_pred) over every scored row, from the published files alone."""
    truth = dict(zip(*pq.read_table(tickets, columns=["id", "truth"]).to_pydict().values()))
    g = pq.read_table(golden, columns=["id", "label"]).to_pydict()
    truth.update({RESERVED_ID_PREFIX + i: lab for i, lab in zip(g["id"], g["label"])})
    pred = {}
    for folder in (out / "results", out / "errors"):
        t = pq.read_table(folder)
        labels = t.column("label").to_pylist() if "label" in t.column_names else [None] * t.num_rows
        pred.update(zip(t.column("id").to_pylist(), labels))
    gr = pq.read_table(out / RESULTS_FILE)
    pred.update(zip(gr.column("id").to_pylist(), gr.column("label").to_pylist()))
    ids = sorted(i for i in truth if i in pred or i.startswith(RESERVED_ID_PREFIX))
    ge = out / "golden" / "errors.parquet"
    pred.update({i: None for i in pq.read_table(ge, columns=["id"]).column(0).to_pylist()})
    return [truth[i] for i in ids], [pred.get(i) or NO_ANSWER for i in ids]


def test_quality_on_real_vllm_equals_scikit_learn_gates_and_reports_a_drop(tmp_path, smollm2, shard_server):
    tickets, golden = _data(tmp_path)
    # the four shards (input and golden rows, two nights) in the test process's worker process: one engine start
    before = shard_server.engines_started
    _nights(tmp_path, smollm2, tickets, golden, shard_server)
    assert shard_server.engines_started - before <= 1


def _nights(tmp_path: Path, smollm2: str, tickets: Path, golden: Path, server: ShardServer) -> None:
    spec1 = _spec(smollm2, tmp_path, "night1", SYSTEM_PROMPT, None)
    plan, r1 = _night(spec1, server)
    assert len(plan.golden.shards) == 1 and plan.total_rows == 60
    q = r1.metrics["quality"]
    y_true, y_pred = _independent(tmp_path / "night1", tickets, golden)
    assert q["labelled"] == len(y_true) == 60 + 150
    assert q["sources"]["input_column"]["of"] == 60 and q["sources"]["ride_along"]["of"] == 150
    assert q["accuracy"]["value"] == pytest.approx(accuracy_score(y_true, y_pred))
    classes = q["classes"]
    assert q["macro_f1"] == pytest.approx(f1_score(y_true, y_pred, labels=classes, average="macro", zero_division=0))
    cm = confusion_matrix(y_true, y_pred, labels=classes + [NO_ANSWER])
    cells = {(c["true"], c["pred"]): c["count"] for c in q["confusion"]}
    assert all(
        cells.get((t, p), 0) == cm[i, j] for i, t in enumerate(classes) for j, p in enumerate(classes + [NO_ANSWER])
    )
    acc = next(c for c in r1.checks if c["name"] == "accuracy")
    assert 0.05 <= acc["value"] < 0.9 and acc["status"] == "warn"  # a weak model: warned, as configured
    assert r1.status in ("warn", "fail")
    assert q["halves"]["most"]["of"] + q["halves"]["least"]["of"] == len(y_true)
    for folder in ("results", "errors"):
        ids = pq.read_table(tmp_path / "night1" / folder, columns=["id"]).column(0).to_pylist()
        assert not any(i.startswith(RESERVED_ID_PREFIX) for i in ids)

    # night 2: the same rows, a system prompt that pushes most tickets to 'other'
    spec2 = _spec(smollm2, tmp_path, "night2", WORSE, str(tmp_path / "night1" / "qa" / "report.json"))
    _, r2 = _night(spec2, server)
    v = r2.metrics["quality"]["vs_previous"]
    assert v["previous"] == pytest.approx(q["accuracy"]["value"]) and v["real_drop"] and v["high"] < 0
    drop = next(c for c in r2.checks if c["name"] == "accuracy_drop")
    assert drop["status"] in ("warn", "fail") and "a real drop" in drop["detail"]
    assert r2.status in ("warn", "fail")


@pytest.mark.reliability
def test_a_golden_worker_killed_mid_chunk_reconciles(tmp_path, tiny_model, shard_server):
    from sample_tickets import write_tickets

    paths = write_tickets(tmp_path / "in", 40, seed=5)
    gold = write_tickets(tmp_path / "golden-src", 70, seed=6)
    g = pq.read_table(gold["tickets"]).append_column("label", pq.read_table(gold["labels"]).column("label"))
    pq.write_table(g, tmp_path / "golden.parquet")
    spec = JobSpec.load(
        {
            "model": {"name": tiny_model, "max_model_len": 512},
            "engine": {"enforce_eager": True, "max_num_seqs": 16},
            "io": {"input_uri": str(paths["tickets"]), "output_uri": str(tmp_path / "out")},
            "prompt": {"template": "Ticket: {text}", "truncation": "truncate"},
            "sampling": {"temperature": 0, "max_tokens": 8, "structured": {"choice": LABELS}},
            "sharding": {"target_rows": 1000, "chunk_rows": 16},
            "qa": {"reference": {"ride_along_uri": str(tmp_path / "golden.parquet")}},
        }
    )
    plan = plan_job(spec)
    (golden_shard,) = plan.golden.shards
    cmd = worker_command(shard_task(spec=spec, shard_id=golden_shard.shard_id, progress_interval_s=1))
    with open(tmp_path / "killed.out", "w") as o, open(tmp_path / "killed.err", "w") as e:  # files: orphans keep pipes
        proc = subprocess.Popen(
            cmd,
            env={**worker_environ(ENV), "VLLM_BATCH_FAULTS": "chunk.mid_file#2=kill"},
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the killed worker's engine processes
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.err").read_text()[-2000:]
    assert not (tmp_path / "out" / "shards" / golden_shard.shard_id / "_COMMITTED.json").exists()
    # the retry of the golden shard and the input's shard in the test process's worker process: one engine for both
    assert shard_server.run(spec, plan.shards[0].shard_id)["status"] == "committed"
    m = shard_server.run(spec, golden_shard.shard_id)
    assert m["status"] == "committed" and m["rows"] == 70
    summary = merge(spec).dump()
    rec = reconcile(tmp_path / "out", pq.read_table(paths["tickets"], columns=["id"]).column(0).to_pylist())
    golden_ids = [
        i
        for name in ("results.parquet", "errors.parquet")
        for i in pq.read_table(tmp_path / "out" / "golden" / name, columns=["id"]).column(0).to_pylist()
    ]
    want = [RESERVED_ID_PREFIX + i for i in g.column("id").to_pylist()]
    lost = len(rec.lost) + len(set(want) - set(golden_ids))
    dup = len(rec.duplicates) + len(golden_ids) - len(set(golden_ids))
    record_fault(
        "golden_worker_sigkill",
        40 + 70,
        lost=lost,
        duplicates=dup,
        partial_visible=len(rec.partial_visible),
        level="process",
    )
    assert rec.clean, str(rec)
    assert sorted(golden_ids) == sorted(want) and summary["golden"]["rows"] == 70 and summary["rows"] == 40
