"""Secrets in the worker's environment never reach its log records or its printed manifest."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from airflow_provider_vllm.core.errors import EXIT_TERMINAL
from tests.support import ROOT
from tests.support.ledger import record_malicious
from tests.support.security import base_doc

pytestmark = pytest.mark.reliability


# ---- secrets never logged ---------------------------------------------------------------
def test_worker_log_redacts_secret_environment_values(tmp_path):
    from airflow_provider_vllm.worker.redact import RedactSecrets, secret_values

    env = {
        "HF_TOKEN": "hf_SENTINEL_abc123",
        "AWS_SECRET_ACCESS_KEY": "aws-SENTINEL-xyz789",
        "HOME": "/root",
        "SHORT_TOKEN": "abc",
    }
    assert secret_values(env) == sorted(["hf_SENTINEL_abc123", "aws-SENTINEL-xyz789"], key=len, reverse=True)
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(logging.Formatter("%(message)s").format(r))
    handler.addFilter(RedactSecrets(secret_values(env)))
    log = logging.getLogger("test.redact")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.error("token %s and key %s", "hf_SENTINEL_abc123", "aws-SENTINEL-xyz789")
        try:
            raise RuntimeError("boom aws-SENTINEL-xyz789")
        except RuntimeError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    text = "\n".join(records)
    assert "SENTINEL" not in text and text.count("***") >= 3


def test_worker_cli_never_prints_a_secret_from_its_environment(allowed):
    """A secret pasted into a param by mistake: the refusal names the field, the secret is masked."""
    token = "hf_SENTINELpastedQ8z2"
    doc = base_doc(allowed)
    task = {"spec": doc, "shard_id": "shard-00000-0123abcd"}
    task["spec"]["model"]["name"] = f"org/model;{token}"
    env = {**os.environ, "HF_TOKEN": token, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.worker", json.dumps(task)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == EXIT_TERMINAL
    assert "model.name" in p.stdout + p.stderr and "***" in p.stderr
    assert token not in p.stdout + p.stderr
    record_malicious("secret_in_param_logged", 1, 1)
