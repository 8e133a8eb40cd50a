"""Which engine a run's shards start, resolved on the Airflow side the way the shard tasks resolve it.

The result cache's key must name the engine that actually answers (``core/engine_identity.py``):
with the local runner, this Airflow worker's vLLM and the environment the worker process gets
(this process's plus the task's ``env``); with the Kubernetes runner, the worker image and the pod's
environment after every layer (``[vllm_batch] kubernetes_defaults`` < the ``kubernetes`` argument or
its Variable < ``env`` < the job's own section). The plan task keys the cache with it; the Kubernetes
shard task checks, before it starts a pod, that it resolves to the same engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.engine_identity import image_engine_identity, local_engine_identity
from airflow_provider_vllm.core.pod_settings import KubernetesSettings
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.utils.deployment import kubernetes_defaults


def layered_pod_settings(
    spec: JobSpec, kubernetes: Mapping[str, Any] | str | None, env: Mapping[str, str] | None
) -> KubernetesSettings:
    """Deployment config (``[vllm_batch] kubernetes_defaults``) < ``kubernetes`` < ``env`` < the job's own
    ``kubernetes`` section (a job field equal to its default does not override a deployment default).
    ValueError on a malformed layer."""
    defaults = kubernetes
    if isinstance(defaults, (str, bytes)):
        defaults = json.loads(defaults) if defaults.strip() else None
    if defaults is not None and not isinstance(defaults, Mapping):
        raise ValueError(f"kubernetes settings must be a mapping, got {type(defaults).__name__}")
    job = spec.kubernetes.model_dump(exclude_defaults=True)
    settings = KubernetesSettings.layered(kubernetes_defaults(), dict(defaults) if defaults else None, job)
    if env:
        merged = {**settings.env, **{k: str(v) for k, v in env.items()}, **job.get("env", {})}
        settings = KubernetesSettings.layered(settings.model_dump(exclude_defaults=True), {"env": merged})
    return settings


def pod_engine_identity(spec: JobSpec, settings: KubernetesSettings) -> str:
    """The engine of a shard pod with these settings: the image and the engine variables of its environment
    (a value from a Secret named by its reference)."""
    from airflow_provider_vllm.utils.pod_spec import DEFAULT_IMAGE, environment

    env, _ = environment(settings)
    values = {}
    for e in env:
        ref = e.value_from.secret_key_ref if e.value_from is not None else None
        values[e.name] = e.value if ref is None else f"secret:{ref.name}/{ref.key}"
    return image_engine_identity(settings.image or DEFAULT_IMAGE, values)


def shard_engine_identity(
    spec: JobSpec,
    runner: str,
    kubernetes: Mapping[str, Any] | str | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """The engine the shards of ``runner`` will run, for the cache key; fails the task (no retry) when it
    cannot be an identity: with the cache on, a Kubernetes image must be pinned by digest."""
    if runner != "kubernetes":
        return local_engine_identity({**envs.environ(), **{k: str(v) for k, v in (env or {}).items()}})
    try:
        settings = layered_pod_settings(spec, kubernetes, env)
    except ValueError as e:
        raise AirflowFailException(f"plan: invalid kubernetes settings: {e}") from None
    identity = pod_engine_identity(spec, settings)
    image = identity.split(" env ", 1)[0].removeprefix("image ")
    if spec.cache.uri and "@sha256:" not in image:
        raise AirflowFailException(
            f"plan: cache.uri is set but the shard pods' image {image!r} is not pinned by digest: a tag can be "
            "moved to other software, and the cache would keep serving the old engine's answers under the new "
            "one's name. Pin it (repo/name:tag@sha256:...) where the image is set ([vllm_batch] "
            "kubernetes_defaults, the kubernetes argument or its Variable, or kubernetes.image), or unset cache.uri"
        )
    return identity
