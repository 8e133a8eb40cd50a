"""The worker's command line (``python -m airflow_provider_vllm.worker``) with forged shard tasks:
exit 2 before it reads or writes anything, the allow-list only from the Airflow side's environment.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from airflow_provider_vllm.core.allow_list import ALLOWED_PREFIXES_ENV
from airflow_provider_vllm.core.errors import EXIT_TERMINAL
from airflow_provider_vllm.core.spec import JobSpec
from tests.conftest import worker_environ
from tests.support import ROOT
from tests.support.data import shard_task
from tests.support.ledger import record_malicious
from tests.support.security import base_doc, prefixes

pytestmark = pytest.mark.reliability


# ---- forged shard tasks at the worker -------------------------------------------------
def test_worker_refuses_forged_shard_tasks(allowed, tmp_path):
    from airflow_provider_vllm.steps.plan.planner import plan_job

    spec = JobSpec.load(base_doc(allowed))
    plan = plan_job(spec)
    shard_id = plan.shards[0].shard_id
    good = shard_task(spec=spec, shard_id=shard_id).model_dump(mode="json")
    elsewhere = tmp_path / "elsewhere"
    forged = {
        "output outside the allow-list": ("io", "output_uri", str(elsewhere / "out"), "outside the allowed"),
        "input outside the allow-list": ("io", "input_uri", str(elsewhere), "outside the allowed"),
        "another spec on the planned prefix": ("prompt", "template", "Other: {text}", "made for another spec"),
        "jinja in the model": ("model", "name", "{{ 7*7 }}", "model.name"),
        "shell in a label": ("sampling", "structured", {"choice": ["a", "b; id"]}, "choice"),
        "history outside the allow-list": ("sharding", "history_uri", str(elsewhere / "h"), "sharding.history_uri"),
        "model path outside the allow-list": ("model", "name", str(elsewhere / "model"), "model.name"),
        "endpoint in storage options": (
            "io",
            "storage_options",
            {"endpoint_url": "http://127.0.0.1:9"},
            "io.storage_options.endpoint_url",
        ),
        "trust_remote_code": ("model", "trust_remote_code", True, "model.trust_remote_code"),
        "code-loading compilation backend": (
            "engine",
            "engine_kwargs",
            {"compilation_config": {"backend": "evil.module.fn"}},
            "compilation_config.backend",
        ),
    }
    env = {**worker_environ(), ALLOWED_PREFIXES_ENV: json.dumps(prefixes(allowed)), "PYTHONPATH": str(ROOT)}
    n = 0
    for name, (section, key, value, message) in forged.items():
        task = json.loads(json.dumps(good))
        task["spec"][section][key] = value
        p = subprocess.run(
            [sys.executable, "-m", "airflow_provider_vllm.worker", json.dumps(task)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == EXIT_TERMINAL, (name, p.stderr[-2000:])
        manifest = json.loads(p.stdout.strip().splitlines()[-1])
        assert manifest["terminal"] is True and message in manifest["message"], (name, manifest)
        n += 1
    assert not elsewhere.exists()  # nothing read or written outside
    assert not (allowed / "out" / "shards").exists()  # no chunk, no marker
    # the allow-list cannot be widened through the task: it is not a field of ShardTask
    task = json.loads(json.dumps(good))
    task["allowed_prefixes"] = ["/"]
    p = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.worker", json.dumps(task)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == EXIT_TERMINAL and "allowed_prefixes" in p.stdout
    record_malicious("forged_shard_task", n + 1, n + 1)


def test_worker_without_an_allow_list_from_airflow_refuses(allowed, tmp_path):
    from airflow_provider_vllm.steps.plan.planner import plan_job

    spec = JobSpec.load(base_doc(allowed))
    plan = plan_job(spec)
    task = shard_task(spec=spec, shard_id=plan.shards[0].shard_id).model_dump_json()
    env = {k: v for k, v in worker_environ().items() if not k.startswith("VLLM_BATCH_ALLOW")}
    env["PYTHONPATH"] = str(ROOT)
    for extra in ({}, {"VLLM_BATCH_ALLOWED_PREFIXES": "[]"}, {"VLLM_BATCH_ALLOW_ANY_LOCATION": "0"}):
        p = subprocess.run(
            [sys.executable, "-m", "airflow_provider_vllm.worker", task],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == EXIT_TERMINAL, p.stderr[-2000:]
        manifest = json.loads(p.stdout.strip().splitlines()[-1])
        assert "VLLM_BATCH_ALLOWED_PREFIXES" in manifest["message"] and manifest["terminal"] is True
    assert not (allowed / "out" / "shards").exists()
    record_malicious("worker_without_allow_list", 3, 3)


def test_a_worker_handed_the_deployments_key_refuses_to_start(allowed):
    """The deployment's own key where the worker key belongs (an old Secret), or beside it: code in the worker could
    seal any record with it. Exit 2 before a row is read, naming how to get the worker key; the key is not
    printed. With the worker key alone, the same task commits."""
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from tests.conftest import TEST_SIGNING_KEY

    spec = JobSpec.load(base_doc(allowed))
    plan = plan_job(spec)
    task = shard_task(spec=spec, shard_id=plan.shards[0].shard_id).model_dump_json()
    env = {**worker_environ(), ALLOWED_PREFIXES_ENV: json.dumps(prefixes(allowed)), "PYTHONPATH": str(ROOT)}
    refusals = {
        "not a worker key": {**env, "VLLM_BATCH_WORKER_KEY": TEST_SIGNING_KEY},
        "holds VLLM_BATCH_SIGNING_KEY": {**env, "VLLM_BATCH_SIGNING_KEY": TEST_SIGNING_KEY},
        "no worker key": {k: v for k, v in env.items() if k != "VLLM_BATCH_WORKER_KEY"},
    }
    for message, child_env in refusals.items():
        p = subprocess.run(
            [sys.executable, "-m", "airflow_provider_vllm.worker", task],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == EXIT_TERMINAL, (message, p.stderr[-2000:])
        manifest = json.loads(p.stdout.strip().splitlines()[-1])
        assert manifest["error"] == "SealError" and message in manifest["message"], manifest
        assert "airflow_provider_vllm.cli.worker_key" in manifest["message"]
        assert TEST_SIGNING_KEY not in p.stdout + p.stderr
        assert not (allowed / "out" / "shards").exists()
    record_malicious("worker_given_the_deployment_key", len(refusals), len(refusals))


@pytest.mark.parametrize(
    "name",
    [
        "AIRFLOW__VLLM_BATCH__SIGNING_KEY",  # the Airflow option itself (a pod's secret_env naming it)
        "airflow__vllm_batch__signing_key",
        "AIRFLOW__VLLM_BATCH__SIGNING_KEY_CMD",
        "vllm_batch_signing_key",
        "S3_STYLE_KEY",  # any other name: an envFrom Secret that holds the deployment's key
    ],
)
def test_a_worker_refuses_the_deployments_key_under_any_name(monkeypatch, name):
    """The deployment's key under another variable than VLLM_BATCH_SIGNING_KEY (the Airflow option, its _CMD form, a
    case variant, a Secret's key taken whole by envFrom) is refused as that one is: code in the worker could seal any
    record with it. Every such variable leaves the environment; the key is not in the message."""
    from airflow_provider_vllm.core.errors import SealError
    from airflow_provider_vllm.worker.__main__ import worker_keyring
    from tests.conftest import TEST_SIGNING_KEY

    for k, v in worker_environ().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("VLLM_BATCH_SIGNING_KEY", raising=False)
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", raising=False)
    value = "cat /secrets/key" if name.endswith("_CMD") else f"{TEST_SIGNING_KEY},{'x' * 40}"
    monkeypatch.setenv(name, value)
    with pytest.raises(SealError, match="deployment's signing key") as e:
        worker_keyring()
    assert TEST_SIGNING_KEY not in str(e.value) and name in str(e.value)
    import os

    assert name not in os.environ and "VLLM_BATCH_WORKER_KEY" not in os.environ


def test_a_worker_keeps_variables_that_hold_no_deployment_key(monkeypatch):
    """Other variables, also long ones and key-like names, do not stop the worker."""
    from airflow_provider_vllm.worker.__main__ import worker_keyring

    for k, v in worker_environ().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("VLLM_BATCH_SIGNING_KEY", raising=False)
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", raising=False)
    monkeypatch.setenv("HF_TOKEN", "h" * 48)
    monkeypatch.setenv("OTHER_SIGNING_KEY_HOLDER", "y" * 48)
    assert worker_keyring().worker
