"""Secrets in the worker's environment never reach its log records or its printed manifest."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from airflow_provider_vllm.core.errors import EXIT_TERMINAL
from tests.conftest import worker_environ
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


def worker_cli(task: dict, env: dict) -> subprocess.CompletedProcess:
    """The worker CLI run on ``task`` in a process of its own, with ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.worker", json.dumps(task)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_worker_cli_never_prints_a_secret_from_its_environment(allowed):
    """A secret pasted into a param by mistake: the refusal names the field, the secret is masked."""
    token = "hf_SENTINELpastedQ8z2"
    doc = base_doc(allowed)
    task = {"spec": doc, "shard_id": "shard-00000-0123abcd", "plan_mac": "0" * 64, "plan_sha256": "0" * 64}
    task["spec"]["model"]["name"] = f"org/model;{token}"
    env = {**worker_environ(), "HF_TOKEN": token, "PYTHONPATH": str(ROOT)}
    p = worker_cli(task, env)
    assert p.returncode == EXIT_TERMINAL
    assert "model.name" in p.stdout + p.stderr and "***" in p.stderr
    assert token not in p.stdout + p.stderr
    record_malicious("secret_in_param_logged", 1, 1)


KILL_AFTER_SETTLE = r"""
import os, signal, sys, threading
from airflow_provider_vllm.worker import redact
redact.guard_streams(["s3cr3t-Tok-9f8e7d6c"])
def hog():  # a thread that keeps the GIL busy, as the engine's threads do
    x = 0
    while True:
        x += 1
threading.Thread(target=hog, daemon=True).start()
for i in range(200):
    sys.stderr.write(f"line {i} s3cr3t-Tok-9f8e7d6c\n")
sys.stderr.write("the last line before the kill")  # no newline: a partial line is passed on too
sys.stderr.flush()
redact.settle()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_settle_passes_on_everything_written_before_a_sigkill(tmp_path):
    """The fault harness's SIGKILL comes right after settle(): every byte written before it reaches the log,
    redacted, even while another thread holds the GIL (an empty pipe is not enough: the pump may hold the
    last bytes it read)."""
    for n in range(10):
        err = tmp_path / f"{n}.err"
        with open(err, "w") as e:
            p = subprocess.run([sys.executable, "-c", KILL_AFTER_SETTLE], stderr=e, cwd=ROOT, timeout=60)
        assert p.returncode == -9
        text = err.read_text()
        assert text.endswith("the last line before the kill"), (n, text[-200:])
        assert "line 199 ***" in text and "s3cr3t" not in text


# ---- credentials in URLs -------------------------------------------------------------------
URL_SECRETS = [
    "http://metrics:PUSHs3cr3t@pushgateway:9091",  # a push gateway's basic auth, written into the URL
    "https://proxy-user:PROXYs3cr3t@proxy.corp:3128",
    "s3://AKIAKEY:wJalr/s3cr3t+K7MD@bucket/x",  # an AWS secret key holds '/' half of the time
    "https://bucket.s3.amazonaws.com/x?X-Amz-Credential=AKIAKEY&X-Amz-Signature=SIGs3cr3t",
    "https://acct.blob.core.windows.net/c/x?sv=2024&sig=SASs3cr3t",
]


def test_credentials_in_any_url_are_masked_in_the_workers_log_records():
    """Until 2026-12 only the values of secret-named variables were masked: a push gateway URL with basic auth
    (``VLLM_BATCH_METRICS_PUSHGATEWAY``) was logged whole on every failed export, as any URL with credentials
    that a library put into a message."""
    from airflow_provider_vllm.worker.metrics import MetricsConfig, ShardMetrics
    from airflow_provider_vllm.worker.redact import RedactSecrets

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(logging.Formatter("%(message)s").format(r))
    handler.addFilter(RedactSecrets([]))  # no secret-named variable at all
    log = logging.getLogger("airflow_provider_vllm.worker")
    log.addHandler(handler)
    try:
        for url in URL_SECRETS:
            log.warning("fetching %s", url)
        try:
            raise OSError(f"cannot reach {URL_SECRETS[1]}")
        except OSError:
            log.exception("failed")
        push = MetricsConfig(pushgateway="http://metrics:PUSHs3cr3t@127.0.0.1:9", push_timeout_s=1)
        ShardMetrics(push, batch_job="j", run="r", shard_id="s", attempt_id="a").export()  # nothing listens: logged
    finally:
        log.removeHandler(handler)
    text = "\n".join(records)
    assert "metrics push to http://***@127.0.0.1:9 failed" in text, text
    assert "s3cr3t" not in text and "AKIAKEY" not in text, text
    assert "pushgateway:9091" in text and "proxy.corp:3128" in text and "bucket/x" in text  # the rest stays
    record_malicious("url_credentials_logged", len(URL_SECRETS) + 2, len(URL_SECRETS) + 2)


PRINT_URLS = r"""
import json, subprocess, sys
from airflow_provider_vllm.worker import redact
redact.guard_streams(["unrelated-Tok-9f8e7d6c"])
urls = json.loads(sys.argv[1])
for u in urls:
    print("native:", u, flush=True)
