"""The DAG templates with runner=kubernetes, through real Airflow (SQLite DB, CLI subprocesses):
the pod dry run of the nightly DAG (with LoRA adapters), and the run-time runner switch of the re-run DAG."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from tests.support.airflow_env import PY, tail
from tests.support.data import write_parquet
from tests.support.pss_restricted import violations

NIGHTLY = "vllm_nightly_reclassification"
RERUN = "vllm_batch_rerun"
# Deployment-owned pod settings come from the deployment config ([vllm_batch] kubernetes_defaults);
# the vllm_batch_kubernetes Variable sets the others (placement, queue). docs/security.md
DEPLOYMENT_POD = {
    "namespace": "vllm-batch",
    "model_cache_pvc": "hf-models",
    "image": "registry.example.com/ml/airflow-provider-vllm-worker:0.1.0@sha256:" + "cd" * 32,
    "hf_token_secret": {"name": "hf-token", "key": "token"},
}
VARIABLE_POD = {
    "kueue_queue": "gpu-batch",
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}
POD_SETTINGS = {**DEPLOYMENT_POD, **VARIABLE_POD}


def kube_env(tmp_path: Path) -> dict[str, str]:
    """Variables choosing the Kubernetes runner, and a connection to a cluster that is not there."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\nclusters: [{name: t, cluster: {server: "
        "'https://127.0.0.1:9'}}]\nusers: [{name: t, user: {}}]\n"
        "contexts: [{name: t, context: {cluster: t, user: t}}]\n"
    )
    return {
        "AIRFLOW_VAR_VLLM_BATCH_RUNNER": "kubernetes",
        "AIRFLOW_VAR_VLLM_BATCH_KUBERNETES": json.dumps(VARIABLE_POD),
        "AIRFLOW__VLLM_BATCH__KUBERNETES_DEFAULTS": json.dumps(DEPLOYMENT_POD),
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config_path": str(kubeconfig)}}
        ),
        # The cncf provider retries each API call (5 attempts, exponential waits up to 15 s) before the
        # task fails: ~15 s of waiting per try against a port that refuses at once. Still every attempt,
        # without the waits; what is asserted is Airflow's task retries, not the client's back-off.
        "AIRFLOW__WORKERS__API_RETRY_WAIT_MIN": "0",
        "AIRFLOW__WORKERS__API_RETRY_WAIT_MAX": "0",
    }


