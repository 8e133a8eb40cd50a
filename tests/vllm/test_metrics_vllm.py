"""Progress lines, resource peaks and metrics from the real worker process on real vLLM (CPU)."""

from __future__ import annotations

import json
import re
import threading
from http.server import ThreadingHTTPServer

import pytest

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.task import ShardTask, worker_command
from tests.unit.worker.test_metrics import _Recorder, samples
from tests.vllm.test_worker_vllm import ENV, manifest, planted, spec_for, tiny_model  # noqa: F401 (fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_real_worker_exports_metrics_and_peaks(tmp_path, tiny_model):  # noqa: F811
    import subprocess

    codes = planted(tmp_path, 60)
    spec = spec_for(tiny_model, tmp_path)
    (shard,) = plan_job(spec).shards
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.requests = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    env = {
        **ENV,
        "VLLM_BATCH_METRICS_TEXTFILE_DIR": str(tmp_path / "prom"),
        "VLLM_BATCH_METRICS_PUSHGATEWAY": f"127.0.0.1:{srv.server_port}",
        "VLLM_BATCH_RUN_ID": "manual__1",
    }
    try:
        proc = subprocess.run(
            worker_command(ShardTask(spec=spec, shard_id=shard.shard_id, progress_interval_s=1)),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        srv.shutdown()
        srv.server_close()
    m = manifest(proc)
    marker = json.loads((tmp_path / "out" / "shards" / shard.shard_id / MARKER).read_text())
    st = marker["stats"]
    assert m["error_rows"] == len(codes) == 3
    summary = [x for x in proc.stderr.splitlines() if f"progress {shard.shard_id} done" in x]
    assert len(summary) == 1 and "rows=60/60" in summary[0] and "EMPTY_INPUT=2, PROMPT_TOO_LONG=1" in summary[0]
    assert st["progress_lines"] == len(re.findall(rf"progress {shard.shard_id} ", proc.stderr))
    # the engine core is a child process holding the 1 GiB KV cache: the tree peak sees it
    assert st["peak_rss_mb"] > 1024 and st["resource_samples"] >= 2

    labels = {"batch_job": spec.name, "run": "manual__1", "shard": shard.shard_id, "attempt": m["attempt_id"]}
    file_samples = samples((tmp_path / "prom" / f"vllm_batch-{spec.name}-{shard.shard_id}.prom").read_text())
    pushed = samples(srv.requests[-1][2])
    for got, lab in ((file_samples, labels), (pushed, {})):
        L = frozenset(lab.items())
        assert got[("vllm_batch_rows_total", frozenset({**lab, "outcome": "ok"}.items()))] == m["ok_rows"] == 57
        assert got[("vllm_batch_errors_total", frozenset({**lab, "code": "EMPTY_INPUT"}.items()))] == 2
        assert got[("vllm_batch_prompt_tokens_total", L)] == st["prompt_tokens"] > 0
        assert got[("vllm_batch_output_tokens_total", L)] == st["completion_tokens"] > 0
        assert abs(got[("vllm_batch_engine_start_seconds", L)] - st["engine_start_s"]) < 0.01
        assert got[("vllm_batch_finished", L)] == 1
        assert got[("vllm_batch_process_rss_peak_bytes", L)] / 2**20 > 1024
    assert all(r[0] == "PUT" for r in srv.requests) and len(srv.requests) >= 2