subprocess.run([sys.executable, "-c", "import sys; print('child: ' + sys.argv[1], file=sys.stderr)", urls[0]])
print(json.dumps({"status": "committed", "uri": "s3://bucket/out", "who": "a@b", "n": "x=1"}), flush=True)
redact.drain()
"""


def test_credentials_in_any_url_are_masked_in_what_the_worker_and_its_children_print():
    p = subprocess.run(
        [sys.executable, "-c", PRINT_URLS, json.dumps(URL_SECRETS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "s3cr3t" not in p.stdout + p.stderr and "AKIAKEY" not in p.stdout, p.stdout + p.stderr
    assert p.stdout.count("native: ") == len(URL_SECRETS) and "child: http://***@pushgateway:9091" in p.stderr
    # the manifest line keeps its shape: nothing spans a quote
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {
        "status": "committed",
        "uri": "s3://bucket/out",
        "who": "a@b",
        "n": "x=1",
    }


# ---- secrets the deployment named, whatever their names ------------------------------------
DEPLOYMENT_SECRETS = {  # names that say nothing, as a deployment's Secret references may be named
    "OPENAI_KEY2": "sk-SENTINEL-openai-4f2a",
    "DB_PASS": "db-SENTINEL-pass-77",
    "MY_CREDS": "creds-SENTINEL-9c1e",
}


def test_values_of_variables_the_deployment_set_from_secrets_are_masked_whatever_their_names():
    """Until 2026-12 only values of variables whose names matched ``SECRET_NAME`` were masked: a Secret mounted as
    ``DB_PASS`` reached the log whole. The deployment lists them in ``VLLM_BATCH_MASKED_ENV``."""
    from airflow_provider_vllm.worker.redact import RedactSecrets, secret_values

    env = {**DEPLOYMENT_SECRETS, "VLLM_BATCH_MASKED_ENV": "OPENAI_KEY2, DB_PASS,MY_CREDS,NOT_SET", "HOME": "/root"}
    masker = RedactSecrets(secret_values(env))
    line = " ".join(f"{k}={v}" for k, v in DEPLOYMENT_SECRETS.items())
    assert masker.redact(line) == "OPENAI_KEY2=*** DB_PASS=*** MY_CREDS=***"
    # the list's own value (names) is not a secret: the names stay readable
    assert masker.redact("VLLM_BATCH_MASKED_ENV=OPENAI_KEY2, DB_PASS,MY_CREDS") == (
        "VLLM_BATCH_MASKED_ENV=OPENAI_KEY2, DB_PASS,MY_CREDS"
    )
    record_malicious("deployment_secret_odd_name_logged", len(DEPLOYMENT_SECRETS), len(DEPLOYMENT_SECRETS))


def test_a_secret_is_masked_in_every_form_it_is_printed_in_and_short_ones_do_not_wreck_the_log(caplog):
    """Attacks on the masker: a multi-line value printed line by line (or cut into pieces by the pipe's reads),
    one with quotes, backslashes and non-ASCII as JSON (ASCII-escaped or not) and ``repr`` show it, regex
    metacharacters, a secret inside ordinary words; and values too short to mask (``a``, ``secret``) are left
    alone, named (never shown) in a warning."""
    import json as _json

    from airflow_provider_vllm.worker import redact as r

    pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\nSENTINELpemLine2xyzABCDEFGH\n-----END"
    odd = 'p"a\\ss.*+?(wörd)[x]$^-SENTINEL'
    env = {
        "VLLM_BATCH_MASKED_ENV": "PEM_FILE,ODD,ONE,WORD,EMPTY,INSIDE",
        "PEM_FILE": pem,
        "ODD": odd,
        "ONE": "a",
        "WORD": "secret",
        "EMPTY": "",
        "INSIDE": "interest",
    }
    masker = r.RedactSecrets(r.secret_values(env))
    for shown in (
        pem,
        pem.splitlines()[1],
        pem.splitlines()[2],
        _json.dumps(pem),
        odd,
        _json.dumps(odd),
        _json.dumps(odd, ensure_ascii=False),
        repr(odd),
        f"error: {odd!r} refused",
    ):
        out = masker.redact(shown)
        assert "SENTINEL" not in out and "MIIEvQ" not in out, (shown, out)
    # a JSON line keeps its shape when a value in it is masked
    line = _json.dumps({"message": f"bad {odd}", "n": 1})
    assert _json.loads(masker.redact(line)) == {"message": "bad ***", "n": 1}
    # bounded: 'a' and 'secret' are not masked (they would turn every such word into ***); a secret inside a
    # longer word is masked there too
    assert masker.redact("a secret of interesting data") == "a secret of ***ing data"
    assert r.too_short(env) == ["ONE", "WORD"]
    with caplog.at_level(logging.WARNING, logger="airflow_provider_vllm.worker.redact"):
        try:
            r.install(env)
        finally:
            r._INSTALLED = None
            logging.setLogRecordFactory(logging.LogRecord)
            for h in logging.getLogger().handlers:
                h.filters.clear()
    (warning,) = [m for m in caplog.messages if "not masked" in m]
    assert "ONE" in warning and "WORD" in warning and "'secret'" not in warning
    record_malicious("secret_shapes_logged", 8, 8)


def test_worker_cli_masks_a_secret_the_deployment_named_in_its_log_and_manifest(allowed, tmp_path):
    """The real worker process: a Secret mounted as ``DB_PASS`` that ends up in a refusal (a param pasted by
    mistake) is masked on stderr, stdout and in the XCom file (which does not pass through the redacted stdout)."""
    token = DEPLOYMENT_SECRETS["DB_PASS"]
    doc = base_doc(allowed)
    task = {"spec": doc, "shard_id": "shard-00000-0123abcd", "plan_mac": "0" * 64, "plan_sha256": "0" * 64}
    task["spec"]["model"]["name"] = f"org/model;{token}"
    xcom = tmp_path / "xcom"
    xcom.mkdir()
    env = {
        **worker_environ(),
        "DB_PASS": token,
        "VLLM_BATCH_MASKED_ENV": "DB_PASS",
        "VLLM_BATCH_XCOM_DIR": str(xcom),
        "PYTHONPATH": str(ROOT),
    }
    p = worker_cli(task, env)
    assert p.returncode == EXIT_TERMINAL
    written = (xcom / "return.json").read_text()
    assert "model.name" in p.stdout + p.stderr and "***" in p.stderr and "***" in written
    assert token not in p.stdout + p.stderr + written
    record_malicious("deployment_secret_in_param_logged", 1, 1)


def test_the_manifest_file_is_masked_too(monkeypatch, tmp_path):
    """``emit`` writes the XCom file directly (the redacted stdout never sees it): a secret in the manifest, as
    JSON escapes it, is masked there too."""
    from airflow_provider_vllm.core.records import FailureManifest
    from airflow_provider_vllm.worker.exits import emit

    secret = 'creds-"SENTINEL"-ü-9c1e'
    monkeypatch.setenv("MY_CREDS", secret)
    monkeypatch.setenv("VLLM_BATCH_MASKED_ENV", "MY_CREDS")
    monkeypatch.setenv("VLLM_BATCH_XCOM_DIR", str(tmp_path))
    emit(FailureManifest(status="failed", error="X", message=f"boom {secret}", terminal=False))
    written = json.loads((tmp_path / "return.json").read_text())
    assert written["message"] == "boom ***"


def test_a_key_inside_a_json_credential_and_a_secret_in_a_url_are_masked():
    """A service account key file in one variable (``GCP_SA``, listed by the deployment) holds a PEM key as JSON
    escapes it (``\\n`` between its lines): a library that prints the key it decoded prints real lines, which the
    value as a whole never matched; and a password percent-encoded into a URL's query or path is not the value."""
    from airflow_provider_vllm.worker.redact import RedactSecrets, secret_values

    pem = (
        "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0SENTINEL\nAASCBKcwggSjAgEAAoIBSENTINEL\n"
        "-----END PRIVATE KEY-----\n"
    )
    sa = json.dumps({"type": "service_account", "private_key": pem, "client_email": "w@p.iam.gserviceaccount.com"})
    password = "p@ss/w0rd SENTINEL?"
    env = {"VLLM_BATCH_MASKED_ENV": "GCP_SA,DB_PASS", "GCP_SA": sa, "DB_PASS": password}
    masker = RedactSecrets(secret_values(env))
    out = masker.redact(f"loaded key:\n{pem}") + masker.redact(
        "GET https://db.internal/login/p%40ss%2Fw0rd%20SENTINEL%3F"
    )
    assert "SENTINEL" not in out, out
    assert "loaded key:" in out and "https://db.internal/login/***" in out
    # JSON's own words are left alone: the manifest's syntax is never masked
    assert masker.redact('{"type": "committed"}') == '{"type": "committed"}'


def test_the_keys_of_a_secret_taken_whole_are_masked_whatever_their_names(tmp_path):
    """A Secret the pod takes whole (``env_from_secrets``): its keys are the files of its mounted folder
    (``VLLM_BATCH_MASKED_ENV_DIRS``); Kubernetes' own entries (``..data``) are no names; a folder that is not there
    masks nothing more and breaks nothing."""
    from airflow_provider_vllm.worker.redact import RedactSecrets, secret_values

    folder = tmp_path / "0"
    folder.mkdir()
    for name in ("DB_URL", "VENDOR_KEY2", "..data"):
        (folder / name).write_text("")
    env = {
        "VLLM_BATCH_MASKED_ENV_DIRS": f"{folder},{tmp_path / 'missing'}",
        "DB_URL": "postgres-SENTINEL-db-host",
        "VENDOR_KEY2": "vendor-SENTINEL-2",
        "PATH": "/usr/bin:/bin",
    }
    masker = RedactSecrets(secret_values(env))
    assert masker.redact("db postgres-SENTINEL-db-host vendor vendor-SENTINEL-2 path /usr/bin:/bin") == (
        "db *** vendor *** path /usr/bin:/bin"
    )


def test_the_manifest_file_keeps_the_attempt_id_that_merge_matches(monkeypatch, tmp_path):
    """The attempt id carries the host (the pod's name): a value the deployment set from a Secret that also occurs in
    it (a team or cluster name in a config Secret taken whole) must not change the id in the XCom file, which merge
    matches against the shard's commit marker (a masked id fails merge, and every rerun of the shard alike). Only the
    free text of a failure is masked there."""
    from airflow_provider_vllm.core.records import WorkerManifest
    from airflow_provider_vllm.worker import redact as r
    from airflow_provider_vllm.worker.exits import emit

    monkeypatch.setattr(r, "_INSTALLED", None)
    monkeypatch.setenv("TEAM", "ticket-triage")
    monkeypatch.setenv("VLLM_BATCH_MASKED_ENV", "TEAM")
    monkeypatch.setenv("VLLM_BATCH_XCOM_DIR", str(tmp_path))
    attempt = "a20261205T235959-ticket-triage-shards-9-41-c0ffee"
    emit(
        WorkerManifest(
            status="committed", shard_id="shard-00000-0123abcd", attempt_id=attempt, rows=3, ok_rows=3, error_rows=0
        )
    )
    written = json.loads((tmp_path / "return.json").read_text())
    assert written["attempt_id"] == attempt and written["shard_id"] == "shard-00000-0123abcd"
