#!/usr/bin/env python
"""Result cache, data plane: plan + merge of a nightly run with a 10M-row cache and 2% changed rows,
as a ratio to the same run without the cache (no vLLM: shard outputs are synthesised).

    .venv/bin/python benchmarks/bench_cache.py [--rows 10000000] [--changed 0.02] [--repeat 2]
                                               [--workdir .cache/bench/cache] [--profile]

1. Input A: ``bench_dataplane.generate_dataset`` (``--rows`` rows, 10 files) with the id appended
   to each text (its texts come from a few thousand template pairs; tickets are unique); input B:
   A with ``--changed`` of the texts edited (same ids; picked by ``hash(id)``), written once with DuckDB.
2. Warm-up, not timed: run 1 over A with an empty cache (plan, synthesised commits, merge, and what publish does
   for the cache: ``publish_cache``), which appends all of A's answers to the cache and lets them serve: the
   "10M-row cache".
3. Timed, alternated ``nocache cache cache nocache`` per repeat: run 2 over B into a fresh output
   prefix, plan (timed) -> synthesised commits for the planned shards (not timed: they stand in
   for the GPU) -> merge (timed). The cache side starts each time from a hard-linked copy of the
   warm cache, so every repeat sees the same 10M-row cache.

``--profile``: one cached run only (plan and merge under cProfile, with the seconds of each DuckDB statement),
printed to stderr; nothing is appended to results.jsonl.

Baseline: the no-cache side in the same invocation. Prints per side the plan and merge seconds
(medians), peak RSS of each stage (its own subprocess), the rows the shards would infer (the
GPU work), and ratio = (plan + merge with cache) / (plan + merge without). One JSON line goes to
benchmarks/results.jsonl.
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

ENGINE = "vllm==0.32.0"  # the engine identity in the key; the synthesised rows say engine_version 0.32.0


# A benchmark's own signing key (docs/adr/0007-sealed-records.md): the stages it runs, in this process
# and in the children it starts, seal and check what they write with it. Never a deployment's key.
os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", "benchmark-signing-key-not-for-deployments-0123456789")


def spec_for(input_dir: Path, run_dir: Path, cache_dir: Path | None):
    from airflow_provider_vllm.core.spec import JobSpec

    doc = dp.bench_spec(input_dir, run_dir, 50_000).model_dump(mode="json")
    doc["model"]["revision"] = "0" * 40  # a hub model must be pinned to a commit for the cache
    doc["cache"] = {"uri": str(cache_dir) if cache_dir else None}
    return JobSpec.load(doc)


def derive(src: Path, dst: Path, text_sql: str, recipe: dict) -> int:
    """``dst`` = ``src`` file by file with ``text`` replaced by ``text_sql`` (same ids, same row groups),
    written once with DuckDB; returns the rows whose text changed."""
    import duckdb

    marker = dst / "_DATASET.json"
    want = {"from": json.loads((src / "_DATASET.json").read_text()), **recipe}
    if marker.exists() and json.loads(marker.read_text())["spec"] == want:
        return json.loads(marker.read_text())["changed"]
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    con = duckdb.connect()
    changed = 0
    for f in sorted(src.glob("part-*.parquet")):
        con.execute(
            f"COPY (SELECT id, {text_sql} AS text FROM read_parquet('{f}')) TO '{dst / f.name}' "
            f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {dp.ROW_GROUP})"
        )
        changed += con.execute(
            f"SELECT count(*) FROM read_parquet('{f}') WHERE {text_sql} IS DISTINCT FROM text"
        ).fetchall()[0][0]
    marker.write_text(json.dumps({"spec": want, "changed": changed}))
    return changed


def publish_cache(spec) -> str | None:
    """What the publish task does for the result cache once the run is published (``vouch_published``, from the
    sealed ``_MERGED.json`` and plan): the run's entry serves later runs. The entry id vouched for."""
    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.cache.result_cache import vouch_published
    from airflow_provider_vllm.steps.merge.merger import read_merged

    keyring = Keyring.from_env()
    merged = read_merged(Storage(spec.io.output_uri, spec.io.storage_options), keyring)
    return vouch_published(spec, load_plan(spec, None, keyring, merged=merged), merged, keyring)


