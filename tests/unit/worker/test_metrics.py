"""Worker metrics: textfile collector output, push gateway PUTs, resource peaks in the marker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.metrics import MetricsConfig
from airflow_provider_vllm.worker.resources import ResourceSampler, load_nvml, process_tree_rss
from airflow_provider_vllm.worker.shard import run_shard
from tests.support import ROOT  # noqa: E402
from tests.support.data import make_spec, shard_task, write_parquet
from tests.support.ledger import record_fault

METRIC_ENV = (
    "VLLM_BATCH_METRICS_PUSHGATEWAY",
    "VLLM_BATCH_METRICS_TEXTFILE_DIR",
    "VLLM_BATCH_METRICS_INTERVAL_S",
    "VLLM_BATCH_METRICS_JOB",
    "VLLM_BATCH_RUN_ID",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in METRIC_ENV:
        monkeypatch.delenv(k, raising=False)


def one_shard_job(tmp_path, n=60):
    texts = [f"ticket number {i}" for i in range(n)]
    texts[5] = ""  # EMPTY_INPUT
    texts[9] = "   "  # EMPTY_INPUT
    texts[20] = "word " * 2000  # PROMPT_TOO_LONG
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(n)], texts)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", name="tickets")
    (shard,) = plan_job(spec).shards
    return spec, shard


def slow_start_factory(made):
    from tests.support.fakes import FakeEngine

    def factory(spec):
        e = FakeEngine(spec)
        e.start_seconds = 1.25
        made.append(e)
        return e

    return factory


def samples(text):
    """{(name, frozenset(labels)): value} of a Prometheus text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def check_counts(got, marker, labels):
    L = lambda **kw: frozenset({**labels, **kw}.items())  # noqa: E731
    st = marker["stats"]
    assert got[("vllm_batch_rows_total", L(outcome="ok"))] == marker["ok_rows"] == 57
    assert got[("vllm_batch_rows_total", L(outcome="error"))] == marker["error_rows"] == 3
    assert got[("vllm_batch_errors_total", L(code="EMPTY_INPUT"))] == 2
    assert got[("vllm_batch_errors_total", L(code="PROMPT_TOO_LONG"))] == 1
    assert got[("vllm_batch_prompt_tokens_total", L())] == st["prompt_tokens"] > 0
    assert got[("vllm_batch_output_tokens_total", L())] == st["completion_tokens"] == 2 * 57
    assert got[("vllm_batch_shard_rows", L())] == 60
    assert got[("vllm_batch_engine_start_seconds", L())] == 1.25
    assert got[("vllm_batch_finished", L())] == 1
    assert got[("vllm_batch_rows_per_second", L())] > 0 and got[("vllm_batch_eta_seconds", L())] == 0
    peak = got[("vllm_batch_process_rss_peak_bytes", L())]
    assert peak > 10 * 2**20 and abs(peak / 2**20 - st["peak_rss_mb"]) < 0.2 * st["peak_rss_mb"]


def test_textfile_collector_file(tmp_path, monkeypatch):
    spec, shard = one_shard_job(tmp_path)
    prom_dir = tmp_path / "textfile"
    monkeypatch.setenv("VLLM_BATCH_METRICS_TEXTFILE_DIR", str(prom_dir))
    made = []
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=slow_start_factory(made))
    marker = json.loads((tmp_path / "out" / "shards" / shard.shard_id / MARKER).read_text())
    assert os.listdir(prom_dir) == [f"vllm_batch-tickets-{shard.shard_id}.prom"]  # no temp files left
    got = samples((prom_dir / f"vllm_batch-tickets-{shard.shard_id}.prom").read_text())
    labels = {
        "batch_job": "tickets",
        "run": spec.content_hash()[:12],
        "shard": shard.shard_id,
        "attempt": m["attempt_id"],
    }
    check_counts(got, marker, labels)
    assert marker["stats"]["peak_rss_mb"] > 10 and marker["stats"]["resource_samples"] >= 2


