"""Parquet inputs: schema and id checks of the scan, and the worker's reads of a segment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import DatasetError
from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.plan import Segment
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.plan.planner import build_plan
from tests.support import ROOT
from tests.support.data import make_spec, shard_task, write_parquet

PARQUET = input_format("parquet")


def test_missing_id_column(tmp_path):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "in.parquet")
    with pytest.raises(DatasetError, match="missing column.*'id'"):
        build_plan(make_spec(tmp_path / "in.parquet", tmp_path / "out"))


def test_null_ids_and_wrong_text_type(tmp_path):
    write_parquet(tmp_path / "a" / "a.parquet", ["1", None], ["t", "t"])
    with pytest.raises(DatasetError, match="null id; first at a.parquet row 1"):
        build_plan(make_spec(tmp_path / "a", tmp_path / "out"))
    pq.write_table(pa.table({"id": ["1"], "text": [3]}), tmp_path / "b.parquet")
    with pytest.raises(DatasetError, match="text column 'text' has type int64"):
        build_plan(make_spec(tmp_path / "b.parquet", tmp_path / "out"))


def test_id_type_must_agree_across_files(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", ["1"], ["t"])
    write_parquet(tmp_path / "in" / "b.parquet", [2], ["t"])
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    with pytest.raises(DatasetError, match="b.parquet: id column type int64 differs from a.parquet's string"):
        PARQUET.scan(Storage(str(tmp_path / "in")), ["a.parquet", "b.parquet"], spec, per_row=False)


def test_scan_sizes_rows_exactly_or_from_footers(tmp_path):
    texts = ["a" * 10, None, "é" * 3, "b" * 40]
    write_parquet(tmp_path / "in" / "a.parquet", ["w", "x", "y", "z"], texts, row_group_size=2)
    spec, root = make_spec(tmp_path / "in", tmp_path / "out"), Storage(str(tmp_path / "in"))
    exact = PARQUET.scan(root, ["a.parquet"], spec, per_row=True)
    assert exact.chars.tolist() == [10, 0, 3, 40] and exact.file_rows == [4]
    assert exact.offsets is None and exact.invalid == 0
    approx = PARQUET.scan(root, ["a.parquet"], spec, per_row=False)
    assert len(approx.chars) == 4 and approx.chars[0] == approx.chars[1]  # one estimate per row group
    assert approx.chars[2] == approx.chars[3] and approx.chars[3] > approx.chars[0]


def test_read_rows_reads_the_segment_with_its_sizes(tmp_path):
    ids = [f"r{i}" for i in range(10)]
    write_parquet(
        tmp_path / "in" / "a.parquet", ids, [f"text {i}" for i in range(10)], row_group_size=3, extra=list(range(10))
    )
    spec = make_spec(tmp_path / "in", tmp_path / "out", prompt={"template": "{text} {extra}", "text_columns": ["text"]})
    root = Storage(str(tmp_path / "in"))
    batch = PARQUET.read_rows(root, "a.parquet", Segment(file=0, start=4, count=5), spec)
    assert batch.ids == ids[4:9]
    assert batch.values == {"text": [f"text {i}" for i in range(4, 9)], "extra": list(range(4, 9))}
    assert batch.faults == [None] * 5 and batch.chars == [6] * 5
    keep = batch.select([i % 2 == 0 for i in range(5)])
    assert keep.ids == ["r4", "r6", "r8"] and keep.values["extra"] == [4, 6, 8] and keep.chars == [6] * 3


def test_a_text_column_of_type_null_counts_no_characters(tmp_path):
    """Planned with bucketing and read by the worker: its rows are empty (EMPTY_INPUT later), not a crash."""
    pq.write_table(pa.table({"id": ["a", "b"], "text": pa.nulls(2)}), tmp_path / "in.parquet")
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"long_row_tokens": 10})
    plan = build_plan(spec)
    assert plan.total_rows == 2 and plan.est_tokens == 0
    batch = PARQUET.read_rows(Storage(plan.input_root), "in.parquet", plan.shards[0].segments[0], spec)
    assert batch.ids == ["a", "b"] and batch.values == {"text": [None, None]} and batch.chars == [0, 0]


def test_file_ids_are_strings_in_file_order(tmp_path):
    write_parquet(tmp_path / "a.parquet", [30, 10, 20], ["t"] * 3)
    spec = make_spec(tmp_path / "a.parquet", tmp_path / "out")
    assert PARQUET.file_ids(Storage(str(tmp_path)), "a.parquet", spec) == ["30", "10", "20"]


def test_unknown_format_name():
    with pytest.raises(ValueError, match="unknown input format 'csv'"):
        input_format("csv")


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (["ID", "id", "text"], "columns 'ID' and 'id' have names equal ignoring the case of ASCII letters"),
        (["id", "Text", "text"], "columns 'Text' and 'text' have names equal ignoring the case of ASCII letters"),
        (["id", "TEXT_\u0414", "text_\u0414"], "columns 'TEXT_\u0414' and 'text_\u0414' have names equal"),
        (["id", "text", "text"], "column 'text' appears twice"),
    ],
)
def test_columns_whose_names_are_equal_ignoring_case_are_refused(tmp_path, columns, message):
    """DuckDB reads ``ID`` + ``id`` as ``ID`` + ``id_1``: the id check would read ``ID`` and pass duplicate ids."""
    arrays = [pa.array(["x1", "x2", "x3"]), pa.array(["b", "a", "b"]), pa.array(["t1", "t2", "t3"])]
    pq.write_table(pa.Table.from_arrays(arrays, names=columns), tmp_path / "in.parquet")
    with pytest.raises(DatasetError, match=f"input file in.parquet: {message}"):
        build_plan(make_spec(tmp_path / "in.parquet", tmp_path / "out"))


@pytest.mark.parametrize(
    "names", [("\u0414", "\u0434"), ("\u212a", "k"), ("\u00c9", "\u00e9"), ("caf\u00e9", "cafe\u0301")]
)
def test_names_that_differ_beyond_ascii_case_are_distinct_columns(tmp_path, names):
    """DuckDB binds names ignoring the case of ASCII letters only: ``Д`` and ``д`` (or the Kelvin sign and ``k``) are
    two columns to it and to Arrow, each read as itself. They were refused (Python's ``str.lower`` equates them)."""
    upper, lower = names
    table = pa.table(
        {"id": ["b", "a", "c"], "text": ["x", "y", "z"], upper: ["u1", "u2", "u3"], lower: ["l1", "l2", "l3"]}
    )
    pq.write_table(table, tmp_path / "in.parquet")
    assert build_plan(make_spec(tmp_path / "in.parquet", tmp_path / "out")).total_rows == 3
    import duckdb

    got = duckdb.sql(f"SELECT \"{lower}\" FROM read_parquet('{tmp_path / 'in.parquet'}') ORDER BY 1").fetchall()
    assert got == [("l1",), ("l2",), ("l3",)]  # DuckDB binds the name to that column, not the other


@pytest.mark.parametrize("id_column", ["id", "filename", "Filename"])
def test_a_column_named_filename_is_an_ordinary_column(tmp_path, id_column):
    """DuckDB's ``filename = true`` failed the plan on it (BinderException); the scan names its column otherwise."""
    ids = ["b", "a", "b"] if id_column == "id" else ["b.pdf", "a.pdf", "b.pdf"]
    other = "filename" if id_column == "id" else "id"
    pq.write_table(pa.table({id_column: ids, "text": ["x", "y", "z"], other: ["1", "2", "3"]}), tmp_path / "in.parquet")
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", prompt={"id_column": id_column})
    with pytest.raises(DatasetError, match=r"1 duplicate id\(s\).* is at in.parquet row 0 and in.parquet row 2"):
        build_plan(spec)
    pq.write_table(pa.table({id_column: ["b", "a", "c"], "text": ["x", "y", "z"]}), tmp_path / "ok.parquet")
    assert build_plan(make_spec(tmp_path / "ok.parquet", tmp_path / "out2", prompt={"id_column": id_column})).total_rows


@pytest.mark.parametrize("column", ["file_row_number", "FILE_ROW_NUMBER", "_vllm_filename"])
def test_a_column_named_like_one_duckdb_adds_is_refused_naming_it(tmp_path, column):
    """DuckDB cannot rename its ``file_row_number`` column: such an input failed the plan with a BinderException."""
    pq.write_table(pa.table({"id": ["b", "a"], "text": ["x", "y"], column: [1, 2]}), tmp_path / "in.parquet")
    with pytest.raises(DatasetError, match=f"input file in.parquet: column '{column}' has the name of a column DuckDB"):
        build_plan(make_spec(tmp_path / "in.parquet", tmp_path / "out"))


def test_an_id_that_is_not_valid_utf8_is_a_dataset_error_naming_the_file(tmp_path):
    """DuckDB's InvalidInputException was raised raw (the plan task retried instead of failing)."""
    raw = pa.array([b"b", b"\xff\xfe", b"a"], pa.binary())
    ids = pa.Array.from_buffers(pa.string(), 3, raw.buffers())  # the bytes as they are: no UTF-8 check
    pq.write_table(pa.table({"id": ids, "text": ["x", "y", "z"]}), tmp_path / "in.parquet")
    with pytest.raises(DatasetError, match="id column 'id' of the input cannot be read: .*in.parquet.*not valid UTF8"):
        build_plan(make_spec(tmp_path / "in.parquet", tmp_path / "out"))


def _strings(values: list[bytes]) -> pa.Array:
    """A Parquet string column holding ``values`` byte for byte (no UTF-8 check, as other writers make them)."""
    return pa.Array.from_buffers(pa.string(), len(values), pa.array(values, pa.binary()).buffers())


def test_ordered_ids_that_are_not_valid_utf8_are_not_proven_by_their_order(tmp_path):
    """Ids in byte order were proven distinct without DuckDB reading them: an id that is not UTF-8 reached the
    worker, which died on a raw UnicodeDecodeError (retried) instead of the plan naming the file."""
    ids = _strings([b"r001", b"r002\xff", b"r003"])
    pq.write_table(pa.table({"id": ids, "text": ["x", "y", "z"]}), tmp_path / "in.parquet")
    with pytest.raises(DatasetError, match=r"id column 'id' of the input cannot be read: .*r002\\xFF.*not valid UTF8"):
        build_plan(make_spec(tmp_path / "in.parquet", tmp_path / "out"))


def test_a_text_or_passthrough_value_that_is_not_utf8_is_its_rows_error_and_the_others_are_read(tmp_path):
    """The worker's read of a segment: pyarrow's to_pylist raised UnicodeDecodeError for the whole shard, and a
    passthrough value was published as it was (a results part that DuckDB and pandas then cannot read)."""
    texts = _strings([b"fine", b"bad \xff text", b"also fine"])
    notes = _strings([b"n0", b"n1", b"n2\xfe"])
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": texts, "note": notes}), tmp_path / "in.parquet")
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    batch = PARQUET.read_rows(Storage(str(tmp_path)), "in.parquet", Segment(file=0, start=0, count=3), spec, ["note"])
    assert batch.values["text"] == ["fine", None, "also fine"]
    assert batch.faults == [
        None,
        ("INVALID_ROW", "column 'text' is not valid UTF-8 text (byte 4)"),
        ("INVALID_ROW", "column 'note' is not valid UTF-8 text (byte 2)"),
    ]
    assert batch.passthrough is not None and batch.passthrough.column("note").to_pylist() == ["n0", "n1", None]
    batch.passthrough.validate(full=True)


def test_a_date_or_timestamp_outside_pythons_years_is_its_rows_error_and_the_others_are_read(tmp_path):
    """Parquet, DuckDB and the plan accept a date before year 1 or a timestamp after 9999 in a template column;
    pyarrow's to_pylist raised OverflowError for the whole batch, so every retry of the shard failed."""
    import datetime as dt

    pq.write_table(
        pa.table(
            {
                "id": ["a", "b", "c"],
                "text": ["x", "y", "z"],
                "day": pa.array([19783, -800000, 3000000], pa.date32()),  # 2024-03-01, 222 BC, year 10183
                "at": pa.array([0, 253402300800000000, None], pa.timestamp("us", tz="UTC")),  # 1970, year 10000
            }
        ),
        tmp_path / "in.parquet",
    )
    spec = make_spec(
        tmp_path / "in.parquet", tmp_path / "out", prompt={"template": "{text} {day} {at}", "text_columns": ["text"]}
    )
    batch = PARQUET.read_rows(Storage(str(tmp_path)), "in.parquet", Segment(file=0, start=0, count=3), spec)
    assert batch.values["day"] == [dt.date(2024, 3, 1), None, None]
    assert batch.values["at"] == [dt.datetime(1970, 1, 1, tzinfo=dt.UTC), None, None]
    assert batch.faults[0] is None
    assert batch.faults[1] is not None and batch.faults[1][0] == "INVALID_ROW" and "'day'" in batch.faults[1][1]
    assert batch.faults[2] is not None and batch.faults[2][0] == "INVALID_ROW" and "'day'" in batch.faults[2][1]
    faults: list = [None] * 3
    from airflow_provider_vllm.core.formats.parquet import _values

    table = pq.read_table(tmp_path / "in.parquet")
    assert _values(table.column("at"), "at", faults)[0] == dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    assert faults[1] == (
        "INVALID_ROW",
        "column 'at' holds a timestamp[us, tz=UTC] value outside the years 1-9999 that the worker can render "
        f"({faults[1][1].split('(', 1)[1]}",
    )
    assert faults[0] is None and faults[2] is None


def test_a_text_that_is_not_utf8_fails_a_plan_that_reads_every_text_naming_file_and_value(tmp_path):
    """The dedupe and the result cache read every text with DuckDB, which refuses the file: a raw
    InvalidInputException before (the plan task retried it)."""
    pq.write_table(pa.table({"id": ["a", "b"], "text": _strings([b"ok", b"x\xff"])}), tmp_path / "in.parquet")
    from airflow_provider_vllm.steps.plan.planner import plan_job

    with pytest.raises(DatasetError, match=r"the dedupe read every row's text.*in.parquet.*x\\xFF.*not valid UTF8"):
        plan_job(make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"dedupe": True}))


