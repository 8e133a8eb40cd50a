from __future__ import annotations

import os
import sys
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
