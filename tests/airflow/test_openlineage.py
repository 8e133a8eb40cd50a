"""OpenLineage: the operators' lineage as OpenLineage objects, and the events a real
``airflow dags test`` run emits through the provider's file transport (fake engine, no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.airflow.test_operators import fake_python  # noqa: F401 (fixture)
from tests.support.airflow_env import tail
from tests.support.data import make_spec, merge_summary, write_parquet

pytest.importorskip("airflow.providers.openlineage", reason="apache-airflow-providers-openlineage (test extra)")

DAG_ID = "vllm_openlineage"
DAG_FILE = """
import json

import pendulum
from airflow.sdk import DAG

from airflow_provider_vllm.task_groups.batch_job import vllm_batch_job

with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1)) as dag:
    vllm_batch_job(json.loads({spec!r}), group_id="job", human_review=False)
# the fake engine instead of vLLM: the shard task runs the real worker CLI through this interpreter
dag.task_dict["job.shard"].partial_kwargs["python"] = {python!r}
"""


def test_operator_lineage_builds_openlineage_datasets_with_facets():
    from openlineage.client.serde import Serde

    from airflow_provider_vllm.steps.lineage import merge_lineage, qa_lineage
    from airflow_provider_vllm.utils.openlineage_facets import operator_lineage

    spec = make_spec("s3://in-bucket/tickets/", "s3://out-bucket/labels/")
    merged = operator_lineage(merge_lineage(spec, merge_summary(3, 2, 1)))
    assert [(d.namespace, d.name) for d in merged.inputs] == [("s3://in-bucket", "tickets")]
    results = json.loads(Serde.to_json(merged.outputs[0]))
    assert results["name"] == "labels/results"
    assert results["outputFacets"]["outputStatistics"]["rowCount"] == 2
    assert ("id", "string") in [(f["name"], f["type"]) for f in results["facets"]["schema"]["fields"]]
    qa = operator_lineage(
        qa_lineage(
            spec,
            {
                "status": "warn",
                "checks": [{"name": "error_rate", "value": 0.1, "warn": 0.05, "fail": 0.2, "status": "warn"}],
            },
        )
    )
    facet = json.loads(Serde.to_json(qa.inputs[0]))["inputFacets"]["dataQualityAssertions"]
    assert [(a["assertion"], a["success"]) for a in facet["assertions"]] == [
        ("error_rate", False),
        ("qa_verdict", True),
    ]
    assert operator_lineage(None).inputs == []  # nothing recorded (a task that failed early)


def test_merge_carries_a_run_facet_naming_model_revision_adapter_vllm_and_settings():
    from openlineage.client.serde import Serde

    from airflow_provider_vllm.steps.lineage import merge_lineage
    from airflow_provider_vllm.utils.openlineage_facets import RUN_FACET, operator_lineage

    spec = make_spec("s3://in-bucket/tickets/", "s3://out-bucket/labels/", model={"name": "org/m", "revision": "r1"})
    summary = merge_summary(3, 2, 1).model_copy(update={"engine_versions": ["0.32.0"]})
    facet = json.loads(Serde.to_json(operator_lineage(merge_lineage(spec, summary)).run_facets[RUN_FACET]))
    assert (facet["model"], facet["revision"], facet["vllmVersions"]) == ("org/m", "r1", ["0.32.0"])
    assert facet["configHash"] == spec.output_hash() and facet["settings"]["sampling"]["max_tokens"] == 8
    assert "adapter" not in facet  # None: OpenLineage leaves unset fields out; this version loads no adapters
    assert facet["_schemaURL"].endswith("#/$defs/RunFacet") and facet["_producer"]


def test_a_failed_qa_still_reports_its_verdict_to_the_failure_event(tmp_path, fake_python):  # noqa: F811
    """The listener's FAIL event asks the same method (no on_failure variant): QA records before it raises."""
    from airflow_provider_vllm.operators import VllmQAFailed, VllmQAOperator
    from tests.airflow.test_operators import context, dataset, run_job, spec_doc

    dataset(tmp_path, 50, empty=(3, 4))
    spec, *_ = run_job(tmp_path, fake_python, spec_doc(tmp_path, qa={"warn_error_rate": 0.0, "fail_error_rate": 0.01}))
    op = VllmQAOperator(task_id="qa", spec=spec)
    with pytest.raises(VllmQAFailed):
        op.execute(context())
    assertions = op.get_openlineage_facets_on_complete(None).inputs[0].inputFacets["dataQualityAssertions"].assertions
    got = {a.assertion: (a.success, a.severity) for a in assertions}
    assert got["error_rate"] == (False, "error") and got["qa_verdict"] == (False, "error")


