"""The pure pod builder: GPU counts, /dev/shm, memory, env and Secret references, for tensor
parallel and one-shard-per-GPU layouts. No Airflow, no cluster."""

from __future__ import annotations

import json

import pytest
from kubernetes.client import ApiClient

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.pod_settings import KubernetesSettings
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.utils.pod_spec import NVLS_OFF, gpu_count, pod_parts
from tests.support.data import make_spec
from tests.support.ledger import record_malicious

SHARD = "shard-00003-abcdef12"
GiB = 1024**3


def parts(settings=None, **engine):
    spec = make_spec("/in", "/out", engine=engine)
    return pod_parts(spec, KubernetesSettings.model_validate(settings or {}), SHARD)


def env_of(p):
    return {e.name: e.value for e in p.env if e.value is not None}


def test_one_gpu_per_shard_layout():
    """Data parallel on one host: one shard per pod, one GPU each; NVLS off even so."""
    p = parts()
    assert p.gpus == 1 and p.resources.limits["nvidia.com/gpu"] == "1"
    assert p.shm_size == "2Gi"
    assert p.resources.requests == {"cpu": "4", "memory": "34Gi"} and p.resources.limits["memory"] == "34Gi"
    assert {k: env_of(p)[k] for k in NVLS_OFF} == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    (dshm,) = [v for v in p.volumes if v.name == "dshm"]
    assert dshm.empty_dir.medium == "Memory" and dshm.empty_dir.size_limit == "2Gi"


@pytest.mark.parametrize(
    "tp, pp, gpus, shm", [(2, 1, 2, "16Gi"), (4, 1, 4, "32Gi"), (2, 2, 4, "32Gi"), (8, 1, 8, "64Gi")]
)
def test_tensor_and_pipeline_parallel_pods_get_tp_x_pp_gpus_and_shm_for_nccl(tp, pp, gpus, shm):
    kw = {"tensor_parallel_size": tp}
    if pp > 1:
        kw["engine_kwargs"] = {"pipeline_parallel_size": pp}
    p = parts(**kw)
    assert p.gpus == gpus and p.resources.limits["nvidia.com/gpu"] == str(gpus)
    assert p.shm_size == shm
    (dshm,) = [v for v in p.volumes if v.name == "dshm"]
    assert dshm.empty_dir.size_limit == shm
    mem = int(p.resources.limits["memory"].removesuffix("Gi"))
    assert mem == 32 * gpus + int(shm.removesuffix("Gi"))  # memory-backed shm counts against the limit
    assert all(env_of(p)[k] == v for k, v in NVLS_OFF.items())


def test_gpu_resource_name_and_count_are_configurable_and_cpu_pods_have_none():
    p = parts(
        {"gpu_resource": "nvidia.com/vgpu", "extra_resources": {"nvidia.com/gpumem": "20000"}}, tensor_parallel_size=2
    )
    assert p.resources.limits["nvidia.com/vgpu"] == "2" and "nvidia.com/gpu" not in p.resources.limits
    assert p.resources.limits["nvidia.com/gpumem"] == "20000"
    cpu = parts({"gpus": 0, "cpu": "2", "memory": "6Gi"})
    assert cpu.gpus == 0 and set(cpu.resources.limits) == {"memory"} and cpu.resources.requests["cpu"] == "2"
    assert cpu.shm_size == "2Gi"


def test_memory_must_leave_room_beyond_shm_and_pipeline_size_must_be_an_int():
    with pytest.raises(SpecError, match=r"kubernetes.memory=8Gi must exceed the /dev/shm size \(16Gi\)"):
        parts({"memory": "8Gi"}, tensor_parallel_size=2)
    spec = make_spec("/in", "/out", engine={"engine_kwargs": {"pipeline_parallel_size": "2"}})
    with pytest.raises(SpecError, match="pipeline_parallel_size must be a positive integer"):
        gpu_count(spec, KubernetesSettings())


