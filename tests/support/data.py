"""Test data builders shared by every tier: a Parquet writer and a job spec with the fake model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

LABELS = ["billing", "bug", "feature_request", "account", "other"]
# A hub model's revision as the result cache wants it: a full commit sha (steps/cache/key.check_revision)
PINNED_REVISION = "0123456789abcdef0123456789abcdef01234567"
# What the plan task's value names for each shard (ShardSummary.plan_mac, plan_sha256), for shard tasks a test never
# lets reach a plan
PLAN_REF = {"plan_mac": "a" * 64, "plan_sha256": "b" * 64}


def write_parquet(path: Path, ids, texts, row_group_size=64, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "text": texts, **extra}), path, row_group_size=row_group_size)
    return path


def files_under(out: Path | str) -> dict[str, bytes]:
    """Every file under ``out`` (path relative to it -> bytes): what a step wrote, to compare before and after."""
    out = Path(out)
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def make_spec(input_uri, output_uri, **over):
    from airflow_provider_vllm.core.spec import JobSpec

    doc = {
        # OpenAI batch request rows of the test corpora name the model "m"
        "model": {"name": "fake", "max_model_len": 1024, "served_model_names": ["m"]},
        "io": {"input_uri": str(input_uri), "output_uri": str(output_uri)},
        "prompt": {"system_prompt": "Classify the ticket.", "template": "Ticket: {text}"},
        "sampling": {"max_tokens": 8, "structured": {"choice": LABELS}},
        "sharding": {"target_rows": 100, "chunk_rows": 16},
    }
    for k, v in over.items():
        doc[k] = {**doc.get(k, {}), **v} if isinstance(v, dict) else v
    return JobSpec.load(doc)


def openai_batch_spec(tmp_path: Path, n: int = 12, **over):
    """A job over ``n`` OpenAI batch chat requests (``tmp_path/batch.jsonl``, written here) with
    ``io.output_format=openai_batch``, writing to ``tmp_path/out``; ``over`` as ``make_spec``'s."""
    reqs = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"ticket {i}"}], "max_tokens": 5},
        }
        for i in range(n)
    ]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return make_spec(
        tmp_path / "batch.jsonl",
        tmp_path / "out",
        io={"output_format": "openai_batch"},
        prompt={"system_prompt": None, "template": "{text}"},
        **over,
    )


def merge_summary(
    rows: int, ok_rows: int, error_rows: int, files: dict[str, str] | None = None, parts: dict[str, int] | None = None
):
    """A ``MergeSummary`` with these counts and files, everything else neutral."""
    from airflow_provider_vllm.core.records import Duplicates, MergeSummary

    return MergeSummary(
        rows=rows,
        ok_rows=ok_rows,
        error_rows=error_rows,
        duplicates_dropped=0,
        duplicates=Duplicates(ids=0, rows_dropped=0, examples=[]),
        shards=1,
        files=files or {},
        checksums={},
        config_hash="c",
        spec_hash="s",
        merge_s=0.0,
        parts=parts or {},
    )


def write_merged_folder(out: Path, kind: str, table: pa.Table) -> Path:
    """``out/<kind>/part-00000.parquet`` + ``_manifest.json``: a merged folder as merge lays it out.

    For tests and benchmarks.
    """
    part = out / kind / "part-00000.parquet"
    part.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, part)
    write_manifest(out, kind)
    return part


def write_manifest(out: Path, kind: str) -> None:
    """``out/<kind>/_manifest.json`` naming every ``part-*.parquet`` already in the folder, in name order."""
    import hashlib

    from airflow_provider_vllm.core.records import PartEntry, PartsManifest

    parts = [
        PartEntry(
            name=p.name,
            bytes=p.stat().st_size,
            sha256=hashlib.sha256(p.read_bytes()).hexdigest(),
            rows=pq.ParquetFile(p).metadata.num_rows,
        )
        for p in sorted((out / kind).glob("part-*.parquet"))
    ]
    manifest = PartsManifest(kind=kind, rows=sum(p.rows for p in parts), parts=parts)  # type: ignore[arg-type]
    (out / kind / "_manifest.json").write_text(manifest.model_dump_json(indent=1))


def write_merged_summary(out: Path, summary) -> None:
    """``out/_MERGED.json`` as the merge writes it: naming the sha256 of the manifests there, sealed with the
    test deployment's key for this folder (``core/seal.py``)."""
    import hashlib

    from airflow_provider_vllm.core import seal as seals
    from airflow_provider_vllm.core.seal import Keyring

    checksums = {
        f"{kind}/_manifest.json": hashlib.sha256((out / kind / "_manifest.json").read_bytes()).hexdigest()
        for kind in ("results", "errors")
        if (out / kind / "_manifest.json").exists()
    }
    summary = summary.model_copy(update={"checksums": checksums})
    sealed = seals.seal_record(Keyring.from_env(), seals.MERGED, seals.scope_of(str(out)), summary)
    (out / "_MERGED.json").write_bytes(seals.record_bytes(sealed))


def history_line(folder, record) -> str:
    """One line of a throughput history file under ``folder``, as merge writes it: ``record`` (a dict or a
    ``ThroughputRecord``) sealed by this deployment for that folder (``sizing.read_history`` uses no other)."""
    from airflow_provider_vllm.core import seal as seals
    from airflow_provider_vllm.core.records import ThroughputRecord
    from airflow_provider_vllm.core.seal import Keyring

    rec = record if isinstance(record, ThroughputRecord) else ThroughputRecord.model_validate(record)
    sealed = seals.seal_record(Keyring.from_env(), seals.HISTORY, seals.scope_of(str(folder)), rec)
    return json.dumps(sealed.dump(), sort_keys=True) + "\n"


