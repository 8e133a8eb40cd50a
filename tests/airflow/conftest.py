"""The Airflow tier: real Airflow 3 (SQLite metadata DB) driven through its CLI in subprocesses.

Each subprocess gets a project-free AIRFLOW_HOME under pytest's tmp folder, the repo's
dags/ folder, Airflow Variables as AIRFLOW_VAR_* (data root, model) and a 1 s retry delay.
Nothing here imports Airflow into the pytest process before the environment is set.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TEST_SIGNING_KEY
from tests.support import ROOT
from tests.support.airflow_env import AIRFLOW, DAGS, LOADED_MACHINE, PY, AirflowSandbox, tail  # noqa: F401  (re-used by fixtures)
from tests.support.airflow_home import throwaway_airflow_home

sys.path.insert(0, str(ROOT / "scripts"))
# Unit tests import Airflow in this process: point it at a throwaway home first (it would
# otherwise create ~/airflow), with the repo's DAGs and no examples.
throwaway_airflow_home()
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(DAGS))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from airflow_provider_vllm.testing.local_models import default_cache_dir, make_tiny_llama

    return str(make_tiny_llama(default_cache_dir() / "tiny-llama"))


def minilm_model() -> str | None:
    """MiniLM's folder in its PyPI package (the embeddings DAG's model), or None when not installed."""
    from airflow_provider_vllm.testing.local_models import LocalModelError, minilm_path

    try:
        return str(minilm_path().resolve())
    except LocalModelError:
        return None


def model_roots(tiny_model: str) -> list[str]:
    """Where the DAGs' local models lie: the model cache and, when installed, MiniLM's package folder."""
    minilm = minilm_model()
    return [str(Path(tiny_model).resolve().parent), *([minilm] if minilm else [])]


@pytest.fixture(scope="session")
def airflow_sandbox(tmp_path_factory, tiny_model) -> Iterator[AirflowSandbox]:
    home = tmp_path_factory.mktemp("airflow_home")
    data = tmp_path_factory.mktemp("vllm_batch_data")
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VLLM_BATCH_INJECT", "VLLM_BATCH_ALLOW"))
    }
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            # This checkout's code, not whatever the venv's editable install points at (worktrees).
            "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "1",
            **LOADED_MACHINE,
            "AIRFLOW_VAR_VLLM_BATCH_DATA_ROOT": str(data),
            "AIRFLOW_VAR_VLLM_BATCH_MODEL": tiny_model,
            # The example DAGs name no model of their own (the wheel has no demo models): the Variables do.
            **({"AIRFLOW_VAR_VLLM_BATCH_EMBEDDING_MODEL": minilm_model()} if minilm_model() else {}),
            # The tiny random model needs room to spell the longer labels through its small vocabulary.
            "AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES": json.dumps({"sampling.max_tokens": 32}),
            # `dags test` cannot answer a review: a QA 'warn' of the random model is published unasked. A Variable
            # turning the review off loosens the gate: this deployment lets Variables do that (docs/security.md).
            "AIRFLOW_VAR_VLLM_BATCH_HUMAN_REVIEW": "false",
            "AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES": "True",
            # The deployment's allow-list: the sandbox's data root and the model cache (tiny model, SmolLM2).
            "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES": json.dumps([str(data), *model_roots(tiny_model)]),
            # its signing key (docs/adr/0007), where result caches may live, the pods' key Secret
            "AIRFLOW__VLLM_BATCH__SIGNING_KEY": TEST_SIGNING_KEY,
            "AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES": json.dumps([str(data)]),
            "AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET": "vllm-batch-signing:key",
            # both runners may be chosen at run time (the re-run form, the vllm_batch_runner Variable)
            "AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS": "local,kubernetes",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    box = AirflowSandbox(home=home, data=data, env=env)
    p = box.run("db", "migrate", timeout=600)
    assert p.returncode == 0, tail(p)
    yield box
    box.close()
