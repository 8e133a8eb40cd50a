"""The Airflow tier: real Airflow 3 (SQLite metadata DB) driven through its CLI in subprocesses.

Each subprocess gets a project-free AIRFLOW_HOME under pytest's tmp folder, the repo's
dags/ folder, Airflow Variables as AIRFLOW_VAR_* (data root, model) and a 1 s retry delay.
Nothing here imports Airflow into the pytest process before the environment is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAGS = ROOT / "dags"
PY = sys.executable
AIRFLOW = str(Path(PY).with_name("airflow"))

sys.path.insert(0, str(ROOT / "scripts"))
# Unit tests import Airflow in this process: point it at a throwaway home first (it would
# otherwise create ~/airflow), with the repo's DAGs and no examples.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="airflow-unit-"))
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(DAGS))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")


@dataclass
class AirflowSandbox:
    home: Path
    data: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: int = 900,
            log: Path | None = None) -> subprocess.CompletedProcess:
        """Run ``airflow <args>``; stdout+stderr also go to ``log`` when given."""
        p = subprocess.run([AIRFLOW, *args], env={**self.env, **(env or {})}, cwd=str(self.home),
                           capture_output=True, text=True, timeout=timeout)
        if log is not None:
            log.write_text(p.stdout + p.stderr)
        return p

    def dags_test(self, dag_id: str, date: str, conf: dict | None = None, env: dict[str, str] | None = None,
                  timeout: int = 900) -> subprocess.CompletedProcess:
        args = ["dags", "test", dag_id, date] + (["-c", json.dumps(conf)] if conf is not None else [])
        log = self.home / f"{dag_id}-{date}-{len(list(self.home.glob('*.log')))}.log"
        return self.run(*args, env=env, timeout=timeout, log=log)

    def inspect(self, dag_id: str) -> dict:
        """Runs, task instances, earlier tries, XComs and asset events of ``dag_id``, from the DB."""
        p = subprocess.run([PY, str(Path(__file__).with_name("inspect_db.py")), dag_id], env=self.env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout)


def tail(p: subprocess.CompletedProcess, n: int = 6000) -> str:
    return (p.stdout + p.stderr)[-n:]


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from airflow_provider_vllm.local_models import default_cache_dir, make_tiny_llama

    return str(make_tiny_llama(default_cache_dir() / "tiny-llama"))


@pytest.fixture(scope="session")
def airflow_sandbox(tmp_path_factory, tiny_model) -> AirflowSandbox:
    home = tmp_path_factory.mktemp("airflow_home")
    data = tmp_path_factory.mktemp("vllm_batch_data")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VLLM_BATCH_INJECT"))}
    env.update({
        "AIRFLOW_HOME": str(home),
        # This checkout's code, not whatever the venv's editable install points at (worktrees).
        "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "1",
        "AIRFLOW_VAR_VLLM_BATCH_DATA_ROOT": str(data),
        "AIRFLOW_VAR_VLLM_BATCH_MODEL": tiny_model,
        # The tiny random model needs room to spell the longer labels through its small vocabulary.
        "AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES": json.dumps({"sampling.max_tokens": 32}),
        # `dags test` cannot answer a review: a QA 'warn' of the random model is published unasked.
        "AIRFLOW_VAR_VLLM_BATCH_HUMAN_REVIEW": "false",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    box = AirflowSandbox(home=home, data=data, env=env)
    p = box.run("db", "migrate", timeout=600)
    assert p.returncode == 0, tail(p)
    return box
