"""Publishing a run to an Iceberg table: by reference (``steps/tables/commit.commit_results``) vs rewriting the rows.

    python benchmarks/bench_iceberg.py [--rows 10000000] [--parts 10] [--repeat 2]

Writes ``--parts`` merged result parts of a structured-choice job (``--rows`` in all, the results schema), then, in
one invocation, alternates two ways of publishing them to a fresh table of a SQL catalog on SQLite with a local
warehouse: **reference**, the provider's publish (one DataFile per part from its footer, one snapshot; the parts
stay where they are), and **rewrite**, what a publisher without it does: read the parts and ``table.append`` the
rows (pyiceberg writes new data files; one snapshot). Both tables then hold the same rows (checked). Prints one
JSON line: the median seconds of each, the ratio rewrite / reference, and the bytes each wrote to the warehouse.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LABELS = ["billing", "bug", "feature_request", "account", "other"]


def write_parts(con, out: Path, rows: int, parts: int) -> list[str]:
    from airflow_provider_vllm.core.rows import RESULT_COLUMNS, RESULT_SCHEMA

    (out / "results").mkdir(parents=True)
    labels = "['" + "','".join(LABELS) + "']"
    cols = ", ".join(
        {
            "id": "'t' || lpad(CAST(i AS VARCHAR), 10, '0') AS id",
            "label": f"{labels}[1 + CAST(hash(i) % 5 AS INTEGER)] AS label",
            "output": f"{labels}[1 + CAST(hash(i) % 5 AS INTEGER)] AS output",
            "valid": "true AS valid",
            "finish_reason": "'stop' AS finish_reason",
            "prompt_tokens": "CAST(40 + i % 200 AS INTEGER) AS prompt_tokens",
            "completion_tokens": "CAST(3 AS INTEGER) AS completion_tokens",
            "latency_ms": "CAST(12.5 AS FLOAT) AS latency_ms",
            "model": "'HuggingFaceTB/SmolLM2-360M-Instruct' AS model",
            "config_hash": "'c0ffee' AS config_hash",
            "shard_id": "'shard-' || lpad(CAST(i // 100000 AS VARCHAR), 5, '0') AS shard_id",
            "confidence": "CAST((hash(i) % 1000) / 1000.0 AS FLOAT) AS confidence",
        }.get(c, f"NULL::{_duck_type(RESULT_SCHEMA.field(c).type)} AS {c}")
        for c in RESULT_COLUMNS
    )
    step = -(-rows // parts)
    names = []
    for k in range(parts):
        name = f"results/part-{k:05d}.parquet"
        con.execute(
            f"COPY (SELECT {cols} FROM range({k * step}, {min(rows, (k + 1) * step)}) t(i)) TO '{out / name}' "
            "(FORMAT parquet, COMPRESSION zstd)"
        )
        names.append(name)
    return names


def _duck_type(t) -> str:
    import pyarrow as pa

    if pa.types.is_list(t):
        return "FLOAT[]"
    return {"string": "VARCHAR", "bool": "BOOLEAN", "int32": "INTEGER", "float": "FLOAT", "int64": "BIGINT"}[str(t)]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--parts", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyiceberg.catalog.sql import SqlCatalog

    from airflow_provider_vllm.core.spec import TableOutput
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.tables.access import Tables
    from airflow_provider_vllm.steps.tables.commit import commit_results

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        d = Path(tmp)
        con = duckdb.connect()
        parts = write_parts(con, d / "run", a.rows, a.parts)
        con.close()
        schema = pq.read_schema(d / "run" / parts[0])
        times: dict[str, list[float]] = {"reference": [], "rewrite": []}
        written: dict[str, int] = {}
        for r in range(a.repeat):
            for way in ("reference", "rewrite") if r % 2 == 0 else ("rewrite", "reference"):
                wh = d / f"wh-{way}-{r}"
                wh.mkdir()
                catalog = SqlCatalog("bench", uri=f"sqlite:///{d / f'cat-{way}-{r}.db'}", warehouse=f"file://{wh}")
                catalog.create_namespace("lake")
                t0 = time.monotonic()
                if way == "reference":
                    tables = Tables(catalog=catalog, allowed=["lake.*"])
                    target = TableOutput(identifier="lake.labels", create=True)
                    commit_results(
                        target, tables, Storage(str(d / "run")), parts, schema, f"run-{r}", dt.date(2026, 12, 1)
                    )
                else:
                    table = catalog.create_table("lake.labels", schema=schema)
                    rows = pa.concat_tables([pq.read_table(d / "run" / p) for p in parts])
                    table.append(rows, snapshot_properties={"vllm-batch.run-id": f"run-{r}"})
                    del rows
                times[way].append(time.monotonic() - t0)
                table = catalog.load_table("lake.labels")
                n = int(table.current_snapshot().summary["total-records"])
                assert n == a.rows and len(table.snapshots()) == 1, (way, n)
                written[way] = folder_bytes(wh)
        ref, rew = statistics.median(times["reference"]), statistics.median(times["rewrite"])
        print(
            json.dumps(
                {
                    "bench": "iceberg_publish",
                    "rows": a.rows,
                    "parts": a.parts,
                    "parts_bytes": folder_bytes(d / "run"),
                    "reference_s": [round(x, 2) for x in times["reference"]],
                    "rewrite_s": [round(x, 2) for x in times["rewrite"]],
                    "ratio_rewrite_to_reference": round(rew / ref, 1),
                    "warehouse_bytes": written,
                    "cpus": os.cpu_count(),
                }
            )
        )


if __name__ == "__main__":
    main()
