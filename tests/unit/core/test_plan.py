"""The plan's records as they cross tasks: ``_plan.json`` (sealed), and the shard summary every mapped shard task
receives through XCom. Files and XComs written before these fields were typed must still validate, and a
sealed plan's seal must still verify (the seal covers the record's JSON as the model dumps it)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from airflow_provider_vllm.core.errors import SealError
from airflow_provider_vllm.core.formats.files import InputFile
from airflow_provider_vllm.core.plan import Evidence, Plan, ShardPlan, ShardSummary, Sizing
from airflow_provider_vllm.core.seal import Keyring
from tests.conftest import TEST_SIGNING_KEY

# A plan written and sealed by the planner while ``files`` and ``sizing`` were plain dicts (sized from a
# throughput history; input and output in fsspec's memory:// store), exactly as it lay in _plan.json.
OLD_PLAN = {
    "chars_per_token": 4.0,
    "config_hash": "72fd123a036fc0bb609cd2cc994cd40eff8455896b2dc68c593845e3f9cc4bad",
    "created_with": {"airflow-provider-vllm": "0.1.0", "pyarrow": "26.0.1"},
    "est_tokens": 0,
    "files": [{"path": "a.parquet", "size": 3293, "version": ""}],
    "fingerprint": "657b26706b71557206736e231e0a59aba3b37e514b52a55db887a3bc0e77402d",
    "format": "parquet",
    "input_root": "memory://old/in",
    "input_uri": "memory://old/in",
    "invalid_lines": 0,
    "long_row_tokens": None,
    "seal": {"kid": "400029c1108c928e", "mac": "597f1584fdd386465622b1344903b676b4a06712ddd67498bef7e037a3fb29bf"},
    "shards": [
        {
            "bucket": "all",
            "est_tokens": 0,
            "index": 0,
            "rows": 500,
            "segments": [{"count": 500, "file": 0, "start": 0}],
            "shard_id": "shard-00000-61801a38",
        }
    ],
    "sizing": {
        "engine_start_s": 60.0,
        "est_infer_s": 16.7,
        "evidence": {
            "basis": "config",
            "completion_tokens_per_row": 2.0,
            "engine_start_s": 60.0,
            "hardware": "1x NVIDIA H200",
            "infer_s": 333.3333,
            "prompt_tokens_per_row": 150.0,
            "records": 1,
            "rows": 10000,
            "rows_per_s": 30.0,
            "tokens_per_s": 4560.0,
        },
        "shards": 1,
        "target_rows": 500,
        "target_s": 600.0,
        "target_tokens": None,
    },
    "spec_hash": "f6e5e241336f2507bcab2b9b457279b307a328d65d9553624a8c8954ad8df86a",
    "total_rows": 500,
    "version": 2,
}
OLD_PLAN_OUTPUT = "memory://old/out"

# Items of the plan task's return value as XCom held them before the shard summary was a model.
OLD_XCOM = [
    {"shard_id": "shard-00000-b96aaac1", "index": 0, "rows": 16, "est_tokens": 75, "bucket": "short"},
    {
        "shard_id": "shard-00001-c0b5ea0a",
        "index": 1,
        "rows": 400,
        "est_tokens": 9000,
        "bucket": "all",
        "name": "shard 1/6 rows 0-399",
    },
]


def old_plan_file() -> bytes:
    return json.dumps(json.loads(json.dumps(OLD_PLAN)), indent=1, sort_keys=True, ensure_ascii=False).encode()


def test_a_plan_sealed_before_files_and_sizing_were_typed_still_verifies_and_writes_back_the_same_bytes():
    plan = Plan.model_validate_json(old_plan_file())
    assert plan.files == [InputFile(path="a.parquet", size=3293, version="")]
    assert isinstance(plan.sizing, Sizing) and isinstance(plan.sizing.evidence, Evidence)
    assert plan.sizing.evidence.basis == "config" and plan.sizing.target_rows == 500
    plan.verify(Keyring.from_text(TEST_SIGNING_KEY), OLD_PLAN_OUTPUT)
    assert plan.dump_json() == old_plan_file()


def test_a_changed_figure_of_an_old_plan_breaks_its_seal():
    doc = json.loads(json.dumps(OLD_PLAN))
    doc["sizing"]["evidence"]["rows_per_s"] = 3000.0
    with pytest.raises(SealError, match="does not match its content"):
        Plan.model_validate(doc).verify(Keyring.from_text(TEST_SIGNING_KEY), OLD_PLAN_OUTPUT)


@pytest.mark.parametrize(
    "path, value",
    [
        (("files", 0, "size"), -1),
        (("files", 0, "etag"), "x"),
        (("sizing", "evidence", "basis"), "guess"),
        (("sizing", "evidence", "extra"), 1),
        (("sizing", "target_s"), "soon"),
    ],
)
def test_a_plan_whose_typed_fields_are_wrong_is_refused_naming_the_field(path, value):
    doc = json.loads(json.dumps(OLD_PLAN))
    at = doc
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    with pytest.raises(ValidationError) as e:
        Plan.model_validate(doc)
    assert ".".join(str(p) for p in path[:-1]) in ".".join(str(x) for x in e.value.errors()[0]["loc"])


def test_evidence_rounded_keeps_ints_and_none():
    ev = Evidence(
        basis="model",
        hardware="1x NVIDIA H200",
        records=2,
        rows=10,
        infer_s=1 / 3,
        rows_per_s=30.000049,
        tokens_per_s=2.0,
        prompt_tokens_per_row=1.23456,
        completion_tokens_per_row=0.0,
        engine_start_s=None,
    )
    r = ev.rounded()
    assert (r.infer_s, r.rows_per_s, r.prompt_tokens_per_row) == (0.3333, 30.0, 1.2346)
    assert (r.records, r.rows, r.engine_start_s) == (2, 10, None) and ev.infer_s == 1 / 3


@pytest.mark.parametrize("item", OLD_XCOM)
def test_the_shard_summaries_of_running_dags_still_validate_and_dump_the_same_json(item):
    assert ShardSummary.model_validate(item).dump() == item
    assert ShardSummary.model_validate_json(json.dumps(item)).dump() == item


@pytest.mark.parametrize(
    "change",
    [{"spec": {}}, {"bucket": "medium"}, {"rows": -1}, {"shard_id": "shard-1"}, {"index": "first"}],
)
def test_a_shard_summary_refuses_unknown_fields_and_bad_values(change):
    with pytest.raises(ValidationError):
        ShardSummary.model_validate({**OLD_XCOM[0], **change})


def test_a_planned_shard_summarises_to_the_old_shape():
    shard = ShardPlan(shard_id="shard-00000-b96aaac1", index=0, bucket="short", rows=16, est_tokens=75, segments=[])
    assert shard.summary().dump() == OLD_XCOM[0]


def test_a_plans_identity_is_its_seal_and_sha256_and_an_unsealed_plan_has_none():
    """``PlanRef``: what the plan task hands merge (and, per shard, ``ShardSummary``) to name the sealed plan."""
    from airflow_provider_vllm.core.errors import CommitError
    from airflow_provider_vllm.core.plan import PlanRef, plan_sha256

    plan = Plan.model_validate_json(old_plan_file())
    ref = plan.ref()
    assert ref == PlanRef(plan_mac=OLD_PLAN["seal"]["mac"], plan_sha256=plan_sha256(plan))
    assert ref.dump() == {"plan_mac": OLD_PLAN["seal"]["mac"], "plan_sha256": plan_sha256(plan)}
    assert ref.describe() == f"seal {ref.plan_mac[:12]}, sha256 {ref.plan_sha256[:12]}"
    with pytest.raises(CommitError, match="carries no seal"):
        plan.model_copy(update={"seal": None}).ref()
    with pytest.raises(ValidationError):
        PlanRef(plan_mac="a" * 64, plan_sha256="not hex")


def test_current_plan_ref_takes_the_folders_sealed_plan_checking_its_seal(tmp_path):
    """For a merge run by hand (no plan task): the identity of whatever sealed plan ``_plan.json`` holds, its seal
    checked; a plan this deployment did not seal is refused."""
    from airflow_provider_vllm.core.plan import PLAN_FILE, current_plan_ref
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from tests.support.data import make_spec, write_parquet

    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["one", "two"])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    plan = plan_job(spec)
    assert current_plan_ref(spec) == plan.ref()
    doc = json.loads((tmp_path / "out" / PLAN_FILE).read_bytes())
    doc["total_rows"] = 3
    (tmp_path / "out" / PLAN_FILE).write_text(json.dumps(doc))
    with pytest.raises(SealError):
        current_plan_ref(spec)
