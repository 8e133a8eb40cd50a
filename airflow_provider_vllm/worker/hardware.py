"""A short, stable name for the hardware a worker runs on, recorded in commit markers.

Throughput history is keyed by model and hardware, so the name must be the same on every
node of one kind: ``"<count>x <GPU name>"`` (e.g. ``"1x NVIDIA H200"``) when CUDA devices are
visible, else ``"cpu:<model name>:<cores>"``. ``VLLM_BATCH_HARDWARE`` overrides it (for
clusters that label node pools, e.g. ``h200-spot``). No Airflow, no vLLM import.
"""

from __future__ import annotations

import os
import sys

from airflow_provider_vllm.core import envs

HARDWARE_ENV = envs.HARDWARE.name


def hardware_id(tensor_parallel_size: int = 1) -> str:
    """The hardware name for one model replica of ``tensor_parallel_size`` devices."""
    forced = envs.HARDWARE.get()
    if forced:
        return forced
    gpu = _gpu_name()
    if gpu:
        return f"{tensor_parallel_size}x {gpu}"
    return f"cpu:{cpu_name()}:{os.cpu_count() or 1}"


def _gpu_name() -> str | None:
    # torch is already loaded by vLLM in the worker; never import it just for a name
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except Exception:  # a broken driver must not fail a finished shard
        return None
    return None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"
