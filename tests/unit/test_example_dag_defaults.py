"""The example DAGs (the wheel ships them as example_dags) stand on the product alone."""

from __future__ import annotations

import ast
import importlib.util

import jinja2
import pytest

from tests.support import ROOT

DAGS = ROOT / "dags"


def _defaults():
    spec = importlib.util.spec_from_file_location("vllm_dag_defaults_under_test", DAGS / "vllm_dag_defaults.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_example_dag_imports_what_the_wheel_leaves_out():
    imported = set()
    for path in DAGS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {(path.name, node.module)}
            elif isinstance(node, ast.Import):
                imported |= {(path.name, a.name) for a in node.names}
    assert imported and not [(f, m) for f, m in imported if m.startswith("airflow_provider_vllm.testing")]


@pytest.mark.parametrize(
    "template, variable", [("CHAT_MODEL", "vllm_batch_model"), ("EMBEDDING_MODEL", "vllm_batch_embedding_model")]
)
def test_a_model_variable_renders_and_an_unset_one_fails_naming_it(template, variable):
    d = _defaults()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    tpl = env.from_string(getattr(d, template))
    assert tpl.render(var={"value": {variable: "/models/m"}}, **d.TEMPLATE_MACROS) == "/models/m"
    for unset in ({}, {variable: ""}):
        with pytest.raises(ValueError, match=f"Airflow Variable '{variable}'.*AIRFLOW_VAR_{variable.upper()}"):
            tpl.render(var={"value": unset}, **d.TEMPLATE_MACROS)
