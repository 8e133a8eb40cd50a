"""A shard attempt's telemetry: metrics only when configured; finish() gives the marker's stats."""

from __future__ import annotations

from airflow_provider_vllm.worker.telemetry import ShardTelemetry
from tests.support.data import make_spec


def test_without_metrics_config_it_still_counts_progress_and_resources(tmp_path):
    spec = make_spec(tmp_path / "i", tmp_path / "o")
    t = ShardTelemetry(spec, "s-0", "a1", total=2, interval=3600, environ={"VLLM_BATCH_RESOURCE_SAMPLE_S": "0.05"})
    assert t.metrics is None and t.progress.on_update is None
    t.engine_started(1.0)  # no metrics: nothing to export, and no error
    t.progress.add_row({"status": "ok", "prompt_tokens": 3, "completion_tokens": 1})
    stats = t.finish()
    assert stats["progress_lines"] >= 1  # the summary line is always written
    assert stats.get("peak_rss_mb", 0) > 0


def test_the_sample_interval_comes_from_the_environment_mapping(tmp_path):
    spec = make_spec(tmp_path / "i", tmp_path / "o")
    t = ShardTelemetry(spec, "s-0", "a1", total=0, interval=3600, environ={"VLLM_BATCH_RESOURCE_SAMPLE_S": "7.5"})
    try:
        assert t.resources.interval == 7.5
    finally:
        t.finish()
