"""Lineage facts: OpenLineage dataset names and what each task read and wrote (pure, no Airflow)."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.steps.lineage import (
    dataset_id,
    inference_facts,
    merge_lineage,
    plan_lineage,
    publish_lineage,
    qa_assertions,
    qa_lineage,
)
from tests.support.data import make_spec, merge_summary


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("s3://bucket/tickets/dt=2026-11-27/", ("s3://bucket", "tickets/dt=2026-11-27")),
        ("gs://bkt/a/b.parquet", ("gs://bkt", "a/b.parquet")),
        ("s3://bucket", ("s3://bucket", "/")),
        ("/data/out/", ("file", "/data/out")),
        ("file:///data/in.jsonl", ("file", "/data/in.jsonl")),
    ],
)
def test_dataset_names_follow_the_openlineage_naming(uri, expected):
    assert dataset_id(uri) == expected


def test_plan_reads_the_input_and_its_plan_file_is_not_a_dataset():
    spec = make_spec("s3://jobs-bucket/in/", "s3://jobs-bucket/out/")
    lin = plan_lineage(spec, rows=300, files=2)
    assert [(d.namespace, d.name, d.rows, d.files) for d in lin.inputs] == [("s3://jobs-bucket", "in", 300, 2)]
    assert lin.outputs == () and lin.inference is None  # _plan.json is the run's bookkeeping


def test_merge_and_publish_name_what_produced_the_answers():
    spec = make_spec(
        "/d/in",
        "/d/out",
        model={"name": "org/model", "revision": "abc123", "dtype": "bfloat16", "max_model_len": 2048},
        engine={"seed": 7, "engine_kwargs": {"kv_cache_dtype": "fp8", "block_size": 16}},
        sampling={"temperature": 0.0, "max_tokens": 8, "structured": {"choice": ["a", "b"]}},
    )
    summary = merge_summary(3, 3, 0).model_copy(update={"engine_versions": ["0.25.0"]})
    facts = merge_lineage(spec, summary).inference
    assert (facts.model, facts.revision, facts.adapter, facts.dtype, facts.max_model_len, facts.task) == (
        "org/model",
        "abc123",
        None,
        "bfloat16",
        2048,
        "chat",
    )
    assert facts.vllm_versions == ("0.25.0",) and facts.config_hash == spec.output_hash()  # the rows' config_hash
    assert facts.settings["sampling"]["structured"] == {"choice": ["a", "b"], "json_schema": None, "regex": None}
    assert facts.settings["prompt"]["template"] == "Ticket: {text}"
    # answer-deciding engine options only: kv_cache_dtype changes answers, block_size only speed
    assert facts.settings["engine"] == {"seed": 7, "engine_kwargs": {"kv_cache_dtype": "fp8"}}
    assert publish_lineage(spec, {"rows": 3}, ["0.25.0"]).inference == facts
    # shards on two images: both named; unknown versions (older markers) left out
    assert inference_facts(spec, ["0.32.0", None, "0.25.0", "0.32.0"]).vllm_versions == ("0.25.0", "0.32.0")


def test_merge_writes_results_and_errors_with_counts_and_columns():
    spec = make_spec("/d/in", "/d/out")
    lin = merge_lineage(
        spec, merge_summary(10, 9, 1, {"results": "results/", "errors": "errors/"}, parts={"results": 3, "errors": 1})
    )
    assert [(d.name, d.rows) for d in lin.inputs] == [("/d/in", 10)]
    results, errors = lin.outputs
    assert (results.namespace, results.name, results.rows) == ("file", "/d/out/results", 9)
    assert (errors.name, errors.rows) == ("/d/out/errors", 1)
    assert (results.files, errors.files) == (3, 1)  # Parquet parts in each folder
    assert ("id", "string") in results.fields and "error_message" in dict(errors.fields)
    assert "error_message" not in dict(results.fields)


def test_qa_checks_and_verdict_become_assertions_on_the_results():
    qa = {
        "status": "fail",
        "summary": "QA fail: error_rate 0.2 > 0.1",
        "checks": [
            {"name": "error_rate", "value": 0.2, "warn": 0.05, "fail": 0.1, "status": "fail"},
            {"name": "truncation_rate", "value": 0.06, "warn": 0.05, "fail": 0.5, "status": "warn"},
            {"name": "label_drift", "value": None, "warn": 0.1, "fail": 0.3, "status": "skip"},
            {"name": "parse_failure_rate", "value": 0.0, "warn": 0.01, "fail": 0.05, "status": "pass"},
        ],
    }
    got = {a.name: (a.success, a.severity, a.actual) for a in qa_assertions(qa)}
    assert got == {
        "error_rate": (False, "error", "0.2"),
        "truncation_rate": (False, "warn", "0.06"),
        "parse_failure_rate": (True, None, "0.0"),
        "qa_verdict": (False, "error", "fail"),
    }
    lin = qa_lineage(make_spec("/d/in", "/d/out"), {**qa, "report_json": "/d/out/qa/report.json"})
    assert lin.inputs[0].name == "/d/out/results" and lin.inputs[0].assertions
    assert [d.name for d in lin.outputs] == ["/d/out/qa/report.json"]
    passed = qa_assertions({"status": "warn", "checks": []})
    assert [(a.name, a.success) for a in passed] == [("qa_verdict", True)]


def test_publish_marks_the_output_folder():
    lin = publish_lineage(make_spec("/d/in", "gs://jobs-bucket/out/"), {"rows": 5, "ok_rows": 4, "error_rows": 1})
    assert [(d.namespace, d.name, d.rows) for d in lin.outputs] == [("gs://jobs-bucket", "out", 5)]
    assert [d.rows for d in lin.inputs] == [4, 1]


def test_accuracy_assertions_go_on_the_results_and_the_golden_set():
    checks = [
        {"name": "error_rate", "value": 0.0, "warn": 0.01, "fail": 0.05, "status": "pass"},
        {
            "name": "accuracy",
            "value": 0.396,
            "warn": 0.8,
            "fail": 0.5,
            "status": "fail",
            "direction": "below",
            "interval": [0.375, 0.418],
            "detail": "792 / 2000",
        },
        {"name": "accuracy_drop", "value": 0.1, "warn": 0.0, "fail": 0.05, "status": "fail", "interval": [0.07, 0.13]},
    ]
    qa = {"status": "fail", "checks": checks, "references": {"golden_set": "s3://bkt/golden.parquet"}}
    acc = {a.name: a for a in qa_assertions(qa)}["accuracy"]
    assert (acc.success, acc.severity, acc.expected) == (False, "error", ">= 0.8 (fails below 0.5)")
    assert acc.actual == "0.396 (95% interval 0.375 to 0.418)" and acc.description == "792 / 2000"
    spec = make_spec(
        "/d/in", "/d/out", qa={"reference": {"golden_uri": "s3://bkt/golden.parquet", "ride_along_uri": "/d/ride"}}
    )
    lin = qa_lineage(spec, qa)
    golden = [d for d in lin.inputs if d.namespace == "s3://bkt"]
    assert [d.name for d in golden] == ["golden.parquet"]
    assert [a.name for a in golden[0].assertions] == ["accuracy", "accuracy_drop"]
    ride = [d for d in lin.inputs if d.name == "/d/ride"]
    assert ride and [a.name for a in ride[0].assertions] == ["accuracy", "accuracy_drop"]
    results = lin.inputs[0]
    assert {a.name for a in results.assertions} >= {"error_rate", "accuracy", "accuracy_drop", "qa_verdict"}


def test_lineage_names_the_adapters_and_the_passthrough_columns():
    from airflow_provider_vllm.core.adapters import AdapterRef
    from airflow_provider_vllm.core.plan import Passthrough

    spec = make_spec(
        "/d/in",
        "/d/out",
        model={
            "adapters": [
                {"name": "billing", "source": "/models/billing"},
                {"name": "hub", "source": "org/lora", "revision": "c" * 40},
            ],
            "adapter_column": "which",
        },
    )
    refs = [AdapterRef(name="billing", source="/models/billing", kind="local", sha256="ab" * 32)]
    carried = Passthrough(columns=["queue"], names=["in_queue"], schema_ipc="", types=["string"])
    lin = merge_lineage(spec, merge_summary(3, 3, 0), refs, carried)
    facts = lin.inference
    assert facts.adapter == "billing, hub"
    assert facts.adapters == (
        {"name": "billing", "source": "/models/billing", "identity": "sha256:" + "ab" * 32},
        {"name": "hub", "source": "org/lora", "revision": "c" * 40},
    )
    assert facts.settings["adapters"] == {"default_adapter": None, "adapter_column": "which"}
    assert ("in_queue", "string") in lin.outputs[0].fields and ("in_queue", "string") in lin.outputs[1].fields
    assert publish_lineage(spec, {"rows": 3}).inference.adapter == "billing, hub"


def test_a_table_input_and_output_are_named_by_location_with_snapshot_and_identifier(tmp_path):
    from airflow_provider_vllm.core.plan import TablePin
    from airflow_provider_vllm.utils.openlineage_facets import operator_lineage

    spec = make_spec("/unused", str(tmp_path / "out"), io={"input_uri": None, "input_table": {"identifier": "lake.t"}})
    pin = TablePin(
        identifier="lake.t",
        snapshot_id=42,
        schema_id=0,
        location="s3://lake/warehouse/lake/t",
        row_filter=None,
        columns=["id", "text"],
        read="reference",
        data_files=2,
        data_rows=10,
    )
    (d,) = plan_lineage(spec, rows=10, files=2, table=pin).inputs
    assert (d.namespace, d.name, d.version, d.table) == ("s3://lake", "warehouse/lake/t", "42", "lake.t")
    event = {"rows": 10, "ok_rows": 9, "error_rows": 1}
    table = {"identifier": "lake.out", "location": "s3://lake/warehouse/lake/out", "snapshot_id": 7}
    out = publish_lineage(spec, {**event, "table": table}).outputs
    assert [(o.name, o.version, o.table) for o in out][1:] == [("warehouse/lake/out", "7", "lake.out")]
    ol = operator_lineage(plan_lineage(spec, rows=10, table=pin))
    facets = ol.inputs[0].facets
    assert facets["version"].datasetVersion == "42" and facets["symlinks"].identifiers[0].name == "lake.t"
