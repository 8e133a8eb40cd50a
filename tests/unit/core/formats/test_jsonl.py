"""JSONL inputs: one pass of the scan (ids, sizes, line positions) and the worker's reads from a line."""

from __future__ import annotations

import json

import pytest

from airflow_provider_vllm.core.errors import DatasetError, InputChangedError
from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.plan import Segment
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.plan.planner import build_plan
from tests.support.data import make_spec

JSONL = input_format("jsonl")


def test_jsonl_missing_id_is_dataset_error(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": "1", "text": "a"}\n{"text": "no id"}\n')
    with pytest.raises(DatasetError, match="line 2: missing or invalid id"):
        build_plan(make_spec(p, tmp_path / "out"))


@pytest.mark.parametrize("raw", ["1.10", "1e2", "0.1e1", "NaN", "Infinity", "-Infinity", "1.0"])
def test_a_float_id_is_refused_naming_the_line_and_field(tmp_path, raw):
    """``1.10`` was the id "1.1" and ``1e2`` "100.0": not the line's text. Integers, however long, stay ids."""
    p = tmp_path / "in.jsonl"
    p.write_text(f'{{"id": 12345678901234567890123, "text": "a"}}\n{{"id": {raw}, "text": "b"}}\n')
    with pytest.raises(
        DatasetError, match=r"in.jsonl line 2: id field 'id' is the number .*not a string or an integer"
    ):
        build_plan(make_spec(p, tmp_path / "out"))
    p.write_text('{"id": 12345678901234567890123, "text": "a"}\n{"id": "1.10", "text": "b"}\n')
    assert JSONL.file_ids(Storage(str(tmp_path)), "in.jsonl", make_spec(p, tmp_path / "out")) == [
        "12345678901234567890123",
        "1.10",
    ]


def _write(tmp_path):
    lines = [
        "\ufeff" + json.dumps({"id": "a", "text": "hello"}),
        "",
        "{oops",
        json.dumps({"id": 7, "text": None}),
        "[1]",
        json.dumps({"id": "c", "text": "xyz", "other": 1}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Storage(str(tmp_path)), make_spec(tmp_path / "in.jsonl", tmp_path / "out")


def test_scan_positions_every_data_line(tmp_path):
    root, spec = _write(tmp_path)
    scan = JSONL.scan(root, ["in.jsonl"], spec, per_row=False)
    assert scan.file_rows == [5] and scan.invalid == 2
    assert scan.lines.tolist() == [1, 3, 4, 5, 6]
    raw = (tmp_path / "in.jsonl").read_bytes()
    assert [raw[o:].split(b"\n", 1)[0][:2] for o in scan.offsets.tolist()] == [b"\xef\xbb", b"{o", b'{"', b"[1", b'{"']
    assert scan.chars.tolist() == [5, 0, 0, 0, 3]


def test_read_rows_from_a_line_gives_faults_and_the_scans_sizes(tmp_path):
    root, spec = _write(tmp_path)
    scan = JSONL.scan(root, ["in.jsonl"], spec, per_row=False)
    seg = Segment(file=0, start=1, count=4, offset=int(scan.offsets[1]), line=int(scan.lines[1]))
    batch = JSONL.read_rows(root, "in.jsonl", seg, spec)
    assert batch.ids == ["__line__:in.jsonl:3", "7", "__line__:in.jsonl:5", "c"]
    assert [f and f[0] for f in batch.faults] == ["INVALID_JSON", None, "INVALID_JSON", None]
    assert "a JSON list, not an object" in batch.faults[2][1]
    assert batch.values == {"text": [None, None, None, "xyz"]} and batch.lines == [3, 4, 5, 6]
    assert batch.chars == scan.chars[1:].tolist()
    with pytest.raises(InputChangedError, match="ended before the planned rows.*new output prefix"):
        JSONL.read_rows(root, "in.jsonl", Segment(file=0, start=1, count=6, offset=seg.offset, line=3), spec)


def test_duplicates_are_named_with_their_lines(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"id": "x", "text": "t"}\n{"id": "y", "text": "t"}\n')
    (tmp_path / "in" / "b.jsonl").write_text('\n{"id": "x", "text": "t"}\n')
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    with pytest.raises(DatasetError, match=r"1 duplicate id\(s\) .*'x' is at a.jsonl line 1 and b.jsonl line 2"):
        JSONL.scan(Storage(str(tmp_path / "in")), ["a.jsonl", "b.jsonl"], spec, per_row=False)


def test_file_ids(tmp_path):
    root, spec = _write(tmp_path)
    assert JSONL.file_ids(root, "in.jsonl", spec) == ["a", "__line__:in.jsonl:3", "7", "__line__:in.jsonl:5", "c"]


def test_a_line_of_bytes_from_the_byte_order_mark_is_an_invalid_line_not_a_blank_one(tmp_path):
    """``bytes.strip`` of the BOM's bytes dropped lines of ``\\xbb`` or ``\\xef`` silently; a whole BOM (first line
    or a concatenated file's) before whitespace or JSON is still skipped."""
    (tmp_path / "in.jsonl").write_bytes(
        b'\xef\xbb\xbf{"id": "a", "text": "x"}\n\xbb\xbb\n\xef\n\xef\xbb\xbf \r\n{"id": "b", "text": "y"}\n'
    )
    root, spec = Storage(str(tmp_path)), make_spec(tmp_path / "in.jsonl", tmp_path / "out")
    scan = JSONL.scan(root, ["in.jsonl"], spec, per_row=False)
    assert scan.file_rows == [4] and scan.invalid == 2 and scan.lines.tolist() == [1, 2, 3, 5]
    batch = JSONL.read_rows(root, "in.jsonl", Segment(file=0, start=0, count=4, offset=0, line=1), spec)
    assert batch.ids == ["a", "__line__:in.jsonl:2", "__line__:in.jsonl:3", "b"]
    assert [f and f[0] for f in batch.faults] == [None, "INVALID_JSON", "INVALID_JSON", None]


@pytest.mark.parametrize(
    "text, kind",
    [
        ('{\n  "id": "a",\n  "text": "x"\n}\n', "an object"),
        ('[\n  {"id": "a", "text": "x"},\n  {"id": "b", "text": "y"}\n]\n', "an array"),
        ('\ufeff[{"id": "a", "text": "x"}, {"id": "b", "text": "y"}]\n', "an array"),
    ],
)
def test_a_json_document_is_refused_naming_the_file_not_read_as_lines(tmp_path, text, kind):
    """A pretty-printed JSON file (a schema beside the data, an export as one array) was read line by line: every
    line an INVALID_JSON row, the plan going on. JSON Lines of two rows never parse as one value."""
    (tmp_path / "rows.json").write_text(text, encoding="utf-8")
    root, spec = Storage(str(tmp_path)), make_spec(tmp_path / "rows.json", tmp_path / "out")
    with pytest.raises(DatasetError, match=f"input file rows.json is one JSON document \\({kind}\\), not JSON Lines"):
        JSONL.scan(root, ["rows.json"], spec, per_row=False)


def test_json_lines_whose_first_line_is_not_an_object_are_still_read(tmp_path):
    """Only a whole file that is one JSON value is refused: a bad first line of JSON Lines is that line's
    INVALID_JSON row, as any other line's."""
    (tmp_path / "in.jsonl").write_text('{"id": "a",\n{"id": "b", "text": "y"}\n[1, 2]\n')
    root, spec = Storage(str(tmp_path)), make_spec(tmp_path / "in.jsonl", tmp_path / "out")
    scan = JSONL.scan(root, ["in.jsonl"], spec, per_row=False)
    assert scan.file_rows == [3] and scan.invalid == 2
    (tmp_path / "one.jsonl").write_text('[1, 2]\n{"id": "b", "text": "y"}\n')
    assert JSONL.scan(root, ["one.jsonl"], spec, per_row=False).invalid == 1


def _records(n: int) -> list[dict]:
    return [{"id": f"r{i}", "text": f"ticket {i}"} for i in range(n)]


@pytest.mark.parametrize(
    "raw, hint",
    [
        # jq without -c: each object over several lines; every line was an INVALID_JSON row of its own
        ("".join(json.dumps(r, indent=2) + "\n" for r in _records(3)).encode(), "pretty-printed"),
        # old Mac line ends: the whole file was one line, its rows one INVALID_JSON row
        ("".join(json.dumps(r) + "\r" for r in _records(3)).encode(), r"carriage return alone"),
        # objects written back to back: one line, one row for all of them
        ("".join(json.dumps(r) for r in _records(3)).encode(), "several JSON values on one line"),
        # Windows 'Unicode' text: one INVALID_JSON row a line
        ("".join(json.dumps(r) + "\r\n" for r in _records(3)).encode("utf-16"), "UTF-16"),
    ],
    ids=["pretty-printed-stream", "cr-line-ends", "back-to-back", "utf-16"],
)
def test_a_file_none_of_whose_lines_is_a_json_object_is_refused_with_its_likely_cause(tmp_path, raw, hint):
    """No line of these files is a row: the plan went on with each line (or the whole file) as INVALID_JSON rows
    under synthetic ids, so a dataset of rows became other rows, and the run completed with all of them errors."""
    (tmp_path / "in.jsonl").write_bytes(raw)
    root, spec = Storage(str(tmp_path)), make_spec(tmp_path / "in.jsonl", tmp_path / "out")
    with pytest.raises(DatasetError, match=f"input file in.jsonl: none of its .* is a JSON object.*{hint}"):
        JSONL.scan(root, ["in.jsonl"], spec, per_row=False)


def test_a_file_with_one_object_among_invalid_lines_is_still_read(tmp_path):
    """The refusal is for files with no row at all: one object makes the other lines that file's bad rows."""
    (tmp_path / "in.jsonl").write_text('not json\n{"id": "a", "text": "x"}\n[1]\n')
    root, spec = Storage(str(tmp_path)), make_spec(tmp_path / "in.jsonl", tmp_path / "out")
    scan = JSONL.scan(root, ["in.jsonl"], spec, per_row=False)
    assert scan.file_rows == [3] and scan.invalid == 2
