"""The Kubernetes shard operator without a cluster: the pod it asks for, validated against the
Kubernetes OpenAPI schema and the Pod Security Standards "restricted" rules.

Pods are built the way the cncf provider's own tests build them,
``build_pod_request_obj(create_context(op, map_index=3))``. The KPO hook reads a kubeconfig
that points at a closed local port: building a pod never calls the API.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from kubernetes.client import ApiClient

from airflow_provider_vllm.core.exit_codes import ExitCode
from tests.support.data import PLAN_REF, make_spec, shard_task
from tests.support.k8s_context import create_context, unreachable_cluster
from tests.support.ledger import record_malicious
from tests.support.pss_restricted import violations

ROOT = Path(__file__).resolve().parents[3]
SHARD = {"shard_id": "shard-00003-0a1b2c3d", "index": 3, "rows": 1000, "est_tokens": 90000, "bucket": "all", **PLAN_REF}
SETTINGS = {  # what an operator puts in the vllm_batch_kubernetes Variable
    "namespace": "vllm-batch",
    "image": "registry.example.com/ml/vllm-worker:0.1.0@sha256:" + "ab" * 32,
    "kueue_queue": "gpu-batch",
    "priority_class": "batch-low",
    "service_account": "vllm-worker",
    "node_selector": {"cloud.google.com/gke-spot": "true"},
    "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
    ],
    "model_cache_pvc": "hf-models",
    "hf_token_secret": {"name": "hf-token", "key": "token"},
    "secret_env": {
        "AWS_ACCESS_KEY_ID": {"name": "s3-creds", "key": "access_key_id"},
        "AWS_SECRET_ACCESS_KEY": {"name": "s3-creds", "key": "secret_access_key"},
    },
}


@pytest.fixture(autouse=True)
def _no_cluster(tmp_path, monkeypatch):
    unreachable_cluster(tmp_path, monkeypatch)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", "/in,/out")  # the specs' locations


def operator(settings=SETTINGS, task_id="shard", **spec_over):
    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator

    spec = make_spec("/in", "/out", **spec_over).model_dump(mode="json")
    return VllmKubernetesShardOperator(task_id=task_id, spec=spec, shard=SHARD, kubernetes=json.dumps(settings))


def manifest(pod) -> dict:
    return ApiClient().sanitize_for_serialization(pod)


def base(pod):
    (c,) = [c for c in pod.spec.containers if c.name == "base"]
    return c


def test_pod_for_a_mapped_task_instance():
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.worker.task import ShardTask, worker_command

    op = operator()
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    labels = pod.metadata.labels
    assert labels["map_index"] == "3" and labels["dag_id"] == "dag" and labels["task_id"] == "shard"
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-batch" and labels["vllm-batch/shard"] == SHARD["shard_id"]
    assert pod.metadata.namespace == "vllm-batch" and pod.metadata.name.startswith("vllm-shard-")
    c = base(pod)
    # exactly the entrypoint + one JSON argument, the local runner's command line
    assert c.command == ["python3", "-m", "airflow_provider_vllm.worker"]
    assert len(c.args) == 1
    task = ShardTask.load(c.args[0])
    assert task.shard_id == SHARD["shard_id"] and task.spec == JobSpec.load(op.spec)
    # the sealed plan the worker runs under: as the plan task's value named it (XCom), never read from the bucket
    assert (task.plan_mac, task.plan_sha256) == (SHARD["plan_mac"], SHARD["plan_sha256"])
    assert c.command + c.args == worker_command(task, python="python3")
    assert c.image == SETTINGS["image"]
    assert c.resources.limits == {"memory": "34Gi", "nvidia.com/gpu": "1"}
    assert c.resources.requests == {"cpu": "4", "memory": "34Gi"}
    vols = {v.name: v for v in pod.spec.volumes}
    assert {"xcom", "tmp", "cache", "dshm", "model-cache"} <= set(vols)
    assert (
        vols["dshm"].empty_dir.medium == "Memory"
        and vols["model-cache"].persistent_volume_claim.claim_name == "hf-models"
    )
    assert {m.mount_path for m in c.volume_mounts} == {"/airflow/xcom", "/tmp", "/cache", "/dev/shm", "/models"}
    refs = {e.name: (e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key) for e in c.env if e.value_from}
    assert refs == {
        "HF_TOKEN": ("hf-token", "token"),
        "AWS_ACCESS_KEY_ID": ("s3-creds", "access_key_id"),
        "AWS_SECRET_ACCESS_KEY": ("s3-creds", "secret_access_key"),
        "VLLM_BATCH_WORKER_KEY": ("vllm-batch-signing", "key"),  # [vllm_batch] kubernetes_signing_secret (conftest)
    }
    assert [(t.key, t.operator, t.value, t.effect) for t in pod.spec.tolerations] == [
        ("nvidia.com/gpu", "Exists", None, "NoSchedule"),
        ("cloud.google.com/gke-spot", "Equal", "true", "NoSchedule"),
    ]
    assert pod.spec.node_selector == {"cloud.google.com/gke-spot": "true"}
    assert pod.spec.priority_class_name == "batch-low" and pod.spec.service_account_name == "vllm-worker"
    assert pod.spec.automount_service_account_token is False and pod.spec.restart_policy == "Never"
    assert pod.spec.termination_grace_period_seconds == 60
    assert c.termination_message_policy == "FallbackToLogsOnError"
    assert [x.name for x in pod.spec.containers] == ["base", "airflow-xcom-sidecar"]  # XCom from return.json


def test_the_pod_names_its_image_to_the_worker_and_the_pod_settings_cannot_rename_it():
    """VLLM_BATCH_IMAGE (the compile cache's key) is the image the pod runs, set last: a pod setting's env naming
    another image does not replace it, so a pod never reads or publishes compile artefacts under another image."""
    op = operator({**SETTINGS, "env": {"VLLM_BATCH_IMAGE": "registry.example.com/other:1"}})
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    c = pod.spec.containers[0]
    named = [e.value for e in c.env or [] if e.name == "VLLM_BATCH_IMAGE"]
    assert named == [c.image] and c.image == SETTINGS["image"]


@pytest.mark.parametrize("setting", ["vllm-batch-signing:key", "team-a-signing:hmac-key"])
def test_the_worker_key_reaches_the_pod_only_as_a_secret_reference(monkeypatch, setting):
    """``VLLM_BATCH_WORKER_KEY`` is in the pod's env exactly once, as a secretKeyRef to the Secret that
    ``[vllm_batch] kubernetes_signing_secret`` names; no key is in the pod; pod settings naming another Secret for
    it, or the deployment's own key (``secret_env`` naming ``VLLM_BATCH_SIGNING_KEY``), build no pod at all."""
    from airflow.sdk.exceptions import AirflowFailException

    from tests.conftest import TEST_SIGNING_KEY, TEST_WORKER_KEY

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", setting)
    secret, key = setting.split(":")
    for name in ("VLLM_BATCH_WORKER_KEY", "VLLM_BATCH_SIGNING_KEY"):
        other = {**SETTINGS, "secret_env": {**SETTINGS["secret_env"], name: {"name": "x", "key": "y"}}}
        op = operator(other)
        with pytest.raises(AirflowFailException, match=rf"cannot set \['{name}'\]"):
            op.prepare_pod()
        assert op.parts is None
    for settings in (SETTINGS,):
        op = operator(settings)
        pod = op.build_pod_request_obj(create_context(op, map_index=3))
        signing = [e for c in pod.spec.containers for e in c.env or [] if e.name == "VLLM_BATCH_WORKER_KEY"]
        assert len(signing) == 1 and signing[0].value is None
        ref = signing[0].value_from.secret_key_ref
        assert (ref.name, ref.key) == (secret, key)
        assert not [e for c in pod.spec.containers for e in c.env or [] if e.name == "VLLM_BATCH_SIGNING_KEY"]
        text = json.dumps(manifest(pod))
        assert TEST_SIGNING_KEY not in text and TEST_WORKER_KEY not in text
        assert "AIRFLOW__VLLM_BATCH__SIGNING_KEY" not in text


def test_a_shard_value_that_names_no_sealed_plan_builds_no_pod():
    """A bare shard id, or the plan task's value of a run planned before per-role keys: fails without retry."""
    from airflow.sdk.exceptions import AirflowFailException

    old_value = {k: v for k, v in SHARD.items() if k not in PLAN_REF}
    for value in (old_value, SHARD["shard_id"]):
        op = operator()
        op.shard = value
        with pytest.raises(AirflowFailException, match="names no sealed plan"):
            op.prepare_pod()
        assert op.parts is None


def test_a_literal_signing_key_in_the_pod_env_is_refused_before_any_pod_exists():
    from airflow.sdk.exceptions import AirflowFailException

    literal = "forged-" + "x" * 40
    op = operator({**SETTINGS, "env": {"VLLM_BATCH_SIGNING_KEY": literal}})
    with pytest.raises(AirflowFailException, match="looks like a secret: pass it with secret_env"):
        op.build_pod_request_obj(create_context(op, map_index=3))
    op = operator()
    op.env = {"VLLM_BATCH_SIGNING_KEY": literal}  # the task's env (shard_env), as rendered
    with pytest.raises(AirflowFailException, match="looks like a secret"):
        op.prepare_pod()
    assert op.parts is None


def test_a_refused_secret_literal_in_the_pod_settings_is_not_echoed_into_the_task_log(monkeypatch):
    """pydantic's message repeats the value it refuses (``input_value={'HF_TOKEN': 'hf_...'}``): until 2026-12 a
    token set as a literal in ``[vllm_batch] kubernetes_defaults`` or a settings Variable was refused, and
    shown in every shard task's log to whoever may read it."""
    from airflow.sdk.exceptions import AirflowFailException

    token = "hf_LEAKCANARY0123456789"
    cases = [
        ({**SETTINGS, "env": {"HF_TOKEN": token}}, None),
        ({**SETTINGS, "env": {"OK_NAME": "x", "bad name": token}}, None),  # refused for its name, beside a value
        (SETTINGS, json.dumps({"env": {"WANDB_API_KEY": token}})),  # the deployment's kubernetes_defaults
    ]
    for settings, defaults in cases:
        if defaults is not None:
            monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_DEFAULTS", defaults)
        op = operator(settings)
        with pytest.raises(AirflowFailException) as e:
            op.build_pod_request_obj(create_context(op, map_index=0))
        assert "invalid kubernetes settings" in str(e.value) and token not in str(e.value), e.value


def test_operator_defaults_and_template_fields():
    op = operator()
    assert op.durable is True and op.get_logs is True and op.do_xcom_push is True
    assert op.on_kill_action.value == "delete_pod" and op.on_finish_action.value == "delete_pod"
    assert {"spec", "shard", "kubernetes", "env"} <= set(op.template_fields)
    assert not {"cmds", "arguments", "image", "env_vars"} & set(op.template_fields)  # set from the spec only


@pytest.mark.parametrize("configured", ["True", "False"])
def test_deferrable_follows_the_operators_default_deferrable_setting(configured, monkeypatch):
    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator

    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", configured)
    assert operator().deferrable is (configured == "True")
    explicit = VllmKubernetesShardOperator(task_id="s", spec={}, shard=SHARD, deferrable=configured != "True")
    assert explicit.deferrable is (configured != "True")  # an argument wins over the setting


def test_the_rendered_pod_task_streams_its_log_and_bounds_scale_up_and_image_pull_separately():
    """Deferred, KPO reads the pod's log only at the end unless ``logging_interval`` is set (its docstring);
    ``schedule_timeout_seconds`` (waiting for a node) and ``startup_timeout_seconds`` (pulling the image)
    are separate waits."""
    op = operator()
    op.build_pod_request_obj(create_context(op, map_index=3))
    assert (op.logging_interval, op.schedule_timeout_seconds, op.startup_timeout_seconds) == (30, 1800, 900)
    op = operator({**SETTINGS, "log_interval_s": 10, "schedule_timeout_s": 3600, "startup_timeout_s": 600})
    op.build_pod_request_obj(create_context(op, map_index=3))
    assert (op.logging_interval, op.schedule_timeout_seconds, op.startup_timeout_seconds) == (10, 3600, 600)
    # deferring: KPO's own invoke_defer_method hands the trigger these values
    from airflow.sdk.exceptions import TaskDeferred

    op.pod = op.build_pod_request_obj(create_context(op, map_index=3))
    with pytest.raises(TaskDeferred) as deferred:
        op.invoke_defer_method()
    trigger = deferred.value.trigger
    assert (trigger.logging_interval, trigger.schedule_timeout, trigger.startup_timeout) == (10, 3600, 600)
    assert trigger.get_logs is True


def test_manifest_validates_against_the_kubernetes_openapi_schema():
    import kubernetes_validate

    op = operator(engine={"tensor_parallel_size": 2})
    doc = manifest(op.build_pod_request_obj(create_context(op, map_index=3)))
    from kubernetes_validate.utils import latest_version

    for version in ("1.30", latest_version()):  # strict: unknown fields are errors too
        assert version.startswith(kubernetes_validate.validate(doc, version, strict=True))
    broken = json.loads(json.dumps(doc))
    broken["spec"]["containers"][0]["resources"]["limits"]["memory"] = ["34Gi"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, latest_version(), strict=True)  # the validator does reject bad manifests


def test_manifest_passes_every_pod_security_standards_restricted_rule():
    op = operator()
    doc = manifest(op.build_pod_request_obj(create_context(op, map_index=3)))
    assert violations(doc) == {}
    # the checker catches what the profile forbids
    bad = json.loads(json.dumps(doc))
    bad["spec"]["hostNetwork"] = True
    bad["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    c = bad["spec"]["containers"][0]
    c["securityContext"].update(
        privileged=True,
        allowPrivilegeEscalation=True,
        runAsUser=0,
        capabilities={"add": ["SYS_ADMIN"]},
        readOnlyRootFilesystem=False,
        seccompProfile={"type": "Unconfined"},
    )
    c["ports"] = [{"containerPort": 80, "hostPort": 80}]
    bad["spec"]["containers"][1]["securityContext"]["runAsNonRoot"] = False
    found = violations(bad)
    assert set(found) == {
        "baseline/host-namespaces",
        "baseline/privileged-containers",
        "baseline/capabilities",
        "baseline/hostpath-volumes",
        "baseline/host-ports",
        "baseline/seccomp",
        "restricted/volume-types",
        "restricted/privilege-escalation",
        "restricted/run-as-non-root",
        "restricted/run-as-non-root-user",
        "restricted/seccomp",
        "restricted/capabilities",
        "extra/read-only-root-filesystem",
    }


def test_tensor_parallel_pod_has_two_gpus_and_shm_for_nccl():
    op = operator({**SETTINGS, "gpu_resource": "nvidia.com/gpu"}, engine={"tensor_parallel_size": 2})
    pod = op.build_pod_request_obj(create_context(op, map_index=0))
    c = base(pod)
    assert c.resources.limits["nvidia.com/gpu"] == "2"
    (dshm,) = [v for v in pod.spec.volumes if v.name == "dshm"]
    assert dshm.empty_dir.medium == "Memory" and dshm.empty_dir.size_limit == "16Gi"
    assert c.resources.limits["memory"] == "80Gi"  # 2 x 32Gi + the 16Gi shm it must hold
    env = {e.name: e.value for e in c.env}
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == (
        "0",
        "1",
        "1",
    )


def test_job_section_wins_over_the_variable_and_shard_env_joins():
    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator

    spec = make_spec(
        "/in",
        "/out",
        kubernetes={"kueue_queue": "urgent", "gpus": 4, "env": {"LOG": "debug"}},
        engine={"tensor_parallel_size": 4},
    )
    op = VllmKubernetesShardOperator(
        task_id="s",
        spec=spec.model_dump(mode="json"),
        shard=SHARD,
        kubernetes=SETTINGS,
        env={"VLLM_BATCH_LOG_LEVEL": "DEBUG", "LOG": "x"},
    )
    pod = op.build_pod_request_obj(create_context(op, map_index=1))
    assert pod.metadata.labels["kueue.x-k8s.io/queue-name"] == "urgent"
    assert pod.metadata.namespace == "vllm-batch"  # from the Variable
    env = {e.name: e.value for e in base(pod).env}
    assert env["VLLM_BATCH_LOG_LEVEL"] == "DEBUG" and env["LOG"] == "debug"
    assert base(pod).resources.limits["nvidia.com/gpu"] == "4"


def test_bad_settings_fail_without_retry_naming_the_field():
    from airflow.sdk.exceptions import AirflowFailException

    op = operator({**SETTINGS, "gpus": "many"})
    with pytest.raises(AirflowFailException, match="gpus"):
        op.build_pod_request_obj(create_context(op, map_index=0))
    op = operator({**SETTINGS, "env": {"HF_TOKEN": "hf_x"}})
    with pytest.raises(AirflowFailException, match="secret_env"):
        op.build_pod_request_obj(create_context(op, map_index=0))
    op = operator("{not json")
    with pytest.raises(AirflowFailException, match="invalid kubernetes settings"):
        op.build_pod_request_obj(create_context(op, map_index=0))


def test_pod_template_file_passes_through_and_hardening_wins(tmp_path):
    template = tmp_path / "pod.yaml"
    template.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  annotations: {team: ml-platform}\n"
        "spec:\n  dnsConfig: {options: [{name: ndots, value: '2'}]}\n"
        "  containers:\n  - name: base\n    securityContext: {privileged: true, readOnlyRootFilesystem: false}\n"
        "    workingDir: /tmp\n"
    )
    op = operator({**SETTINGS, "pod_template_file": str(template)})
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    assert pod.metadata.annotations["team"] == "ml-platform"
    assert pod.spec.dns_config.options[0].name == "ndots" and base(pod).working_dir == "/tmp"
    sc = base(pod).security_context
    assert sc.privileged is False and sc.read_only_root_filesystem is True
    assert violations(manifest(pod)) == {}


@pytest.mark.reliability
def test_no_secret_value_in_args_env_literals_or_logs(monkeypatch, caplog, capsys):
    """Secrets on the Airflow worker never reach the pod spec or the task log; the pod names Secrets."""
    secret_values = {
        "HF_TOKEN": "hf_LEAKCANARY0123456789",
        "AWS_SECRET_ACCESS_KEY": "aws/LEAKCANARY+abcdef",
        "AWS_ACCESS_KEY_ID": "AKIALEAKCANARY000",
    }
    for k, v in secret_values.items():
        monkeypatch.setenv(k, v)  # present in the scheduler/worker environment, as on many deployments
    caplog.set_level(logging.DEBUG)
    op = operator()
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    op.dry_run()
    text = json.dumps(manifest(pod)) + capsys.readouterr().out + caplog.text
    c = base(pod)
    literals = [e.value for e in c.env if e.value is not None]
    leaked = [k for k, v in secret_values.items() if v in text or any(v in x for x in literals + c.args)]
    # they arrive as Secret references, and so does the deployment's signing key
    assert {e.name for e in c.env if e.value_from} == set(secret_values) | {"VLLM_BATCH_WORKER_KEY"}
    record_malicious(
        "secret_value_into_pod_spec_or_log", tried=len(secret_values), rejected=len(secret_values) - len(leaked)
    )
    assert leaked == []


def test_worker_exit_codes_map_to_fail_or_retry(monkeypatch):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
    from kubernetes.client import models as k8s

    from airflow_provider_vllm.operators.kubernetes import worker_exit_code

    def pod_exited(code):
        state = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=code))
        return k8s.V1Pod(
            status=k8s.V1PodStatus(
                phase="Failed",
                container_statuses=[
                    k8s.V1ContainerStatus(
                        name="base", state=state, image="i", image_id="", ready=False, restart_count=0
                    )
                ],
            )
        )

    def kpo_failure(self, pod, remote_pod, xcom_result=None, context=None):
        raise AirflowException(f"Pod {pod.metadata.name} returned a failure.")  # what KPO's cleanup raises

    monkeypatch.setattr(KubernetesPodOperator, "cleanup", kpo_failure)
    op = operator()
    pod = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p"))
    manifest_doc = {"status": "failed", "error": "SpecError", "message": "bad spec", "terminal": True}
    with pytest.raises(AirflowFailException, match=r"exit 2, not retried\): SpecError: bad spec"):
        op.cleanup(pod, pod_exited(2), xcom_result=manifest_doc)
    for code, text in [(75, "exit 75, retried"), (137, "exited 137"), (1, "exited 1")]:
        with pytest.raises(AirflowException, match=text) as e:
            op.cleanup(pod, pod_exited(code))
        assert not isinstance(e.value, AirflowFailException)
    assert worker_exit_code(pod_exited(2), "base") == 2 and worker_exit_code(pod, "base") is None
    monkeypatch.setattr(KubernetesPodOperator, "cleanup", lambda *a, **k: None)
    done = {
        "status": "committed",
        "shard_id": SHARD["shard_id"],
        "attempt_id": "a1",
        "rows": 5,
        "ok_rows": 5,
        "error_rows": 0,
        "stats": {},
    }
    op.cleanup(pod, pod_exited(0), xcom_result=done)  # success passes through
    with pytest.raises(AirflowException, match="exited 0 without its manifest") as e:  # as the local runner
        op.cleanup(pod, pod_exited(0), xcom_result={**done, "shard_id": "another"})
    assert not isinstance(e.value, AirflowFailException)
    with pytest.raises(AirflowException, match="its manifest is not one this provider reads .*rows") as e:
        op.cleanup(pod, pod_exited(0), xcom_result={"status": "committed", "shard_id": SHARD["shard_id"]})
    assert not isinstance(e.value, AirflowFailException)


