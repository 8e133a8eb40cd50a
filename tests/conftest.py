from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The deployment's allow-list for the tests (docs/security.md): the temp folder (pytest's
# tmp_path), the model cache and this checkout. Without it every plan is refused (fail closed);
# tests of that default remove both variables (the ``fail_closed`` fixture).
TEST_PREFIXES = json.dumps([os.path.realpath(tempfile.gettempdir()),
                            os.path.realpath(os.environ.get("VLLM_BATCH_MODEL_CACHE", ROOT / ".cache" / "models")),
                            str(ROOT)])
os.environ.setdefault("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", TEST_PREFIXES)
os.environ.setdefault("VLLM_BATCH_ALLOWED_PREFIXES", TEST_PREFIXES)  # a worker CLI a test starts itself

LABELS = ["billing", "bug", "feature_request", "account", "other"]


def write_parquet(path: Path, ids, texts, row_group_size=64, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "text": texts, **extra}), path, row_group_size=row_group_size)
    return path


def make_spec(input_uri, output_uri, **over):
    from airflow_provider_vllm.spec import JobSpec

    doc = {
        "model": {"name": "fake", "max_model_len": 1024},
        "io": {"input_uri": str(input_uri), "output_uri": str(output_uri)},
        "prompt": {"system_prompt": "Classify the ticket.", "template": "Ticket: {text}"},
        "sampling": {"max_tokens": 8, "structured": {"choice": LABELS}},
        "sharding": {"target_rows": 100, "chunk_rows": 16},
    }
    for k, v in over.items():
        doc[k] = {**doc.get(k, {}), **v} if isinstance(v, dict) else v
    return JobSpec.load(doc)


@pytest.fixture
def fail_closed(monkeypatch):
    """The default deployment: no allow-list, no "any location" (Airflow side and worker side)."""
    for name in ("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", "AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION",
                 "VLLM_BATCH_ALLOWED_PREFIXES", "VLLM_BATCH_ALLOW_ANY_LOCATION"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_engine_factory():
    from tests.fakes import FakeEngine

    made = []

    def factory(spec, **kw):
        e = FakeEngine(spec, **kw)
        made.append(e)
        return e

    factory.made = made
    return factory


@pytest.fixture
def set_faults():
    """``set_faults("engine.step#3=oom")``: arm the fault harness in this process (reset after the test)."""
    from airflow_provider_vllm import faults

    def set_(value: str) -> None:
        faults.reload({faults.ENV: value})

    yield set_
    faults.reload({})
