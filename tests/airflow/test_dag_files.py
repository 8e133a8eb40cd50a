"""The DAG templates: they import cleanly and do no I/O while being parsed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.airflow_env import LOADED_MACHINE

HERE = Path(__file__).resolve().parent
DAGS = HERE.parents[1] / "dags"
DAG_IDS = {"vllm_nightly_reclassification", "vllm_nightly_table", "vllm_batch_rerun", "vllm_embeddings"}


def dagbag():
    from airflow.dag_processing.dagbag import BundleDagBag

    return BundleDagBag(dag_folder=str(DAGS), bundle_path=DAGS)


def test_dagbag_has_the_four_dags_and_no_import_errors():
    bag = dagbag()
    assert bag.import_errors == {}
    assert set(bag.dags) == DAG_IDS
    for dag in bag.dags.values():
        assert dag.doc_md and "vllm" in dag.tags
        (shard,) = [t for t in dag.tasks if t.task_id.endswith(".shard")]
        assert shard.is_mapped and shard.partial_kwargs["map_index_template"]
        publish = next(t for t in dag.tasks if t.task_id.endswith(".publish"))
        assert len(publish.outlets) == 1 and publish.outlets[0].uri.startswith("x-vllm-batch://")
        assert all(t.get_flat_relative_ids(upstream=False) or t is publish for t in dag.tasks)  # publish is last


def test_nightly_is_a_cron_data_interval_over_the_logical_date_partition():
    dag = dagbag().dags["vllm_nightly_reclassification"]
    assert type(dag.timetable).__name__ == "CronDataIntervalTimetable"
    assert dag.timetable.expression == "0 2 * * *" and dag.catchup is False
    plan = dag.task_dict["reclassify.plan"]
    assert plan.spec["io"]["input_uri"].endswith("/tickets/dt={{ ds }}/")
    assert plan.spec["io"]["output_uri"].endswith("/reclassification/dt={{ ds }}/")
    assert "var.value.get('vllm_batch_data_root'" in plan.spec["io"]["input_uri"]
    # the result cache (shared by every date) and the changes against the run this DAG last published, which the
    # plan task reads from its Asset's events (an inlet beside the input) and the publish task emits
    assert plan.spec["cache"]["uri"].endswith("/reclassification/_cache/")
    assert plan.spec["changes"] == {"previous_published": True}
    asset = dag.task_dict["reclassify.publish"].outlets[0]
    assert asset.uri == "x-vllm-batch://ticket_reclassification" and asset in plan.inlets
    assert (plan.published_asset, plan.publish_task_id) == (asset, "reclassify.publish")
    assert (plan.spec["qa"]["warn_churn_rate"], plan.spec["qa"]["fail_churn_rate"]) == (0.05, 0.5)
    # QA's drift and accuracy-drop baseline: the report of that same published run, not dt=D-1's
    assert plan.spec["qa"]["previous_published"] is True and "previous_report_uri" not in plan.spec["qa"]


def test_the_table_nightly_compares_with_what_it_published():
    """The table variant, like the folder one: the change set and QA's baseline are the run this DAG last published
    (the plan reads its Asset's events as an inlet), never whatever dt=D-1 holds."""
    dag = dagbag().dags["vllm_nightly_table"]
    plan = dag.task_dict["reclassify.plan"]
    assert plan.spec["changes"] == {"previous_published": True}
    assert plan.spec["qa"]["previous_published"] is True and "previous_report_uri" not in plan.spec["qa"]
    asset = dag.task_dict["reclassify.publish"].outlets[0]
    assert asset.uri == "x-vllm-batch://ticket_labels_table" and asset in plan.inlets
    assert (plan.published_asset, plan.publish_task_id) == (asset, "reclassify.publish")


def test_both_nightlies_score_the_golden_rows_of_the_golden_variable():
    """vllm_batch_golden_uri (the defaults' golden rows, scored every night) rides along with both nightlies: the
    table variant left it out, so a deployment that set it had its table nightly published unscored."""
    for dag_id in ("vllm_nightly_reclassification", "vllm_nightly_table"):
        plan = dagbag().dags[dag_id].task_dict["reclassify.plan"]
        ride_along = plan.spec["qa"]["reference"]["ride_along_uri"]
        assert "var.value.get('vllm_batch_golden_uri'" in ride_along, dag_id


def test_rerun_params_form_schema():
    dag = dagbag().dags["vllm_batch_rerun"]
    schema = {k: dag.params.get_param(k).schema for k in dag.params}
    assert set(schema) == {
        "input_uri",
        "output_uri",
        "model",
        "labels",
        "system_prompt",
        "temperature",
        "max_tokens",
        "shard_rows",
        "compare_with",
        "runner",
        "dry_run",
    }
    assert schema["dry_run"]["type"] == "boolean"
    assert schema["runner"]["enum"] == [None, "local", "kubernetes"]  # empty: the deployment's runner
    assert schema["shard_rows"]["minimum"] == 1 and schema["shard_rows"]["type"] == "integer"
    assert schema["input_uri"]["pattern"].startswith("^") and schema["output_uri"]["pattern"].endswith("$")
    assert schema["compare_with"]["pattern"] == schema["output_uri"]["pattern"]
    plan = dag.task_dict["rerun.plan"]
    assert (
        plan.runner == "{{ params.runner or var.value.get('vllm_batch_runner', 'local') }}"
        and "shard_rows" in plan.param_overrides
    )


def test_parsing_the_dag_files_does_no_io_and_reads_no_variable(tmp_path):
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        **LOADED_MACHINE,
    }
    p = subprocess.run(
        [sys.executable, str(HERE / "parse_audit.py"), str(DAGS)],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["warm_import_errors"] == {}
    assert sorted(d for _, ids in report["parsed"] for d in ids) == sorted(DAG_IDS)
    assert report["events"] == {"open": [], "fs": [], "net": [], "proc": [], "variable_get": []}
    assert not [p for p in tmp_path.rglob("*") if "home" not in p.parts]  # nothing written beside


PARSE_ONE_FOLDER = """
import json, sys
from airflow.dag_processing.dagbag import BundleDagBag
bag = BundleDagBag(dag_folder=sys.argv[1], bundle_path=sys.argv[1])
print(json.dumps({"errors": {k: v[-300:] for k, v in bag.import_errors.items()}, "dags": sorted(bag.dags)}))
"""


def test_a_template_copied_alone_finds_the_defaults_in_the_package(tmp_path):
    """Without vllm_dag_defaults.py beside it, a DAG file imports airflow_provider_vllm.example_dags' copy."""
    alone = tmp_path / "dags"
    alone.mkdir()
    shutil.copy2(DAGS / "vllm_batch_rerun.py", alone)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(alone),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        **LOADED_MACHINE,
        "PYTHONPATH": str(HERE.parents[1]),
    }
    p = subprocess.run(
        [sys.executable, "-c", PARSE_ONE_FOLDER, str(alone)],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"errors": {}, "dags": ["vllm_batch_rerun"]}
    # and the fallback is the only way it could have parsed: no defaults module in that folder
    assert [f.name for f in alone.iterdir() if f.suffix == ".py"] == ["vllm_batch_rerun.py"]