def test_kpo_failure_class_is_the_one_the_operator_catches():
    """The provider raises its compat AirflowException: the same class Airflow's retry logic sees."""
    from airflow.providers.common.compat.sdk import AirflowException as Compat
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    assert Compat is AirflowException and issubclass(AirflowFailException, AirflowException)


def test_dockerfile_entrypoint_is_the_worker_command_entrypoint():
    from airflow_provider_vllm.utils.pod_spec import WORKER_PYTHON
    from airflow_provider_vllm.worker.task import worker_command

    text = (ROOT / "docker" / "Dockerfile.worker").read_text()
    (entry,) = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    task = shard_task(spec=make_spec("/in", "/out"), shard_id=SHARD["shard_id"])
    assert json.loads(entry) == worker_command(task, python=WORKER_PYTHON)[:-1]
    assert "CMD" not in re.findall(r"^(\w+)", text, re.M)  # the shard task is the only argument


def test_images_are_pinned_by_digest_as_the_lock_says():
    lock = {}
    for line in (ROOT / "docker" / "images.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, ref = line.split("=", 1)
            lock[name.strip()] = ref.strip()
    assert re.fullmatch(r"vllm/vllm-openai:v[\d.]+@sha256:[0-9a-f]{64}", lock["VLLM_IMAGE"])
    worker = (ROOT / "docker" / "Dockerfile.worker").read_text()
    assert f"ARG VLLM_IMAGE={lock['VLLM_IMAGE']}" in worker and "FROM ${VLLM_IMAGE}" in worker
    airflow = (ROOT / "docker" / "Dockerfile.airflow").read_text()
    assert "FROM ${AIRFLOW_IMAGE}" in airflow and lock["AIRFLOW_IMAGE"].startswith("apache/airflow:3.3.2")
    assert re.search(r"pip install --no-cache-dir --no-deps /wheels/\*\.whl", worker) and re.search(
        r"^USER\s+1000", worker, re.M
    )


def test_pin_digests_script_pins_and_checks(tmp_path):
    """docker/pin-digests.sh with a stand-in for `crane` (no registry here): it pins, rewrites, checks."""
    import shutil
    import subprocess

    work = tmp_path / "docker"
    shutil.copytree(ROOT / "docker", work)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    digests = tmp_path / "digests"
    (bin_dir / "crane").write_text(
        f'#!/bin/sh\n[ "$1" = digest ] || exit 3\ngrep -F "$2 " {digests} | cut -d\' \' -f2\n'
    )
    (bin_dir / "crane").chmod(0o755)
    lock = dict(
        line.split("=", 1)
        for line in (work / "images.lock").read_text().splitlines()
        if line and not line.startswith("#")
    )
    vllm_tag, vllm_digest = lock["VLLM_IMAGE"].split("@")
    tags = {k: v.split("@")[0] for k, v in lock.items()}
    # the registry's answer: what the lock pins where it pins, else a new digest
    new = {
        k: lock[k].split("@")[1] if "@" in lock[k] else "sha256:" + str(i) * 64
        for i, k in ((1, "AIRFLOW_IMAGE"), (2, "VLLM_CPU_IMAGE"))
    }
    digests.write_text(
        f"{vllm_tag} {vllm_digest}\n{tags['AIRFLOW_IMAGE']} {new['AIRFLOW_IMAGE']}\n"
        f"{tags['VLLM_CPU_IMAGE']} {new['VLLM_CPU_IMAGE']}\n"
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    run = lambda *a: subprocess.run(
        ["bash", str(work / "pin-digests.sh"), *a], env=env, capture_output=True, text=True, timeout=60
    )
    assert run("--check").returncode == 0  # unpinned entries are not a mismatch
    p = run()
    assert p.returncode == 0, p.stderr
    pinned = (work / "images.lock").read_text()
    assert f"AIRFLOW_IMAGE={tags['AIRFLOW_IMAGE']}@{new['AIRFLOW_IMAGE']}" in pinned
    assert f"VLLM_CPU_IMAGE={tags['VLLM_CPU_IMAGE']}@{new['VLLM_CPU_IMAGE']}" in pinned
    assert f"VLLM_IMAGE={lock['VLLM_IMAGE']}" in pinned and "# VLLM_IMAGE:" in pinned  # kept, comments kept
    digests.write_text(digests.read_text().replace(vllm_digest, "sha256:" + "3" * 64))  # the tag moved
    p = run("--check")
    assert p.returncode == 1 and "VLLM_IMAGE" in p.stderr and "now points to sha256:333" in p.stderr
    assert run().returncode == 0
    assert f"ARG VLLM_IMAGE={vllm_tag}@sha256:{'3' * 64}" in (work / "Dockerfile.worker").read_text()


def test_operator_dry_run_prints_a_manifest_kubectl_takes(capsys):
    import kubernetes_validate
    import yaml
    from kubernetes_validate.utils import latest_version

    op = operator()
    op.dry_run()
    out = capsys.readouterr().out
    doc = yaml.safe_load(out[out.index("apiVersion: v1\n") :])  # after Airflow's own log lines (also stdout)
    assert doc["kind"] == "Pod" and "map_index" not in doc["metadata"]["labels"]  # no task instance in a dry run
    assert doc["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True  # camelCase keys
    assert latest_version().startswith(kubernetes_validate.validate(doc, latest_version(), strict=True))
    assert violations(doc) == {}


@pytest.mark.reliability
def test_allow_list_is_checked_before_the_pod_exists_and_reaches_the_worker_env(monkeypatch):
    """The deployment's allow-list: a spec outside it fails before any pod spec; inside, the pod's
    env carries the list (set last, so the settings' env cannot widen it)."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.core.allow_list import ALLOWED_PREFIXES_ENV

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", "/in/,/out/")
    widened = {**SETTINGS, "env": {ALLOWED_PREFIXES_ENV: '["/"]'}}
    op = operator(settings=widened)
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    env = {e.name: e.value for e in base(pod).env if e.value is not None}
    assert json.loads(env[ALLOWED_PREFIXES_ENV]) == ["/in", "/out"]  # canonical form
    assert [e.name for e in base(pod).env].count(ALLOWED_PREFIXES_ENV) == 1

    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator

    outside = make_spec("/in", "/elsewhere/out").model_dump(mode="json")
    bad = VllmKubernetesShardOperator(task_id="shard", spec=outside, shard=SHARD, kubernetes=json.dumps(SETTINGS))
    with pytest.raises(AirflowFailException, match="elsewhere"):
        bad.build_pod_request_obj(create_context(bad, map_index=3))
    assert getattr(bad, "parts", None) is None  # refused before any pod part was built
    record_malicious("k8s_output_outside_allow_list", 1, 1)


VARIABLE_TEMPLATE = "{{ var.value.get('vllm_batch_kubernetes', '{}') }}"  # the builder's default


def rendered_operator(raw_kubernetes, rendered_kubernetes, raw_env=None, rendered_env=None, spec_over=None):
    """A shard operator built from DAG-file values, its fields as Airflow's render leaves them."""
    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator

    spec = make_spec("/in", "/out", **(spec_over or {})).model_dump(mode="json")
    op = VllmKubernetesShardOperator(task_id="shard", spec=spec, shard=SHARD, kubernetes=raw_kubernetes, env=raw_env)
    op.kubernetes, op.env = rendered_kubernetes, rendered_env
    return op


@pytest.mark.reliability
def test_pod_identity_from_a_variable_needs_the_deployments_opt_in_and_never_comes_from_a_trigger(monkeypatch):
    """image, service account, namespace, env, Secrets, PVCs, pod template from the vllm_batch_kubernetes
    Variable: refused before any pod spec exists unless [vllm_batch] deployment_settings_from_variables;
    from a trigger (params, dag_run.conf) always refused."""
    from airflow.sdk.exceptions import AirflowFailException

    hostile = {
        "image": "evil.example/miner:latest",
        "service_account": "cluster-admin",
        "namespace": "kube-system",
        "env": {"LD_PRELOAD": "/tmp/x.so"},
        "env_from_secrets": ["prod-db"],
        "secret_env": {"AWS_SECRET_ACCESS_KEY": {"name": "other-team", "key": "k"}},
        "hf_token_secret": {"name": "other-team", "key": "token"},
        "pod_template_file": "/tmp/privileged.yaml",
        "data_pvc": "other-team-data",
        "model_cache_read_only": False,
        "annotations": {"iam.amazonaws.com/role": "admin"},
        "runtime_class": "unconfined",
    }
    tried = rejected = 0
    for field, value in hostile.items():
        for raw in (VARIABLE_TEMPLATE, "{{ params.pod }}", "{{ dag_run.conf['pod'] | tojson }}"):
            tried += 1
            op = rendered_operator(raw, json.dumps({"gpus": 1, field: value}))
            try:
                op.prepare_pod()
            except AirflowFailException as e:
                if f"kubernetes.{field} is deployment-owned" in str(e) and op.parts is None:
                    rejected += 1
                    continue
                print(f"REFUSED FOR ANOTHER REASON {field} via {raw}: {e}")
            else:
                print(f"ACCEPTED {field} via {raw}")
    # shard_env (the builder's templated env) from a trigger
    for raw_env in ({"X": "{{ params.x }}"}, {"X": "{{ dag_run.conf['x'] }}"}):
        tried += 1
        op = rendered_operator(json.dumps({"gpus": 1}), json.dumps({"gpus": 1}), raw_env, {"X": "y"})
        with pytest.raises(AirflowFailException, match="kubernetes.env is deployment-owned"):
            op.prepare_pod()
        rejected += 1
    record_malicious("pod_identity_from_variable_or_trigger", tried, rejected)
    assert rejected == tried
    # placement and sizes from the Variable are fine, and the deployment config supplies the identity
    monkeypatch.setenv(
        "AIRFLOW__VLLM_BATCH__KUBERNETES_DEFAULTS",
        json.dumps({"image": "registry.example.com/w:1", "service_account": "vllm-batch", "namespace": "ml"}),
    )
    # (gpus must equal the engine's tensor x pipeline parallel size: 1 here)
    op = rendered_operator(VARIABLE_TEMPLATE, json.dumps({"gpus": 1, "kueue_queue": "gpu", "memory": "64Gi"}))
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    assert base(pod).image == "registry.example.com/w:1" and pod.spec.service_account_name == "vllm-batch"
    assert pod.metadata.namespace == "ml" and base(pod).resources.limits["nvidia.com/gpu"] == "1"
    # with the opt-in, the Variable may set the identity too; a trigger still may not
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__DEPLOYMENT_SETTINGS_FROM_VARIABLES", "True")
    op = rendered_operator(VARIABLE_TEMPLATE, json.dumps({"image": "registry.example.com/w:2"}))
    assert base(op.build_pod_request_obj(create_context(op, map_index=3))).image == "registry.example.com/w:2"
    op = rendered_operator("{{ params.pod }}", json.dumps({"image": "evil/x"}))
    with pytest.raises(AirflowFailException, match="trigger params"):
        op.prepare_pod()


@pytest.mark.parametrize("code", [*ExitCode, 1, 137, -9])
def test_both_runners_map_every_exit_code_through_the_one_table(monkeypatch, code):
    """The local runner and the Kubernetes operator end a shard the same way for each exit code, as
    ``core/exit_codes.py`` says: success returns the manifest, FAIL -> AirflowFailException, RETRY -> retried."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
    from kubernetes.client import models as k8s

    from airflow_provider_vllm.core.exit_codes import Outcome, outcome
    from airflow_provider_vllm.operators.shard import VllmLocalShardOperator
    from airflow_provider_vllm.utils.worker_process import WorkerResult

    shard_id = SHARD["shard_id"]
    if outcome(code) is Outcome.SUCCESS:
        doc = {
            "status": "committed",
            "shard_id": shard_id,
            "attempt_id": "a1",
            "rows": 5,
            "ok_rows": 5,
            "error_rows": 0,
            "stats": {},
        }
    else:
        doc = {"status": "failed", "error": "SpecError", "message": "bad", "terminal": code == 2}
    local = VllmLocalShardOperator(task_id="local", spec={}, shard=SHARD)
    state = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=code))
    pod_done = k8s.V1Pod(
        status=k8s.V1PodStatus(
            phase="Failed" if code else "Succeeded",
            container_statuses=[
                k8s.V1ContainerStatus(name="base", state=state, image="i", image_id="", ready=False, restart_count=0)
            ],
        )
    )

    def kpo_cleanup(self, pod, remote_pod, xcom_result=None, context=None):
        if code != 0:
            raise AirflowException("Pod p returned a failure.")  # what KPO's cleanup raises

    monkeypatch.setattr(KubernetesPodOperator, "cleanup", kpo_cleanup)
    kube = operator()

    def ending(run):
        try:
            return run(), None
        except AirflowException as e:
            return None, type(e)

    local_value, local_exc = ending(lambda: local._outcome(shard_id, WorkerResult(code, doc, [])))
    _, kube_exc = ending(
        lambda: kube.cleanup(k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p")), pod_done, xcom_result=doc)
    )
    expected = {Outcome.SUCCESS: None, Outcome.FAIL: AirflowFailException, Outcome.RETRY: AirflowException}
    assert local_exc is kube_exc is expected[outcome(code)]
    if local_exc is None:
        assert local_value == doc
        # success without this shard's manifest: retried by both
        _, local_exc = ending(lambda: local._outcome(shard_id, WorkerResult(code, None, [])))
        _, kube_exc = ending(lambda: kube.cleanup(k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p")), pod_done))
        assert local_exc is kube_exc is AirflowException


# ---- the shared compile cache (docs/adr/0008-shared-compile-cache.md) -------------------------------
CLAIM = "vllm-compile-cache"


def _compile_cache_parts(pod):
    vols = [v for v in pod.spec.volumes if v.name == "compile-cache"]
    mounts = [m for m in base(pod).volume_mounts if m.name == "compile-cache"]
    env = {e.name: e.value for e in base(pod).env if e.name.startswith("VLLM_BATCH_COMPILE_CACHE")}
    return vols, mounts, env


def test_the_deployments_compile_cache_claim_is_mounted_and_the_pod_keys_its_snapshot_folder(monkeypatch, tmp_path):
    """Rendered as the cncf provider renders pods: the claim of ``[vllm_batch] kubernetes_compile_cache_pvc`` at
    /compile-cache, read-write, named to the worker; the pod stays PSS restricted (no hostPath). The worker of that
    pod, with that environment, restores and publishes under /compile-cache/<key>: a key that another model, GPU
    type or vLLM never shares."""
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.worker import compile_cache
    from tests.conftest import TEST_SIGNING_KEY

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", CLAIM)
    op = operator()
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    (vol,), (mount,), env = _compile_cache_parts(pod)
    assert vol.persistent_volume_claim.claim_name == CLAIM and not vol.persistent_volume_claim.read_only
    assert mount.mount_path == "/compile-cache" and not mount.read_only
    assert env == {"VLLM_BATCH_COMPILE_CACHE": "/compile-cache"}
    doc = manifest(pod)
    assert violations(doc) == {} and all("hostPath" not in v for v in doc["spec"]["volumes"])
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(doc, latest_version(), strict=True)

    # the worker in that pod: its env, with the claim's mount point standing in a local folder
    pod_env = {e.name: e.value for e in base(pod).env if e.value is not None}
    (tmp_path / "compile-cache").mkdir()
    local = {**pod_env, "VLLM_BATCH_COMPILE_CACHE": str(tmp_path / "compile-cache")}
    spec = JobSpec.load(op.spec)
    keyring = Keyring.from_text(TEST_SIGNING_KEY).worker_keyring()
    monkeypatch.setattr(compile_cache, "accelerator", lambda: "gpu:NVIDIA H200 (cc 9.0)")
    cache = compile_cache.from_env(spec, keyring, local)
    assert cache is not None and cache.folder == tmp_path / "compile-cache" / cache.key
    assert re.fullmatch(r"[0-9a-f]{32}", cache.key)
    assert cache.dirs == {"vllm": "/cache/vllm", "torchinductor": "/cache/torchinductor", "triton": "/cache/triton"}
    assert cache.facts["model"]["name"] == "fake" and cache.facts["accelerator"] == "gpu:NVIDIA H200 (cc 9.0)"
    other_model = JobSpec.load({**op.spec, "model": {**op.spec["model"], "name": "other"}})
    assert compile_cache.from_env(other_model, keyring, local).key != cache.key
    monkeypatch.setattr(compile_cache, "accelerator", lambda: "gpu:NVIDIA A100-SXM4-80GB (cc 8.0)")
    assert compile_cache.from_env(spec, keyring, local).key != cache.key


def test_no_compile_cache_unless_the_deployment_names_a_claim(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", raising=False)
    op = operator()
    assert _compile_cache_parts(op.build_pod_request_obj(create_context(op, map_index=3))) == ([], [], {})
    bad_claims = ("/var/lib/vllm-cache", "Claim", "hostPath:/x", "a" * 254)
    for bad in bad_claims:
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", bad)
        with pytest.raises(AirflowFailException, match="kubernetes_compile_cache_pvc"):
            operator().build_pod_request_obj(create_context(op, map_index=3))
    record_malicious("k8s_compile_cache_claim_not_a_claim", len(bad_claims), len(bad_claims))


def test_neither_a_job_nor_the_pod_settings_choose_the_compile_cache(monkeypatch):
    """The claim is the deployment's option alone: the job's kubernetes section has no such field, and its env
    cannot point the worker at another folder or switch publishing on."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.core.errors import SpecError

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", CLAIM)
    with pytest.raises((SpecError, ValueError), match="compile_cache_pvc"):
        make_spec("/in", "/out", kubernetes={"compile_cache_pvc": "mine"})
    for name in ("VLLM_BATCH_COMPILE_CACHE", "VLLM_BATCH_COMPILE_CACHE_PUBLISH"):
        op = operator({**SETTINGS, "env": {name: "/data"}})
        with pytest.raises(AirflowFailException, match="kubernetes_compile_cache_pvc"):
            op.build_pod_request_obj(create_context(op, map_index=3))
    record_malicious("k8s_compile_cache_from_job_or_env", 3, 3)


def test_a_job_that_may_run_model_repo_code_mounts_the_compile_cache_read_only(monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", CLAIM)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_REMOTE_CODE", "True")
    op = operator(model={"trust_remote_code": True, "revision": "0" * 40})
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    (vol,), (mount,), env = _compile_cache_parts(pod)
    assert vol.persistent_volume_claim.read_only and mount.read_only
    assert env == {"VLLM_BATCH_COMPILE_CACHE": "/compile-cache", "VLLM_BATCH_COMPILE_CACHE_PUBLISH": "0"}


HOSTILE_POD_TEMPLATE = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "x"},
    "spec": {
        "containers": [
            {"name": "base", "image": "ignored"},
            {"name": "sidecar", "image": "{{ params.sidecar_image }}", "securityContext": {"privileged": True}},
        ],
        "hostNetwork": True,
    },
}


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("arg", "raw", "rendered"),
    [
        ("pod_template_dict", HOSTILE_POD_TEMPLATE, {**HOSTILE_POD_TEMPLATE, "kind": "Pod"}),
        ("kubernetes_conn_id", "{{ params.cluster }}", "prod_cluster_admin"),
        ("config_file", "{{ dag_run.conf['kubeconfig'] }}", "/tmp/attacker-kubeconfig"),
        ("cluster_context", "{{ params.ctx }}", "admin@prod"),
        ("configmaps", ["{{ params.cm }}"], ["prod-secrets"]),
    ],
)
def test_the_cluster_its_identity_and_unchecked_pod_parts_never_come_from_the_trigger(arg, raw, rendered):
    """KPO's own arguments that choose the cluster, its credentials or pod spec parts the provider does not check
    are not template fields of the shard task, and one the DAG file wrote as a template over trigger values is
    refused before any pod spec exists; the same argument as a DAG-file literal still builds the pod."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator

    assert arg not in VllmKubernetesShardOperator.template_fields
    spec = make_spec("/in", "/out").model_dump(mode="json")
    op = VllmKubernetesShardOperator(
        task_id="shard", spec=spec, shard=SHARD, kubernetes=json.dumps(SETTINGS), **{arg: raw}
    )
    setattr(op, arg, rendered)  # as a renderer would
    with pytest.raises(AirflowFailException, match=rf"{arg} is deployment-owned and came from the trigger|{arg}"):
        op.build_pod_request_obj(create_context(op, map_index=3))
    assert op.parts is None
    literal = VllmKubernetesShardOperator(
        task_id="shard", spec=spec, shard=SHARD, kubernetes=json.dumps(SETTINGS), kubernetes_conn_id="gpu_cluster"
    )
    assert literal.prepare_pod().image == SETTINGS["image"] and literal.kubernetes_conn_id == "gpu_cluster"
    record_malicious("kpo_cluster_settings_from_trigger", 1, 1)


def test_the_pod_tells_the_worker_which_variables_came_from_secrets_and_no_env_unlists_them():
    """The worker masks the values of the variables the deployment set from Secrets whatever their names
    (``DB_PASS``): the pod names them in ``VLLM_BATCH_MASKED_ENV``, set last, so neither the pod settings' ``env``
    nor the task's ``shard_env`` shorten the list; values stay Secret references."""
    odd = {**SETTINGS, "secret_env": {**SETTINGS["secret_env"], "DB_PASS": {"name": "db", "key": "pass"}}}
    for env in (None, {"VLLM_BATCH_MASKED_ENV": ""}):
        op = operator({**odd, "env": env or {}})
        if env:
            op.env = {"VLLM_BATCH_MASKED_ENV": "NOTHING"}  # the task's env (shard_env), as rendered
        pod = op.build_pod_request_obj(create_context(op, map_index=3))
        listed = [e for e in base(pod).env if e.name == "VLLM_BATCH_MASKED_ENV"]
        assert len(listed) == 1
        assert listed[0].value.split(",") == [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "DB_PASS",
            "HF_TOKEN",
            "VLLM_BATCH_WORKER_KEY",
        ]
        db = [e for e in base(pod).env if e.name == "DB_PASS"]
        assert db[0].value is None and db[0].value_from.secret_key_ref.name == "db"


