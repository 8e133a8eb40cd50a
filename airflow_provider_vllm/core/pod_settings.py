"""Where and how a shard pod runs: the ``kubernetes`` section of a job spec.

Pure pydantic (no Kubernetes client, no Airflow): the worker image loads the job spec too.
Deployment defaults come from the ``[vllm_batch] kubernetes_defaults`` config option and the
``vllm_batch_kubernetes`` Airflow Variable (which may set deployment-owned fields such as the
image or service account only with the deployment's opt-in; docs/security.md) and are layered
under a job's own section with ``KubernetesSettings.layered``. The section is left out of
``JobSpec.content_hash()``: moving a job to another node pool does not change its shards.

Secrets never appear here as values: the HF token and object-store credentials are named
as Kubernetes Secret references, and plain ``env`` refuses names that look like secrets.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from airflow_provider_vllm import __version__

DEFAULT_IMAGE = f"airflow-provider-vllm-worker:{__version__}"
"""The worker image as docker/README.md tags it; production pins ``repo/name:tag@sha256:...``."""

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Literal env values with these names would put a secret in the pod spec and the task log.
_SECRET_LIKE = re.compile(
    r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY|API_KEY|SIGNING_KEY|WORKER_KEY)", re.I
)
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


class _Section(BaseModel):
    # hide_input_in_errors: a refusal (a literal HF_TOKEN in env, a bad name beside it) must not echo the env
    # values it refuses into the task log, as pydantic's message does by default (input_value=...)
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class SecretKeyRef(_Section):
    """One key of a Kubernetes Secret in the pod's namespace."""

    name: str = Field(pattern=_DNS_SUBDOMAIN, description="Secret name.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="Key in the Secret.")


class Toleration(_Section):
    """A pod toleration (e.g. for tainted spot or GPU node pools)."""

    key: str | None = Field(None, description="Taint key; empty with operator Exists tolerates everything.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal (key=value) or Exists (key only).")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; empty matches all effects."
    )
    toleration_seconds: int | None = Field(None, ge=0, description="NoExecute only: how long to stay bound.")


