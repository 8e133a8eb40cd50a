"""Baseline of ``bench_cache_entries.py``: the previous version's plan (commit 748e4ad: unsealed cache entries,
no check beyond sizes) against a cache of ``--entries`` entries holding every input row's answer.

It imports that version's modules, so it runs only in a checkout of 748e4ad, over the input that
``bench_cache_entries.py`` generated (docs/BENCHMARKS.md, section 10):

    git worktree add --detach ../base 748e4ad && cd ../base
    PYTHONPATH=. python ../<this checkout>/benchmarks/baselines/cache_entries_unsealed.py \
        --input-dir <workdir>/input-200000 --work <dir> --entries 1000 --repeat 4
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ENGINE = "vllm==0.32.0"


def spec_for(input_dir, out, cache_dir):
    sys.path.insert(0, "benchmarks")
    import bench_dataplane as dp

    from airflow_provider_vllm.core.spec import JobSpec

    spec = dp.bench_spec(input_dir, out, 50_000).model_dump(mode="json")
    spec["cache"] = {"uri": str(cache_dir)}
    spec["model"]["revision"] = "0" * 40
    return JobSpec.load(spec)


def build(input_dir, cache_dir, entries):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_vllm.core import duck
    from airflow_provider_vllm.core.records import CacheCommit, CacheFileEntry
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps import cache as rc

    spec = spec_for(input_dir, cache_dir.parent / "unused", cache_dir)
    khash = rc.key_hash(rc.key_config(spec, ENGINE))
    files = sorted(str(p) for p in input_dir.glob("*.parquet"))
    con = duck.connect()
    listed = ", ".join(repr(f) for f in files)
    keys = con.execute(
        f"SELECT CAST(id AS VARCHAR), {rc.key_sql(spec, khash)} FROM read_parquet([{listed}])"
    ).fetchall()
    st = Storage(str(cache_dir))
    per = -(-len(keys) // entries)
    for n in range(entries):
        part = keys[n * per : (n + 1) * per]
        eid = f"{n:032x}"
        cols = {f.name: pa.nulls(len(part), f.type) for f in rc.ENTRY_SCHEMA}
        cols.update(
            key=pa.array([k for _, k in part]),
            source_id=pa.array([i for i, _ in part]),
            output=pa.array(["billing"] * len(part)),
            label=pa.array(["billing"] * len(part)),
        )
        rel = f"{rc.ENTRIES}/{eid}/part-00000.parquet"
        os.makedirs(cache_dir / rc.ENTRIES / eid, exist_ok=True)
        pq.write_table(pa.table(cols, schema=rc.ENTRY_SCHEMA), cache_dir / rel)
        c = CacheCommit(
            entry_id=eid,
            key_hash=khash,
            files=[CacheFileEntry(path=rel, bytes=st.size(rel), sha256=st.sha256(rel), rows=len(part))],
            rows=len(part),
            source_output_uri=f"/runs/{n}",
            source_config_hash="c",
            source_spec_hash="s",
            versions={"engine": ENGINE},
            created=datetime.now(UTC).isoformat(timespec="microseconds"),
        )
        os.makedirs(cache_dir / rc.COMMITS, exist_ok=True)
        (cache_dir / rc.COMMITS / f"{eid}.json").write_text(json.dumps(c.dump(), indent=1))
    return len(keys)


def plan_once(input_dir, out, cache_dir):
    from airflow_provider_vllm.steps.plan import plan_job

    t0 = time.perf_counter()
    p = plan_job(spec_for(input_dir, out, cache_dir), engine_identity=ENGINE)
    return time.perf_counter() - t0, p.cache.hits


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--input-dir", type=Path)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--entries", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--child")
    a = ap.parse_args()
    cache = a.work / f"base-cache-{a.entries}"
    if a.child == "plan":
        s, hits = plan_once(a.input_dir, a.work / "out", cache)
        print(json.dumps({"seconds": s, "hits": hits}))
        sys.exit(0)
    if not (cache / "_DONE").exists():
        shutil.rmtree(cache, ignore_errors=True)
        rows = build(a.input_dir, cache, a.entries)
        (cache / "_DONE").write_text(str(rows))
    secs = []
    for _ in range(a.repeat):
        shutil.rmtree(a.work / "out", ignore_errors=True)
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "plan",
                "--input-dir",
                str(a.input_dir),
                "--work",
                str(a.work),
                "--entries",
                str(a.entries),
            ],
            capture_output=True,
            text=True,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        r = json.loads(p.stdout.strip().splitlines()[-1])
        secs.append(r["seconds"])
        print(r, file=sys.stderr)
    print(
        json.dumps(
            {
                "bench": "cache_entries_base",
                "commit": "748e4ad",
                "entries": a.entries,
                "plan_s": secs,
                "median_s": statistics.median(secs),
            }
        )
    )
