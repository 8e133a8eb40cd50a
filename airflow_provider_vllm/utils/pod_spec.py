"""The shard pod's parts as Kubernetes client models: hardened by default, sized for the model.

Pure: Kubernetes client models in, models out; no Airflow, no API calls. The Kubernetes
runner's operator hands these parts to ``KubernetesPodOperator``.

Hardening (Pod Security Standards "restricted" plus a read-only root filesystem): non-root
uid/gid, no privilege escalation, every capability dropped, seccomp RuntimeDefault, no host
namespaces, ports or paths, no service-account token. Writable places are ``emptyDir``s:
``/tmp``, ``/cache`` (HF, vLLM, Triton and torch caches) and ``/dev/shm`` (memory medium).

Warm starts: with the deployment's compile-cache claim (``[vllm_batch] kubernetes_compile_cache_pvc``,
never a job's or a trigger's choice, never a hostPath) the pod also mounts that claim at
``/compile-cache`` and names it in ``VLLM_BATCH_COMPILE_CACHE``: the worker restores its key's
snapshot into ``/cache`` before vLLM starts and publishes one after a cold start
(``worker/compile_cache.py``, docs/adr/0008-shared-compile-cache.md). A job that may run code from
the model repo (``spec_guard.code_loading_options``) mounts it read-only and never publishes.

GPUs: ``tensor_parallel_size * pipeline_parallel_size`` of ``settings.gpu_resource`` (one
engine per pod; ``settings.gpus`` may only say 0, a CPU pod, or the same count). NVLink
multicast (NVLS) stays off in every pod: on a shared host it can take GPUs out of service for
every tenant.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from decimal import Decimal

from kubernetes.client import ApiClient
from kubernetes.client import models as k8s
from kubernetes.utils.quantity import parse_quantity

from airflow_provider_vllm import __version__
from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.pod_settings import DEFAULT_IMAGE, KubernetesSettings
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import code_loading_options

WORKER_PYTHON = "python3"
"""The interpreter on the worker image's PATH (argv[0] of ``worker_command`` in the pod)."""

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ADAPTERS_ANNOTATION = "vllm-batch/adapters"  # the job's LoRA adapters, name -> source[@commit]
XCOM_DIR = "/airflow/xcom"
CACHE_DIR = "/cache"
COMPILE_CACHE_DIR = "/compile-cache"
COMPILE_CACHE_VOLUME = "compile-cache"
GiB = 1024**3

# Always set in the worker container; settings.env cannot change them.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BASE_ENV = {
    "PYTHONUNBUFFERED": "1",
    "HOME": "/tmp",  # read-only root filesystem: the non-root user's home is not writable
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HOME": f"{CACHE_DIR}/huggingface",
    "VLLM_BATCH_ADAPTER_DIR": f"{CACHE_DIR}/adapters",  # LoRA adapters may be larger than /tmp's 4Gi
    "VLLM_CACHE_ROOT": f"{CACHE_DIR}/vllm",
    "XDG_CACHE_HOME": CACHE_DIR,
    "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/torchinductor",
    "VLLM_BATCH_XCOM_DIR": XCOM_DIR,
    **NVLS_OFF,
}
# Set by the deployment's compile-cache claim alone; settings.env cannot set them (a job must not point the
# worker at a folder of compiled code of its choosing).
COMPILE_CACHE_ENV = ("VLLM_BATCH_COMPILE_CACHE", "VLLM_BATCH_COMPILE_CACHE_PUBLISH")
# The folders compiled code is loaded from (the worker's private copies, keyed and sealed by worker/compile_cache.py):
# always in the pod's own emptyDir; settings.env cannot move them onto a volume that other writers share.
PRIVATE_COMPILE_ENV = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# The pod's own mounts: a PVC of the settings (model_cache_path, data_path) mounted at, inside or above one of
# them would replace a private folder (e.g. /cache/triton) with a shared volume.
# each env_from_secrets Secret is also mounted here (files readable by root only): the worker lists its keys, the
# names of the variables it must mask, which only the cluster knows
ENV_FROM_KEYS_DIR = "/etc/vllm-batch/env-from"
RESERVED_MOUNTS = ("/tmp", CACHE_DIR, "/dev/shm", COMPILE_CACHE_DIR, XCOM_DIR, ENV_FROM_KEYS_DIR)


