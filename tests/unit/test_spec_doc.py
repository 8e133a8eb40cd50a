"""docs/spec.md is generated from JobSpec (scripts/spec_doc.py) and equal to what the code says."""

from __future__ import annotations

import importlib.util

import pytest
from pydantic import BaseModel

from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import DEPLOYMENT_OWNED
from tests.support import ROOT


@pytest.fixture(scope="module")
def spec_doc():
    spec = importlib.util.spec_from_file_location("spec_doc", ROOT / "scripts" / "spec_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_spec_md_is_the_generated_reference(spec_doc):
    assert (ROOT / "docs" / "spec.md").read_text() == spec_doc.render(), (
        "docs/spec.md is out of date: run python scripts/spec_doc.py (make spec-doc)"
    )


def _all_fields(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        yield path, info
        for arg in [info.annotation, *getattr(info.annotation, "__args__", ())]:
            for inner in [arg, *getattr(arg, "__args__", ())]:
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    yield from _all_fields(inner, path + ".")


def test_every_field_is_in_the_reference_with_a_description(spec_doc):
    text = spec_doc.render()
    for path, info in _all_fields(JobSpec):
        section = isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
        assert section or info.description, f"{path}: add Field(description=...) (docs/spec.md shows it)"
    for path in ("model.name", "sampling.structured.choice", "kubernetes.schedule_timeout_s", "qa.fail_error_rate"):
        assert f"| `{path}` |" in text, path


def test_who_may_set_a_field_follows_the_trust_model(spec_doc):
    for path in DEPLOYMENT_OWNED:
        assert "never a trigger" in spec_doc.who(path), path
    assert spec_doc.who("io.input_uri") == "DAG file, Variable, trigger (`input_uri`), inside `allowed_uri_prefixes`"
    assert spec_doc.who("sampling.max_tokens") == "DAG file, Variable, trigger (`max_tokens`)"
    assert "allow_remote_code" in spec_doc.who("model.trust_remote_code")
    assert spec_doc.who("kubernetes.secret_env.<NAME>.key") == spec_doc.who("kubernetes.secret_env")
    # the plan task reads the Asset's events only when vllm_batch_job saw it in the DAG file's dict spec
    assert spec_doc.who("changes.previous_published").startswith("DAG file: `true` in the dict spec")
    # ... and, as the churn gate's baseline, a Variable or trigger cannot turn it off either (core/qa_gates.py)
    assert "neither on (the plan fails) nor off" in spec_doc.who("changes.previous_published")
    # what decides publication: a Variable or trigger only tightens it
    for path in ("qa.fail_accuracy_below", "qa.fail_churn_rate", "qa.min_labelled", "qa.reference.golden_uri"):
        assert spec_doc.who(path).startswith("DAG file; Variable, trigger: "), path
        assert "a Variable with `qa_settings_from_variables`, a trigger never" in spec_doc.who(path), path
    assert "or lower, stricter" in spec_doc.who("qa.fail_churn_rate")
    assert "or higher, stricter" in spec_doc.who("qa.fail_accuracy_below")
    assert spec_doc.who("changes.previous_uri").startswith("DAG file; Variable, trigger (`compare_with`): added where")
    assert spec_doc.who("qa.seed") == "DAG file, Variable, trigger"
