"""Shared real-vLLM runs of the vllm tier.

An engine start is what a test here costs most (tests/conftest.py has the figures: by default the engine
runs in the worker's process without a compiler; ENGINE_PROCESSES, the production layout, costs more).
Tests that need the same job on the same model share one run through a session fixture here, each
asserting its own part of it; a test that needs its own job (a fault, another model or setting) still
starts its own engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from airflow_provider_vllm.testing.local_models import default_cache_dir, make_tiny_llama, prepare_smollm2
from tests.conftest import ENGINE_PROCESSES, worker_environ
from tests.support.data import shard_task


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(make_tiny_llama(default_cache_dir() / "tiny-llama"))


@pytest.fixture(scope="session")
def smollm2() -> str:
    return str(prepare_smollm2(default_cache_dir() / "smollm2-135m-instruct"))


@dataclass
class TinyRun:
    """One worker process on the tiny model, as captured right after it exited."""

    root: Path  # tmp folder: in/, out/, prom/, models/
    model: str  # the model path the spec names (a link whose name holds SECRET)
    spec: object  # JobSpec
    shard_id: str
    codes: dict[str, str]  # planted error rows -> error code
    proc: subprocess.CompletedProcess
    marker: dict  # the shard's commit marker
    prom: str  # the metrics text file it wrote
    pushed: list[tuple[str, str, str]]  # (method, path, body) the push gateway received


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_model) -> TinyRun:
    """The tiny model's classification job over 80 rows with planted bad rows, run once by the worker
    CLI for three tests: the planted rows and the rerun (test_worker_vllm), metrics and resource peaks
    (test_metrics_vllm), and no secret from the environment in the output although vLLM's engine core
    logs the model path that holds it (test_redaction). So the one run has the model behind a link
    named after the secret, the secret in the worker's environment, metrics to a text file and a push
    gateway, and progress lines every second."""
    from airflow_provider_vllm.core.commit import MARKER
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.task import worker_command
    from tests.unit.worker.test_metrics import _Recorder
    from tests.vllm.test_redaction import SECRET
    from tests.vllm.test_worker_vllm import ENV, planted, spec_for

    root = tmp_path_factory.mktemp("tiny_run")
    (root / "models").mkdir()
    model = root / "models" / SECRET
    model.symlink_to(tiny_model, target_is_directory=True)
    codes = planted(root, 80)
    spec = spec_for(str(model), root)
    (shard,) = plan_job(spec).shards
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.requests = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    env = {
        **worker_environ(ENV),  # a worker's: its worker key, no deployment key
        **ENGINE_PROCESSES,  # the engine core's own log lines are part of what test_redaction checks
        "MODEL_STORE_TOKEN": SECRET,
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_BATCH_METRICS_TEXTFILE_DIR": str(root / "prom"),
        "VLLM_BATCH_METRICS_PUSHGATEWAY": f"127.0.0.1:{srv.server_port}",
        "VLLM_BATCH_RUN_ID": "manual__1",
    }
    try:
        proc = subprocess.run(
            worker_command(shard_task(spec=spec, shard_id=shard.shard_id, progress_interval_s=1)),
            env=env,
            capture_output=True,
            text=True,
            timeout=800,
        )
    finally:
        srv.shutdown()
        srv.server_close()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    marker = json.loads((root / "out" / "shards" / shard.shard_id / MARKER).read_text())
    prom = (root / "prom" / f"vllm_batch-{spec.name}-{shard.shard_id}.prom").read_text()
    return TinyRun(root, str(model), spec, shard.shard_id, codes, proc, marker, prom, list(srv.requests))


@pytest.fixture(scope="session")
def raw_smollm2(tmp_path_factory, smollm2) -> dict:
    """Raw vLLM (no worker) on SmolLM2 float32, one engine for two tests of test_worker_vllm: LLM.chat over
    the planted rows that succeed (test_smollm2_labels_and_confidence_equal_raw_llm_chat), and token prompts
    against text prompts for the generate and the chat task (test_token_prompts_give_the_same_outputs_as_
    text_prompts). Both used the same engine settings in a process of their own; the prefix cache is reset
    before every call, so each call computes as on a fresh engine."""
    from tests.vllm.test_worker_vllm import (
        ENV,
        LABELS,
        RAW_SMOLLM2,
        SYSTEM,
        TOKEN_TEXTS,
        planted_rows,
        token_specs,
    )

    ids, texts, codes = planted_rows(48)
    chat_texts = [t for i, t in zip(ids, texts) if i not in codes]
    gen, chat = token_specs(smollm2, tmp_path_factory.mktemp("raw_smollm2"))
    args = {
        "model": smollm2,
        "dtype": "float32",
        "chat": {"labels": LABELS, "system": SYSTEM, "texts": chat_texts},
        "tokens": {
            "max_tokens": 24,
            "texts": TOKEN_TEXTS,
            "specs": {"generate": gen.model_dump(mode="json"), "chat": chat},
        },
    }
    raw = subprocess.run(
        [sys.executable, "-c", RAW_SMOLLM2, json.dumps(args)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert raw.returncode == 0, raw.stderr[-3000:]
    return json.loads(next(x for x in raw.stdout.splitlines() if x.startswith("RAW "))[4:])


@pytest.fixture(scope="session")
def shard_server(tmp_path_factory):
    """One shard server (tests/support/shard_server.py) per test process, for the tests here that need shards run by
    the worker's own ``run_shard`` on a real engine but nothing of the worker's process (its exit codes, signals,
    output streams and environment are tested with the worker CLI: tiny_run, the kill and reliability tests). Each
    such test paid a process and ``import vllm`` (~10-14 CPU-s here) before its engine start; through the server a
    test process pays it once, and a test whose engine settings equal the last one's reuses that engine (its prefix
    cache reset, so it computes as a fresh one). One engine kept at a time: the server lives as long as the test
    process, beside the other tests' engines and Airflows."""
    from tests.support.shard_server import ShardServer
    from tests.vllm.test_worker_vllm import ENV

    server = ShardServer(tmp_path_factory.mktemp("shard_server") / "shard-server.log", ENV, keep=1)
    try:
        yield server
    finally:
        server.close()
