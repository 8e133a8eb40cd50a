"""The pod's command line, run as a process against a real shard on real vLLM (CPU build).

The container is emulated where this machine differs from a pod: each volume mount becomes a
local folder (and env values under a mount path follow it), and ``python3`` on PATH is this
venv's interpreter, as it is the vLLM image's. The argv is exactly the pod's command + args.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_WORKER_KEY
from tests.support.data import make_spec, write_parquet
from tests.support.k8s_context import create_context, unreachable_cluster

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


def test_pod_command_line_runs_a_real_shard(tmp_path, monkeypatch, tiny_model):
    from airflow_provider_vllm.core.commit import MARKER
    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator
    from airflow_provider_vllm.steps.plan.planner import plan_job

    unreachable_cluster(tmp_path, monkeypatch)
    n = 24
    write_parquet(
        tmp_path / "in" / "part-0.parquet",
        [f"t{i:03d}" for i in range(n)],
        [f"ticket {i}: I was charged twice, please refund" for i in range(n)],
    )
    spec = make_spec(
        tmp_path / "in",
        tmp_path / "out",
        model={"name": tiny_model, "max_model_len": 512},
        engine={"enforce_eager": True, "cpu_kvcache_space_gb": 1, "max_num_seqs": 16},
        sampling={"max_tokens": 32},
        sharding={"target_rows": 12, "chunk_rows": 8},
    )
    plan = plan_job(spec)
    assert len(plan.shards) == 2
    shard = plan.mapped_shards()[1].dump()  # the plan task's value: it names the sealed plan
    op = VllmKubernetesShardOperator(
        task_id="shard",
        spec=spec.model_dump(mode="json"),
        shard=shard,
        kubernetes={"gpus": 0, "memory": "6Gi", "namespace": "batch"},
        progress_interval_s=1.0,
    )
    pod = op.build_pod_request_obj(create_context(op, map_index=1))
    (c,) = [c for c in pod.spec.containers if c.name == "base"]
    argv = c.command + c.args

    mounts = {m.mount_path: tmp_path / "mnt" / m.name for m in c.volume_mounts}
    for folder in mounts.values():
        folder.mkdir(parents=True)

    def local(value: str) -> str:
        for path, folder in mounts.items():
            if value == path or value.startswith(path + "/"):
                return str(folder) + value[len(path) :]
        return value

    env = {e.name: local(e.value) for e in c.env if e.value is not None}
    # the only Secret reference: the worker key, which the kubelet would resolve from the Secret holding the output
    # of python -m airflow_provider_vllm.cli.worker_key
    (signing,) = [e for e in c.env if e.value_from]
    assert signing.name == "VLLM_BATCH_WORKER_KEY" and signing.value_from.secret_key_ref.name == "vllm-batch-signing"
    assert "VLLM_BATCH_SIGNING_KEY" not in env
    env[signing.name] = TEST_WORKER_KEY
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # The engine in the worker's process (tests/conftest.py): one `import vllm` instead of three. The
            # pod's own layout, vLLM's engine core and worker processes, is what the ENGINE_PROCESSES tests run.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            # this test process's cores under xdist, and the tests' engines without a compiler (tests/conftest.py:
            # the first compile of a model on a fresh machine cost this test ~40 CPU-s, a C++ compiler included)
            **{
                k: os.environ[k]
                for k in (
                    "OMP_NUM_THREADS",
                    "VLLM_CPU_OMP_THREADS_BIND",
                    "VLLM_CPU_CI_ENV",
                    "TORCHDYNAMO_DISABLE",
                    "VLLM_USE_AOT_COMPILE",
                )
                if k in os.environ
            },
        }
    )
    p = subprocess.run(argv, env=env, cwd=mounts["/tmp"], capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr[-4000:]
    manifest = json.loads((mounts["/airflow/xcom"] / "return.json").read_text())  # what the KPO sidecar reads
    assert manifest == json.loads(p.stdout.strip().splitlines()[-1])
    assert manifest["shard_id"] == shard["shard_id"] and manifest["rows"] == shard["rows"] == 12
    assert manifest["ok_rows"] + manifest["error_rows"] == 12
    marker = json.loads((tmp_path / "out" / "shards" / shard["shard_id"] / MARKER).read_text())
    assert marker["attempt_id"] == manifest["attempt_id"]
    assert not (tmp_path / "out" / "shards" / plan.shards[0].shard_id / MARKER).exists()  # only its own shard
    assert "rows/s" in p.stderr  # progress lines go to the pod log (stderr), stdout only the manifest