@pytest.mark.parametrize("tp, pp, gpus", [(1, 1, 2), (1, 1, 8), (2, 1, 1), (2, 1, 4), (4, 1, 2), (2, 2, 2)])
def test_pod_gpu_request_must_equal_the_engines_gpus(tp, pp, gpus):
    """One engine per pod: a GPU count other than TP x PP (or 0, a CPU pod) is refused, naming the fields."""
    kw = {"tensor_parallel_size": tp}
    if pp > 1:
        kw["engine_kwargs"] = {"pipeline_parallel_size": pp}
    with pytest.raises(
        SpecError,
        match=rf"kubernetes.gpus={gpus} but .*engine.tensor_parallel_size x "
        rf"pipeline_parallel_size = {tp * pp} GPU",
    ):
        parts({"gpus": gpus}, **kw)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_pod_gpu_request_equals_the_layouts_tensor_parallel_size(tp):
    """The dry run's layout (gpus_per_pod) and the pod's nvidia.com/gpu limit agree, with or without kubernetes.gpus."""
    from airflow_provider_vllm.steps.plan.memory import GiB as G
    from airflow_provider_vllm.steps.plan.memory import ModelShape, choose_layout

    shape = ModelShape.from_config(
        {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
        }
    )
    lay = choose_layout(shape, requested_tp=tp, max_model_len=8192, gpu_memory_bytes=int(79.2 * G))
    assert lay.refusal is None and lay.gpus_per_pod == tp
    for settings in ({}, {"gpus": tp}):
        p = parts(settings, tensor_parallel_size=tp)
        assert p.gpus == lay.gpus_per_pod and p.resources.limits["nvidia.com/gpu"] == str(tp)
    assert parts({"gpus": 0, "memory": "6Gi"}, tensor_parallel_size=tp).gpus == 0  # CPU pod: no GPU request
    spec = make_spec("/in", "/out", engine={"engine_kwargs": {"pipeline_parallel_size": True}})
    with pytest.raises(SpecError, match="pipeline_parallel_size must be a positive integer"):
        gpu_count(spec, KubernetesSettings())


def test_caches_tmp_and_model_cache_volumes_and_env():
    p = parts({"model_cache_pvc": "hf-models", "data_pvc": "batch-data"})
    vols = {v.name: v for v in p.volumes}
    assert vols["tmp"].empty_dir is not None and vols["cache"].empty_dir is not None
    assert vols["model-cache"].persistent_volume_claim.claim_name == "hf-models"
    assert vols["model-cache"].persistent_volume_claim.read_only is True
    mounts = {m.mount_path: m for m in p.volume_mounts}
    assert set(mounts) == {"/tmp", "/cache", "/dev/shm", "/models", "/data"}
    assert mounts["/models"].read_only is True
    env = env_of(p)
    assert env["HF_HUB_CACHE"] == "/models/hub" and env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_HOME"].startswith("/cache/") and env["VLLM_CACHE_ROOT"].startswith("/cache/")
    assert env["HOME"] == "/tmp"


def test_secrets_only_as_references():
    p = parts(
        {
            "hf_token_secret": {"name": "hf", "key": "token"},
            "secret_env": {
                "AWS_ACCESS_KEY_ID": {"name": "s3", "key": "id"},
                "AWS_SECRET_ACCESS_KEY": {"name": "s3", "key": "secret"},
            },
            "env_from_secrets": ["gcs-creds"],
        }
    )
    refs = {e.name: (e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key) for e in p.env if e.value_from}
    assert refs == {
        "HF_TOKEN": ("hf", "token"),
        "AWS_ACCESS_KEY_ID": ("s3", "id"),
        "AWS_SECRET_ACCESS_KEY": ("s3", "secret"),
    }
    assert all(e.value is None for e in p.env if e.value_from)
    assert [f.secret_ref.name for f in p.env_from] == ["gcs-creds"]