def child(stage: str, input_dir: Path, run_dir: Path, cache_dir: str, profile: bool = False) -> None:
    import resource

    from airflow_provider_vllm.core.plan import current_plan_ref
    from airflow_provider_vllm.steps.merge.merger import merge
    from airflow_provider_vllm.steps.plan.planner import plan_job

    spec = spec_for(input_dir, run_dir, Path(cache_dir) if cache_dir else None)
    extra: dict = {}
    if profile:
        _profiled(stage, input_dir, run_dir, cache_dir)
        return
    # run by hand, no plan task names the plan: take the folder's sealed plan, explicitly (outside the timing)
    pinned = current_plan_ref(spec) if stage == "merge" else None
    t0 = time.perf_counter()
    use0 = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = use0.ru_utime + use0.ru_stime
    if stage == "plan":
        plan = plan_job(spec, engine_identity=ENGINE)
        extra.update(
            shards=len(plan.shards),
            infer_rows=sum(s.rows for s in plan.shards),
            hits=plan.cache.hits if plan.cache else 0,
        )
    elif stage == "setup":
        extra.update(dp.synthesise_commits(spec, engine_identity=ENGINE))
    elif stage == "merge":
        assert pinned is not None
        s = merge(spec, plan=pinned)
        extra.update(
            ok_rows=s.ok_rows,
            error_rows=s.error_rows,
            appended=s.cache.appended if s.cache else None,
            skipped=s.cache.skipped if s.cache else None,
        )
    elif stage == "publish":  # the warm-up only, never timed
        extra.update(vouched=publish_cache(spec))
    else:
        raise SystemExit(f"unknown stage {stage}")
    seconds = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    cpu = use.ru_utime + use.ru_stime - cpu0  # every thread's CPU: on a shared machine steadier than seconds
    peak = use.ru_maxrss / 1024
    print(
        json.dumps(
            {"stage": stage, "seconds": round(seconds, 3), "cpu_s": round(cpu, 2), "peak_rss_mib": round(peak, 1)}
            | extra
        )
    )


def _profiled(stage: str, input_dir: Path, run_dir: Path, cache_dir: str) -> None:
    """``stage`` again under cProfile with bench_dataplane's per-statement DuckDB timers, printed to stderr."""
    import cProfile
    import pstats

    sql_log: list = []
    dp._install_sql_timers(sql_log)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(child, stage, input_dir, run_dir, cache_dir)
    print(f"{stage}: {time.perf_counter() - t0:.2f} s under the profiler", file=sys.stderr)
    st = pstats.Stats(prof, stream=sys.stderr)
    st.sort_stats("cumulative").print_stats(30)
    st.sort_stats("tottime").print_stats(15)
    print("DuckDB statements (and their fetches), slowest first:", file=sys.stderr)
    for s, q in sorted(sql_log, reverse=True)[:15]:
        print(f"  {s:7.3f}s  {q}", file=sys.stderr)


def run_child(stage: str, input_dir: Path, run_dir: Path, cache_dir: Path | None, profile: bool = False) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        stage,
        "--input-dir",
        str(input_dir),
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(cache_dir or ""),
    ] + (["--profile"] if profile else [])
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if profile:
        sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"stage {stage} failed (exit {proc.returncode})")
    r = json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
    r["load1_before"] = round(load, 2)
    return r


