"""Peak resource use of a worker: GPU utilisation and memory through NVML, process RSS.

A daemon thread samples every ``interval`` seconds (a few syscalls, or one NVML query per GPU)
from the start of an attempt until ``stop()``. RSS covers the worker and its child processes
(vLLM runs its engine core in a child). NVML is optional: ``pynvml`` (the ``nvidia-ml-py``
package) or the copy vLLM ships; without a driver or a GPU the GPU figures are simply absent.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_vllm.core import envs

log = logging.getLogger("airflow_provider_vllm.worker")

MB = 1024 * 1024


def load_nvml():
    """The pynvml module with NVML initialised, or None (no package, no driver, no GPU)."""
    mod: Any = None
    try:
        import pynvml  # nvidia-ml-py

        mod = pynvml
    except ImportError:
        spec = importlib.util.find_spec("vllm")  # finding it does not import vLLM
        for loc in (spec.submodule_search_locations or []) if spec else []:
            path = os.path.join(loc, "third_party", "pynvml.py")
            if os.path.exists(path):
                s = importlib.util.spec_from_file_location("_vllm_batch_pynvml", path)
                if s is None or s.loader is None:
                    continue
                mod = importlib.util.module_from_spec(s)
                try:
                    s.loader.exec_module(mod)
                except Exception:
                    mod = None
                break
    if mod is None:
        return None
    try:
        mod.nvmlInit()
        if mod.nvmlDeviceGetCount() < 1:
            mod.nvmlShutdown()
            return None
    except Exception:  # NVMLError: library or driver not found, no device
        return None
    return mod


def _visible_gpus(nvml) -> list[int]:
    """NVML indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES when it lists indices)."""
    n = nvml.nvmlDeviceGetCount()
    vis = envs.CUDA_VISIBLE_DEVICES.get()
    if vis is not None and vis.strip():
        parts = [p.strip() for p in vis.split(",") if p.strip()]
        if all(p.isdigit() for p in parts):
            return [int(p) for p in parts if int(p) < n]
    return list(range(n))


def process_tree_rss() -> int:
    """Resident bytes of this process plus its live descendants (psutil), or of this process only."""
    try:
        import psutil
    except ImportError:
        return _self_rss()
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _self_rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class GpuPeak:
    index: int
    name: str = ""
    util_peak: float = 0.0
    util_sum: float = 0.0
    samples: int = 0
    mem_peak: int = 0
    mem_total: int = 0
    util_last: float = 0.0
    mem_last: int = 0


@dataclass
class ResourceSampler:
    """Samples RSS (and GPUs when NVML works) on a daemon thread; ``peaks()`` for the marker."""

    interval: float = 2.0
    nvml: Any = None
    rss_peak: int = 0
    rss_last: int = 0
    samples: int = 0
    gpus: dict[int, GpuPeak] = field(default_factory=dict)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def start(cls, interval: float = 2.0, use_nvml: bool = True) -> ResourceSampler:
        s = cls(interval=interval, nvml=load_nvml() if use_nvml else None)
        if s.nvml is not None:
            for i in _visible_gpus(s.nvml):
                h = s.nvml.nvmlDeviceGetHandleByIndex(i)
                name = s.nvml.nvmlDeviceGetName(h)
                s.gpus[i] = GpuPeak(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    mem_total=int(s.nvml.nvmlDeviceGetMemoryInfo(h).total),
                )
        s.sample()
        # the thread holds only a weak reference: an attempt that dies without stop() ends it too
        s._thread = threading.Thread(
            target=_sample_loop, args=(weakref.ref(s), s._stop, interval), name="vllm-batch-resources", daemon=True
        )
        s._thread.start()
        return s

    def sample(self) -> None:
        """Take one sample now."""
        rss = process_tree_rss()
        with self._lock:
            self.samples += 1
            self.rss_last = rss
            self.rss_peak = max(self.rss_peak, rss)
        for i, g in self.gpus.items():
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            util = float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            used = int(self.nvml.nvmlDeviceGetMemoryInfo(h).used)
            with self._lock:
                g.samples += 1
                g.util_last, g.mem_last = util, used
                g.util_sum += util
                g.util_peak = max(g.util_peak, util)
                g.mem_peak = max(g.mem_peak, used)

    def stop(self) -> None:
        """Take a last sample and stop the thread (idempotent)."""
        if self._thread is not None and not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=5)
            try:
                self.sample()
            except Exception:
                pass
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.nvml = None

    def rss_peak_bytes(self) -> int:
        """Peak RSS: the sampled process tree, or this process's own lifetime peak if higher
        (``ru_maxrss`` also sees spikes between samples). The marker and the metrics both use it."""
        self_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        with self._lock:
            return max(self.rss_peak, self_peak)

    def peaks(self) -> dict[str, Any]:
        """Marker stats: ``peak_rss_mb`` (process tree), and ``gpu_*`` when GPUs were sampled."""
        rss_peak = self.rss_peak_bytes()
        with self._lock:
            out: dict[str, Any] = {
                "peak_rss_mb": round(rss_peak / MB, 1),
                "resource_samples": self.samples,
            }
            if self.gpus:
                gs = list(self.gpus.values())
                out["gpus"] = [
                    {
                        "index": g.index,
                        "name": g.name,
                        "util_peak_pct": g.util_peak,
                        "util_mean_pct": round(g.util_sum / g.samples, 1) if g.samples else None,
                        "mem_peak_mb": round(g.mem_peak / MB, 1),
                        "mem_total_mb": round(g.mem_total / MB, 1),
                    }
                    for g in gs
                ]
                out["gpu_util_peak_pct"] = max(g.util_peak for g in gs)
                out["gpu_mem_peak_mb"] = round(max(g.mem_peak for g in gs) / MB, 1)
        return out


def _sample_loop(ref: weakref.ref, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        sampler = ref()
        if sampler is None:
            return
        try:
            sampler.sample()
        except Exception as e:  # a failed sample never stops the shard
            log.debug("resource sample failed: %s", e)
        del sampler