def shard_task(spec, shard_id: str, **kw):
    """``ShardTask`` for a shard of the run planned at ``spec``'s output, naming its sealed plan as the plan task's
    XCom does (``plan_mac``, ``plan_sha256``): read from ``_plan.json`` now, so a plan swapped later is another plan.
    No plan there: a task naming none (the worker then meets no plan). ``kw``: the task's other fields."""
    from airflow_provider_vllm.core.errors import SpecError
    from airflow_provider_vllm.core.plan import plan_sha256, read_plan
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.worker.task import ShardTask

    spec = spec if isinstance(spec, JobSpec) else JobSpec.load(spec)
    try:
        plan, _ = read_plan(spec)
        ref = {"plan_mac": plan.seal.mac, "plan_sha256": plan_sha256(plan)} if plan.seal is not None else {}
    except SpecError:
        ref = {}
    ref = {"plan_mac": "0" * 64, "plan_sha256": "0" * 64, **ref}
    return ShardTask(spec=spec, shard_id=shard_id, **{**ref, **kw})


def plan_xcom(spec, filesystems=None) -> dict[str, str]:
    """What the plan task pushes under the XCom key ``plan`` for the run planned at ``spec``'s output
    (``PlanRef.dump()``), for a merge task a test starts without a plan task: read from ``_plan.json`` now (its seal
    not checked: merge checks it), so a plan swapped later is another plan. No sealed plan there: an identity of no
    plan (merge then meets none, or refuses the one it finds)."""
    from airflow_provider_vllm.core.errors import CommitError, SpecError
    from airflow_provider_vllm.core.plan import read_plan
    from airflow_provider_vllm.core.spec import JobSpec

    try:
        spec = spec if isinstance(spec, JobSpec) else JobSpec.load(spec)
        plan, _ = read_plan(spec, filesystems)
        return plan.ref().dump()
    except (SpecError, CommitError):
        return {"plan_mac": "0" * 64, "plan_sha256": "0" * 64}


def merge(spec, *args, **kw):
    """``steps.merge.merger.merge`` run by hand, as the tests run it: under the sealed plan at ``_plan.json`` now
    (``plan_xcom``) unless ``plan`` names one. A DAG's merge task takes the plan task's value instead."""
    from airflow_provider_vllm.core.plan import PlanRef
    from airflow_provider_vllm.steps.merge import merger

    if "plan" not in kw:
        kw["plan"] = PlanRef.model_validate(plan_xcom(spec, kw.get("filesystems")))
    return merger.merge(spec, *args, **kw)


def worker_env(env) -> dict[str, str]:
    """``env`` as a shard worker's environment, as the local runner makes it: the worker key of its deployment key
    (``VLLM_BATCH_SIGNING_KEY``, the steps' key outside Airflow) unless it names one, and no deployment key (a worker
    refuses to start with one)."""
    from airflow_provider_vllm.core.seal import Keyring

    env = dict(env)
    key = env.pop("VLLM_BATCH_SIGNING_KEY", None)
    env.pop("AIRFLOW__VLLM_BATCH__SIGNING_KEY", None)
    if key and "VLLM_BATCH_WORKER_KEY" not in env:
        env["VLLM_BATCH_WORKER_KEY"] = Keyring.from_text(key).worker_text()
    return env


def cache_entry_id(spec, plan) -> str:
    """The result cache entry the merge of the run under ``spec`` files (``result_cache.entry_id``): from the parts its
    results manifest names that this run's shards computed (the cache's hits and the followers left out)."""
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.cache.result_cache import entry_id, made_from
    from airflow_provider_vllm.steps.merge.merger import RESULTS, read_manifest

    out = Storage(spec.io.output_uri, spec.io.storage_options)
    return entry_id(plan, spec.io.output_uri, made_from(read_manifest(out, RESULTS).parts))


def vouch_cache(spec, filesystems=None) -> str | None:
    """What publish does for the result cache once the run under ``spec`` is published (``vouch_published``, the
    function the publish task calls): its entry, as the sealed ``_MERGED.json`` names it, serves later runs. Tests
    that fill the cache by plan and merge alone call it where a DAG's publish task would run."""
    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.cache.result_cache import vouch_published
    from airflow_provider_vllm.steps.merge.merger import read_merged

    spec = spec if isinstance(spec, JobSpec) else JobSpec.load(spec)
    keyring = Keyring.from_env()
    merged = read_merged(Storage(spec.io.output_uri, spec.io.storage_options, filesystems), keyring)
    plan = load_plan(spec, filesystems, keyring, merged=merged)
    return vouch_published(spec, plan, merged, keyring, filesystems)


def cached_job_spec(tmp_path: Path, run: str, ids: list[str], texts: list[str], **over: Any) -> Any:
    """A fake-model job with the result cache at ``tmp_path/cache``: ``ids``/``texts`` written to
    ``in-<run>.parquet``, output ``out-<run>``, shards of 20 rows (``over``: more spec fields)."""
    write_parquet(tmp_path / f"in-{run}.parquet", ids, texts)
    return make_spec(
        tmp_path / f"in-{run}.parquet",
        tmp_path / f"out-{run}",
        model={"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
        cache={"uri": str(tmp_path / "cache")},
        sharding={"target_rows": 20},
        **over,
    )
