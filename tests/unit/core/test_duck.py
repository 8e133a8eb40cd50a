"""DuckDB over a Storage's Parquet files: the file list literal survives hostile names."""

from __future__ import annotations

import os
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import storage
from airflow_provider_vllm.core.duck import connect, file_list, local_list
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


@pytest.mark.parametrize("name", ["[_]data.parquet", "p*.parquet", "a?b.parquet"])
def test_a_path_with_a_glob_character_is_refused_not_expanded(tmp_path, name):
    """DuckDB expands each path of the list: ``[_]data.parquet`` read ``_data.parquet``, ``p*.parquet`` every p..."""
    with pytest.raises(ValueError, match="may not hold a glob character"):
        file_list(Storage(str(tmp_path)), ["a.parquet", name])
    with pytest.raises(ValueError, match="may not hold a glob character"):
        local_list([str(tmp_path / name)])


def test_braces_and_a_lone_closing_bracket_are_read_as_themselves(tmp_path):
    for name, ids in (("{a,b}.parquet", ["x"]), ("a.parquet", ["y"]), ("b].parquet", ["z"])):
        pq.write_table(pa.table({"id": ids}), tmp_path / name)
    st = Storage(str(tmp_path))
    con = connect(st, memory_limit="256MB")
    rows = con.sql(f"SELECT id FROM read_parquet({file_list(st, ['{a,b}.parquet', 'b].parquet'])}) ORDER BY id")
    assert [r[0] for r in rows.fetchall()] == ["x", "z"]


def test_a_query_past_the_memory_limit_spills_into_a_private_directory_not_the_working_directory(tmp_path, monkeypatch):
    """An Airflow task's working directory may be read-only or gone. With DuckDB's default (``.tmp`` in the working
    directory) a GROUP BY past the limit failed there with 'Failed to create directory ".tmp"'; each connection now
    spills into a directory of its own under TMPDIR, which DuckDB removes on close."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    (tmp_path / "tmpdir").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches the directory it found first
    gone = tmp_path / "cwd"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # the working directory no longer exists: nothing can be created in it
    cons = [connect(memory_limit="30MB") for _ in range(2)]
    dirs = [c.execute("SELECT current_setting('temp_directory')").fetchall()[0][0] for c in cons]
    held = os.path.dirname(dirs[0])  # the process's swept folder (``storage.process_copies_folder``)
    assert os.path.dirname(held) == str(tmp_path / "tmpdir") and os.path.basename(held).startswith("vllm-batch-duckdb-")
    assert len(set(dirs)) == 2 and all(os.path.dirname(d) == held for d in dirs)
    (n,) = (
        cons[0].execute("SELECT count(*) FROM (SELECT i % 3000000 AS k FROM range(6000000) t(i) GROUP BY 1)").fetchone()
    )
    assert n == 3_000_000 and os.listdir(dirs[0])  # it spilled, into its own directory
    for c in cons:
        c.close()
    assert not os.listdir(held)  # removed with the connection
    storage._remove_process_folders()  # what the process's exit does
    assert not os.listdir(tmp_path / "tmpdir")


SPILLER = """
import os, sys, tempfile
tempfile.tempdir = sys.argv[1]
from airflow_provider_vllm.core import duck
con = duck.connect(memory_limit="30MB")
spill = con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
os.makedirs(spill)
with open(os.path.join(spill, "duckdb_temp_storage-0.tmp"), "wb") as f:
    f.write(b"x" * 1000)  # what a spill leaves
print(spill, flush=True)
sys.stdin.readline()  # spills until killed, or told to go on
"""


def test_what_a_task_killed_with_sigkill_spilled_is_removed_by_the_next_process_s_first_connection(
    tmp_path, monkeypatch
):
    """DuckDB removes a connection's spill directory when the connection closes: a task killed with SIGKILL (the
    OOM killer, past its memory) never closes it, and its spill (up to GBs) stayed under TMPDIR for ever. It lies
    in the process's swept folder, which the next process's first connection removes; a live one's is kept, and a
    process that exits removes its own."""
    import subprocess
    import sys

    from tests.support import ROOT

    temp = tmp_path / "tmpdir"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def spiller() -> tuple[subprocess.Popen, str]:
        args = [sys.executable, "-c", SPILLER, str(temp)]
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        return proc, proc.stdout.readline().strip()

    live, kept = spiller()
    try:
        killed, left = spiller()
        killed.kill()
        killed.wait()
        assert os.listdir(left) and os.listdir(kept)
        connect().close()
        assert not os.path.exists(os.path.dirname(left)) and os.listdir(kept)
    finally:
        live.communicate("go on\n")
    storage._remove_process_folders()
    assert live.returncode == 0 and os.listdir(temp) == []  # the live one removed its own at its exit


def test_labels_are_stripped_as_python_strips_them():
    import duckdb

    from airflow_provider_vllm.core.duck import SPACES, label_sql

    assert set(SPACES) == {chr(c) for c in range(0x110000) if chr(c).isspace()}
    con = duckdb.connect()
    for text in ("bug\n", "\tbug\xa0", "\u3000bug\u2028", " b u g ", "\u200bbug", "", " \n", None):
        got = con.execute(f"SELECT {label_sql('$t')}", {"t": text}).fetchone()[0]
        assert got == (text.strip() or None if text is not None else None), repr(text)