def gpu_count(spec: JobSpec, settings: KubernetesSettings) -> int:
    """GPUs one shard pod requests: TP x PP of the spec's engine (one engine per pod).

    ``settings.gpus`` may say 0 (a CPU pod) or repeat TP x PP; any other count is refused: fewer
    GPUs than the engine spans cannot start it, more sit idle in the pod (run more shards at
    once instead, one pod per TP group: memory.choose_layout).
    """
    pp = spec.engine.engine_kwargs.get("pipeline_parallel_size", 1)
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise SpecError(f"engine.engine_kwargs.pipeline_parallel_size must be a positive integer, got {pp!r}")
    engine_gpus = spec.engine.tensor_parallel_size * pp
    if settings.gpus is not None and settings.gpus not in (0, engine_gpus):
        raise SpecError(
            f"kubernetes.gpus={settings.gpus} but the engine spans engine.tensor_parallel_size x "
            f"pipeline_parallel_size = {engine_gpus} GPU(s): the pod's GPU request must equal it (0 for a CPU pod); "
            "to use more GPUs run more shards at once (one pod per GPU at tensor_parallel_size 1)"
        )
    return engine_gpus if settings.gpus is None else settings.gpus


def shm_bytes(settings: KubernetesSettings, gpus: int) -> int:
    """/dev/shm size: the setting, else 2 GiB for one GPU or none, 8 GiB per GPU across several."""
    if settings.shm_size is not None:
        return int(parse_quantity(settings.shm_size))
    return 8 * GiB * gpus if gpus > 1 else 2 * GiB


def _quantity(n: int | Decimal) -> str:
    n = int(n)
    return f"{n // GiB}Gi" if n % GiB == 0 else str(n)


@dataclass
class PodParts:
    """Everything the runner sets on the pod and its worker container."""

    gpus: int
    shm_size: str
    resources: k8s.V1ResourceRequirements
    pod_security_context: k8s.V1PodSecurityContext
    container_security_context: k8s.V1SecurityContext
    volumes: list[k8s.V1Volume]
    volume_mounts: list[k8s.V1VolumeMount]
    env: list[k8s.V1EnvVar]
    env_from: list[k8s.V1EnvFromSource]
    tolerations: list[k8s.V1Toleration]
    node_selector: dict[str, str]
    affinity: k8s.V1Affinity | None
    labels: dict[str, str]
    annotations: dict[str, str]
    image: str
    image_pull_secrets: list[k8s.V1LocalObjectReference] = field(default_factory=list)


def container_security_context(settings: KubernetesSettings) -> k8s.V1SecurityContext:
    """PSS restricted + read-only root filesystem, for the worker and the XCom sidecar."""
    return k8s.V1SecurityContext(
        allow_privilege_escalation=False,
        privileged=False,
        read_only_root_filesystem=True,
        run_as_non_root=True,
        run_as_user=settings.run_as_user,
        run_as_group=settings.run_as_group,
        capabilities=k8s.V1Capabilities(drop=["ALL"]),
        seccomp_profile=_seccomp(settings),
    )


def pod_security_context(settings: KubernetesSettings) -> k8s.V1PodSecurityContext:
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=settings.run_as_user,
        run_as_group=settings.run_as_group,
        fs_group=settings.run_as_group,
        seccomp_profile=_seccomp(settings),
    )


def _seccomp(settings: KubernetesSettings) -> k8s.V1SeccompProfile:
    return k8s.V1SeccompProfile(type=settings.seccomp_profile, localhost_profile=settings.seccomp_localhost_profile)


def resources(settings: KubernetesSettings, gpus: int, shm: int) -> k8s.V1ResourceRequirements:
    """Requests and limits; memory limit = request, and it covers /dev/shm (memory-backed)."""
    if settings.memory is not None:
        memory = int(parse_quantity(settings.memory))
        if memory <= shm:
            raise SpecError(
                f"kubernetes.memory={settings.memory} must exceed the /dev/shm size ({_quantity(shm)}): "
                "a memory-backed emptyDir counts against the container's memory limit"
            )
    else:
        memory = (32 * GiB * gpus if gpus else 8 * GiB) + shm
    cpu = settings.cpu or str(4 * gpus if gpus else 2)
    requests = {"cpu": cpu, "memory": _quantity(memory)}
    limits: dict[str, str] = {"memory": _quantity(memory)}
    if settings.cpu_limit:
        limits["cpu"] = settings.cpu_limit
    if gpus:
        limits[settings.gpu_resource] = str(gpus)
    # extended resources beside the GPUs (HAMi's gpumem, ...): never a count or size set above, which would
    # bypass the rules on them (the GPU count equals the engine's, memory exceeds /dev/shm)
    taken = sorted(
        n for n in settings.extra_resources if n in ("cpu", "memory", settings.gpu_resource) or n.endswith("/gpu")
    )
    if taken:
        raise SpecError(
            f"kubernetes.extra_resources cannot set {taken}: set them with cpu / cpu_limit, memory, or the "
            "engine's GPU count (tensor_parallel_size x pipeline_parallel_size of gpu_resource)"
        )
    limits.update(settings.extra_resources)
    return k8s.V1ResourceRequirements(requests=requests, limits=limits)


