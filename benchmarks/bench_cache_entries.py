#!/usr/bin/env python
"""The result cache's plan with many past entries: 1,000 sealed entries vs the same answers compacted.

    .venv/bin/python benchmarks/bench_cache_entries.py [--rows 200000] [--entries 1000] [--repeat 3]
                                                       [--workdir .cache/bench/cache-entries]

1. An input of ``--rows`` unique tickets (``bench_dataplane.generate_dataset``, the id appended).
2. A cache holding the answer of every row, split over ``--entries`` sealed entries (each one
   nightly run's worth: ``CacheStore.write``, as a merge writes them, without compacting, each vouched for as
   publish does: ``CacheStore.vouch``), and a
   second one built the same way and then compacted (``CacheStore.compact``: one entry with the same
   answers). Each is built in its own folder once (seals name the folder).
3. Timed, alternated ``many compacted compacted many`` per repeat: ``plan_job`` of a run over the
   input, into a fresh output prefix, against each cache.

Every plan checks each commit's seal and copies each part while hashing it (docs/adr/0007), so
the plan's cost without compaction grows with the entries; compaction (which every merge runs when
a key config has more than 16 live entries) keeps it at one entry. Baseline: the compacted side in
the same invocation; ratio = many / compacted. One JSON line goes to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_dataplane as dp  # noqa: E402

ENGINE = "vllm==0.32.0"
# A benchmark's own signing key (docs/adr/0007-sealed-records.md). Never a deployment's key.
os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", "benchmark-signing-key-not-for-deployments-0123456789")


def spec_for(input_dir: Path, out: Path, cache_dir: Path):
    from airflow_provider_vllm.core.spec import JobSpec

    spec = dp.bench_spec(input_dir, out, 50_000).model_dump(mode="json")
    spec["cache"] = {"uri": str(cache_dir)}
    spec["model"]["revision"] = "0" * 40
    return JobSpec.load(spec)


def build_cache(input_dir: Path, cache_dir: Path, entries: int) -> dict:
    """``entries`` sealed entries holding every input row's answer under its real key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_vllm.core import duck
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.steps.cache import result_cache as rc
    from airflow_provider_vllm.steps.cache.store import CacheStore

    spec = spec_for(input_dir, cache_dir.parent / "unused", cache_dir)
    khash = rc.key_hash(rc.key_config(spec, ENGINE))
    files = sorted(str(p) for p in input_dir.glob("*.parquet"))
    con = duck.connect()
    source = f"read_parquet({duck.local_list(files)})"
    types = rc.column_types(con, source, spec)
    keys = con.execute(f"SELECT CAST(id AS VARCHAR), {rc.key_sql(spec, khash, types)} FROM {source}").fetchall()
    con.close()
    store = CacheStore(str(cache_dir), {}, Keyring.from_env())
    per = -(-len(keys) // entries)
    tmp = cache_dir.parent / "entry.parquet"
    for n in range(entries):
        part = keys[n * per : (n + 1) * per]
        cols = {f.name: pa.nulls(len(part), f.type) for f in rc.ENTRY_SCHEMA}
        cols.update(
            key=pa.array([k for _, k in part]),
            source_id=pa.array([i for i, _ in part]),
            output=pa.array(["billing"] * len(part)),
            label=pa.array(["billing"] * len(part)),
            computed_at=pa.array([f"2026-11-{1 + n % 28:02d}T00:00:00.{n:06d}+00:00"] * len(part)),
        )
        pq.write_table(pa.table(cols, schema=rc.ENTRY_SCHEMA), tmp)
        store.write(khash, f"{n:032x}", str(tmp), len(part), {"output_uri": f"/runs/{n}", "engine": ENGINE})
        # each run published: publish vouches for its entry (only entries of published runs are read)
        made = store.read_commit(khash, f"{n:032x}")
        assert made is not None and made.seal is not None
        store.vouch(khash, f"{n:032x}", made.seal.mac, "publish", f"/runs/{n}")
    return {"rows": len(keys), "entries": entries, "key_hash": khash}


def child(stage: str, input_dir: Path, out: Path, cache_dir: Path, entries: int) -> None:
    import resource

    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.steps.cache.store import CacheStore
    from airflow_provider_vllm.steps.plan.planner import plan_job

    extra: dict = {}
    t0 = time.perf_counter()
    if stage == "build":
        extra.update(build_cache(input_dir, cache_dir, entries))
    elif stage == "compact":
        store = CacheStore(str(cache_dir), {}, Keyring.from_env())
        khash = json.loads(os.environ["BENCH_KEY_HASH"])
        from airflow_provider_vllm.steps.cache import store as store_mod

        store_mod.COMPACT_AFTER = 1
        extra["compacted_into"] = store.compact(khash, str(out))
    elif stage == "plan":
        plan = plan_job(spec_for(input_dir, out, cache_dir), engine_identity=ENGINE)
        extra.update(hits=plan.cache.hits, commits_read=len(plan.cache.commits_read), shards=len(plan.shards))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"stage": stage, "seconds": round(seconds, 3), "peak_rss_mib": round(peak, 1), **extra}))