def test_dry_run_of_the_nightly_dag_prints_a_valid_restricted_pod_manifest(airflow_sandbox, tmp_path):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    box = airflow_sandbox
    box.reserialize()
    # LoRA adapters from the spec-overrides Variable: the pod names them and the notes say how it gets each
    adapters = [
        {"name": "billing", "source": f"{box.data}/adapters/billing"},
        {"name": "shipping", "source": "acme/shipping-lora", "revision": "c" * 40},
    ]
    overrides = {**json.loads(box.env["AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES"]), "model.adapters": adapters}
    p = subprocess.run(
        [PY, "-m", "airflow_provider_vllm.cli.pod_dry_run", NIGHTLY, "2026-11-28", "--map-index", "2"],
        env=box.environ({**kube_env(tmp_path), "AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES": json.dumps(overrides)}),
        cwd=str(box.home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, tail(p)
    assert p.stdout.startswith("# note: example shard id")
    pod = yaml.safe_load(p.stdout)
    assert latest_version().startswith(kubernetes_validate.validate(pod, latest_version(), strict=True))
    assert violations(pod) == {}
    meta, (base, sidecar) = pod["metadata"], pod["spec"]["containers"]
    assert meta["namespace"] == "vllm-batch" and meta["labels"]["map_index"] == "2"
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-batch"
    assert meta["labels"]["task_id"] == "reclassify.shard_kubernetes" and meta["labels"]["dag_id"] == NIGHTLY
    assert base["command"] == ["python3", "-m", "airflow_provider_vllm.worker"] and len(base["args"]) == 1
    task = json.loads(base["args"][0])
    assert task["shard_id"] == "shard-00002-00000000"
    assert task["spec"]["io"]["input_uri"] == f"{box.data}/tickets/dt=2026-11-28/"  # Jinja rendered
    assert task["spec"]["qa"]["previous_published"] is True and task["spec"]["qa"].get("previous_report_uri") is None
    # the run to compare with is the one the plan pins from the Asset's events, not a folder in the spec
    assert task["spec"]["changes"]["previous_published"] is True and "previous_uri" not in task["spec"]["changes"]
    assert task["spec"]["cache"]["uri"] == f"{box.data}/reclassification/_cache/"
    assert base["image"] == POD_SETTINGS["image"] and base["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"key": "token", "name": "hf-token"}}} in base["env"]
    assert sidecar["name"] == "airflow-xcom-sidecar"
    assert task["spec"]["model"]["adapters"] == adapters
    assert json.loads(meta["annotations"]["vllm-batch/adapters"]) == {
        "billing": f"{box.data}/adapters/billing",
        "shipping": "acme/shipping-lora@" + "c" * 40,
    }
    notes = [ln for ln in p.stdout.splitlines() if ln.startswith("# note: adapter")]
    assert notes == [
        f"# note: adapter 'billing' ({box.data}/adapters/billing): a local folder on no volume the pod mounts "
        "(it must be in the image): mount it with kubernetes.model_cache_pvc or data_pvc",
        f"# note: adapter 'shipping' (acme/shipping-lora): a hub repo at commit {'c' * 40}, from HF_HUB_CACHE on "
        "the model-cache PVC (/models/hub, read-only: offline)",
    ]


def test_runner_chosen_at_run_time_sends_the_shards_to_pods(airflow_sandbox, tmp_path):
    """runner=kubernetes from the trigger form: plan, then the runner branch follows the pod task
    (the local one is skipped); with no cluster the pod cannot be created and the shard fails
    after its retries, the way a transient cluster error fails it."""
    box = airflow_sandbox
    folder = box.data / "k8s_adhoc"
    write_parquet(folder / "part-0.parquet", [f"k{i}" for i in range(30)], [f"ticket {i}" for i in range(30)])
    conf = {"input_uri": str(folder), "runner": "kubernetes", "shard_rows": 15}
    p = box.dags_test(RERUN, "2026-11-24", conf=conf, env=kube_env(tmp_path), timeout=600)
    assert p.returncode != 0
    db = box.inspect(RERUN)
    run_id = db["runs"][-1]["run_id"]
    tis = {(t["task_id"].split(".")[-1], t["map_index"]): t for t in db["tis"] if t["run_id"] == run_id}
    assert tis[("plan", -1)]["state"] == "success" and tis[("runner", -1)]["state"] == "success"
    assert tis[("shard", -1)]["state"] == "skipped"
    pods = {k: t for k, t in tis.items() if k[0] == "shard_kubernetes"}
    assert sorted(k[1] for k in pods) == [0, 1]  # mapped over the plan's two shards
    assert all(t["state"] == "failed" and t["try_number"] == 3 for t in pods.values())  # retried twice
    assert tis[("merge", -1)]["state"] == "upstream_failed"
    log = p.stdout + p.stderr
    assert "runner kubernetes: shards run in rerun.shard_kubernetes" in log
    assert "127.0.0.1" in log  # it tried the configured cluster


def test_the_cache_key_follows_the_deployments_image(airflow_sandbox, tmp_path):
    """The deployment moves its pods to another image through [vllm_batch] kubernetes_defaults: the nightly's
    plan keys the result cache with the image the pods will run (by digest), so the old engine's answers
    are not served under the new one's name; the rendered pod gets the signing key by reference only."""
    box = airflow_sandbox
    images = {
        day: "registry.example.com/ml/airflow-provider-vllm-worker:0.1.0@sha256:" + digest * 32
        for day, digest in (("2026-11-20", "a1"), ("2026-11-21", "b2"))
    }
    runs = []
    for day, image in images.items():
        write_parquet(
            box.data / "tickets" / f"dt={day}" / "part-0.parquet",
            [f"t{i}" for i in range(12)],
            [f"ticket {i}" for i in range(12)],
        )
        env = {
            **kube_env(tmp_path),
            "AIRFLOW__VLLM_BATCH__KUBERNETES_DEFAULTS": json.dumps({**DEPLOYMENT_POD, "image": image}),
        }
        runs.append((NIGHTLY, day, None, env))
    # the two nights in one process (tests/airflow/cli_many.py); the shards fail: no cluster; the plan is what counts
    box.dags_test_many(*runs, timeout=600)
    keys = {}
    for day, image in images.items():
        plan = json.loads((box.data / "reclassification" / f"dt={day}" / "_plan.json").read_text())
        assert plan["cache"]["key_config"]["engine_identity"].startswith(f"image {image}")
        keys[day] = plan["cache"]["key_hash"]
    assert keys["2026-11-20"] != keys["2026-11-21"]
    p = subprocess.run(
        [PY, "-m", "airflow_provider_vllm.cli.pod_dry_run", NIGHTLY, "2026-11-21"],
        env=box.environ(kube_env(tmp_path)),
        cwd=str(box.home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, tail(p)
    base = yaml.safe_load(p.stdout)["spec"]["containers"][0]
    signing = [e for e in base["env"] if e["name"] in ("VLLM_BATCH_WORKER_KEY", "VLLM_BATCH_SIGNING_KEY")]
    assert signing == [
        {"name": "VLLM_BATCH_WORKER_KEY", "valueFrom": {"secretKeyRef": {"key": "key", "name": "vllm-batch-signing"}}}
    ]
    assert box.env["AIRFLOW__VLLM_BATCH__SIGNING_KEY"] not in p.stdout
    # --from-plan: the run's sealed plan, checked with the deployment's key from Airflow's configuration (the
    # shell that renders a pod has no VLLM_BATCH_SIGNING_KEY), names the plan the pod's worker would run under
    env = {k: v for k, v in box.environ(kube_env(tmp_path)).items() if k != "VLLM_BATCH_SIGNING_KEY"}
    p = subprocess.run(
        [PY, "-m", "airflow_provider_vllm.cli.pod_dry_run", NIGHTLY, "2026-11-21", "--from-plan"],
        env=env,
        cwd=str(box.home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, tail(p)
    task = json.loads(yaml.safe_load(p.stdout)["spec"]["containers"][0]["args"][0])
    sealed = json.loads((box.data / "reclassification" / "dt=2026-11-21" / "_plan.json").read_text())
    assert task["plan_mac"] == sealed["seal"]["mac"] and task["shard_id"] == sealed["shards"][0]["shard_id"]


def test_pod_dry_run_refuses_a_negative_map_index_naming_it(capsys):
    """A map index below 0 names no mapped task: refused before any DAG is read, naming --map-index (with
    --from-plan it rendered the plan's last shard under index -1; without, a validation error of the shard value)."""
    import pytest

    from airflow_provider_vllm.cli.pod_dry_run import main

    for extra in ([], ["--from-plan"]):
        with pytest.raises(SystemExit) as e:
            main(["no_such_dag", "2026-11-28", "--map-index", "-1", *extra])
        assert e.value.code == 2
        assert "--map-index" in capsys.readouterr().err
