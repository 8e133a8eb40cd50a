"""The changes output at scale: ``steps/changes.compute_changes`` over two merged runs of N rows.

    python benchmarks/bench_changes.py [--rows 10000000] [--changed 0.02]

Writes two merged runs (results + errors Parquet and ``_MERGED.json``, a structured-choice job:
the previous run, then 2% of labels moved, 1% of ids removed and 1% added), then times
``compute_changes`` in a child process (its peak RSS: ``VmHWM``, not inherited like ``ru_maxrss``) against a baseline
measured in the same run: DuckDB copying both runs' results into one Parquet file (the I/O a
comparison cannot avoid). Prints one JSON line: seconds, the ratio to the baseline, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LABELS = ["billing", "bug", "feature_request", "account", "other"]


# A benchmark's own signing key (docs/adr/0007-sealed-records.md): the stages it runs, in this process
# and in the children it starts, seal and check what they write with it. Never a deployment's key.
os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", "benchmark-signing-key-not-for-deployments-0123456789")


def write_run(con, out: Path, rows: int, offset: int, moved: float) -> None:
    from airflow_provider_vllm.core.rows import ERROR_COLUMNS, ERROR_SCHEMA, RESULT_COLUMNS, RESULT_SCHEMA
    from tests.support.data import merge_summary, write_manifest

    (out / "results").mkdir(parents=True)
    labels = "['" + "','".join(LABELS) + "']"
    # label of id i: stable, except a `moved` share that shifts by one
    shift = f"(CASE WHEN hash(i) % 10000 < {int(moved * 10000)} THEN 1 ELSE 0 END)"
    cols = ", ".join(
        {
            "id": "'t' || lpad(CAST(i AS VARCHAR), 10, '0') AS id",
            "label": f"{labels}[1 + CAST((i + {shift}) % 5 AS INTEGER)] AS label",
            "output": f"{labels}[1 + CAST((i + {shift}) % 5 AS INTEGER)] AS output",
            "valid": "true AS valid",
            "model": "'m' AS model",
            "config_hash": "'c' AS config_hash",
        }.get(c, f"NULL::{_duck_type(RESULT_SCHEMA.field(c).type)} AS {c}")
        for c in RESULT_COLUMNS
    )
    con.execute(
        f"COPY (SELECT {cols} FROM range({offset}, {offset + rows}) t(i)) TO '{out}/results/part-00000.parquet' "
        "(FORMAT parquet, COMPRESSION zstd)"
    )
    ecols = ", ".join(
        f"NULL::{_duck_type(ERROR_SCHEMA.field(c).type)} AS {c}" if c != "id" else "'e' AS id" for c in ERROR_COLUMNS
    )
    (out / "errors").mkdir(parents=True)
    con.execute(f"COPY (SELECT {ecols} LIMIT 0) TO '{out}/errors/part-00000.parquet' (FORMAT parquet)")
    write_manifest(out, "results")
    write_manifest(out, "errors")
    s = merge_summary(rows, rows, 0).model_copy(update={"task": "chat", "id_column": "id"})
    (out / "_MERGED.json").write_text(json.dumps(s.dump()))


def _duck_type(t) -> str:
    import pyarrow as pa

    if pa.types.is_list(t):
        return "FLOAT[]"
    return {"string": "VARCHAR", "bool": "BOOLEAN", "int32": "INTEGER", "float": "FLOAT"}[str(t)]


CHILD = """
import json, sys, time
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.merge.changes import compute_changes
t0 = time.monotonic()
s = compute_changes(JobSpec.model_validate_json(sys.argv[1]))
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM"))  # kB; this process only
print(json.dumps({"s": time.monotonic() - t0, "rss_mb": hwm / 1024,
                  "counts": s.counts.model_dump(), "churn_rate": s.churn_rate}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--changed", type=float, default=0.02)
    a = ap.parse_args()
    import duckdb

    from tests.support.data import make_spec

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        d = Path(tmp)
        con = duckdb.connect()
        gone = a.rows // 100
        write_run(con, d / "prev", a.rows, 0, 0.0)
        write_run(con, d / "now", a.rows, gone, a.changed)  # 1% removed at the start, 1% added at the end
        t0 = time.monotonic()
        con.execute(
            f"COPY (SELECT * FROM read_parquet(['{d}/prev/results/part-00000.parquet', "
            f"'{d}/now/results/part-00000.parquet'])) TO '{d}/copy.parquet' (FORMAT parquet, COMPRESSION zstd)"
        )
        base_s = time.monotonic() - t0
        con.close()
        spec = make_spec(d / "in.parquet", d / "now", changes={"previous_uri": str(d / "prev")})
        p = subprocess.run(
            [sys.executable, "-c", CHILD, spec.model_dump_json()],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        if p.returncode:
            sys.exit(p.stderr[-3000:])
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(
            json.dumps(
                {
                    "bench": "changes",
                    "rows": a.rows,
                    "changes_s": round(r["s"], 2),
                    "baseline_copy_s": round(base_s, 2),
                    "ratio_to_copy": round(r["s"] / base_s, 2),
                    "peak_rss_mb": round(r["rss_mb"]),
                    "counts": r["counts"],
                    "churn_rate": round(r["churn_rate"], 4),
                    "cpus": os.cpu_count(),
                }
            )
        )


if __name__ == "__main__":
    main()
