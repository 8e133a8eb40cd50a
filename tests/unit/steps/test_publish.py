"""How a consumer checks a published run (steps/publish.py): the marker by its seal or the Asset event's
sha256, each manifest against the marker, each part against its manifest."""

from __future__ import annotations

import hashlib
import json

import pytest

from airflow_provider_vllm.core.errors import CommitError, SealError
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.steps.merge.merger import RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.publish import SUCCESS, success_bytes, verify_published
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, shard_task, write_parquet

IDS = [f"r{i:02d}" for i in range(30)]


@pytest.fixture
def published(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in.parquet", IDS, [f"t{i}" for i in IDS])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 10})
    for s in plan_job(spec).shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    merged = merge(spec)
    body = success_bytes(
        {"rows": merged.rows, "checksums": merged.checksums}, Keyring.from_env(), str(tmp_path / "out")
    )
    (tmp_path / "out" / SUCCESS).write_bytes(body)
    return tmp_path / "out", hashlib.sha256(body).hexdigest()


def test_a_genuine_run_verifies_by_seal_or_by_the_event_sha256(published):
    out, sha = published
    assert verify_published(str(out), keyring=Keyring.from_env())["rows"] == len(IDS)
    assert verify_published(str(out), success_sha256=sha)["rows"] == len(IDS)
    with pytest.raises(ValueError, match="proves nothing by itself"):
        verify_published(str(out))


def test_a_part_changed_after_publishing_is_caught_even_at_the_same_size(published):
    out, sha = published
    part = sorted((out / RESULTS).glob("part-*.parquet"))[0]
    raw = part.read_bytes()
    part.write_bytes(raw[:200] + bytes([raw[200] ^ 1]) + raw[201:])
    with pytest.raises(CommitError, match=part.name):
        verify_published(str(out), success_sha256=sha)


def test_a_rewritten_marker_is_caught(published):
    out, sha = published
    doc = json.loads((out / SUCCESS).read_text())
    doc["rows"] = 1
    (out / SUCCESS).write_text(json.dumps(doc))
    with pytest.raises(SealError):
        verify_published(str(out), keyring=Keyring.from_env())
    with pytest.raises(CommitError, match="sha256 differs"):
        verify_published(str(out), success_sha256=sha)
