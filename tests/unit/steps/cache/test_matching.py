"""The plan's lookup (steps/cache/matching.py): the hits file from several entry parts, the reader thread.

End to end (plan + merge with the fake engine) the cache is tested in test_result_cache.py; here the hits file
is built from hand-made entry parts so that row groups, parts without a column and shared entry rows are
all on purpose.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.rows import RESULT_SCHEMA, result_schema
from airflow_provider_vllm.steps.cache.matching import Matched, _prefetched, write_hits


def part(path, labels: list[str], drop: tuple[str, ...] = (), row_group_size: int = 3) -> str:
    """An entry part whose row i answers ``labels[i]`` (confidence i / 10), in row groups of 3 rows."""
    n = len(labels)
    t = pa.table(
        {
            "key": pa.array([bytes([i]) * 32 for i in range(n)], pa.binary()),
            "source_id": [f"s{i}" for i in range(n)],
            "label": labels,
            "confidence": pa.array([i / 10 for i in range(n)], pa.float32()),
            "model": ["m"] * n,
            "cached_from": ["/runs/1"] * n,
        }
    ).drop_columns(list(drop))
    pq.write_table(t, path, row_group_size=row_group_size)
    return str(path)


def matched(hits: list[tuple[int, int, str]]) -> Matched:
    """Hits as (entry row over all parts, input place, id), in input order, in batches of 2."""
    m = Matched()
    for i in range(0, len(hits), 2):
        batch = hits[i : i + 2]
        m.hit_entry_rows.append(np.array([e for e, _, _ in batch], np.int64))
        m.hit_places.append(np.array([p for _, p, _ in batch], np.int64))
        m.hit_values.append(pa.RecordBatch.from_pydict({"id": [x for _, _, x in batch]}))
    m.hits = len(hits)
    return m


def test_hits_come_from_each_row_group_of_each_part_with_their_own_ids(tmp_path):
    a = part(tmp_path / "a.parquet", ["a0", "a1", "a2", "a3", "a4", "a5", "a6"])  # rows 0..6, 3 row groups
    b = part(tmp_path / "b.parquet", ["b0", "b1"], drop=("confidence",))  # rows 7, 8: a part of an older version
    # input order: rows that share an entry row (ids i3 and i6: a2), rows of both parts, groups skipped (a3..a5)
    hits = [(8, 0, "i0"), (0, 1, "i1"), (6, 2, "i2"), (2, 3, "i3"), (7, 4, "i4"), (1, 5, "i5"), (2, 6, "i6")]
    dest = tmp_path / "hits.parquet"
    assert write_hits(matched(hits), [a, b], RESULT_SCHEMA, str(dest)) == 7
    assert pq.read_schema(dest).equals(RESULT_SCHEMA)  # text columns read back as text, not dictionaries
    rows = pq.read_table(dest).to_pylist()
    # part a's groups in order (group 0: input order within it), then part b's
    assert [r["id"] for r in rows] == ["i1", "i3", "i5", "i6", "i2", "i0", "i4"]
    got = {r["id"]: (r["label"], r["confidence"], r["cached_from"], r["model"]) for r in rows}
    assert got["i3"] == got["i6"] == ("a2", pytest.approx(0.2), "/runs/1", "m")
    assert got["i2"][:2] == ("a6", pytest.approx(0.6)) and got["i1"][0] == "a0" and got["i5"][0] == "a1"
    assert got["i0"] == ("b1", None, "/runs/1", "m") and got["i4"][:2] == ("b0", None)  # no column: NULL
    assert {r["shard_id"] for r in rows} == {None}  # a column no part holds: NULL


def test_no_hits_give_an_empty_file_in_the_results_schema(tmp_path):
    dest = tmp_path / "hits.parquet"
    assert write_hits(Matched(), [], RESULT_SCHEMA, str(dest)) == 0
    assert pq.read_schema(dest).equals(RESULT_SCHEMA) and pq.read_metadata(dest).num_rows == 0


@pytest.mark.parametrize("honoured", [True, False])
def test_passthrough_columns_keep_their_types(tmp_path, monkeypatch, caplog, honoured):
    """A time zone or an unsigned type lives only in the file's Arrow schema record. Should pyarrow not honour
    the record (``honoured`` False: it is never written), the file is written again with plain text columns."""
    if not honoured:
        monkeypatch.setattr(pq.ParquetWriter, "add_key_value_metadata", lambda self, kv: None)
    a = part(tmp_path / "a.parquet", ["a0", "a1"])
    extra = pa.schema([pa.field("in_ts", pa.timestamp("ms", tz="Europe/Paris")), pa.field("in_n", pa.uint16())])
    schema = result_schema(extra)
    m = Matched()
    m.hit_entry_rows, m.hit_places = [np.array([1, 0], np.int64)], [np.array([0, 1], np.int64)]
    m.hit_values = [
        pa.RecordBatch.from_pydict(
            {"id": ["x", "y"], "in_ts": pa.array([1000, 2000], pa.timestamp("us")), "in_n": pa.array([7, 8])}
        )
    ]
    dest = tmp_path / "hits.parquet"
    assert write_hits(m, [a], schema, str(dest)) == 2
    t = pq.read_table(dest)
    assert t.schema.equals(schema)
    assert t.column("id").to_pylist() == ["x", "y"] and t.column("label").to_pylist() == ["a1", "a0"]
    assert t.column("in_n").to_pylist() == [7, 8]
    assert ("writing it with plain text" in caplog.text) is not honoured


def test_the_reader_thread_hands_over_its_error_and_stops_when_the_writer_does():
    def failing():
        yield 1
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(_prefetched(failing()))
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    it = _prefetched(endless(), depth=2)
    assert [next(it), next(it)] == [0, 1]
    it.close()  # the consumer stops early: the producer thread ends, nothing keeps running
    assert not [t for t in threading.enumerate() if t.name == "cache-hits-reader"]
    assert len(produced) <= 5


def test_many_hits_read_back_as_a_plain_take_of_the_entry_and_unique_columns_skip_dictionaries(tmp_path):
    """The hits file by value: every column equal to the entry rows taken one by one (grouped by row group, input
    order within one), whatever the pages; the id and the numbers are written without dictionary pages (nearly
    every value differs), the text answers with them."""
    n, rng = 2000, np.random.default_rng(7)
    entry = pa.table(
        {
            "key": pa.array([i.to_bytes(32, "big") for i in range(n)], pa.binary()),
            "source_id": [f"s{i}" for i in range(n)],
            "output": [f"answer {i % 5}" for i in range(n)],
            "label": [None if i % 7 == 0 else f"l{i % 3}" for i in range(n)],
            "latency_ms": pa.array(rng.random(n) * 1000, pa.float32()),
            "prompt_tokens": pa.array(rng.integers(1, 500, n), pa.int32()),
            "prompt_hash": pa.array(rng.integers(-(2**62), 2**62, n), pa.int64()),
            "confidence": pa.array(rng.random(n), pa.float32()),
            "cached_from": ["/runs/1"] * n,
        }
    )
    path = tmp_path / "entry.parquet"
    pq.write_table(entry, path, row_group_size=300)
    hit_rows = rng.choice(n, 1500, replace=True)  # input order; some entry rows answer several inputs
    ids = [f"in-{p:05d}" for p in range(len(hit_rows))]
    m = Matched()
    for lo in range(0, len(hit_rows), 256):
        m.hit_entry_rows.append(hit_rows[lo : lo + 256].astype(np.int64))
        m.hit_places.append(np.arange(lo, min(lo + 256, len(hit_rows)), dtype=np.int64))
        m.hit_values.append(pa.RecordBatch.from_pydict({"id": ids[lo : lo + 256]}))
    dest = tmp_path / "hits.parquet"
    assert write_hits(m, [str(path)], RESULT_SCHEMA, str(dest)) == len(hit_rows)
    order = np.argsort(hit_rows // 300, kind="stable")  # entry row group, then input order
    want = entry.take(pa.array(hit_rows[order]))
    got = pq.read_table(dest)
    assert got.schema.equals(RESULT_SCHEMA)
    assert got.column("id").to_pylist() == [ids[i] for i in order]
    for c in ("output", "label", "latency_ms", "prompt_tokens", "prompt_hash", "confidence", "cached_from"):
        assert got.column(c).equals(want.column(c).cast(RESULT_SCHEMA.field(c).type)), c
    assert got.column("model").null_count == len(hit_rows)  # a column the entry lacks: NULL
    md = pq.ParquetFile(dest).metadata
    names = md.schema.names
    encodings = {names[i]: md.row_group(0).column(i).encodings for i in range(md.num_columns)}
    for c in ("id", "latency_ms", "prompt_tokens", "prompt_hash", "confidence"):
        assert "RLE_DICTIONARY" not in encodings[c] and "PLAIN_DICTIONARY" not in encodings[c], (c, encodings[c])
    assert "RLE_DICTIONARY" in encodings["output"] and "RLE_DICTIONARY" in encodings["cached_from"]
    assert md.row_group(0).column(names.index("id")).statistics.has_min_max  # statistics as before


@pytest.mark.parametrize("seed", range(4))
def test_hits_file_equals_a_row_by_row_construction(tmp_path, seed):
    """Random hits over parts of uneven row groups (shared entry rows, groups no hit touches, batches out of input
    order, a passthrough value): the file holds exactly the naive rows, entry row group by entry row group and in
    input order within one; each row's answer is its entry row's, under its own id."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(1, 40)) for _ in range(3)]
    paths, labels = [], []
    for k, n in enumerate(sizes):
        names = [f"p{k}-{i}" for i in range(n)]
        paths.append(part(tmp_path / f"p{k}.parquet", names, row_group_size=int(rng.integers(1, 9))))
        labels += names
    total = len(labels)
    n_hits = int(rng.integers(1, 3 * total))
    erows = rng.integers(0, total, n_hits)  # rows of one text share an entry row
    places = np.sort(rng.choice(10 * n_hits, n_hits, replace=False))  # input order
    ids = [f"id{p}" for p in places]
    extra = pa.schema([pa.field("in_n", pa.int64())])
    m = Matched()
    batches = [(a, min(n_hits, a + 5)) for a in range(0, n_hits, 5)]
    rng.shuffle(batches)  # batches handed over out of input order
    for a, b in batches:
        m.hit_entry_rows.append(erows[a:b])
        m.hit_places.append(places[a:b])
        m.hit_values.append(pa.RecordBatch.from_pydict({"id": ids[a:b], "in_n": places[a:b].tolist()}))
    m.hits = n_hits
    dest = tmp_path / "hits.parquet"
    assert write_hits(m, paths, result_schema(extra), str(dest)) == n_hits
    got = pq.read_table(dest)
    assert got.schema.equals(result_schema(extra))
    # naive: for each entry row group in order, the hits into it in input order
    starts, groups = 0, []
    for path in paths:
        md = pq.read_metadata(path)
        for g in range(md.num_row_groups):
            groups.append((starts, starts + md.row_group(g).num_rows))
            starts += md.row_group(g).num_rows
    want = [
        (ids[i], labels[erows[i]], round(erows[i] / 10 - sum(sizes[:k]) / 10, 4), int(places[i]))
        for lo, hi in groups
        for i in range(n_hits)
        if lo <= erows[i] < hi
        for k in [next(j for j in range(len(sizes)) if erows[i] < sum(sizes[: j + 1]))]
    ]
    rows = [(r["id"], r["label"], round(r["confidence"], 4), r["in_n"]) for r in got.to_pylist()]
    assert rows == want
