"""Secrets from the worker's environment never reach its logs, whoever writes them.

vLLM configures its own ``vllm`` logger tree (own handler, ``propagate=False``) and its engine
core runs in child processes whose stdout/stderr the task log captures; native code prints
without Python logging at all. Each of these paths is tried in a real worker process, and on
real vLLM CPU with the secret in the model path, which vLLM's engine core echoes in its
"Initializing a V1 LLM engine ... model=..." line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.ledger import record_malicious

pytestmark = pytest.mark.reliability

from tests.support import ROOT  # noqa: E402

SECRET = "s3cr3t-Tok-9f8e7d6c5b4a"

SCRIPT = r"""
import io, logging, multiprocessing, os, subprocess, sys
from airflow_provider_vllm.worker import redact
from airflow_provider_vllm.worker.exits import emit, exit_hard
secret = os.environ["MODEL_STORE_TOKEN"]
redact.guard_streams()
logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")
redact.install()
# a logger configured the way vLLM configures its own: own handler, not propagating to root
own = io.StringIO()
vl = logging.getLogger("vllm.engine")
vl.propagate = False
vl.addHandler(logging.StreamHandler(own))
vl.addHandler(logging.StreamHandler(sys.stderr))
vl.warning("Initializing engine with config: model='/models/%s'", secret)
try:
    raise RuntimeError("load failed for " + secret)
except RuntimeError:
    vl.exception("engine failed")
logging.getLogger("airflow_provider_vllm.worker").error("root path %s", secret)
# an engine process started with spawn (no inherited logging set-up) and native output
ctx = multiprocessing.get_context("spawn")
p = ctx.Process(target=print, args=("spawned child prints " + secret,), kwargs={"flush": True})
p.start(); p.join()
subprocess.run(["sh", "-c", 'echo "native stderr $MODEL_STORE_TOKEN" >&2; printf "no newline $MODEL_STORE_TOKEN"'])
os.write(2, ("\rprogress " + secret + "\r").encode())
print("python stdout " + secret, flush=True)
sys.stderr.write("vllm-style handler got (hex): " + own.getvalue().encode().hex() + "\n")  # hex: past the pipe
emit({"status": "failed", "error": "Stalled", "message": "last line", "terminal": False})
exit_hard(75)
"""


def test_every_output_path_of_the_worker_and_its_children_is_redacted_and_nothing_is_lost(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MODEL_STORE_TOKEN": SECRET}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 75, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert SECRET not in out, out
    for line in (
        "Initializing engine with config: model='/models/***'",
        "load failed for ***",
        "root path ***",
        "spawned child prints ***",
        "native stderr ***",
        "no newline ***",
        "progress ***",
        "python stdout ***",
    ):
        assert line in out, (line, out)
    assert json.loads(p.stdout.splitlines()[-1]) == {
        "error": "Stalled",
        "message": "last line",
        "status": "failed",
        "terminal": False,
    }
    # what the logger's own handler received was redacted before any stream (the record factory)
    own = bytes.fromhex(p.stderr.split("vllm-style handler got (hex): ")[1].split()[0]).decode()
    assert "model='/models/***'" in own and "load failed for ***" in own and SECRET not in own
    record_malicious("secret_in_child_or_vllm_logger_output", 7, 7)


def test_without_secrets_the_streams_are_left_alone():
    from airflow_provider_vllm.worker import redact

    assert redact.guard_streams([]) is False and not redact._PUMPS


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_real_vllm_engine_core_output_never_shows_a_secret_from_the_environment(tiny_run):
    """The model path holds the secret (a per-tenant model store token in its folder name); vLLM's
    engine core (started with ``spawn`` here, so it inherits no Python logging set-up of the
    worker) logs that path in its "Initializing a V1 LLM engine" line. The worker run is the shared
    ``tiny_run`` (tests/vllm/conftest.py): the model behind a link named SECRET, MODEL_STORE_TOKEN=SECRET
    and VLLM_WORKER_MULTIPROC_METHOD=spawn in its environment."""
    assert SECRET in tiny_run.model and tiny_run.spec.model.name == tiny_run.model
    p = tiny_run.proc
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "Initializing a V1 LLM engine" in out  # the engine core's line is in the captured output
    engine_lines = [x for x in out.splitlines() if "Initializing a V1 LLM engine" in x]
    assert all("models/***" in x for x in engine_lines), engine_lines
    assert SECRET not in out
    record_malicious("secret_in_vllm_engine_core_log", 1, 1)
