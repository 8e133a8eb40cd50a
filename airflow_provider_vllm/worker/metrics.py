"""Optional Prometheus metrics of a shard attempt, exported the way short-lived pods need.

Off unless ``VLLM_BATCH_METRICS_PUSHGATEWAY`` or ``VLLM_BATCH_METRICS_TEXTFILE_DIR`` is set;
when off nothing here runs and ``prometheus_client`` is not imported. When on, the worker
exports at most once per ``VLLM_BATCH_METRICS_INTERVAL_S`` seconds (piggy-backing on progress
lines), once after engine start, and once at the end:

* push gateway: ``PUT /metrics/job/<job>/batch_job/<spec name>/run/<run>/shard/<id>/attempt/<id>``
  (``push_to_gateway``; the grouping key labels every series);
* textfile collector: ``<dir>/vllm_batch-<spec name>-<shard id>.prom`` written atomically
  (``write_to_textfile``: temp file + rename), with the same labels on every series.

An export failure is logged and never fails the shard. Names and meanings: docs/metrics.md.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import SpecError

log = logging.getLogger("airflow_provider_vllm.worker")

ENV_PUSHGATEWAY = envs.METRICS_PUSHGATEWAY.name
ENV_TEXTFILE_DIR = envs.METRICS_TEXTFILE_DIR.name
ENV_INTERVAL = envs.METRICS_INTERVAL_S.name
ENV_JOB = envs.METRICS_JOB.name
ENV_RUN = envs.RUN_ID.name
PREFIX = "vllm_batch_"
LABELS = ("batch_job", "run", "shard", "attempt")


class MetricsConfig(BaseModel):
    """Where and how often to export; ``from_env`` reads the ``VLLM_BATCH_METRICS_*`` variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pushgateway: str | None = Field(None, description="Push gateway address (host:port or http(s) URL).")
    textfile_dir: str | None = Field(None, description="node_exporter textfile collector directory.")
    interval_s: float = Field(15.0, ge=0, description="Least seconds between two exports (the last one always goes).")
    job: str = Field("vllm_batch", min_length=1, description="Push gateway job name.")
    run: str | None = Field(None, min_length=1, description="Run label; default: the first 12 hex of the spec hash.")
    push_timeout_s: float = Field(5.0, gt=0, description="HTTP timeout of one push.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MetricsConfig | None:
        """The config from the environment; None (metrics off) when no exporter is named."""
        push, textdir = envs.METRICS_PUSHGATEWAY.get(environ), envs.METRICS_TEXTFILE_DIR.get(environ)
        if push is None and textdir is None:
            return None
        doc: dict[str, Any] = {"pushgateway": push, "textfile_dir": textdir}
        for key, var in (("interval_s", envs.METRICS_INTERVAL_S), ("job", envs.METRICS_JOB), ("run", envs.RUN_ID)):
            if var.get(environ) is not None:
                doc[key] = var.get(environ)
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            names = {"interval_s": ENV_INTERVAL, "job": ENV_JOB, "run": ENV_RUN}
            bad = "; ".join(f"{names.get(str(err['loc'][0]), err['loc'][0])}: {err['msg']}" for err in e.errors())
            raise SpecError(f"invalid metrics settings: {bad}") from None


class ShardMetrics:
    """Metric values of one attempt, refreshed from ``Progress`` and the resource sampler."""

    def __init__(
        self,
        config: MetricsConfig,
        *,
        batch_job: str,
        run: str,
        shard_id: str,
        attempt_id: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        from prometheus_client import CollectorRegistry

        self.config = config
        self.labels = {"batch_job": batch_job, "run": run, "shard": shard_id, "attempt": attempt_id}
        self.clock = clock
        self.last_export = float("-inf")
        self.exports = 0
        self.failures = 0
        self.values: dict[str, Any] = {"engine_start_seconds": None, "finished": 0}
        # the push gateway adds the grouping key to every series; the textfile has no such key
        self.push_registry = CollectorRegistry(auto_describe=False)
        self.push_registry.register(_Collector(self, {}))
        self.file_registry = CollectorRegistry(auto_describe=False)
        self.file_registry.register(_Collector(self, self.labels))

    @property
    def textfile_path(self) -> str | None:
        if not self.config.textfile_dir:
            return None
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"vllm_batch-{self.labels['batch_job']}-{self.labels['shard']}")
        return os.path.join(self.config.textfile_dir, safe + ".prom")

    def engine_started(self, seconds: float) -> None:
        self.values["engine_start_seconds"] = float(seconds)

    def update(self, progress, resources=None, final: bool = False, force: bool = False) -> None:
        """Take the progress counters (and resource readings); export when due, ``final`` or ``force``."""
        s = progress.snapshot()
        self.values.update(
            shard_rows=progress.total,
            ok=progress.ok,
            errors=progress.errors,
            errors_by_code=dict(progress.errors_by_code),
            prompt_tokens=progress.prompt_tokens,
            output_tokens=progress.completion_tokens,
            rows_per_s=s["rows_per_s"],
            tokens_per_s=s["tokens_per_s"],
            elapsed_s=s["elapsed_s"],
            eta_s=s["eta_s"],
            finished=1 if final else 0,
        )
        if resources is not None:
            self.values["resources"] = resources
        if final or force or self.clock() - self.last_export >= self.config.interval_s:
            self.export()

    def export(self) -> None:
        """Push and/or write the textfile now; failures are logged, counted, never raised."""
        from prometheus_client import push_to_gateway, write_to_textfile

        self.last_export = self.clock()
        self.values["timestamp"] = time.time()
        self.exports += 1
        if self.config.pushgateway:
            try:
                push_to_gateway(
                    self.config.pushgateway,
                    job=self.config.job,
                    registry=self.push_registry,
                    grouping_key=self.labels,
                    timeout=self.config.push_timeout_s,
                )
            except Exception as e:
                self.failures += 1
                log.warning("metrics push to %s failed (%d so far): %s", self.config.pushgateway, self.failures, e)
        path = self.textfile_path
        if path:
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                write_to_textfile(path, self.file_registry)
            except Exception as e:
                self.failures += 1
                log.warning("metrics textfile %s failed (%d so far): %s", path, self.failures, e)


class _Collector:
    """Builds the metric families from ``ShardMetrics.values`` at export time."""

    def __init__(self, owner: ShardMetrics, const: dict[str, str]):
        self.owner = owner
        self.const = const

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        v = self.owner.values
        names, vals = list(self.const), list(self.const.values())

        def fam(kind, name, doc, extra=(), points=()):
            m = kind(PREFIX + name, doc, labels=names + list(extra))
            for labels, value in points:
                if value is not None:
                    m.add_metric(vals + list(labels), float(value))
            return m

        G, C = GaugeMetricFamily, CounterMetricFamily
        yield fam(
            G,
            "shard_rows",
            "Rows this attempt has to process (planned rows less reused chunks).",
            points=[((), v.get("shard_rows"))],
        )
        yield fam(
            C,
            "rows",
            "Rows finished by this attempt, by outcome.",
            ["outcome"],
            [(("ok",), v.get("ok", 0)), (("error",), v.get("errors", 0))],
        )
        yield fam(
            C,
            "errors",
            "Error rows by reason code.",
            ["code"],
            [((code,), n) for code, n in sorted((v.get("errors_by_code") or {}).items())],
        )
        yield fam(C, "prompt_tokens", "Prompt tokens of finished rows.", points=[((), v.get("prompt_tokens", 0))])
        yield fam(C, "output_tokens", "Generated tokens of finished rows.", points=[((), v.get("output_tokens", 0))])
        yield fam(
            G,
            "engine_start_seconds",
            "Seconds to import vLLM and load the model.",
            points=[((), v.get("engine_start_seconds"))],
        )
        yield fam(G, "rows_per_second", "Rows per second since inference started.", points=[((), v.get("rows_per_s"))])
        yield fam(
            G,
            "tokens_per_second",
            "Prompt + output tokens per second since inference started.",
            points=[((), v.get("tokens_per_s"))],
        )
        yield fam(G, "inference_seconds", "Seconds since inference started.", points=[((), v.get("elapsed_s"))])
        yield fam(G, "eta_seconds", "Estimated seconds left.", points=[((), v.get("eta_s"))])
        yield fam(G, "finished", "1 once the attempt has processed all its rows.", points=[((), v.get("finished"))])
        yield fam(G, "last_update_timestamp_seconds", "Unix time of this export.", points=[((), v.get("timestamp"))])
        r = v.get("resources")
        if r is None:
            return
        yield fam(
            G,
            "process_rss_bytes",
            "Resident memory of the worker and its children, last sample.",
            points=[((), r.rss_last)],
        )
        yield fam(
            G,
            "process_rss_peak_bytes",
            "Peak resident memory of the worker and its children.",
            points=[((), r.rss_peak_bytes())],
        )
        gpus = list(r.gpus.values())
        if not gpus:
            return
        yield fam(
            G,
            "gpu_utilization_percent",
            "GPU utilisation (NVML), last sample.",
            ["gpu"],
            [((str(g.index),), g.util_last) for g in gpus],
        )
        yield fam(
            G,
            "gpu_utilization_peak_percent",
            "Peak GPU utilisation (NVML).",
            ["gpu"],
            [((str(g.index),), g.util_peak) for g in gpus],
        )
        yield fam(
            G,
            "gpu_memory_used_bytes",
            "GPU memory used (NVML), last sample.",
            ["gpu"],
            [((str(g.index),), g.mem_last) for g in gpus],
        )
        yield fam(
            G,
            "gpu_memory_peak_bytes",
            "Peak GPU memory used (NVML).",
            ["gpu"],
            [((str(g.index),), g.mem_peak) for g in gpus],
        )
