"""The hardware name recorded in markers: stable per kind of node, overridable by the deployment."""

from __future__ import annotations

import os
import sys

from airflow_provider_vllm.worker.hardware import HARDWARE_ENV, hardware_id


def test_the_deployment_override_wins(monkeypatch):
    monkeypatch.setenv(HARDWARE_ENV, "h200-spot")
    assert hardware_id(4) == "h200-spot"


def test_without_a_gpu_it_names_the_cpu_and_its_cores(monkeypatch):
    monkeypatch.delenv(HARDWARE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # vLLM's torch not loaded: never import it for a name
    name = hardware_id()
    assert name.startswith("cpu:") and name.endswith(f":{os.cpu_count() or 1}")
    assert hardware_id() == name  # stable


def test_a_visible_gpu_is_named_with_the_replica_size(monkeypatch):
    class Cuda:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def get_device_name(i):
            return "NVIDIA H200"

    class Torch:
        cuda = Cuda

    monkeypatch.delenv(HARDWARE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "torch", Torch)
    assert hardware_id(2) == "2x NVIDIA H200"
