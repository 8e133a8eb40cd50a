"""Progress lines, resource peaks and metrics from the real worker process on real vLLM (CPU)."""

from __future__ import annotations

import re

import pytest

from tests.unit.worker.test_metrics import samples
from tests.vllm.test_worker_vllm import manifest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_real_worker_exports_metrics_and_peaks(tiny_run):
    """The shared run (``tiny_run``, tests/vllm/conftest.py): 80 rows, 3 of them planted bad rows, metrics to a
    text file and a push gateway, progress lines every second."""
    proc, spec, shard_id, codes = tiny_run.proc, tiny_run.spec, tiny_run.shard_id, tiny_run.codes
    m = manifest(proc)
    st = tiny_run.marker["stats"]
    assert m["error_rows"] == len(codes) == 3
    summary = [x for x in proc.stderr.splitlines() if f"progress {shard_id} done" in x]
    assert len(summary) == 1 and "rows=80/80" in summary[0] and "EMPTY_INPUT=2, PROMPT_TOO_LONG=1" in summary[0]
    assert st["progress_lines"] == len(re.findall(rf"progress {shard_id} ", proc.stderr))
    # the engine core is a child process holding the 1 GiB KV cache: the tree peak sees it
    assert st["peak_rss_mb"] > 1024 and st["resource_samples"] >= 2

    labels = {"batch_job": spec.name, "run": "manual__1", "shard": shard_id, "attempt": m["attempt_id"]}
    file_samples = samples(tiny_run.prom)
    pushed = samples(tiny_run.pushed[-1][2])
    for got, lab in ((file_samples, labels), (pushed, {})):
        L = frozenset(lab.items())
        assert got[("vllm_batch_rows_total", frozenset({**lab, "outcome": "ok"}.items()))] == m["ok_rows"] == 77
        assert got[("vllm_batch_errors_total", frozenset({**lab, "code": "EMPTY_INPUT"}.items()))] == 2
        assert got[("vllm_batch_prompt_tokens_total", L)] == st["prompt_tokens"] > 0
        assert got[("vllm_batch_output_tokens_total", L)] == st["completion_tokens"] > 0
        assert abs(got[("vllm_batch_engine_start_seconds", L)] - st["engine_start_s"]) < 0.01
        assert got[("vllm_batch_finished", L)] == 1
        assert got[("vllm_batch_process_rss_peak_bytes", L)] / 2**20 > 1024
    assert all(r[0] == "PUT" for r in tiny_run.pushed) and len(tiny_run.pushed) >= 2