class _Recorder(BaseHTTPRequestHandler):
    def do_PUT(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append(("PUT", self.path, body.decode()))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def gateway():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.requests = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_push_gateway_puts_grouped_metrics(tmp_path, monkeypatch, gateway):
    spec, shard = one_shard_job(tmp_path)
    monkeypatch.setenv("VLLM_BATCH_METRICS_PUSHGATEWAY", f"http://127.0.0.1:{gateway.server_port}")
    monkeypatch.setenv("VLLM_BATCH_RUN_ID", "scheduled__2026-11-29")
    monkeypatch.setenv("VLLM_BATCH_METRICS_INTERVAL_S", "3600")
    made = []
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=slow_start_factory(made))
    marker = json.loads((tmp_path / "out" / "shards" / shard.shard_id / MARKER).read_text())
    assert len(gateway.requests) == 2  # after engine start, final (the interval never elapsed)
    for method, path, _ in gateway.requests:
        assert method == "PUT" and path.startswith("/metrics/job/vllm_batch/")
        parts = path.removeprefix("/metrics/job/vllm_batch/").split("/")
        assert dict(zip(parts[::2], parts[1::2])) == {
            "batch_job": "tickets",
            "run": "scheduled__2026-11-29",
            "shard": shard.shard_id,
            "attempt": m["attempt_id"],
        }
    first = samples(gateway.requests[0][2])
    assert first[("vllm_batch_engine_start_seconds", frozenset())] == 1.25
    assert first[("vllm_batch_finished", frozenset())] == 0
    check_counts(samples(gateway.requests[-1][2]), marker, {})  # the grouping key carries the labels


def test_gateway_down_does_not_fail_the_shard(tmp_path, monkeypatch, caplog):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec, shard = one_shard_job(tmp_path)
    monkeypatch.setenv("VLLM_BATCH_METRICS_PUSHGATEWAY", f"127.0.0.1:{port}")
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=slow_start_factory([]))
    assert m["status"] == "committed" and m["ok_rows"] + m["error_rows"] == 60
    record_fault("metrics_push_gateway_down", 60, lost=60 - m["rows"])
    assert any("metrics push" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)


def test_metrics_off_by_default_imports_nothing(tmp_path):
    code = f"""
import sys
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import shard_task
from tests.support.data import make_spec, write_parquet
from tests.support.fakes import FakeEngine
from pathlib import Path
tmp = Path({str(tmp_path)!r})
write_parquet(tmp / "in.parquet", ["a", "b"], ["x", "y"])
spec = make_spec(tmp / "in.parquet", tmp / "out")
(shard,) = plan_job(spec).shards
m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=FakeEngine)
assert m["status"] == "committed", m
print("prometheus_client" in sys.modules)
"""
    env = {k: v for k, v in os.environ.items() if k not in METRIC_ENV}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


def test_config_from_env_names_bad_variable():
    assert MetricsConfig.from_env({}) is None
    cfg = MetricsConfig.from_env({"VLLM_BATCH_METRICS_TEXTFILE_DIR": "/x", "VLLM_BATCH_METRICS_INTERVAL_S": "30"})
    assert cfg.textfile_dir == "/x" and cfg.interval_s == 30 and cfg.pushgateway is None
    with pytest.raises(SpecError, match="VLLM_BATCH_METRICS_INTERVAL_S"):
        MetricsConfig.from_env({"VLLM_BATCH_METRICS_PUSHGATEWAY": "pg:9091", "VLLM_BATCH_METRICS_INTERVAL_S": "soon"})


def test_rss_peak_covers_child_processes():
    # vLLM runs its engine core in a child process: its memory must count
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; b=bytearray(300*2**20); b[::4096]=b'x'*len(b[::4096]);"
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        own = process_tree_rss()
        sampler = ResourceSampler.start(interval=3600, use_nvml=False)
        sampler.sample()
        peaks = sampler.peaks()
        sampler.stop()
    finally:
        child.kill()
        child.wait()
    assert sampler.rss_peak >= 250 * 2**20 and own >= 250 * 2**20
    assert peaks["peak_rss_mb"] >= 250 and "gpu_mem_peak_mb" not in peaks
    assert process_tree_rss() < own - 200 * 2**20  # the child is gone


def test_sampler_thread_ends_when_dropped():
    s = ResourceSampler.start(interval=0.01, use_nvml=False)
    t = s._thread
    del s
    t.join(timeout=30)
    assert not t.is_alive()


@pytest.mark.skipif(load_nvml() is None, reason="no NVML (no NVIDIA driver/GPU)")
def test_gpu_peaks_through_nvml():
    torch = pytest.importorskip("torch")
    s = ResourceSampler.start(interval=0.05)
    x = torch.empty(int(4 * 2**30), dtype=torch.uint8, device="cuda")  # 4 GiB
    a = torch.randn(8192, 8192, device="cuda")
    t_end = time.monotonic() + 3
    while time.monotonic() < t_end:
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    peaks = s.peaks()
    s.stop()
    del x
    assert peaks["gpu_mem_peak_mb"] >= 4096 and peaks["gpu_util_peak_pct"] > 0