@pytest.mark.parametrize(
    "settings",
    [
        {"secret_env": {"VLLM_BATCH_SIGNING_KEY": {"name": "old-signing", "key": "key"}}},
        {"secret_env": {"AIRFLOW__VLLM_BATCH__SIGNING_KEY": {"name": "airflow", "key": "signing"}}},
        {"secret_env": {"airflow__vllm_batch__signing_key_secret": {"name": "airflow", "key": "signing"}}},
        {"secret_env": {"VLLM_BATCH_WORKER_KEY": {"name": "other", "key": "key"}}},
    ],  # as literal env, each name is refused already: it looks like a secret (test_secret_values_cannot_be_put...)
)
def test_pod_settings_cannot_hand_a_pod_the_deployments_key_or_choose_its_worker_key(settings):
    """The deployment's signing key never reaches a pod, under its own name or the Airflow option's (``_CMD`` /
    ``_SECRET``, any case), and only the operator sets the worker key (``kubernetes_signing_secret``). Before, the
    operator dropped ``VLLM_BATCH_SIGNING_KEY`` silently and let the other names through to the pod, whose worker
    then refused to start only once it was scheduled on a GPU node."""
    with pytest.raises(SpecError, match=r"kubernetes\.env / secret_env cannot set .*kubernetes_signing_secret"):
        parts(settings)
    record_malicious("k8s_pod_settings_naming_a_signing_key", 1, 1)


@pytest.mark.reliability
def test_secret_values_cannot_be_put_in_the_pod_spec():
    tries = [
        lambda: KubernetesSettings(env={"HF_TOKEN": "hf_abc"}),
        lambda: KubernetesSettings(env={"AWS_SECRET_ACCESS_KEY": "x"}),
        lambda: KubernetesSettings(env={"DB_PASSWORD": "x"}),
        lambda: parts({"env": {"NCCL_NVLS_ENABLE": "1"}}),
        lambda: parts({"env": {"HF_HUB_OFFLINE": "0"}, "secret_env": {"HF_HUB_OFFLINE": {"name": "a", "key": "b"}}}),
        lambda: pod_parts(
            JobSpec.load(
                {
                    **make_spec("/in", "/out").model_dump(mode="json"),
                    "io": {
                        "input_uri": "s3://bkt/in",
                        "output_uri": "s3://bkt/out",
                        "storage_options": {"key": "AKIA", "secret": "s3cr3t"},
                    },
                }
            ),
            KubernetesSettings(),
            SHARD,
        ),
        lambda: pod_parts(
            JobSpec.load(
                {
                    **make_spec("/in", "/out").model_dump(mode="json"),
                    "io": {
                        "input_uri": "gs://bkt/in",
                        "output_uri": "gs://bkt/out",
                        "storage_options": {"sas_token": "x"},
                    },
                }
            ),
            KubernetesSettings(),
            SHARD,
        ),
    ]
    rejected = 0
    for attempt in tries:
        with pytest.raises((SpecError, ValueError)) as e:
            attempt()
        assert "secret" in str(e.value).lower() or "nvlink" in str(e.value).lower() or "both" in str(e.value)
        rejected += 1
    record_malicious("secret_literal_in_pod_spec", tried=len(tries), rejected=rejected)
    assert rejected == len(tries)


def test_placement_labels_and_affinity():
    p = parts(
        {
            "node_selector": {"cloud.google.com/gke-spot": "true"},
            "kueue_queue": "gpu-batch",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}
                                ]
                            }
                        ]
                    }
                }
            },
        }
    )
    assert p.labels["kueue.x-k8s.io/queue-name"] == "gpu-batch" and p.labels["vllm-batch/shard"] == SHARD
    assert p.node_selector == {"cloud.google.com/gke-spot": "true"}
    assert p.tolerations[0].key == "nvidia.com/gpu" and p.tolerations[0].operator == "Exists"
    term = p.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[0]
    assert term.match_expressions[0].values == ["NVIDIA-H200"]
    with pytest.raises(SpecError, match="affinity has fields"):
        parts({"affinity": {"nodeAfinity": {}}})