def test_the_keys_of_a_secret_the_pod_takes_whole_reach_the_worker_as_a_folder_to_list():
    """``env_from_secrets`` gives the pod every key of a Secret as a variable, and only the cluster knows the keys:
    the pod also mounts the Secret read-only (files readable by root only: the worker lists names, never reads
    values) and names the folders in ``VLLM_BATCH_MASKED_ENV_DIRS``, set last."""
    op = operator({**SETTINGS, "env_from_secrets": ["prod-db", "vendor-api"]})
    op.env = {"VLLM_BATCH_MASKED_ENV_DIRS": "/nowhere"}  # the task's env cannot point it elsewhere
    pod = op.build_pod_request_obj(create_context(op, map_index=3))
    c = base(pod)
    (dirs,) = [e.value for e in c.env if e.name == "VLLM_BATCH_MASKED_ENV_DIRS"]
    assert dirs == "/etc/vllm-batch/env-from/0,/etc/vllm-batch/env-from/1"
    vols = {v.name: v for v in pod.spec.volumes}
    mounts = {m.mount_path: m for m in c.volume_mounts}
    for i, name in enumerate(["prod-db", "vendor-api"]):
        m = mounts[f"/etc/vllm-batch/env-from/{i}"]
        assert m.read_only and vols[m.name].secret.secret_name == name and vols[m.name].secret.default_mode == 0o400
    assert [f.secret_ref.name for f in c.env_from] == ["prod-db", "vendor-api"]


