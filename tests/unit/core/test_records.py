"""Records that cross a process or a task: what the code before the typed models wrote still validates
(literal samples copied from files it wrote), is written back unchanged, and anything else is refused
naming the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from airflow_provider_vllm.core.commit import MARKER, ChunkMeta, CommitMarker, RunSeal, ShardStore
from airflow_provider_vllm.core.errors import CommitError, SealError
from airflow_provider_vllm.core.records import (
    FailureManifest,
    MergeSummary,
    ShardStats,
    ThroughputRecord,
    WorkerManifest,
    read_manifest,
)
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import Storage

# Written by the dict-based code at c8257f6 (fake engine, local folder); one file entry / shard kept.
OLD_MARKER = '{"attempt_id": "a20261130T153847-vm-19440-399c26", "committed_at": "2026-11-30T15:39:04Z", "config_hash": "6b960d960a8bd64498b66740fa02247f89fb898c8f5d18d112efa4dfe19cee24", "error_rows": 0, "files": [{"bytes": 6610, "error_rows": 0, "ok_rows": 2, "path": "shards/shard-00000-4f84e2c7/attempts/a20261130T153847-vm-19440-399c26/chunk-00000.parquet", "rows": 2, "sha256": "5a6acbfb4dd5e114452eb8cd37d97291a3c6f2edf47f2323bb872f570a2b28f8"}], "ok_rows": 2, "plan_fingerprint": "fe212f36320500d99aaef44398d5e55845b8985e92fcf19eb54335a3d9c41c67", "rows": 2, "shard_id": "shard-00000-4f84e2c7", "spec_hash": "511448a9a5eb626d77601d6fe57fa29ce778629f7c8ec276b56a2d1a36aa2645", "stats": {"completion_tokens": 6, "engine_error_rows": 0, "engine_limits": {"max_num_batched_tokens": 8192, "max_num_seqs": 256}, "engine_rebuilds": 0, "engine_start_s": 0.0, "hardware": "cpu:AMD EPYC:2", "infer_rows": 3, "infer_s": 0.022, "oom_error_rows": 0, "oom_events": 0, "peak_rss_mb": 547.0, "progress_lines": 1, "prompt_tokens": 189, "read_s": 0.007, "resource_samples": 10, "reused_chunks": 0, "rows": 3, "rows_per_s": 136.364, "step_failures": 0, "tokens_per_s": 8863.6, "wall_s": 16.812}, "versions": {"airflow-provider-vllm": "0.1.0", "model": "fake", "model_revision": null, "python": "3.11.7", "vllm": "fake-0"}}'
OLD_MANIFEST = '{"attempt_id": "a20261130T153847-vm-19440-399c26", "error_rows": 0, "ok_rows": 3, "rows": 3, "shard_id": "shard-00000-4f84e2c7", "stats": {"completion_tokens": 6, "engine_error_rows": 0, "engine_limits": {"max_num_batched_tokens": 8192, "max_num_seqs": 256}, "engine_rebuilds": 0, "engine_start_s": 0.0, "hardware": "cpu:AMD EPYC:2", "infer_rows": 3, "infer_s": 0.022, "oom_error_rows": 0, "oom_events": 0, "peak_rss_mb": 547.0, "progress_lines": 1, "prompt_tokens": 189, "read_s": 0.007, "resource_samples": 10, "reused_chunks": 0, "rows": 3, "rows_per_s": 136.364, "step_failures": 0, "tokens_per_s": 8863.6, "wall_s": 16.812}, "status": "committed"}'
OLD_FAILURE = '{"error": "SpecError", "message": "bad spec", "status": "failed", "terminal": true}'
OLD_MERGED = '{"checksums": {"results/errors.parquet": "1e91561bc52f647382ac9938904bb40d43b4266828fe600e752a6d777485e511", "results/results.parquet": "0ba89fd2066a6c433a0dde36ca2a9c6c2902c26d67954b13b6f6a34bef4a7ff0"}, "config_hash": "6b960d960a8bd64498b66740fa02247f89fb898c8f5d18d112efa4dfe19cee24", "duplicates": {"examples": [], "ids": 0, "rows_dropped": 0}, "duplicates_dropped": 0, "error_rows": 0, "files": {"errors": "results/errors.parquet", "results": "results/results.parquet"}, "merge_s": 0.091, "ok_rows": 6, "rows": 6, "shard_stats": [{"attempt_id": "a20261130T153847-vm-19440-399c26", "completion_tokens": 6, "engine_error_rows": 0, "engine_limits": {"max_num_batched_tokens": 8192, "max_num_seqs": 256}, "engine_rebuilds": 0, "engine_start_s": 0.0, "hardware": "cpu:AMD EPYC:2", "infer_rows": 3, "infer_s": 0.022, "oom_error_rows": 0, "oom_events": 0, "peak_rss_mb": 547.0, "progress_lines": 1, "prompt_tokens": 189, "read_s": 0.007, "resource_samples": 10, "reused_chunks": 0, "rows": 3, "rows_per_s": 136.364, "shard_id": "shard-00000-4f84e2c7", "step_failures": 0, "tokens_per_s": 8863.6, "wall_s": 16.812}], "shards": 2, "spec_hash": "511448a9a5eb626d77601d6fe57fa29ce778629f7c8ec276b56a2d1a36aa2645", "versions": {"airflow-provider-vllm": "0.1.0", "duckdb": "2.0.1"}}'
OLD_HISTORY = '{"completion_tokens": 12, "completion_tokens_per_row": 2.0, "config_hash": "6b960d960a8bd64498b66740fa02247f89fb898c8f5d18d112efa4dfe19cee24", "engine_start_s": null, "est_prompt_tokens_per_row": 5.0, "hardware": "cpu:AMD EPYC:2", "infer_s": 0.03, "job": "job", "max_num_seqs": null, "model": "fake", "model_revision": null, "prompt_tokens": 378, "prompt_tokens_per_row": 63.0, "recorded_at": "2026-11-30T15:39:04Z", "rows": 6, "rows_per_s": 200.0, "shards": 2, "spec_hash": "511448a9a5eb626d77601d6fe57fa29ce778629f7c8ec276b56a2d1a36aa2645", "task": "chat", "tensor_parallel_size": 1, "tokens_per_s": 13000.0, "version": 1}'
OLD_FOOTER = '{"chunk": 0, "config_hash": "6b960d960a8bd64498b66740fa02247f89fb898c8f5d18d112efa4dfe19cee24", "first_row": 0, "rows": 2, "shard_id": "shard-00001-672c298a"}'
# resources.peaks() on a GPU host adds these to the stats
GPU_STATS = {
    "gpus": [
        {
            "index": 0,
            "name": "NVIDIA H200",
            "util_peak_pct": 97,
            "util_mean_pct": 80.5,
            "mem_peak_mb": 120000.0,
            "mem_total_mb": 143771.0,
        }
    ],
    "gpu_util_peak_pct": 97,
    "gpu_mem_peak_mb": 120000.0,
}

SAMPLES = [
    (CommitMarker, OLD_MARKER),
    (WorkerManifest, OLD_MANIFEST),
    (FailureManifest, OLD_FAILURE),
    (MergeSummary, OLD_MERGED),
    (ThroughputRecord, OLD_HISTORY),
    (ChunkMeta, OLD_FOOTER),
]


@pytest.mark.parametrize(("model", "raw"), SAMPLES, ids=lambda x: getattr(x, "__name__", ""))
def test_old_files_validate_and_are_written_back_unchanged(model, raw):
    rec = model.model_validate_json(raw)
    assert rec.dump() == json.loads(raw)


def test_old_chunk_footer_is_written_byte_for_byte():
    meta = ChunkMeta.model_validate_json(OLD_FOOTER)
    assert meta.to_kv() == {"vllm_batch.chunk": OLD_FOOTER}


def test_gpu_stats_validate():
    stats = ShardStats.model_validate({**json.loads(OLD_MANIFEST)["stats"], **GPU_STATS})
    assert stats.gpus[0].name == "NVIDIA H200" and stats.dump()["gpu_mem_peak_mb"] == 120000.0


def test_manifest_kinds_are_told_apart_by_status():
    assert isinstance(read_manifest(OLD_MANIFEST), WorkerManifest)
    failure = read_manifest(json.loads(OLD_FAILURE))
    assert isinstance(failure, FailureManifest) and failure.terminal and failure.error == "SpecError"
    with pytest.raises(ValidationError, match="status"):
        read_manifest({"status": "done", "shard_id": "s"})


def _nested_set(doc, path, value):
    *head, last = path
    for k in head:
        doc = doc[k]
    doc[last] = value


BAD = [
    (CommitMarker, OLD_MARKER, ("surprise",), 1, "surprise"),
    (CommitMarker, OLD_MARKER, ("rows",), "many", "rows"),
    (CommitMarker, OLD_MARKER, ("files", 0, "sha256"), None, "files.0.sha256"),
    (CommitMarker, OLD_MARKER, ("stats", "rows_per_s"), "fast", "stats.rows_per_s"),
    (CommitMarker, OLD_MARKER, ("stats", "mystery"), 3, "stats.mystery"),
    (WorkerManifest, OLD_MANIFEST, ("ok_rows",), "3 rows", "ok_rows"),
    (WorkerManifest, OLD_MANIFEST, ("extra",), True, "extra"),
    (MergeSummary, OLD_MERGED, ("duplicates", "ids"), "none", "duplicates.ids"),
    (MergeSummary, OLD_MERGED, ("shard_stats", 0, "shard_id"), 7, "shard_stats.0.shard_id"),
    (MergeSummary, OLD_MERGED, ("unknown",), 0, "unknown"),
    (ThroughputRecord, OLD_HISTORY, ("infer_s",), "slow", "infer_s"),
    (ThroughputRecord, OLD_HISTORY, ("new_field",), 1, "new_field"),
    (ChunkMeta, OLD_FOOTER, ("chunk",), "first", "chunk"),
]


@pytest.mark.parametrize(("model", "raw", "path", "value", "named"), BAD, ids=[b[4] for b in BAD])
def test_unknown_field_or_wrong_type_is_refused_naming_the_field(model, raw, path, value, named):
    doc = json.loads(raw)
    _nested_set(doc, path, value)
    with pytest.raises(ValidationError) as e:
        model.model_validate(doc)
    assert named in str(e.value)


def test_the_store_refuses_an_unsealed_old_marker_and_a_bad_one_naming_the_field(tmp_path):
    """A marker written before seals parses (the model reads it) but is refused: nothing vouches for it."""
    m = CommitMarker.model_validate_json(OLD_MARKER)
    assert m.files[0].path.endswith("chunk-00000.parquet") and m.stats.infer_rows == 3
    store = ShardStore(Storage(str(tmp_path)), "shard-00000-4f84e2c7", RunSeal(Keyring.from_env(), "0" * 64))
    (tmp_path / store.dir).mkdir(parents=True)
    (tmp_path / store.dir / MARKER).write_text(OLD_MARKER)
    with pytest.raises(SealError, match="carries no seal"):
        store.marker()
    doc = json.loads(OLD_MARKER)
    doc["files"][0]["bytes"] = "big"
    (tmp_path / store.dir / MARKER).write_text(json.dumps(doc))
    with pytest.raises(CommitError, match=r"(?s)is not a valid marker.*files\.0\.bytes"):
        store.marker()
    (tmp_path / store.dir / MARKER).write_text("{not json")
    with pytest.raises(CommitError, match="is not valid JSON"):
        store.marker()


def test_merge_xcom_leaves_out_per_shard_stats():
    x = MergeSummary.model_validate_json(OLD_MERGED).xcom()
    assert "shard_stats" not in x and "versions" not in x and x["ok_rows"] == 6 and x["duplicates"]["ids"] == 0