def test_settings_layering_and_the_spec_hash_ignores_the_kubernetes_section():
    merged = KubernetesSettings.layered({"namespace": "batch", "kueue_queue": "q1"}, {"kueue_queue": "q2"})
    assert merged.namespace == "batch" and merged.kueue_queue == "q2"
    a = make_spec("/in", "/out")
    b = make_spec("/in", "/out", kubernetes={"namespace": "other", "gpus": 2})
    assert a.content_hash() == b.content_hash() and b.kubernetes.gpus == 2
    assert "kubernetes" not in a.canonical_json()
    with pytest.raises(SpecError, match="kubernetes.gpus"):
        make_spec("/in", "/out", kubernetes={"gpus": -1})


def test_security_contexts_are_restricted():
    p = parts()
    c = ApiClient().sanitize_for_serialization(p.container_security_context)
    assert c == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod = ApiClient().sanitize_for_serialization(p.pod_security_context)
    assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    with pytest.raises(ValueError, match="run_as_user"):
        KubernetesSettings(run_as_user=0)


def test_the_pod_names_its_adapters_and_how_it_gets_each():
    from airflow_provider_vllm.utils.pod_spec import ADAPTERS_ANNOTATION, adapter_sources

    spec = JobSpec.load(
        {
            "model": {
                "name": "org/base",
                "adapters": [
                    {"name": "pvc", "source": "/models/adapters/billing"},
                    {"name": "obj", "source": "s3://bucket/adapters/refunds"},
                    {"name": "hub", "source": "org/adapter", "revision": "c" * 40},
                    {"name": "nowhere", "source": "/srv/adapters/x"},
                ],
            },
            "io": {"input_uri": "s3://bucket/in/", "output_uri": "s3://bucket/out/"},
        }
    )
    settings = KubernetesSettings.model_validate({"model_cache_pvc": "models", "model_cache_read_only": True})
    parts = pod_parts(spec, settings, SHARD)
    assert json.loads(parts.annotations[ADAPTERS_ANNOTATION]) == {
        "pvc": "/models/adapters/billing",
        "obj": "s3://bucket/adapters/refunds",
        "hub": "org/adapter@" + "c" * 40,
        "nowhere": "/srv/adapters/x",
    }
    lines = adapter_sources(spec, settings)
    assert lines[0] == "adapter 'pvc' (/models/adapters/billing): a local folder on the model-cache PVC"
    assert "read by the worker with the pod's identity" in lines[1]
    assert "from HF_HUB_CACHE on the model-cache PVC (/models/hub, read-only: offline)" in lines[2]
    assert "on no volume the pod mounts" in lines[3]
    assert (
        ADAPTERS_ANNOTATION
        not in pod_parts(
            JobSpec.load({**spec.model_dump(mode="json"), "model": {"name": "org/base"}}), settings, SHARD
        ).annotations
    )


def test_the_compile_cache_claim_is_a_pvc_mount_read_only_for_jobs_that_may_run_model_repo_code():
    from airflow_provider_vllm.utils.pod_spec import COMPILE_CACHE_DIR

    assert [v.name for v in pod_parts(make_spec("/in", "/out"), KubernetesSettings(), "s").volumes] == [
        "tmp",
        "cache",
        "dshm",
    ]  # none without the deployment's claim
    for spec, read_only in (
        (make_spec("/in", "/out"), False),
        (make_spec("/in", "/out", model={"trust_remote_code": True}), True),
    ):
        p = pod_parts(spec, KubernetesSettings(), "s", compile_cache_pvc="cc")
        (vol,) = [v for v in p.volumes if v.name == "compile-cache"]
        (mount,) = [m for m in p.volume_mounts if m.name == "compile-cache"]
        assert vol.host_path is None and vol.persistent_volume_claim.claim_name == "cc"
        assert vol.persistent_volume_claim.read_only is read_only and mount.read_only is read_only
        assert mount.mount_path == COMPILE_CACHE_DIR
        env = env_of(p)
        assert env["VLLM_BATCH_COMPILE_CACHE"] == COMPILE_CACHE_DIR
        assert env.get("VLLM_BATCH_COMPILE_CACHE_PUBLISH") == ("0" if read_only else None)
    with pytest.raises(SpecError, match="kubernetes_compile_cache_pvc"):
        pod_parts(make_spec("/in", "/out"), KubernetesSettings(env={"VLLM_BATCH_COMPILE_CACHE": "/data"}), "s")


