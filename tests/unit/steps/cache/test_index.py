"""The entries' key index (steps/cache/index.py): both key formats, newest-wins dedupe, exact 32-byte lookups.

Lookups are checked against a plain dict over the same keys, with keys that share their first 8 bytes (the
binary search's word) planted on purpose, since sha256 keys would almost never show them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.steps.cache.index import KEY_BYTES, build_index, key_matrix, read_keys


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def rows(*names: str) -> np.ndarray:
    return key_matrix(pa.array([digest(n) for n in names], pa.binary()))


def no_meta(files, rows_):
    raise AssertionError("no key is held twice: newest() must not be asked")


# ---- key_matrix -----------------------------------------------------------------------------------------
def test_binary_hex_and_fixed_width_keys_give_the_same_bytes():
    keys = [digest(str(i)) for i in range(50)]
    want = np.frombuffer(b"".join(keys), np.uint8).reshape(50, KEY_BYTES)
    for arr in (
        pa.array(keys, pa.binary()),
        pa.array(keys, pa.large_binary()),
        pa.array(keys, pa.binary(KEY_BYTES)),
        pa.array([k.hex() for k in keys]),  # the previous format: 64 hex characters
        pa.array([k.hex() for k in keys], pa.large_string()),
        pa.chunked_array([pa.array(keys[:20]), pa.array(keys[20:])]),
        pa.array(keys, pa.binary_view()),
        pa.array([k.hex() for k in keys], pa.string_view()),
    ):
        assert np.array_equal(key_matrix(arr), want), arr.type
    sliced = pa.array(keys, pa.binary()).slice(7, 11)  # an array that starts inside its buffers
    assert np.array_equal(key_matrix(sliced), want[7:18])
    # hex text is decoded from Arrow's buffer in place: a slice decodes its own rows, not the buffer's first ones
    hex_sliced = pa.array([k.hex() for k in keys]).slice(13, 20)
    assert np.array_equal(key_matrix(hex_sliced), want[13:33])
    assert np.array_equal(key_matrix(pa.chunked_array([hex_sliced.slice(0, 5), hex_sliced.slice(5)])), want[13:33])
    assert key_matrix(pa.array([], pa.binary())).shape == (0, KEY_BYTES)


@pytest.mark.parametrize(
    ("arr", "message"),
    [
        (pa.array([digest("a"), None], pa.binary()), "NULL"),
        (pa.array([digest("a"), digest("b")[:31]], pa.binary()), "not all 32 bytes"),
        (pa.array([digest("a") + b"x"], pa.binary()), "not all 32 bytes"),
        (pa.array(["zz" * 32]), "not hex"),
        (pa.array([digest("a").hex()[:63]]), "not all 64 characters"),
        (pa.array([b"x" * 16], pa.binary(16)), "16 bytes"),
        (pa.array([1, 2]), "neither binary nor hex"),
    ],
)
def test_anything_else_is_refused_not_misread(arr, message):
    with pytest.raises(ValueError, match=message):
        key_matrix(arr)


# ---- lookups ----------------------------------------------------------------------------------------
def test_lookup_finds_exactly_the_held_keys():
    held = [f"k{i}" for i in range(0, 400, 2)]
    index = build_index([np.sort(rows(*held).view("V32"), axis=0).view(np.uint8).reshape(-1, KEY_BYTES)], no_meta)
    sorted_keys = sorted(digest(n) for n in held)
    where = {k: i for i, k in enumerate(sorted_keys)}
    got = index.lookup(rows(*[f"k{i}" for i in range(400)]))
    assert got.tolist() == [where[digest(f"k{i}")] if i % 2 == 0 else -1 for i in range(400)]
    assert index.rows is None  # one sorted run, each key once: no row map kept


def test_unsorted_runs_and_the_previous_format_are_read_and_sorted():
    a, b = [f"a{i}" for i in range(30)], [f"b{i}" for i in range(30)]
    old = key_matrix(pa.array([digest(n).hex() for n in a]))  # hex keys, in source-id order (unsorted)
    new = rows(*b)
    index = build_index([old, new], no_meta)
    got = index.lookup(rows(*a, *b, "c"))
    assert got.tolist() == list(range(60)) + [-1]  # entry rows counted over the parts in order


def test_keys_sharing_their_first_8_bytes_are_told_apart_by_all_32():
    base = digest("x")
    twins = [base[:8] + digest(f"t{i}")[8:] for i in range(5)]  # one first word, five keys
    others = [digest(f"o{i}") for i in range(20)]
    keys = pa.array(twins + others, pa.binary())
    index = build_index([key_matrix(keys)], no_meta)
    assert index.collisions
    stranger = base[:8] + digest("stranger")[8:]
    got = index.lookup(key_matrix(pa.array(list(reversed(twins)) + [stranger] + others[:3], pa.binary())))
    assert got.tolist() == [4, 3, 2, 1, 0, -1, 5, 6, 7]


def test_a_key_held_twice_answers_from_the_newest_then_the_smallest_source_id():
    first = rows("a", "b", "c")
    second = rows("b", "c", "d")
    third = rows("c")
    meta = {  # (part, row) -> (computed_at, source_id)
        (0, 1): ("2026-01-01T00:00:00+00:00", "id-9"),
        (1, 0): ("2026-02-01T00:00:00+00:00", "id-7"),  # b: newer than part 0's
        (0, 2): ("2026-03-01T00:00:00+00:00", "id-5"),
        (1, 1): ("2026-03-01T00:00:00+00:00", "id-3"),  # c: as new as two others, the smallest source id
        (2, 0): ("2026-03-01T00:00:00+00:00", "id-4"),
    }
    asked = []

    def newest(files, rows_):
        asked.extend(zip(files.tolist(), rows_.tolist()))
        return [meta[(f, r)][0] for f, r in zip(files, rows_)], [meta[(f, r)][1] for f, r in zip(files, rows_)]

    index = build_index([first, second, third], newest)
    assert sorted(asked) == sorted(meta)  # only the rows whose key another row holds
    assert index.lookup(rows("a", "b", "c", "d")).tolist() == [0, 3, 4, 5]


def test_a_null_computed_at_or_source_id_loses():
    index = build_index(
        [rows("k"), rows("k")],
        lambda f, r: ([None if int(x) == 0 else "2026-01-01T00:00:00+00:00" for x in f], ["a", "b"]),
    )
    assert index.lookup(rows("k")).tolist() == [1]
    at = "2026-01-01T00:00:00+00:00"
    index = build_index([rows("k"), rows("k")], lambda f, r: ([at, at], [None, "\U0001f600"]))  # beyond U+FFFF
    assert index.lookup(rows("k")).tolist() == [1]


def test_an_empty_index_answers_nothing():
    index = build_index([np.zeros((0, KEY_BYTES), np.uint8)], no_meta)
    assert index.lookup(rows("a", "b")).tolist() == [-1, -1]


def test_random_lookups_agree_with_a_dict():
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 256, (n, KEY_BYTES), dtype=np.uint8) for n in (500, 1, 0, 300)]
    parts[3][:40, :8] = parts[0][:40, :8]  # shared first words across parts
    flat = np.concatenate(parts)
    where = {bytes(k): i for i, k in enumerate(flat)}
    index = build_index(parts, no_meta)
    queries = np.concatenate([flat[rng.permutation(len(flat))], rng.integers(0, 256, (200, KEY_BYTES), np.uint8)])
    assert index.lookup(queries).tolist() == [where.get(bytes(q), -1) for q in queries]


def test_read_keys_reads_an_entry_part_of_either_format(tmp_path):
    keys = [digest(str(i)) for i in range(10)]
    pq.write_table(pa.table({"key": pa.array(keys, pa.binary()), "label": ["x"] * 10}), tmp_path / "new.parquet")
    pq.write_table(pa.table({"key": [k.hex() for k in keys], "label": ["x"] * 10}), tmp_path / "old.parquet")
    a, b = read_keys(str(tmp_path / "new.parquet")), read_keys(str(tmp_path / "old.parquet"))
    assert np.array_equal(a, b) and a.shape == (10, KEY_BYTES)
    pq.write_table(pa.table({"key": pa.array([k[:20] for k in keys], pa.binary())}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="32 bytes"):
        read_keys(str(tmp_path / "bad.parquet"))