def _check_mount_path(what: str, path: str) -> None:
    """A settings PVC's mount path must not be, lie inside or lie above one of the pod's own mounts."""
    norm = posixpath.normpath(path)
    for own in RESERVED_MOUNTS:
        if norm == own or norm.startswith(own + "/") or own.startswith(norm.rstrip("/") + "/"):
            raise SpecError(
                f"kubernetes.{what}={path!r} would mount a shared volume over the pod's own {own} (its private "
                f"caches, compiled code included, /tmp, /dev/shm, the compile-cache claim, the XCom folder or the "
                f"folders of the env_from_secrets Secrets); "
                f"choose a path outside {sorted(RESERVED_MOUNTS)}"
            )


def volumes(settings: KubernetesSettings, shm: int) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    vols = [
        k8s.V1Volume(name="tmp", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit="4Gi")),
        k8s.V1Volume(name="cache", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit="50Gi")),
        k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=_quantity(shm))),
    ]
    mounts = [
        k8s.V1VolumeMount(name="tmp", mount_path="/tmp"),
        k8s.V1VolumeMount(name="cache", mount_path=CACHE_DIR),
        k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
    ]
    if settings.model_cache_pvc:
        _check_mount_path("model_cache_path", settings.model_cache_path)
        vols.append(
            k8s.V1Volume(
                name="model-cache",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                    claim_name=settings.model_cache_pvc, read_only=settings.model_cache_read_only
                ),
            )
        )
        mounts.append(
            k8s.V1VolumeMount(
                name="model-cache", mount_path=settings.model_cache_path, read_only=settings.model_cache_read_only
            )
        )
    if settings.data_pvc:
        _check_mount_path("data_path", settings.data_path)
        vols.append(
            k8s.V1Volume(
                name="data",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=settings.data_pvc),
            )
        )
        mounts.append(k8s.V1VolumeMount(name="data", mount_path=settings.data_path))
    for i, (name, folder) in enumerate(zip(settings.env_from_secrets, env_from_key_dirs(settings))):
        vols.append(
            k8s.V1Volume(name=f"env-from-{i}", secret=k8s.V1SecretVolumeSource(secret_name=name, default_mode=0o400))
        )
        mounts.append(k8s.V1VolumeMount(name=f"env-from-{i}", mount_path=folder, read_only=True))
    return vols, mounts


def env_from_key_dirs(settings: KubernetesSettings) -> list[str]:
    """Where each ``env_from_secrets`` Secret is mounted, for the worker to list its keys
    (``VLLM_BATCH_MASKED_ENV_DIRS``)."""
    return [f"{ENV_FROM_KEYS_DIR}/{i}" for i in range(len(settings.env_from_secrets))]


def compile_cache(spec: JobSpec, claim: str | None) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount], dict]:
    """The deployment's compile-cache claim as the pod's volume, mount and env (nothing without a claim).

    Read-only, and the worker told not to publish, for a job that may run code from the model repo: code
    the deployment allowed for one job must not land in artefacts that other jobs' pods execute.
    """
    if not claim:
        return [], [], {}
    read_only = bool(code_loading_options(spec))
    vol = k8s.V1Volume(
        name=COMPILE_CACHE_VOLUME,
        persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=claim, read_only=read_only),
    )
    mount = k8s.V1VolumeMount(name=COMPILE_CACHE_VOLUME, mount_path=COMPILE_CACHE_DIR, read_only=read_only)
    env = {COMPILE_CACHE_ENV[0]: COMPILE_CACHE_DIR, **({COMPILE_CACHE_ENV[1]: "0"} if read_only else {})}
    return [vol], [mount], env