def events_by_task(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event.get("eventType") in ("COMPLETE", "FAIL") and "." in event["job"]["name"]:  # dag_id.group.task
            out.setdefault(event["job"]["name"].rsplit(".", 1)[1], []).append(event)
    return out


def test_a_dag_run_emits_input_output_datasets_and_the_qa_facet(airflow_sandbox, fake_python, tmp_path):  # noqa: F811
    box = airflow_sandbox
    src, out = box.data / "ol" / "in", box.data / "ol" / "out"
    write_parquet(src / "part-0.parquet", [f"t{i:03d}" for i in range(30)], [f"ticket {i}: refund" for i in range(30)])
    dags = tmp_path / "dags"
    dags.mkdir()
    spec = json.dumps(make_spec(src, out).model_dump(mode="json"))
    (dags / "vllm_openlineage.py").write_text(DAG_FILE.format(dag_id=DAG_ID, spec=spec, python=fake_python))
    events = tmp_path / "openlineage.jsonl"
    p = box.dags_test(
        DAG_ID,
        "2026-11-28",
        env={
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                {"type": "file", "log_file_path": str(events), "append": True}
            ),
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "vllm-batch-test",
        },
    )
    assert p.returncode == 0, tail(p)
    assert (out / "_SUCCESS.json").exists(), tail(p)
    by_task = events_by_task(events)
    names = lambda ds: [(d["namespace"], d["name"]) for d in ds]  # noqa: E731

    plan = by_task["plan"][-1]
    assert names(plan["inputs"]) == [("file", str(src))]
    assert plan["inputs"][0]["inputFacets"]["inputStatistics"]["rowCount"] == 30
    assert plan["outputs"] == []  # _plan.json is the run's bookkeeping, not a dataset

    merge = by_task["merge"][-1]
    assert names(merge["inputs"]) == [("file", str(src))]
    assert names(merge["outputs"]) == [("file", f"{out}/results"), ("file", f"{out}/errors")]
    counts = [d["outputFacets"]["outputStatistics"]["rowCount"] for d in merge["outputs"]]
    assert sum(counts) == 30 and merge["outputs"][0]["facets"]["schema"]["fields"]
    facet = merge["run"]["facets"]["vllmBatch"]
    assert facet["model"] == "fake" and facet["vllmVersions"] == ["fake-0"]  # what the (fake) engine reported
    assert facet["configHash"] == make_spec(src, out).output_hash()

    qa = by_task["qa"][-1]
    verdict = json.loads((out / "qa" / "report.json").read_text())["status"]
    assertions = qa["inputs"][0]["inputFacets"]["dataQualityAssertions"]["assertions"]
    assert {"assertion": "qa_verdict", "success": verdict != "fail"}.items() <= next(
        a for a in assertions if a["assertion"] == "qa_verdict"
    ).items()
    assert assertions[-1]["actual"] == verdict

    assert by_task["qa"][-1]["eventType"] == "COMPLETE"
    publish = by_task["publish"][-1]
    assert names(publish["outputs"]) == [("file", str(out))]
    assert publish["run"]["facets"]["vllmBatch"] == facet
