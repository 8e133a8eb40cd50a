"""What a shard attempt reports about itself: progress lines, resource peaks, optional metrics.

``run_shard`` makes one ``ShardTelemetry`` per attempt, hands ``progress`` to the row loop,
calls ``engine_started`` and, before writing the commit marker, ``finish()``, whose dict goes
into the marker's ``stats`` (progress line count, peak RSS, GPU peaks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.worker.metrics import MetricsConfig
from airflow_provider_vllm.worker.progress import Progress
from airflow_provider_vllm.worker.resources import ResourceSampler

ENV_SAMPLE_S = envs.RESOURCE_SAMPLE_S.name


class ShardTelemetry:
    def __init__(
        self,
        spec: JobSpec,
        shard_id: str,
        attempt_id: str,
        total: int,
        interval: float,
        environ: Mapping[str, str] | None = None,
    ):
        cfg = MetricsConfig.from_env(environ)
        self.metrics = None
        if cfg is not None:
            from airflow_provider_vllm.worker.metrics import ShardMetrics

            self.metrics = ShardMetrics(
                cfg,
                batch_job=spec.name,
                run=cfg.run or spec.content_hash()[:12],
                shard_id=shard_id,
                attempt_id=attempt_id,
            )
        self.resources = ResourceSampler.start(interval=float(envs.RESOURCE_SAMPLE_S.value(environ)))
        self.progress = Progress(shard_id, total, interval, on_update=self._on_progress if self.metrics else None)

    def _on_progress(self, progress: Progress, final: bool) -> None:
        if self.metrics is not None:  # only registered as the callback when metrics are on
            self.metrics.update(progress, self.resources, final=final)

    def engine_started(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.engine_started(seconds)
            self.metrics.update(self.progress, self.resources, force=True)

    def finish(self) -> dict[str, Any]:
        """Summary line, last resource sample, final export; the marker's extra stats."""
        self.resources.stop()
        self.progress.finish()
        return {"progress_lines": self.progress.lines, **self.resources.peaks()}