def environment(settings: KubernetesSettings) -> tuple[list[k8s.V1EnvVar], list[k8s.V1EnvFromSource]]:
    """Literal env (no secrets) + Secret references; NVLS stays off whatever ``settings.env`` says."""
    clash = sorted(set(settings.env) & set(NVLS_OFF))
    if clash:
        raise SpecError(f"kubernetes.env cannot change {clash}: NVLink multicast stays off on shared hosts")
    reserved = sorted(set(settings.env) & set(COMPILE_CACHE_ENV))
    if reserved:
        raise SpecError(
            f"kubernetes.env cannot set {reserved}: the shared compile cache is the deployment's "
            "([vllm_batch] kubernetes_compile_cache_pvc)"
        )
    # the operator alone sets the worker key; the worker refuses the others too, but only once its pod is scheduled
    keys = sorted(n for n in {*settings.env, *settings.secret_env} if envs.names_a_key(n))
    if keys:
        raise SpecError(
            f"kubernetes.env / secret_env cannot set {keys}: no pod ever gets the deployment's signing key or its "
            "setting (code in the worker could seal any record with it); the operator gives each pod its worker key "
            "from the Secret named by [vllm_batch] kubernetes_signing_secret"
        )
    private = sorted(set(settings.env) & set(PRIVATE_COMPILE_ENV))
    if private:
        raise SpecError(
            f"kubernetes.env cannot set {private}: the engine loads compiled code from these folders, which stay "
            f"in the pod's own {CACHE_DIR} emptyDir (shared warm starts: [vllm_batch] kubernetes_compile_cache_pvc)"
        )
    env = dict(BASE_ENV)
    if settings.model_cache_pvc:
        env["HF_HUB_CACHE"] = f"{settings.model_cache_path.rstrip('/')}/hub"
        if settings.model_cache_read_only:
            env["HF_HUB_OFFLINE"] = "1"
    env.update(settings.env)
    refs = dict(settings.secret_env)
    if settings.hf_token_secret is not None:
        refs["HF_TOKEN"] = settings.hf_token_secret
    dup = sorted(set(refs) & set(env))
    if dup:
        raise SpecError(f"kubernetes: {dup} set both as plain env and as a Secret reference")
    out = [k8s.V1EnvVar(name=k, value=v) for k, v in env.items()]
    out += [
        k8s.V1EnvVar(
            name=k, value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(name=r.name, key=r.key))
        )
        for k, r in sorted(refs.items())
    ]
    env_from = [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=n)) for n in settings.env_from_secrets]
    return out, env_from


def secret_env_names(settings: KubernetesSettings) -> list[str]:
    """The variables the pod gets from a Secret by reference (``secret_env``, ``hf_token_secret``), sorted.

    Not the keys of ``env_from_secrets``: only the cluster knows which keys those Secrets hold (the worker lists
    them, ``env_from_key_dirs``)."""
    return sorted({*settings.secret_env, *(["HF_TOKEN"] if settings.hf_token_secret is not None else [])})


# fsspec option names that carry credentials (s3fs key/secret/token, gcsfs token, adlfs keys).
_CREDENTIAL_OPTION = re.compile(
    r"^(key|secret|token|password|passwd|sas_token|account_key|client_secret|"
    r"aws_secret_access_key|aws_session_token|credentials?)$",
    re.I,
)


def check_no_credentials_in_spec(spec: JobSpec) -> None:
    """The spec becomes the pod's argument (visible to whoever can read pods): no credentials in it."""
    bad = sorted(k for k in spec.io.storage_options if _CREDENTIAL_OPTION.match(k) or _SECRETISH.search(k))
    if bad:
        raise SpecError(
            f"io.storage_options {bad} look like credentials; the job spec is the pod's argument, so "
            "pass them as Secret references (kubernetes.secret_env / env_from_secrets) instead"
        )


_SECRETISH = re.compile(r"(secret|token|password|credential)", re.I)


def label_value(value: str) -> str:
    """A valid label value (63 chars of [A-Za-z0-9_.-], alphanumeric at both ends)."""
    v = re.sub(r"[^A-Za-z0-9_.-]+", "-", value)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", v)