class KubernetesSettings(_Section):
    """Pod settings for the Kubernetes runner; every field optional, defaults are safe."""

    image: str | None = Field(
        None,
        description="Worker image; default the pinned worker image built from docker/ "
        "(pin production images by digest: repo/name:tag@sha256:...).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(None, description="Image pull policy.")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secret names for private registries.")
    namespace: str | None = Field(
        None, pattern=_DNS_LABEL, description="Namespace; default the Kubernetes connection's (then 'default')."
    )
    service_account: str | None = Field(None, pattern=_DNS_SUBDOMAIN, description="Service account of the pod.")
    gpu_resource: str = Field(
        "nvidia.com/gpu",
        pattern=r"^[a-z0-9.-]+/[a-z0-9._-]+$",
        description="Extended resource name of a GPU: nvidia.com/gpu (device plugin / GPU operator), or a "
        "virtualised one such as HAMi's where the cluster has it.",
    )
    gpus: int | None = Field(
        None,
        ge=0,
        description="GPUs per pod; default tensor_parallel_size * pipeline_parallel_size. "
        "0: a CPU pod (vLLM's CPU image, e.g. the kind demo).",
    )
    extra_resources: dict[str, str] = Field(
        default_factory=dict, description="More extended resources as limits, e.g. {'nvidia.com/gpumem': '20000'}."
    )
    cpu: str | None = Field(
        None, pattern=_QUANTITY, description="CPU request, e.g. '8'; default 4 per GPU (2 without)."
    )
    memory: str | None = Field(
        None,
        pattern=_QUANTITY,
        description="Memory request and limit, e.g. '64Gi'; default 32Gi per GPU (8Gi "
        "without) plus /dev/shm, which counts against the limit.",
    )
    cpu_limit: str | None = Field(None, pattern=_QUANTITY, description="CPU limit; default none (no throttling).")
    shm_size: str | None = Field(
        None,
        pattern=_QUANTITY,
        description="/dev/shm (memory-backed emptyDir) size; default 2Gi, or 8Gi per GPU "
        "when the model spans several GPUs (NCCL and vLLM's workers exchange tensors through it).",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pod must match.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations, e.g. for spot pools.")
    affinity: dict[str, Any] | None = Field(None, description="A Kubernetes affinity object (camelCase keys).")
    priority_class: str | None = Field(None, pattern=_DNS_SUBDOMAIN, description="PriorityClass name.")
    kueue_queue: str | None = Field(
        None, pattern=_DNS_SUBDOMAIN, description="Kueue LocalQueue; sets the kueue.x-k8s.io/queue-name label."
    )
    runtime_class: str | None = Field(None, pattern=_DNS_SUBDOMAIN, description="RuntimeClass, e.g. 'nvidia'.")
    model_cache_pvc: str | None = Field(
        None,
        pattern=_DNS_SUBDOMAIN,
        description="PVC with model weights, mounted at model_cache_path and used "
        "as the Hugging Face hub cache (HF_HUB_CACHE=<path>/hub).",
    )
    model_cache_path: str = Field("/models", pattern=r"^/[^:]*$", description="Where the model-cache PVC is mounted.")
    model_cache_read_only: bool = Field(
        True, description="Mount the model cache read-only (pre-populated cache; sets HF_HUB_OFFLINE=1)."
    )
    data_pvc: str | None = Field(None, pattern=_DNS_SUBDOMAIN, description="PVC for local-path input/output.")
    data_path: str = Field("/data", pattern=r"^/[^:]*$", description="Where data_pvc is mounted.")
    hf_token_secret: SecretKeyRef | None = Field(None, description="Secret key holding the HF token (-> HF_TOKEN).")
    secret_env: dict[str, SecretKeyRef] = Field(
        default_factory=dict,
        description="Env var -> Secret key, e.g. object-store keys {'AWS_ACCESS_KEY_ID': {'name': 's3', 'key': 'id'}}.",
    )
    env_from_secrets: list[str] = Field(
        default_factory=list, description="Secrets whose every key becomes an env var (envFrom)."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Plain env vars (no secrets: names like *TOKEN*, *SECRET* are refused)."
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Pod annotations.")
    run_as_user: int = Field(1000, ge=1, description="Non-root uid of the worker (the image's user).")
    run_as_group: int = Field(1000, ge=1, description="gid of the worker.")
    seccomp_profile: Literal["RuntimeDefault", "Localhost"] = Field("RuntimeDefault", description="Seccomp profile.")
    seccomp_localhost_profile: str | None = Field(None, description="Profile file with seccomp_profile=Localhost.")
    termination_grace_period_s: int = Field(
        60,
        ge=1,
        description="Seconds between SIGTERM (the worker stops and exits 75, keeping committed chunks) and SIGKILL.",
    )
    active_deadline_s: int | None = Field(None, ge=1, description="Hard wall-clock limit of the pod.")
    schedule_timeout_s: int = Field(
        1800,
        ge=1,
        description="Seconds to wait for the pod to be scheduled: a GPU node pool may have to scale up first, "
        "or Kueue admit the pod when quota frees up.",
    )
    startup_timeout_s: int = Field(
        900,
        ge=1,
        description="Seconds from scheduled to running: the image pull (the worker image is large) and the "
        "container's start.",
    )
    log_interval_s: int = Field(
        30,
        ge=5,
        le=3600,
        description="Deferrable shard tasks: seconds between reads of the pod's log while it runs, so the "
        "worker's progress lines (rows/s, ETA) reach the task log during the run, not only at its end.",
    )
    pod_template_file: str | None = Field(
        None,
        description="A pod template YAML on the Airflow workers for anything not covered here; "
        "these settings win over it.",
    )

    @field_validator("env")
    @classmethod
    def _no_secret_literals(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _ENV_NAME.match(name):
                raise ValueError(f"env name {name!r} is not a valid variable name")
            if _SECRET_LIKE.search(name):
                raise ValueError(f"env {name!r} looks like a secret: pass it with secret_env (a Secret reference)")
        return v

    @field_validator("secret_env")
    @classmethod
    def _env_names(cls, v: dict[str, SecretKeyRef]) -> dict[str, SecretKeyRef]:
        bad = [n for n in v if not _ENV_NAME.match(n)]
        if bad:
            raise ValueError(f"secret_env names are not valid variable names: {bad}")
        return v

    @model_validator(mode="after")
    def _seccomp(self) -> KubernetesSettings:
        if (self.seccomp_profile == "Localhost") != (self.seccomp_localhost_profile is not None):
            raise ValueError("seccomp_localhost_profile is required with, and only with, seccomp_profile=Localhost")
        return self

    @classmethod
    def layered(cls, *docs: Any) -> KubernetesSettings:
        """Later documents win, key by key (``None``/empty documents are skipped)."""
        merged: dict[str, Any] = {}
        for doc in docs:
            if doc is None or doc == "":
                continue
            if isinstance(doc, KubernetesSettings):
                doc = doc.model_dump(exclude_unset=True)
            if not isinstance(doc, dict):
                raise ValueError(f"kubernetes settings must be a mapping, got {type(doc).__name__}")
            merged.update(doc)
        return cls.model_validate(merged)