def test_a_categorical_passthrough_value_that_is_not_utf8_is_its_rows_error_and_a_nested_one_names_the_column():
    from airflow_provider_vllm.core.formats.parquet import _checked_passthrough, _values

    bad = _strings([b"a", b"b\xff", b"a"])
    faults: list = [None] * 3
    table = _checked_passthrough(pa.table({"queue": bad.dictionary_encode()}), faults, "in.parquet")
    assert table.column("queue").to_pylist() == ["a", None, "a"] and pa.types.is_dictionary(table["queue"].type)
    assert faults[1] == ("INVALID_ROW", "column 'queue' is not valid UTF-8 text (byte 1)") and faults[0] is None
    tags = pa.chunked_array([pa.ListArray.from_arrays([0, 1, 3], bad)])
    with pytest.raises(DatasetError, match="column 'tags' holds a string that is not UTF-8"):
        _values(tags, "tags", [None, None])


PEAK = """
import json, sys
import pyarrow as pa
from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.plan import Segment
from airflow_provider_vllm.core.storage import Storage
from tests.support.data import make_spec

root, what = Storage(sys.argv[1]), sys.argv[2]
spec = make_spec(sys.argv[1] + "/in.parquet", sys.argv[1] + "/out")
if what == "plan":  # the plan's exact per-row sizes of the one row group
    got = input_format("parquet").scan(root, ["in.parquet"], spec, per_row=True).groups.chars(0)
    out = {"rows": len(got), "chars": int(got.sum())}
else:
    start = int(what)
    got = input_format("parquet").read_rows(root, "in.parquet", Segment(file=0, start=start, count=10), spec)
    out = {"ids": got.ids, "chars": got.chars}
print(json.dumps({**out, "peak_mb": pa.default_memory_pool().max_memory() >> 20}))
"""


