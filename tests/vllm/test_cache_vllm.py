"""The result cache with the real worker on real vLLM (CPU build) and the tiny local model (every run's shards
go to one worker process, tests/support/shard_server.py).

Run 1 fills the cache; run 2 over an edited input (5% texts edited, 5% rows added, 2% removed) sends only the
edited and new rows to the engine, serves the rest from run 1, and equals a full recompute on every row;
another prompt gets no hit, and neither does the same input with the template's float32 column re-exported as
double (the worker would render other prompts).
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.testing.local_models import default_cache_dir, make_tiny_llama
from tests.support.data import merge, vouch_cache, write_parquet
from tests.support.shard_server import ShardServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LABELS = ["billing", "bug", "other"]
TICKETS = [
    "I was charged twice for my subscription this month, please refund one payment.",
    "The app crashes every time I open the settings page on Android.",
    "Can you tell me where your office is located?",
    "My invoice shows the wrong VAT number.",
    "After the last update the export button does nothing and the page freezes.",
]
ENV = {
    **os.environ,
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
}
N = 60


def spec_for(
    model: str, tmp: Path, run: str, cache: bool = True, template: str = "Ticket: {text} (priority {priority})"
) -> JobSpec:
    return JobSpec.load(
        {
            "model": {"name": model, "max_model_len": 512},
            "engine": {"enforce_eager": True, "max_num_seqs": 16},
            "io": {"input_uri": str(tmp / f"in-{run}"), "output_uri": str(tmp / f"out-{run}")},
            "prompt": {"system_prompt": "Classify the ticket.", "template": template, "text_columns": ["text"]},
            "sampling": {"temperature": 0, "max_tokens": 8, "structured": {"choice": LABELS}},
            "sharding": {"target_rows": 10_000, "chunk_rows": 16},
            "cache": {"uri": str(tmp / "cache") if cache else None},
        }
    )


def run(spec: JobSpec, server: ShardServer) -> tuple[list[dict], dict]:
    """Plan, every shard in the worker (the server's process), merge and publish's step for the cache (the entry then
    serves later runs): (worker manifests, merge summary)."""
    manifests = [server.run(spec, shard.shard_id) for shard in plan_job(spec).shards]
    merged = merge(spec).dump()
    vouch_cache(spec)
    return manifests, merged


def labels(spec: JobSpec) -> dict[str, tuple[str, str | None]]:
    t = pq.read_table(Path(spec.io.output_uri) / "results")
    cached = t.column("cached_from").to_pylist() if "cached_from" in t.column_names else [None] * t.num_rows
    return {i: (lab, c) for i, lab, c in zip(t.column("id").to_pylist(), t.column("label").to_pylist(), cached)}


def test_second_run_infers_only_edited_and_new_rows(tmp_path, shard_server):
    # the three runs' shards in the test process's worker process: at most one engine start (none when the last
    # test's engine had these settings; the engine identity the cache keys on is read afresh for each shard, from
    # the environment the process started with)
    before = shard_server.engines_started
    _runs(tmp_path, shard_server)
    assert shard_server.engines_started - before <= 1


def _runs(tmp_path: Path, server: ShardServer) -> None:
    model = str(make_tiny_llama(default_cache_dir() / "tiny-llama"))
    ids = [f"t{i:03d}" for i in range(N)]
    texts = [TICKETS[i % len(TICKETS)] + f" (ref {i})" for i in range(N)]
    priority = {i: 0.1 * (n % 7) for n, i in enumerate(ids)}  # a float32 column: rendered 0.10000000149011612
    write_parquet(
        tmp_path / "in-a" / "a.parquet",
        ids,
        texts,
        row_group_size=16,
        priority=pa.array(list(priority.values()), pa.float32()),
    )
    s1 = spec_for(model, tmp_path, "a")
    m1, merged1 = run(s1, server)
    assert sum(m["stats"]["infer_rows"] for m in m1) == N and merged1["cache"]["appended"] == N
    first = labels(s1)

    edited = {ids[i] for i in (7, 23, 41)}  # 5% of the texts
    removed = {ids[50]}  # 2% of the rows (1 of 60)
    ids2 = [i for i in ids if i not in removed] + ["n1", "n2", "n3"]  # 5% new rows
    by_id = dict(zip(ids, texts))
    texts2 = [
        (by_id[i] + " It happened again today." if i in edited else by_id[i])
        if i in by_id
        else f"A brand new ticket {i}: my card was charged twice."
        for i in ids2
    ]
    prio2 = [priority.get(i, 0.5) for i in ids2]
    write_parquet(
        tmp_path / "in-b" / "b.parquet", ids2, texts2, row_group_size=16, priority=pa.array(prio2, pa.float32())
    )
    s2 = spec_for(model, tmp_path, "b")
    m2, merged2 = run(s2, server)
    assert sum(m["stats"]["infer_rows"] for m in m2) == len(edited) + 3  # only edited + new reach the engine
    assert merged2["cache"]["hits"] == len(ids2) - len(edited) - 3 and merged2["ok_rows"] == len(ids2)
    second = labels(s2)
    assert set(second) == set(ids2)
    for i in ids2:
        if i in first and i not in edited:
            assert second[i] == (first[i][0], str(tmp_path / "out-a")), i
        else:
            assert second[i][1] is None, i

    # a full recompute (no cache) of run 2's input answers every row the same
    s_full = spec_for(model, tmp_path, "b", cache=False)
    s_full = JobSpec.load(
        {
            **s_full.model_dump(mode="json"),
            "io": {**s_full.io.model_dump(mode="json"), "output_uri": str(tmp_path / "out-full")},
        }
    )
    run(s_full, server)
    full = labels(s_full)
    assert {i: v[0] for i, v in full.items()} == {i: v[0] for i, v in second.items()}

    # another prompt: no hit (checked at plan time: nothing to infer here)
    other = spec_for(model, tmp_path, "b", template="Support ticket: {text} (priority {priority})")
    other = JobSpec.load(
        {
            **other.model_dump(mode="json"),
            "io": {**other.io.model_dump(mode="json"), "output_uri": str(tmp_path / "out-other")},
        }
    )
    assert plan_job(other).cache.hits == 0

    # run 2's input re-exported with the priority as double: other prompts, so no hit (plan time)
    write_parquet(
        tmp_path / "in-c" / "c.parquet", ids2, texts2, row_group_size=16, priority=pa.array(prio2, pa.float64())
    )
    retyped = plan_job(spec_for(model, tmp_path, "c"))
    assert (retyped.cache.hits, retyped.cache.misses) == (0, len(ids2))