def test_the_engine_check_reads_only_the_plan_the_shard_task_names(tmp_path, monkeypatch):
    """The engine check before a pod starts reads the plan the plan task named (its seal and sha256, from XCom), never
    whatever sealed plan of the folder is at _plan.json: another plan of this deployment put back there (keyed with
    the engine the pod would run, or with no cache) must not pass the check for a run keyed with another engine."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.core.plan import PLAN_FILE, plan_sha256
    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from tests.support.data import write_parquet

    write_parquet(tmp_path / "in" / "part-0.parquet", ["a", "b"], ["one", "two"])
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps([str(tmp_path)]))
    plain = make_spec(tmp_path / "in", tmp_path / "out")
    other = plan_job(plain)  # another sealed plan of this folder: no cache, so no engine keyed
    assert (tmp_path / "out" / PLAN_FILE).exists()
    spec = make_spec(tmp_path / "in", tmp_path / "out", cache={"uri": str(tmp_path / "cache")})
    op = VllmKubernetesShardOperator(
        task_id="shard", spec=spec.model_dump(mode="json"), shard=SHARD, kubernetes=json.dumps(SETTINGS)
    )
    with pytest.raises(AirflowFailException, match="not the plan this shard task was started for"):
        op.check_engine(spec, op.settings(spec))
    # the plan the task names is the one read
    assert other.seal is not None
    named = {**SHARD, "plan_mac": other.seal.mac, "plan_sha256": plan_sha256(other)}
    op = VllmKubernetesShardOperator(
        task_id="shard", spec=spec.model_dump(mode="json"), shard=named, kubernetes=json.dumps(SETTINGS)
    )
    op.check_engine(spec, op.settings(spec))
