"""DuckDB over a Storage's Parquet files: the file list literal survives hostile names."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core.duck import connect, file_list
from airflow_provider_vllm.core.storage import Storage


def test_reads_local_parquet_files_including_a_name_with_a_quote(tmp_path):
    for name, ids in (("a.parquet", ["x", "y"]), ("it's.parquet", ["z"])):
        pq.write_table(pa.table({"id": ids}), tmp_path / name)
    st = Storage(str(tmp_path))
    con = connect(st, memory_limit="256MB")
    files = file_list(st, ["a.parquet", "it's.parquet"])
    rows = con.sql(f"SELECT id FROM read_parquet({files}) ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ["x", "y", "z"]
    (limit,) = con.execute("SELECT current_setting('memory_limit')").fetchall()[0]
    assert limit.startswith("244")  # the memory_limit asked for (256 MB, shown in MiB)


def test_a_name_cannot_close_the_literal():
    st = Storage("/data")
    lit = file_list(st, ["x'] ; DROP TABLE t; --.parquet"])
    assert lit == "['/data/x''] ; DROP TABLE t; --.parquet']"
