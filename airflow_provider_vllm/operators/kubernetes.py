"""The shard task, Kubernetes runner: one pod per shard running the worker image.

A thin ``KubernetesPodOperator`` subclass in the manner of the cncf provider's
``_KubernetesDecoratedOperator``: it sets the container command, arguments, resources,
volumes, env and security contexts from the shard's job spec, then lets KPO do the rest
(pod naming, reattach after a worker restart, deferral, log streaming, XCom sidecar,
deletion on finish and on kill). Pod parts come from the pure ``pod_spec`` module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.common.compat.sdk import AirflowException, AirflowSkipException, conf
from airflow.sdk.exceptions import AirflowFailException
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.exit_codes import ExitCode
from airflow_provider_vllm.core.plan import ShardSummary
from airflow_provider_vllm.core.pod_settings import KubernetesSettings
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import DEPLOYMENT_OWNED
from airflow_provider_vllm.utils import provenance
from airflow_provider_vllm.utils.deployment import (
    check_spec_allowed,
    compile_cache_pvc,
    kubernetes_signing_secret,
    variables_may_set_deployment_settings,
    worker_env,
)
from airflow_provider_vllm.utils.engine_identity import layered_pod_settings, pod_engine_identity
from airflow_provider_vllm.utils.job_spec import (
    data_plane_errors,
    load_shard_plan,
    load_spec,
    shard_id_of,
    shard_plan,
)
from airflow_provider_vllm.utils.pod_spec import (
    WORKER_PYTHON,
    PodParts,
    container_security_context,
    env_from_key_dirs,
    pod_parts,
    secret_env_names,
)
from airflow_provider_vllm.utils.worker_outcome import worker_failure, worker_result
from airflow_provider_vllm.worker.task import ShardTask, worker_command

SETTINGS_VARIABLE = "vllm_batch_kubernetes"
"""Airflow Variable (JSON object of ``KubernetesSettings`` fields): deployment-wide pod defaults."""

# Set from the shard spec in execute(); never templated (the spec is data from the plan's XCom).
_NOT_TEMPLATED = {
    "cmds",
    "arguments",
    "image",
    "container_resources",
    "volumes",
    "volume_mounts",
    "env_vars",
    "env_from",
    "labels",
    "annotations",
    "node_selector",
    "namespace",
    "pod_template_file",
    # which cluster, with which identity, and pod specs the provider neither overwrites nor checks:
    # DAG-file settings (CLUSTER_SETTINGS below), never rendered from a trigger
    "pod_template_dict",
    "kubernetes_conn_id",
    "config_file",
    "cluster_context",
    "configmaps",
    "trigger_kwargs",
}
CLUSTER_SETTINGS = (
    "pod_template_dict",
    "full_pod_spec",
    "pod_template_file",
    "kubernetes_conn_id",
    "config_file",
    "cluster_context",
    "in_cluster",
    "configmaps",
    "trigger_kwargs",
)
"""KPO arguments that choose the cluster, its credentials or pod spec parts: deployment-owned (docs/security.md)."""


class VllmKubernetesShardOperator(KubernetesPodOperator):
    """Run one shard in a pod: ``worker_command(ShardTask(...))``, the local runner's command line.

    :param spec: the validated job spec from the plan task (its ``spec`` XCom).
    :param shard: one item of the plan's return value (a ``ShardSummary``'s JSON form, as XCom hands it over;
        it names the sealed plan the worker runs under).
    :param kubernetes: deployment defaults for the pod (a ``KubernetesSettings`` dict or JSON
        text, templated; the builder passes the ``vllm_batch_kubernetes`` Variable). The job
        spec's ``kubernetes`` section wins over it field by field. Image, GPU count and
        resource name, CPU/memory, /dev/shm, node selector, tolerations, affinity, priority
        class, Kueue queue, service account, model-cache and data PVCs, Secret references
        (HF token, object-store keys) and a pod template file are all set there.
    :param env: plain environment variables for the worker (templated; no secrets: names such
        as ``*TOKEN*`` are refused, use ``secret_env`` in the settings), over the settings' ``env``.
    :param progress_interval_s: seconds between the worker's progress lines (pod log).

    Defaults differ from KPO's where a batch shard needs it: ``durable`` (a restarted task
    reattaches to its pod), pod deleted on finish and on kill, logs streamed, the worker's
    manifest read from ``/airflow/xcom/return.json`` as the XCom value, ``FallbackToLogsOnError``
    termination messages. ``deferrable`` follows ``[operators] default_deferrable`` as every
    operator does (True frees the Airflow worker slot while the pod runs; it needs a running
    triggerer); a deferred task reads the pod's log every ``log_interval_s`` of the settings, so
    progress lines arrive while the shard runs. ``schedule_timeout_s`` (node scale-up, queueing)
    and ``startup_timeout_s`` (image pull, container start) bound the two waits separately.
    Worker exit 2 (terminal) fails the task without retry; 75 (transient) and any other failure
    are retried by Airflow.
    """

    template_fields: Sequence[str] = tuple(
        {"spec", "shard", "kubernetes", "env", *KubernetesPodOperator.template_fields} - _NOT_TEMPLATED
    )
    template_fields_renderers = {"spec": "json", "shard": "json", "kubernetes": "json", "env": "json"}
    ui_color = "#e3f2fd"

    def __init__(
        self,
        *,
        spec: Any,
        shard: dict[str, Any] | ShardSummary | str,
        kubernetes: dict[str, Any] | str | None = None,
        env: dict[str, str] | None = None,
        progress_interval_s: float = 10.0,
        name: str = "vllm-shard",
        deferrable: bool | None = None,
        durable: bool = True,
        on_kill_action: str = "delete_pod",
        on_finish_action: str = "delete_pod",
        get_logs: bool = True,
        do_xcom_push: bool = True,
        log_events_on_failure: bool = True,
        termination_message_policy: str = "FallbackToLogsOnError",
        **kwargs: Any,
    ) -> None:
        if deferrable is None:  # read when the task is built, not when this module was imported
            deferrable = conf.getboolean("operators", "default_deferrable", fallback=False)
        super().__init__(
            name=name,
            deferrable=deferrable,
            durable=durable,
            on_kill_action=on_kill_action,
            on_finish_action=on_finish_action,
            get_logs=get_logs,
            do_xcom_push=do_xcom_push,
            log_events_on_failure=log_events_on_failure,
            termination_message_policy=termination_message_policy,
            **kwargs,
        )
        self.spec = spec
        self.shard = shard
        self.kubernetes = kubernetes
        self.env = env
        self._raw_kubernetes, self._raw_env = kubernetes, env  # before rendering: who set what (provenance)
        self._raw_cluster = {k: getattr(self, k, None) for k in CLUSTER_SETTINGS}
        self.progress_interval_s = progress_interval_s
        self.parts: PodParts | None = None

    @property
    def shard_id(self) -> str:
        return shard_id_of(self.shard)

    def check_provenance(self, defaults: dict[str, Any] | None) -> None:
        """Deployment-owned pod settings in ``kubernetes`` / ``env`` came from the DAG file, or a Variable
        with ``[vllm_batch] deployment_settings_from_variables``; never from the trigger."""
        env = provenance.template_env(self)
        owned = [p for p in DEPLOYMENT_OWNED if p.startswith("kubernetes.") and p.split(".", 1)[1] in (defaults or {})]

        def from_kubernetes(path: str):
            raw = self._raw_kubernetes
            if isinstance(raw, str):
                return provenance.template_sources(raw, env)
            return provenance.template_sources((raw or {}).get(path.split(".", 1)[1]), env)

        problems = provenance.violations(owned, [from_kubernetes], variables_may_set_deployment_settings())
        if self.env:
            problems += provenance.violations(
                ["kubernetes.env"],
                [lambda p: provenance.template_sources(self._raw_env, env)],
                variables_may_set_deployment_settings(),
            )
        if problems:
            raise AirflowFailException(f"shard {self.shard_id}: " + "; ".join(problems))

    def check_cluster_provenance(self) -> None:
        """The cluster, its credentials and pod spec parts (``CLUSTER_SETTINGS``: ``kubernetes_conn_id``,
        ``pod_template_dict``, ...) came from the DAG file, never from a template over the trigger's values
        (or a Variable without the deployment's opt-in). They are not template fields; this also catches a
        subclass or a caller that renders them anyway."""
        env = provenance.template_env(self)
        raw = self._raw_cluster
        problems = provenance.violations(
            [k for k in CLUSTER_SETTINGS if raw.get(k)],
            [lambda p: provenance.template_sources(raw.get(p), env)],
            variables_may_set_deployment_settings(),
        )
        changed = [
            k for k in CLUSTER_SETTINGS if k not in ("pod_template_file",) and getattr(self, k, None) != raw.get(k)
        ]
        if changed:  # rendered or set after the DAG file built the task
            problems.append(f"{', '.join(changed)}: changed after the DAG file set them; they are deployment-owned")
        if problems:
            raise AirflowFailException(f"shard {self.shard_id}: " + "; ".join(problems))

    def settings(self, spec) -> KubernetesSettings:
        """Deployment config (``[vllm_batch] kubernetes_defaults``) < ``kubernetes`` < ``env`` < the job's
        own ``kubernetes`` section.

        A job field equal to its default does not override a deployment default (the spec
        reaches the task as JSON, where an explicit default looks like an unset field).
        Deployment-owned fields (image, namespace, service account, env, Secrets, PVCs, ...) in
        ``kubernetes`` or ``env`` must come from the DAG file, or from a Variable with the
        deployment's opt-in; the job section's were checked by the plan task.
        """
        defaults = self.kubernetes
        try:
            if isinstance(defaults, (str, bytes)):
                defaults = json.loads(defaults) if defaults.strip() else None
            if defaults is not None and not isinstance(defaults, dict):
                raise ValueError(f"kubernetes settings must be a mapping, got {type(defaults).__name__}")
            self.check_provenance(defaults)
            return layered_pod_settings(spec, defaults, self.env)
        except ValueError as e:  # pydantic's ValidationError and json's errors are ValueErrors
            raise AirflowFailException(f"shard {self.shard_id}: invalid kubernetes settings: {e}") from None

    def prepare_pod(self) -> PodParts:
        """Set the pod's fields from the shard spec (idempotent); fails without retry on bad input."""
        self.check_cluster_provenance()
        spec = load_spec(self.spec, "shard")
        prefixes = check_spec_allowed(spec, f"shard {self.shard_id}")  # before any pod spec exists
        claim = compile_cache_pvc()  # the deployment's alone: never the spec, a Variable or a trigger
        try:
            task = ShardTask(
                spec=spec,
                shard_id=self.shard_id,
                progress_interval_s=self.progress_interval_s,
                **shard_plan(self.shard),
            )
            settings = self.settings(spec)
            parts = pod_parts(spec, settings, task.shard_id, claim)
        except (SpecError, ValueError) as e:
            raise AirflowFailException(f"shard {self.shard_id!r}: {e}") from None
        argv = worker_command(task, python=WORKER_PYTHON)
        self.cmds, self.arguments = argv[:-1], argv[-1:]
        self.image = parts.image
        self.image_pull_policy = settings.image_pull_policy or self.image_pull_policy
        self.image_pull_secrets = parts.image_pull_secrets
        self.namespace = settings.namespace or self.namespace
        self.container_resources = parts.resources
        self.volumes = parts.volumes
        self.volume_mounts = parts.volume_mounts
        # the deployment's allow-list reaches the worker through its environment, set last (never the task JSON),
        # and the worker key through a secretKeyRef ([vllm_batch] kubernetes_signing_secret), never a literal; the
        # deployment's own signing key never reaches a pod (pod_parts refuses settings that name a key variable)
        allow = worker_env(prefixes)
        # and the names of the variables it set from Secrets, which the worker masks whatever their names
        allow[envs.SECRET_ENV_NAMES.name] = ",".join(secret_env_names(settings) + [envs.WORKER_KEY.name])
        allow[envs.SECRET_ENV_DIRS.name] = ",".join(env_from_key_dirs(settings))
        allow[envs.WORKER_IMAGE.name] = self.image  # the compile cache's key: never another image's artefacts
        secret, key = kubernetes_signing_secret()
        signing = k8s.V1EnvVar(
            name=envs.WORKER_KEY.name,
            value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(name=secret, key=key)),
        )
        self.env_vars = (
            [e for e in parts.env if e.name not in allow]
            + [k8s.V1EnvVar(name=k, value=v) for k, v in allow.items()]
            + [signing]
        )
        self.env_from = parts.env_from
        self.labels = {**(self.labels or {}), **parts.labels}
        self.annotations = {**(self.annotations or {}), **parts.annotations}
        self.node_selector = parts.node_selector
        self.tolerations = parts.tolerations
        self.affinity = parts.affinity or {}
        self.priority_class_name = settings.priority_class
        self.service_account_name = settings.service_account
        self.automount_service_account_token = False  # the worker never calls the Kubernetes API
        self.runtime_class_name = settings.runtime_class
        self.security_context = parts.pod_security_context
        self.container_security_context = parts.container_security_context
        self.xcom_sidecar_container_security_context = container_security_context(settings)
        self.hostnetwork = False
        self.termination_grace_period = settings.termination_grace_period_s
        self.active_deadline_seconds = settings.active_deadline_s
        self.schedule_timeout_seconds = settings.schedule_timeout_s  # to scheduled: node scale-up, queueing
        self.startup_timeout_seconds = settings.startup_timeout_s  # scheduled to running: image pull
        self.logging_interval = settings.log_interval_s  # deferred: progress lines while the pod runs
        self.pod_template_file = settings.pod_template_file
        self.parts = parts
        return parts

    def check_engine(self, spec: JobSpec, settings: KubernetesSettings) -> None:
        """With the result cache: the pod about to start must be the engine the plan keyed (same image by digest,
        same engine variables); the deployment's pod settings changing between plan and shard fails the task."""
        if not spec.cache.uri:
            return
        from airflow_provider_vllm.hooks.filesystems import task_filesystems

        with data_plane_errors(f"shard {self.shard_id}"):  # the plan the task names, not one put back since
            plan = load_shard_plan(spec, self.shard, task_filesystems(None, None))
        keyed = plan.cache.key_config.get("engine_identity") if plan.cache is not None else None
        now = pod_engine_identity(spec, settings)
        if keyed is not None and keyed != now:
            raise AirflowFailException(
                f"shard {self.shard_id}: the pod would run {now}, but the plan keyed the result cache with {keyed}: "
                "the deployment's pod settings changed since the plan; rerun the job from the plan"
            )

    def build_pod_request_obj(self, context=None, *, dry_run: bool = False) -> k8s.V1Pod:
        self.prepare_pod()
        return super().build_pod_request_obj(context, dry_run=dry_run)

    def dry_run(self) -> None:
        """Print the pod manifest as kubectl takes it (camelCase YAML); no Kubernetes API call."""
        import yaml

        pod = self.build_pod_request_obj(dry_run=True)
        print(yaml.safe_dump(ApiClient().sanitize_for_serialization(pod), sort_keys=False), end="")

    def execute(self, context: Any) -> Any:
        parts = self.prepare_pod()
        spec = load_spec(self.spec, "shard")
        self.check_engine(spec, self.settings(spec))  # before a pod starts: the engine the plan keyed
        self.log.info(
            "shard %s: image %s, %d GPU(s), memory %s, /dev/shm %s: %s '<shard task json, %d bytes>'",
            self.shard_id,
            self.image,
            parts.gpus,
            parts.resources.limits.get("memory"),
            parts.shm_size,
            " ".join(self.cmds),
            len(self.arguments[0]),
        )
        return super().execute(context)

    def cleanup(self, pod, remote_pod, xcom_result=None, context=None) -> None:
        """KPO's cleanup (logs, XCom, deletion), then the worker's exit code decides retry or not
        (``core/exit_codes.py``, shared with the local runner); a succeeded worker must have left
        this shard's manifest (``WorkerManifest``), as with the local runner, else the task is retried."""
        try:
            super().cleanup(pod=pod, remote_pod=remote_pod, xcom_result=xcom_result, context=context)
        except (AirflowSkipException, AirflowFailException):
            raise
        except AirflowException as e:
            raise worker_failure(
                worker_exit_code(remote_pod, self.base_container_name), self.shard_id, xcom_result
            ) from e
        if remote_pod is not None and self.do_xcom_push and not getattr(self, "_killed", False):
            worker_result(ExitCode.OK, self.shard_id, xcom_result)


def worker_exit_code(pod: k8s.V1Pod | None, container: str) -> int | None:
    """Exit code of ``container`` in a pod's status, when it has terminated."""
    statuses = (pod.status.container_statuses if pod is not None and pod.status else None) or []
    for s in statuses:
        if s.name == container and s.state is not None and s.state.terminated is not None:
            return s.state.terminated.exit_code
    return None
