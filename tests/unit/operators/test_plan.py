"""The plan operator's spec layering: spec < deployment overrides < trigger params (no Airflow run needed)."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.operators.plan import VllmPlanOperator

pytestmark = pytest.mark.unit

SPEC = {
    "model": {"name": "m", "revision": "r"},
    "io": {"input_uri": "/in", "output_uri": "/out"},
    "cache": {"uri": "/cache"},
    "sharding": {"target_rows": 100},
}


def op(overrides, param_overrides=()):
    return VllmPlanOperator(task_id="plan", spec=SPEC, overrides=overrides, param_overrides=param_overrides)


def test_a_null_override_turns_a_field_off():
    assert op({"cache.uri": None}).build_spec({}).cache.uri is None
    assert op({"cache": {"uri": None}}).build_spec({}).cache.uri is None
    assert op({}).build_spec({}).cache.uri == "/cache"


def test_an_empty_form_field_keeps_the_override():
    o = op({"sharding.target_rows": 7}, param_overrides=["shard_rows"])
    assert o.build_spec({"shard_rows": None}).sharding.target_rows == 7
    assert o.build_spec({"shard_rows": 9}).sharding.target_rows == 9
