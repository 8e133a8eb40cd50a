"""Modules the worker keeps out of its processes (``VLLM_BATCH_SKIP_IMPORTS``).

``import vllm`` costs 11-15 CPU-s on this project's 2-core CPU machines, and about a third of it
is packages that transformers and vLLM import only because they are installed: transformers imports
scikit-learn for assisted generation's candidate generator and scipy for a few losses, vLLM imports
scipy for audio resampling, Ray for its Ray executor and OpenTelemetry's OTLP exporters (with gRPC and
protobuf) for request tracing. scikit-learn, scipy and Ray are not in the engine's lock
(``requirements/engine.txt``), so an engine started from it never loads them; the local runner's
worker runs in the Airflow venv, where providers bring them. OpenTelemetry is in both: vLLM depends on
it, and the worker never turns vLLM's tracing on (the job spec has no OTLP endpoint), so the pod's
worker skips it too. The worker marks them absent before anything imports vLLM
(``sys.modules[name] = None``: Python's documented way to make ``import name`` raise
``ModuleNotFoundError``), so transformers' and vLLM's optional imports take their "not installed"
branch. ``from vllm import LLM`` in the Airflow venv here, 7 alternated pairs on 2026-12-03: medians
9.8 CPU-s with both marked absent, 13.5 without (per pair 0.6-5.6 CPU-s less, median 2.3). That is
OpenTelemetry and Ray marked absent as well: about 1 CPU-s less again (5 alternated pairs, medians 12.6
against 13.6 CPU-s, on a machine busy with other work). That is
the whole engine's saving where the engine runs in the worker's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The processes vLLM spawns (its engine core, always spawned on the
CPU build) import vLLM afresh: a spawned child re-imports its parent's main module before anything else,
but never a package's ``__main__``, which is how the worker starts. ``carry_to_spawned`` names
``worker/spawned.py`` as the worker's main module for them, whose import marks the same modules absent
there. A module the process already imported is left alone.

The deployment names the modules (a comma-separated list of top-level module names, or ``none``);
a name that is not a module name is refused before the engine starts, naming the variable.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Mapping

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import SpecError

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what the worker and its engine need: marked absent, they would fail every shard with a misleading error
# ("vLLM is not installed")
NEEDED = ("airflow_provider_vllm", "vllm", "torch", "transformers", "tokenizers", "numpy", "pyarrow", "pydantic")


def skipped_imports(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The top-level modules ``VLLM_BATCH_SKIP_IMPORTS`` names (default: scikit-learn, scipy, OpenTelemetry, Ray)."""
    raw = envs.SKIP_IMPORTS.value(env)
    if raw.lower() == "none":
        return ()
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",")))
    bad = [n for n in names if not _MODULE.fullmatch(n)]
    if bad:
        raise SpecError(
            f"{envs.SKIP_IMPORTS.name}: {', '.join(repr(n[:80]) for n in bad)} is not a top-level module name "
            "(a comma-separated list such as 'sklearn,scipy', or 'none')"
        )
    needed = [n for n in names if n in NEEDED]
    if needed:
        raise SpecError(f"{envs.SKIP_IMPORTS.name}: {', '.join(needed)} is needed by the worker and cannot be skipped")
    return names


def skip_unused_imports(env: Mapping[str, str] | None = None) -> list[str]:
    """Mark the ``skipped_imports`` that this process has not imported yet as absent; the names marked."""
    marked = []
    for name in skipped_imports(env):
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # import raises ModuleNotFoundError
            marked.append(name)
    return marked


SPAWNED = "airflow_provider_vllm.worker.spawned"


def carry_to_spawned() -> None:
    """Have the processes multiprocessing spawns from this one skip the same imports: ``__main__``'s module
    spec becomes ``worker/spawned.py``'s, which a spawned child imports (as ``__mp_main__``) before it
    unpickles its target (``multiprocessing.spawn.get_preparation_data`` reads ``__main__.__spec__.name``).
    Nothing in this process reads it again; a forked child inherits the marks anyway."""
    main = sys.modules.get("__main__")
    if main is not None:
        main.__spec__ = importlib.util.find_spec(SPAWNED)
