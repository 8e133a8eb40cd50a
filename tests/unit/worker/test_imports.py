"""worker/imports.py: the modules ``VLLM_BATCH_SKIP_IMPORTS`` names are absent in the worker's process, bad names
are refused naming the variable, and a module the process already imported is left alone. (That the real worker
started on real vLLM loads neither scikit-learn nor scipy: tests/vllm/test_reliability_lifecycle.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.worker.imports import skip_unused_imports, skipped_imports
from tests.support import ROOT

ENV = "VLLM_BATCH_SKIP_IMPORTS"


def test_default_names_scikit_learn_and_scipy_and_none_names_nothing():
    default = ("sklearn", "scipy", "opentelemetry", "ray")
    assert skipped_imports({}) == default
    assert skipped_imports({ENV: "  "}) == default  # empty: the default, as every variable
    assert skipped_imports({ENV: "None"}) == ()
    assert skipped_imports({ENV: " a_b , c1,a_b"}) == ("a_b", "c1")


@pytest.mark.parametrize(
    "value",
    ["sklearn.metrics", "scipy,", "../x", "os;rm -rf /", "1abc", "<b>x</b>", "x" * 5000 + " y", "sklearn,,scipy"],
)
def test_a_value_that_is_not_module_names_is_refused_naming_the_variable(value):
    with pytest.raises(SpecError, match=ENV) as e:
        skipped_imports({ENV: value})
    assert len(str(e.value)) < 400  # a huge value is not echoed whole


@pytest.mark.parametrize("value", ["vllm", "scipy,torch", "airflow_provider_vllm", "numpy"])
def test_what_the_worker_needs_cannot_be_skipped(value):
    with pytest.raises(SpecError, match=f"{ENV}: .* is needed by the worker"):
        skipped_imports({ENV: value})


PROBE = """
import importlib.util, json, sys
import json as already  # imported before: left alone
from airflow_provider_vllm.worker.imports import skip_unused_imports
marked = skip_unused_imports()
spec_none = importlib.util.find_spec("fake_mod_x") is None
out = {"marked": marked, "json_kept": sys.modules["json"] is already, "spec": spec_none}
for name in ("fake_mod_x", "fake_mod_x.sub"):
    try:
        __import__(name)
        out[name] = "imported"
    except ModuleNotFoundError as e:
        out[name] = "absent"
print(json.dumps(out))
"""


def test_marked_modules_cannot_be_imported_and_look_not_installed():
    env = {**os.environ, ENV: "fake_mod_x,json", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out == {
        "marked": ["fake_mod_x"],
        "json_kept": True,
        "spec": True,
        "fake_mod_x": "absent",
        "fake_mod_x.sub": "absent",
    }


def test_the_worker_refuses_a_bad_value_before_it_reads_its_task(tmp_path):
    env = {**os.environ, ENV: "scipy;x", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.worker", "{}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    manifest = json.loads(p.stdout.splitlines()[-1])
    assert manifest["status"] == "failed" and manifest["terminal"] and ENV in manifest["message"]


def test_skip_unused_imports_in_this_process_leaves_what_is_imported(monkeypatch):
    monkeypatch.setenv(ENV, "json")
    assert skip_unused_imports() == [] and sys.modules["json"] is json
