"""benchmarks/bench_cache_dag.py: day D+1 is day D with the advertised edits, removals and new rows."""

from __future__ import annotations

import importlib.util

from tests.support import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cache_dag", ROOT / "benchmarks" / "bench_cache_dag.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_next_day_edits_5_percent_removes_2_percent_and_appends_the_new_rows():
    bench = _bench()
    day1 = [{"id": f"t{i}", "text": f"text {i}", "channel": "email"} for i in range(2000)]
    new = [{"id": f"n{i}", "text": f"new {i}", "channel": "chat"} for i in range(100)]
    day2, counts = bench.next_day(day1, new)
    assert counts == {"edited": 100, "removed": 40, "new": 100}
    assert (bench.EDITED, bench.REMOVED, bench.NEW) == (0.05, 0.02, 0.05)
    old = {r["id"]: r["text"] for r in day1}
    ids2 = [r["id"] for r in day2]
    assert len(ids2) == len(set(ids2)) == 2000 - 40 + 100
    assert len(set(old) - set(ids2)) == 40  # removed
    edited = [r for r in day2 if r["id"] in old and r["text"] != old[r["id"]]]
    assert len(edited) == 100 and all(r["text"].startswith(old[r["id"]]) for r in edited)
    assert day2[-100:] == new and day1[7]["text"] == "text 7"  # day D itself is not modified


def test_by_task_sums_mapped_shards_and_leaves_out_skipped_tasks():
    tis = [
        {"task": "plan", "map_index": -1, "state": "success", "seconds": 2.0},
        {"task": "shard", "map_index": 0, "state": "success", "seconds": 10.0},
        {"task": "shard", "map_index": 1, "state": "success", "seconds": 12.5},
        {"task": "shard_kubernetes", "map_index": -1, "state": "skipped", "seconds": None},
    ]
    assert _bench().by_task(tis) == {"plan": {"seconds": 2.0, "count": 1}, "shard": {"seconds": 22.5, "count": 2}}
