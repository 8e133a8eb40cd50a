"""The worker refuses a vLLM outside the supported range at start-up, before loading a model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.conftest import worker_environ
from tests.support.data import make_spec, shard_task, write_parquet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# The worker CLI with vLLM's reported version replaced, as an image with another vLLM would have it.
RUN_WITH_VERSION = """
import sys, vllm
vllm.__version__ = sys.argv[1]
from airflow_provider_vllm.worker.__main__ import main
sys.exit(main([sys.argv[2]]))
"""


def test_worker_refuses_an_unsupported_vllm_naming_it(tmp_path):
    import vllm

    from airflow_provider_vllm.core.compat import check_vllm_version

    check_vllm_version(vllm.__version__)  # the installed CPU build itself is supported
    write_parquet(tmp_path / "in" / "a.parquet", ["a", "b"], ["one", "two"])
    spec = make_spec(tmp_path / "in", tmp_path / "out", model={"name": str(tmp_path / "no-model-needed")})
    plan = plan_job(spec)
    task = shard_task(spec=spec, shard_id=plan.shards[0].shard_id).model_dump_json()
    r = subprocess.run(
        [sys.executable, "-c", RUN_WITH_VERSION, "0.40.1", task],
        env=worker_environ(),  # a worker's environment: its worker key, never the deployment's
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert r.returncode == 2, r.stderr[-3000:]  # terminal: no retry on the same image
    assert "vLLM 0.40.1 is installed" in r.stderr and ">=0.25.0" in r.stderr, r.stderr[-3000:]
    manifest = json.loads(r.stdout.strip().splitlines()[-1])
    assert manifest["terminal"] is True
