"""benchmarks/bench_cache.py: its warm-up really fills the result cache, so its "cached" runs measure hits.

The benchmark's shard outputs are synthesised (``bench_dataplane.synthesise_commits``); a commit marker that lacks
what merge requires to append (e.g. the worker's clock probe of the chat template) left the cache empty, and every
"cached" run was all misses without any error."""

from __future__ import annotations

import importlib.util
import sys

from tests.support import ROOT


def _bench_cache():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_cache imports bench_dataplane beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_cache", ROOT / "benchmarks" / "bench_cache.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_synthesised_commits_of_a_warm_up_are_appended_and_the_next_run_hits(tmp_path, monkeypatch):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from tests.support.data import merge

    bench = _bench_cache()
    monkeypatch.setenv("VLLM_BATCH_SIGNING_KEY", "benchmark-signing-key-not-for-deployments-0123456789")
    bench.dp.generate_dataset(tmp_path / "in", 2_000)
    cache = tmp_path / "cache"
    spec = bench.spec_for(tmp_path / "in", tmp_path / "run1", cache)
    plan_job(spec, engine_identity=bench.ENGINE)
    bench.dp.synthesise_commits(spec, engine_identity=bench.ENGINE)
    merged = merge(spec)
    assert merged.cache is not None and merged.cache.skipped is None, merged.cache
    assert merged.cache.appended > 0  # one answer per key: the generated texts repeat, so fewer than ok_rows
    assert bench.publish_cache(spec) == merged.cache.entry_id  # the warm-up's publish step: the entry serves
    again = plan_job(bench.spec_for(tmp_path / "in", tmp_path / "run2", cache), engine_identity=bench.ENGINE)
    assert again.cache is not None and merged.ok_rows <= again.cache.hits <= again.total_rows == 2_000
