"""The ordered-ids proof (core/formats/parquet_ids.py): valid ordered ids skip DuckDB; every fault still refused."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import duck
from airflow_provider_vllm.core.errors import DatasetError
from airflow_provider_vllm.core.formats import parquet_ids
from airflow_provider_vllm.core.formats.parquet import _check_ids
from airflow_provider_vllm.core.storage import Storage


def _write(folder, name, groups, type_=pa.string()):
    """One file of the given row groups (lists of ids), each its own row group (an empty list: zero rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    schema = pa.schema({"id": type_, "text": pa.string()})
    with pq.ParquetWriter(folder / name, schema) as w:
        for ids in groups:
            w.write_table(pa.table({"id": pa.array(ids, type_), "text": ["t"] * len(ids)}, schema=schema))
    return name


def _proven(folder, names, threads=2):
    return parquet_ids.ids_proven(Storage(str(folder)), names, "id", threads=threads)


@pytest.fixture
def no_duckdb(monkeypatch):
    monkeypatch.setattr(duck, "connect", lambda *a, **k: pytest.fail("the exact check ran"))


@pytest.mark.parametrize("threads", [1, 2])
def test_ordered_ids_over_files_and_row_groups_are_proven_without_duckdb(tmp_path, no_duckdb, threads):
    a = _write(tmp_path, "b.parquet", [["k-003", "k-004"], [], ["k-007"]])  # a row group with zero rows
    b = _write(tmp_path, "a.parquet", [["k-000", "k-001", "k-002"]])  # files in any order: ranges checked
    c = _write(tmp_path, "c.parquet", [[]])  # a file with no rows
    d = _write(tmp_path, "d.parquet", [["\u00e9-1", "\u00e9-2", "\u3000x"]])  # first byte not ASCII: pattern
    assert _proven(tmp_path, [a, b, c, d], threads)
    _check_ids(Storage(str(tmp_path)), [a, b, c, d], "id")


def test_ordered_integer_ids_are_proven(tmp_path, no_duckdb):
    a = _write(tmp_path, "a.parquet", [[-5, 0, 7], [8, 2**40]], pa.int64())
    b = _write(tmp_path, "b.parquet", [[2**40 + 1]], pa.int64())
    assert _proven(tmp_path, [a, b])


@pytest.mark.parametrize(
    "files, message",
    [
        # a duplicate across files: each file ordered, the ranges overlap
        (
            {"a.parquet": [["k-1", "k-2"]], "b.parquet": [["k-2", "k-3"]]},
            r"'k-2' x2; 'k-2' is at a.parquet row 1 and b",
        ),
        # a duplicate across row groups of one file
        ({"a.parquet": [["k-1", "k-2"], ["k-2", "k-3"]]}, r"'k-2' is at a.parquet row 1 and a.parquet row 2"),
        ({"a.parquet": [["k-1"], ["k-2", None]]}, r"1 row\(s\) have a null id; first at a.parquet row 2"),
        ({"a.parquet": [["", "k-1"]]}, r"empty id .* first at a.parquet row 0"),
        ({"a.parquet": [["\t ", "k-1"]]}, r"empty id .* first at a.parquet row 0"),
        ({"a.parquet": [["k-1"]], "b.parquet": [["\u3000\u2029"]]}, r"empty id .* first at b.parquet row 0"),
        # unordered with a duplicate: the proof gives up at once, the exact check names it
        ({"a.parquet": [["k-9", "k-1", "k-9"]]}, r"'k-9' is at a.parquet row 0 and a.parquet row 2"),
    ],
)
def test_faults_are_refused_naming_the_row(tmp_path, files, message):
    names = [_write(tmp_path, n, g) for n, g in files.items()]
    assert not _proven(tmp_path, names)
    with pytest.raises(DatasetError, match=message):
        _check_ids(Storage(str(tmp_path)), names, "id")


def test_integer_duplicates_are_refused(tmp_path):
    a = _write(tmp_path, "a.parquet", [[1, 2, 3]], pa.int32())
    b = _write(tmp_path, "b.parquet", [[3, 4]], pa.int32())
    assert not _proven(tmp_path, [a, b])
    with pytest.raises(DatasetError, match=r"'3' x2"):
        _check_ids(Storage(str(tmp_path)), [a, b], "id", strings=False)
    c = _write(tmp_path, "c.parquet", [[9, 0, 9]], pa.int64())  # unordered: the exact check, no pattern
    with pytest.raises(DatasetError, match=r"'9' is at c.parquet row 0 and c.parquet row 2"):
        _check_ids(Storage(str(tmp_path)), [c], "id", strings=False)
    d = _write(tmp_path, "d.parquet", [[9, 0, None]], pa.int64())
    with pytest.raises(DatasetError, match=r"null id; first at d.parquet row 2"):
        _check_ids(Storage(str(tmp_path)), [d], "id", strings=False)


def test_unordered_valid_ids_fall_back_to_the_exact_check(tmp_path):
    a = _write(tmp_path, "a.parquet", [["k-5", "k-1", "k-3"]])
    assert not _proven(tmp_path, [a])
    _check_ids(Storage(str(tmp_path)), [a], "id")  # valid: no error


def test_large_string_ids_with_a_sliced_batch(tmp_path, no_duckdb, monkeypatch):
    monkeypatch.setattr(parquet_ids, "BATCH_ROWS", 2)  # batches that start inside a row group
    a = _write(tmp_path, "a.parquet", [["a", "b", "c", "d", "e"]], pa.large_string())
    assert _proven(tmp_path, [a])
    b = _write(tmp_path, "b.parquet", [["f", "g", " "]], pa.large_string())
    assert not _proven(tmp_path, [a, b])  # ' ' (0x20) sorts below 'g': not ordered anyway


def test_an_id_column_of_another_type_is_never_vouched_for(tmp_path):
    a = _write(tmp_path, "a.parquet", [[1.0, 2.0]], pa.float64())
    assert not _proven(tmp_path, [a])


def test_blank_candidates_only_by_first_byte(tmp_path, no_duckdb):
    """Ids starting with printable ASCII skip the pattern; others are matched (non-blank ones still pass)."""
    a = _write(tmp_path, "a.parquet", [["!x", "~y", "\u00a0z", "\u00e9"]])
    assert _proven(tmp_path, [a])
    b = _write(tmp_path, "b.parquet", [["\u00a0\u00a0"]])  # only no-break spaces: blank
    assert not _proven(tmp_path, [b])