def test_a_segment_of_a_row_group_that_decodes_to_300_mb_is_read_in_batches(tmp_path):
    """One row group of 20,000 rows of 16 KiB texts (a few hundred KB zstd-compressed, 312 MiB decoded): the
    worker's read of a 10-row segment at its start or its end, and the plan's exact per-row sizes of the row group,
    hold a few batches of it in Arrow memory, never the row group whole (the code before: 573 MiB for the segment,
    902 MiB for the sizes)."""
    n, text = 20_000, 16 << 10
    texts = pc.binary_join_element_wise(pa.array([str(i) for i in range(n)]), "x" * text, " ")  # distinct texts
    ids = pa.array([f"r{i:05d}" for i in range(n)])
    pq.write_table(pa.table({"id": ids, "text": texts}), tmp_path / "in.parquet", row_group_size=n, compression="zstd")
    del texts
    decoded_mb = n * text >> 20

    def peak(what: str) -> dict:
        got = subprocess.run(
            [sys.executable, "-c", PEAK, str(tmp_path), what],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
        )
        return json.loads(got.stdout.strip().splitlines()[-1])

    for start in (0, n - 10):
        doc = peak(str(start))
        assert doc["ids"] == [f"r{i:05d}" for i in range(start, start + 10)], doc["ids"]
        assert doc["chars"] == [len(str(i)) + 1 + text for i in range(start, start + 10)]
        assert doc["peak_mb"] < decoded_mb // 4, doc["peak_mb"]  # 312 MiB decoded whole
    doc = peak("plan")
    assert doc["rows"] == n and doc["chars"] == sum(len(str(i)) + 1 + text for i in range(n))
    assert doc["peak_mb"] < decoded_mb // 4, doc["peak_mb"]


@pytest.mark.parametrize("repeat", [False, True], ids=["distinct-texts", "repeated-texts"])
def test_string_and_large_string_id_columns_are_one_input_and_every_row_merges_once(
    tmp_path, fake_engine_factory, repeat
):
    """pyarrow and pandas write ``string``, polars ``large_string``: the same text to Arrow and DuckDB. A folder of
    both was refused as 'id column type large_string differs from a.parquet's string'. Repeated texts take the
    dedupe's DuckDB read over both files."""
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import merge

    texts = ["same ticket", "same ticket"] if repeat else ["ticket one", "ticket two"]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": pa.array(["a", "b"], pa.string()), "text": texts}), tmp_path / "in" / "a.parquet")
    pq.write_table(
        pa.table({"id": pa.array(["c", "d"], pa.large_string()), "text": texts}), tmp_path / "in" / "b.parquet"
    )
    spec = make_spec(tmp_path / "in", tmp_path / "out", sharding={"target_rows": 1})
    plan = plan_job(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    summary = merge(spec)
    assert summary.ok_rows == 4 and summary.error_rows == 0
    assert sorted(pq.read_table(tmp_path / "out" / "results", columns=["id"]).column(0).to_pylist()) == list("abcd")
