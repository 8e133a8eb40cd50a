"""The nightly template's table variant end to end: real Airflow (`airflow dags test`, SQLite), an Iceberg SQL
catalog on SQLite from the deployment's Connection, the fake engine in the real worker CLI (no vLLM)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.airflow.test_operators import fake_python  # noqa: F401 (fixture)
from tests.support.airflow_env import DAGS, tail

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DAG_ID = "vllm_nightly_table"
DAY, OTHER, REAL_DAY = "2026-11-27", "2026-11-26", "2026-11-25"
# The template as shipped, with the shard task's interpreter swapped for the fake engine's.
WRAPPER = """
import importlib.util, sys
sys.path.insert(0, {dags!r})  # vllm_dag_defaults beside the template
spec = importlib.util.spec_from_file_location("vllm_nightly_table_template", {path!r})
template = importlib.util.module_from_spec(spec)
spec.loader.exec_module(template)
dag = template.dag  # an airflow DAG
dag.task_dict["reclassify.shard"].partial_kwargs["python"] = {python!r}
"""


@pytest.fixture(scope="module")
def lake(airflow_sandbox):
    """The deployment's Iceberg catalog (SQLite, a warehouse under the sandbox's allowed data root) and a table of
    tickets partitioned by dt: 40 rows on DAY, 2 on OTHER, 12 on REAL_DAY (the real-vLLM run's)."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.transforms import IdentityTransform

    box = airflow_sandbox
    lake = box.data / "lake"
    (lake / "warehouse").mkdir(parents=True)
    props = {
        "type": "sql",
        "uri": f"sqlite:///{lake / 'catalog.db'}",
        "warehouse": f"file://{lake / 'warehouse'}",
        "catalog-name": "lake",  # the name the tables were created under (SQL catalogs key tables by it)
    }
    catalog = SqlCatalog("lake", uri=props["uri"], warehouse=props["warehouse"])
    catalog.create_namespace("support")
    schema = pa.schema([pa.field("id", pa.string()), pa.field("text", pa.string()), pa.field("dt", pa.string())])
    src = catalog.create_table("support.tickets", schema=schema)
    with src.update_spec() as spec:
        spec.add_field("dt", IdentityTransform(), "dt")
    src = catalog.load_table("support.tickets")
    for day, n, prefix in ((DAY, 40, "d"), (OTHER, 2, "x"), (REAL_DAY, 12, "r")):
        ids = [f"{prefix}{i:03d}" for i in range(n)]
        # texts of their own per day: the fake engine's answers (cached under the local engine's identity, which
        # the plan sees) must not answer the real-vLLM run's rows
        texts = [f"ticket {prefix}{i} of {day}: I was charged twice, please refund" for i in range(n)]
        src.append(pa.table({"id": ids, "text": texts, "dt": [day] * n}, schema))
    env = {
        "AIRFLOW_CONN_ICEBERG_DEFAULT": json.dumps({"conn_type": "iceberg", "extra": props}),
        "AIRFLOW__VLLM_BATCH__ALLOWED_TABLES": "support.*",
    }
    return catalog, env


def test_the_table_variant_reads_a_pinned_snapshot_and_publishes_one_snapshot(
    airflow_sandbox,
    lake,
    fake_python,  # noqa: F811
    tmp_path,
):
    box = airflow_sandbox
    catalog, lake_env = lake
    pinned = catalog.load_table("support.tickets").current_snapshot().snapshot_id
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "vllm_nightly_table_fake.py").write_text(
        WRAPPER.format(dags=str(DAGS), path=str(DAGS / "vllm_nightly_table.py"), python=fake_python)
    )
    env = {**lake_env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "AIRFLOW_VAR_VLLM_BATCH_SHARD_ROWS": "20"}
    p = box.dags_test(DAG_ID, DAY, env=env)
    assert p.returncode == 0, tail(p)
    out = box.data / "reclassification_table" / f"dt={DAY}"
    plan = json.loads((out / "_plan.json").read_text())
    assert plan["table"]["snapshot_id"] == pinned and plan["table"]["read"] == "reference"
    assert plan["total_rows"] == 40 and len(plan["shards"]) == 2
    assert f"input: table support.tickets snapshot {pinned} (reference" in p.stdout + p.stderr
    success = json.loads((out / "_SUCCESS.json").read_text())
    labels = catalog.load_table("support.ticket_labels")
    assert [s.snapshot_id for s in labels.snapshots()] == [success["table"]["snapshot_id"]]
    summary = labels.current_snapshot().summary
    assert summary["vllm-batch.input-snapshot"] == f"support.tickets@{pinned}"
    assert summary["vllm-batch.run-id"] == f"{out}"
    assert summary["vllm-batch.results-manifest-sha256"] == success["checksums"]["results/_manifest.json"]
    assert summary["vllm-batch.airflow-run"].startswith(f"{DAG_ID}/")
    event = next(e for e in box.inspect(DAG_ID)["asset_events"] if e["uri"] == "x-vllm-batch://ticket_labels_table")
    assert event["extra"]["table"] == success["table"]  # the Asset event names the committed snapshot
    got = labels.scan(selected_fields=("id", "run_date")).to_arrow()
    assert sorted(got.column("id").to_pylist()) == sorted(
        pq.read_table(out / "results", columns=["id"]).column("id").to_pylist()
    )
    assert {d.isoformat() for d in got.column("run_date").to_pylist()} == {DAY}
    assert f"support.tickets@{pinned}" in (out / "qa" / "report.json").read_text()
    assert plan["cache"]["misses"] == 40  # the first night: nothing cached yet
    # the baseline is the run this DAG published last (its Asset's events): none before the first night
    assert plan["changes_from"]["source"] == "published" and plan["changes_from"]["previous_uri"] is None
    assert not (out / "changes").exists()
    report = json.loads((out / "qa" / "report.json").read_text())
    assert any("published nothing before this run (qa.previous_published)" in n for n in report["notes"])


@pytest.mark.vllm
def test_the_table_variant_runs_real_vllm_on_the_cpu(airflow_sandbox, lake):
    """The shipped template as it is (no fake): the tiny model on vLLM's CPU build, one shard of the day's rows."""
    box = airflow_sandbox
    catalog, lake_env = lake
    p = box.dags_test(DAG_ID, REAL_DAY, env={**lake_env, "AIRFLOW_VAR_VLLM_BATCH_SHARD_ROWS": "100"})
    assert p.returncode == 0, tail(p)
    out = box.data / "reclassification_table" / f"dt={REAL_DAY}"
    res = pq.read_table(out / "results", columns=["id", "engine_version"])
    err = pq.read_table(out / "errors", columns=["id"]).column("id").to_pylist()
    assert sorted(res.column("id").to_pylist() + err) == [f"r{i:03d}" for i in range(12)]
    assert set(res.column("engine_version").to_pylist()) - {None} and "fake" not in str(res.column("engine_version"))
    labels = catalog.load_table("support.ticket_labels")
    days = labels.scan(selected_fields=("id", "run_date")).to_arrow()
    mine = [
        i
        for i, d in zip(days.column("id").to_pylist(), days.column("run_date").to_pylist())
        if d.isoformat() == REAL_DAY
    ]
    assert sorted(mine) == sorted(res.column("id").to_pylist())
