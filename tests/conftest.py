from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _minilm_prefixes() -> list[str]:
    """MiniLM's folder in its installed package: inside this checkout's .venv on a fresh clone, elsewhere
    when the tests run with another checkout's venv (a worktree, CONTRIBUTING.md)."""
    from airflow_provider_vllm.testing.local_models import LocalModelError, minilm_path

    try:
        return [os.path.realpath(minilm_path())]
    except LocalModelError:
        return []


# The deployment's allow-list for the tests (docs/security.md): the temp folder (pytest's
# tmp_path), the model cache, MiniLM's package folder and this checkout. Without it every plan is
# refused (fail closed); tests of that default remove both variables (the ``fail_closed`` fixture).
TEST_PREFIXES = json.dumps(
    [
        os.path.realpath(tempfile.gettempdir()),
        os.path.realpath(os.environ.get("VLLM_BATCH_MODEL_CACHE", ROOT / ".cache" / "models")),
        *_minilm_prefixes(),
        str(ROOT),
    ]
)
os.environ.setdefault("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", TEST_PREFIXES)
os.environ.setdefault("VLLM_BATCH_ALLOWED_PREFIXES", TEST_PREFIXES)  # a worker CLI a test starts itself
# The deployment's signing key for the tests (core/seal.py): the Airflow side's option and the
# worker's variable (a worker a test starts itself). Tests of the unset default remove both.
TEST_SIGNING_KEY = "test-signing-key-" + "k" * 40
os.environ.setdefault("AIRFLOW__VLLM_BATCH__SIGNING_KEY", TEST_SIGNING_KEY)
os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", TEST_SIGNING_KEY)
os.environ.setdefault("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", "vllm-batch-signing:key")
# result caches may live under the test folders (the deployment's choice: [vllm_batch] cache_uri_prefixes)
os.environ.setdefault("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", TEST_PREFIXES)
# The weights fingerprint's memo (steps/cache/fingerprint_memo.py) of the tests: not the user's ~/.cache
os.environ.setdefault(
    "VLLM_BATCH_FINGERPRINT_MEMO",
    os.path.join(tempfile.gettempdir(), f"vllm-batch-test-fingerprints-{os.getuid()}.json"),
)


@pytest.fixture
def fail_closed(monkeypatch):
    """The default deployment: no allow-list, no "any location" (Airflow side and worker side)."""
    for name in (
        "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES",
        "AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION",
        "VLLM_BATCH_ALLOWED_PREFIXES",
        "VLLM_BATCH_ALLOW_ANY_LOCATION",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_engine_factory():
    from tests.support.fakes import FakeEngine

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
    from airflow_provider_vllm.core import faults

    def set_(value: str) -> None:
        faults.reload({faults.ENV: value})

    yield set_
    faults.reload({})


TIERS = ("unit", "s3", "vllm", "airflow", "ui")  # also the run order: cheapest first, the browser last


def _tier(item) -> str | None:
    parts = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests").parts
    return parts[0] if parts and parts[0] in TIERS else None


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier, the folder under tests/ it lives in (``-m unit``, ``-m s3`` ...), and
    run the tiers in ``TIERS`` order. The ui tier goes last: its session-wide Playwright would make any
    later sync Playwright (tests/unit/steps/qa/test_html.py) fail with "Sync API inside the asyncio loop"."""
    for item in items:
        tier = _tier(item)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    items.sort(key=lambda item: TIERS.index(_tier(item) or "unit"))  # stable: file order within a tier