def pod_parts(
    spec: JobSpec, settings: KubernetesSettings, shard_id: str, compile_cache_pvc: str | None = None
) -> PodParts:
    """The pod for one shard of ``spec``; raises SpecError naming the setting that is wrong.

    ``compile_cache_pvc``: the deployment's compile-cache claim (``[vllm_batch] kubernetes_compile_cache_pvc``).
    """
    check_no_credentials_in_spec(spec)
    gpus = gpu_count(spec, settings)
    shm = shm_bytes(settings, gpus)
    vols, mounts = volumes(settings, shm)
    env, env_from = environment(settings)
    cc_vols, cc_mounts, cc_env = compile_cache(spec, compile_cache_pvc)
    vols, mounts = vols + cc_vols, mounts + cc_mounts
    env += [k8s.V1EnvVar(name=k, value=v) for k, v in cc_env.items()]
    labels = {
        "app.kubernetes.io/name": "airflow-provider-vllm",
        "app.kubernetes.io/component": "shard-worker",
        "app.kubernetes.io/version": label_value(__version__),
        "vllm-batch/job": label_value(spec.name),
        "vllm-batch/shard": label_value(shard_id),
        **settings.labels,
    }
    if settings.kueue_queue:
        labels[KUEUE_QUEUE_LABEL] = settings.kueue_queue
    annotations = {"vllm-batch/config-hash": spec.output_hash()[:16], **settings.annotations}
    if spec.model.adapters:
        annotations[ADAPTERS_ANNOTATION] = json.dumps(
            {a.name: a.source + (f"@{a.revision}" if a.revision else "") for a in spec.model.adapters},
            sort_keys=True,
        )
    affinity = _affinity(settings.affinity)
    return PodParts(
        gpus=gpus,
        shm_size=_quantity(shm),
        resources=resources(settings, gpus, shm),
        pod_security_context=pod_security_context(settings),
        container_security_context=container_security_context(settings),
        volumes=vols,
        volume_mounts=mounts,
        env=env,
        env_from=env_from,
        tolerations=[k8s.V1Toleration(**t.model_dump(exclude_none=True)) for t in settings.tolerations],
        node_selector=dict(settings.node_selector),
        affinity=affinity,
        labels=labels,
        annotations=annotations,
        image=settings.image or DEFAULT_IMAGE,
        image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in settings.image_pull_secrets],
    )


def adapter_sources(spec: JobSpec, settings: KubernetesSettings) -> list[str]:
    """How the shard pod gets each LoRA adapter (the pod dry run prints these): as it gets models. A local
    folder must be on a volume the pod mounts (the model-cache PVC or the data PVC); an object store folder is
    read by the worker with the pod's own identity; a hub adapter is fetched at its commit into HF_HUB_CACHE
    (on the model-cache PVC when there is one). The worker checks every adapter against the plan's identity."""
    mounts = [
        (settings.model_cache_pvc, settings.model_cache_path, "the model-cache PVC"),
        (settings.data_pvc, settings.data_path, "the data PVC"),
    ]
    lines = []
    for a in spec.model.adapters:
        if a.kind == "object_store":
            how = "an object store folder, read by the worker with the pod's identity (Secret env, workload identity)"
        elif a.kind == "hub":
            offline = ", read-only: offline" if settings.model_cache_read_only else ""
            cache = (
                f"the model-cache PVC ({settings.model_cache_path}/hub{offline})"
                if settings.model_cache_pvc
                else "the pod's emptyDir cache (downloaded by every pod)"
            )
            how = f"a hub repo at commit {a.revision}, from HF_HUB_CACHE on {cache}"
        else:
            path = a.source.removeprefix("file://")
            on = next((what for pvc, at, what in mounts if pvc and (path + "/").startswith(at.rstrip("/") + "/")), None)
            how = (
                f"a local folder on {on}"
                if on
                else "a local folder on no volume the pod mounts (it must be in the image): mount it with "
                "kubernetes.model_cache_pvc or data_pvc"
            )
        lines.append(f"adapter {a.name!r} ({a.source}): {how}")
    return lines


def _affinity(doc: dict | None) -> k8s.V1Affinity | None:
    """A camelCase affinity document as the client's model; refuses keys the model drops."""
    if not doc:
        return None
    client = ApiClient()
    try:
        model = client._ApiClient__deserialize(doc, k8s.V1Affinity)  # what the cncf provider does too
    except (ValueError, TypeError, AttributeError) as e:
        raise SpecError(f"kubernetes.affinity is not a valid Affinity: {e}") from None
    if client.sanitize_for_serialization(model) != doc:
        raise SpecError(f"kubernetes.affinity has fields an Affinity does not have (check the camelCase names): {doc}")
    return model