def one_run(input_dir: Path, run_dir: Path, cache_dir: Path | None, profile: bool = False) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    plan = run_child("plan", input_dir, run_dir, cache_dir, profile)
    run_child("setup", input_dir, run_dir, cache_dir)
    merged = run_child("merge", input_dir, run_dir, cache_dir, profile)
    return {"plan": plan, "merge": merged, "total_s": round(plan["seconds"] + merged["seconds"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--changed", type=float, default=0.02)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=HERE.parent / ".cache" / "bench" / "cache")
    ap.add_argument("--child")
    ap.add_argument("--input-dir", type=Path)
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--cache-dir", default="")
    ap.add_argument("--profile", action="store_true", help="one cached run, profiled (stderr); no results line")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.input_dir, args.run_dir, args.cache_dir, args.profile)
        return 0
    if not 0 < args.changed < 1:
        raise SystemExit("--changed must be a fraction in (0, 1)")
    w = args.workdir.resolve()
    w.mkdir(parents=True, exist_ok=True)
    gen, a, b = w / "in-gen", w / "in-a", w / "in-b"
    dp.generate_dataset(gen, args.rows)
    # bench_dataplane's texts come from a few thousand template pairs; tickets are unique, so is each text here
    derive(gen, a, "text || ' [' || id || ']'", {"unique": 1})
    cut = int(args.changed * 10_000)
    edited = derive(
        a, b, f"CASE WHEN hash(id) % 10000 < {cut} THEN text || ' (edited)' ELSE text END", {"changed": args.changed}
    )
    # The cache's commits are sealed for the cache folder they live in (a copy elsewhere is another cache, whose
    # seals do not verify): run 1 fills cache-run, a hard-linked copy keeps it, and each timed run starts from
    # that copy put back at the same path.
    cache_run, warm = w / "cache-run", w / "cache-warm"
    done = w / "cache-warm.json"
    # a warm cache of an earlier version holds entries no publish vouched for: it serves nothing, made again
    if not (done.exists() and json.loads(done.read_text()).get("rows") == args.rows and "vouched" in done.read_text()):
        shutil.rmtree(warm, ignore_errors=True)
        shutil.rmtree(cache_run, ignore_errors=True)
        t0 = time.monotonic()
        run1 = one_run(a, w / "run1", cache_run)
        if not run1["merge"]["appended"]:  # else every "cached" run below measures an empty cache (all misses)
            raise SystemExit(f"the warm-up appended nothing to the cache: {run1['merge']['skipped']}")
        vouched = run_child("publish", a, w / "run1", cache_run)["vouched"]  # its entry serves only once published
        shutil.copytree(cache_run, warm, copy_function=os.link)
        done.write_text(json.dumps({"rows": args.rows, "appended": run1["merge"]["appended"], "vouched": vouched}))
        print(f"warm-up (run 1, cold cache): {json.dumps(run1)} in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    if args.profile:
        shutil.rmtree(cache_run, ignore_errors=True)
        shutil.copytree(warm, cache_run, copy_function=os.link)
        print(json.dumps(one_run(b, w / "run2-cache", cache_run, profile=True)))
        return 0
    sides: dict[str, list[dict]] = {"nocache": [], "cache": []}
    order = [("nocache", "cache"), ("cache", "nocache")]
    for rep in range(args.repeat):
        for side in order[rep % 2]:
            cache_dir = None
            if side == "cache":
                cache_dir = cache_run
                shutil.rmtree(cache_dir, ignore_errors=True)
                shutil.copytree(warm, cache_dir, copy_function=os.link)
            r = one_run(b, w / f"run2-{side}", cache_dir)
            sides[side].append(r)
            print(
                f"{side:8s} plan {r['plan']['seconds']:7.2f}s cpu {r['plan']['cpu_s']:6.2f}s "
                f"({r['plan']['peak_rss_mib']:.0f} MiB)  merge {r['merge']['seconds']:7.2f}s cpu "
                f"{r['merge']['cpu_s']:6.2f}s ({r['merge']['peak_rss_mib']:.0f} MiB)  "
                f"infer rows {r['plan']['infer_rows']}  load {r['plan']['load1_before']}",
                file=sys.stderr,
            )

    def med(side: str, key: str) -> float:
        vals = [r[key]["seconds"] if key in ("plan", "merge") else r[key] for r in sides[side]]
        return round(statistics.median(vals), 3)

    summary = {
        side: {
            "plan_s": med(side, "plan"),
            "merge_s": med(side, "merge"),
            "total_s": med(side, "total_s"),
            "infer_rows": sides[side][0]["plan"]["infer_rows"],
            "hits": sides[side][0]["plan"]["hits"],
            "peak_rss_mib": max(max(r["plan"]["peak_rss_mib"], r["merge"]["peak_rss_mib"]) for r in sides[side]),
        }
        for side in sides
    }
    ratio = round(summary["cache"]["total_s"] / summary["nocache"]["total_s"], 3)
    line = {
        "bench": "cache",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": args.rows,
        "changed": args.changed,
        "edited_rows": edited,
        "repeat": args.repeat,
        "env": dp.environment(),
        "summary": summary,
        "ratio_plan_merge_cache_vs_nocache": ratio,
        "infer_rows_ratio": round(summary["cache"]["infer_rows"] / summary["nocache"]["infer_rows"], 4),
        "runs": sides,
    }
    with open(dp.RESULTS_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps({k: v for k, v in line.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