def run_child(stage: str, args, input_dir: Path, out: Path, cache_dir: Path, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", stage, "--input-dir", str(input_dir), "--out", str(out)]
    cmd += ["--cache-dir", str(cache_dir), "--entries", str(args.entries)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=3600)
    if p.returncode:
        raise SystemExit(f"{stage} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--entries", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=HERE.parent / ".cache" / "bench" / "cache-entries")
    ap.add_argument("--child")
    ap.add_argument("--input-dir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cache-dir", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.input_dir, args.out, args.cache_dir, args.entries)
        return 0
    work = args.workdir.resolve()
    input_dir = work / f"input-{args.rows}"
    if not (input_dir / "_DONE").exists():
        shutil.rmtree(input_dir, ignore_errors=True)
        dp.generate_dataset(input_dir, args.rows)
        (input_dir / "_DONE").write_text("ok")
    # Seals name their cache folder (a copied cache is not trusted), so each side is built in place, once;
    # plans only read it.
    many, compacted = work / f"cache-{args.entries}", work / f"cache-{args.entries}-compacted"
    for folder in (many, compacted):
        if not (folder / "_DONE").exists() or not (folder / "published").exists():  # an earlier version's: unvouched
            shutil.rmtree(folder, ignore_errors=True)
            built = run_child("build", args, input_dir, work / "x", folder)
            if folder == compacted:
                env = {"BENCH_KEY_HASH": json.dumps(built["key_hash"])}
                c = run_child("compact", args, input_dir, work / "compact-tmp", folder, env)
                assert c["compacted_into"], c
                print(f"compacted into {c['compacted_into']} in {c['seconds']:.1f}s", file=sys.stderr)
            (folder / "_DONE").write_text(json.dumps(built))
    built = json.loads((many / "_DONE").read_text())
    print(f"{built['entries']} entries over {built['rows']:,} rows", file=sys.stderr)
    sides: dict[str, list[dict]] = {"many": [], "compacted": []}
    for _ in range(args.repeat):
        for side in ("many", "compacted", "compacted", "many"):
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            r = run_child("plan", args, input_dir, out, many if side == "many" else compacted)
            assert r["hits"] == built["rows"], r
            sides[side].append(r)
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in sides.items()}
    line = {
        "bench": "cache_entries",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": built["rows"],
        "entries": built["entries"],
        "plan_s": {k: [r["seconds"] for r in v] for k, v in sides.items()},
        "median_s": med,
        "commits_read": {k: v[0]["commits_read"] for k, v in sides.items()},
        "peak_rss_mib": {k: max(r["peak_rss_mib"] for r in v) for k, v in sides.items()},
        "ratio_many_to_compacted": round(med["many"] / med["compacted"], 3),
        "env": dp.environment(),
    }
    print(json.dumps(line, indent=1))
    with open(HERE / "results.jsonl", "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