@pytest.mark.parametrize(
    "settings",
    [
        {"env": {"TRITON_CACHE_DIR": "/data/shared-triton"}, "data_pvc": "team-data"},
        {"env": {"TORCHINDUCTOR_CACHE_DIR": "/models/inductor"}, "model_cache_pvc": "hf"},
        {"env": {"VLLM_CACHE_ROOT": "/data/vllm"}, "data_pvc": "team-data"},
        {"data_pvc": "team-data", "data_path": "/cache/torchinductor"},
        {"data_pvc": "team-data", "data_path": "/cache"},
        {"data_pvc": "team-data", "data_path": "/models/../cache/triton"},
        {"model_cache_pvc": "hf", "model_cache_path": "/cache/triton", "model_cache_read_only": False},
        {"data_pvc": "team-data", "data_path": "/compile-cache/0123"},
        {"data_pvc": "team-data", "data_path": "/airflow"},
        {"model_cache_pvc": "hf", "model_cache_path": "/"},
        {"data_pvc": "team-data", "data_path": "/tmp"},
    ],
)
def test_pod_settings_cannot_put_the_folders_compiled_code_is_loaded_from_on_a_shared_volume(settings):
    """The engine executes what it finds in its private cache folders (inductor modules, Triton .so/cubin): they
    stay in the pod's own emptyDir, restored only from sealed snapshots. Before, a job's kubernetes section moved
    them onto its data or model PVC (its env, or a PVC mounted over /cache/...), whose other writers then chose
    the code the pod ran, unsealed, past the compile cache's checks."""
    with pytest.raises(SpecError, match=r"kubernetes\.(env cannot set|data_path|model_cache_path)"):
        pod_parts(make_spec("/in", "/out"), KubernetesSettings.model_validate(settings), SHARD, "cc")
    record_malicious("k8s_private_compile_folders_on_a_shared_volume", 1, 1)
    ok = {"data_pvc": "team-data", "data_path": "/data/cache", "model_cache_pvc": "hf", "model_cache_path": "/mnt/tmp"}
    assert {m.mount_path for m in parts(ok).volume_mounts} >= {"/data/cache", "/mnt/tmp"}


@pytest.mark.parametrize(
    "extra",
    [{"nvidia.com/gpu": "8"}, {"amd.com/gpu": "1"}, {"memory": "1Gi"}, {"cpu": "64"}, {"nvidia.com/vgpu": "4"}],
)
def test_extra_resources_cannot_change_the_gpu_count_cpu_or_memory_the_rules_decide(extra):
    """``gpus`` may only repeat the engine's GPU count and ``memory`` must exceed /dev/shm; before, the same
    limits set through ``extra_resources`` (a field a Variable or the job may set) replaced them unchecked: a
    pod of a one-GPU engine holding 8 GPUs, or a memory limit under its /dev/shm."""
    settings = {"gpu_resource": "nvidia.com/vgpu", "extra_resources": extra}
    with pytest.raises(SpecError, match="extra_resources cannot set"):
        parts(settings)
    record_malicious("k8s_extra_resources_override_checked_limits", 1, 1)
