"""Cutting by tokens from per-group totals (steps/plan/groups.py) gives the shards a per-row array gave."""

import hashlib
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.formats.base import RowGroups, array_groups
from airflow_provider_vllm.core.plan import ShardPlan
from airflow_provider_vllm.steps.plan import groups as groups_mod
from airflow_provider_vllm.steps.plan import planner as plan_mod
from airflow_provider_vllm.steps.plan.groups import GroupTokens
from airflow_provider_vllm.steps.plan.planner import build_plan
from tests.support.data import make_spec


# ---- the cut as it was (per-row arrays over every row): the reference ------------------------------------
def _old_cut(spec, fp, values, file_rows, offsets=None, lines=None):
    sh = spec.sharding
    n = len(values)
    if n == 0:
        return []
    target_tokens = sh.target_tokens if sh.target_rows is None else None
    by_tokens = target_tokens is not None
    target = target_tokens if target_tokens is not None else (sh.target_rows or plan_mod.DEFAULT_TARGET_ROWS)
    tokens = values
    if sh.long_row_tokens is not None and sh.max_shards >= 2:
        long_mask = tokens > sh.long_row_tokens
        split = [(b, np.nonzero(m)[0]) for b, m in (("short", ~long_mask), ("long", long_mask))]
        buckets = [(b, idx) for b, idx in split if len(idx)]
    else:
        buckets = [("all", None)]
    sizes = [n if idx is None else len(idx) for _, idx in buckets]
    if by_tokens:
        weights = [tokens if idx is None else tokens[idx] for _, idx in buckets]
        wanted = [min(m, max(1, math.ceil(float(w.sum()) / target))) for m, w in zip(sizes, weights)]
    else:
        weights = [None] * len(buckets)
        wanted = [min(m, max(1, math.ceil(m / target))) for m in sizes]
    counts = plan_mod._cap(wanted, sh.max_shards)
    plan_key = hashlib.sha256(
        json.dumps(
            [fp, spec.prompt.id_column, spec.sharding.model_dump(mode="json", exclude={"dedupe"})], sort_keys=True
        ).encode()
    ).hexdigest()
    file_starts = np.concatenate([[0], np.cumsum(file_rows)]).astype(np.int64)
    shards = []
    for (bucket, idx), w, m, k in zip(buckets, weights, sizes, counts):
        if w is None:
            cuts = np.rint(m * np.arange(1, k) / k).astype(np.int64)
        else:
            cum = np.cumsum(w, dtype=np.float64)
            cuts = np.searchsorted(cum, cum[-1] * np.arange(1, k) / k, side="left") + 1
        inner = np.clip(cuts, 1, m - 1) if m > 1 else np.zeros(0, np.int64)
        bounds = np.unique(np.concatenate([[0], inner, [m]]).astype(np.int64)).tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if idx is None:
                segs = plan_mod._range_segments(a, b, file_starts, offsets, lines)
                est = int(tokens[a:b].sum())
            else:
                rows = idx[a:b]
                segs = []
                fids = np.searchsorted(file_starts, rows, side="right") - 1
                for fid in np.unique(fids):
                    r = rows[fids == fid]
                    lo, hi = int(r.min()), int(r.max()) + 1
                    segs.append(
                        plan_mod._segment(
                            int(fid), lo - int(file_starts[fid]), hi - int(file_starts[fid]), lo, offsets, lines
                        )
                    )
                est = int(tokens[idx[a:b]].sum())
            key = hashlib.sha256(f"{plan_key}:{bucket}:{json.dumps([s.model_dump() for s in segs])}".encode())
            shards.append(
                ShardPlan(
                    shard_id=f"shard-{len(shards):05d}-{key.hexdigest()[:8]}",
                    index=len(shards),
                    bucket=bucket,
                    rows=int(b - a),
                    est_tokens=est,
                    segments=segs,
                )
            )
    return shards


def _write(folder, files, use_dictionary=True):
    """Parquet files, each a list of row groups (lists of texts); ids are distinct and in order."""
    folder.mkdir(parents=True, exist_ok=True)
    k = 0
    for f, groups in enumerate(files):
        schema = pa.schema({"id": pa.string(), "text": pa.string()})
        with pq.ParquetWriter(folder / f"p{f:02d}.parquet", schema, use_dictionary=use_dictionary) as w:
            for texts in groups:
                ids = [f"r{k + i:08d}" for i in range(len(texts))]
                k += len(texts)
                w.write_table(pa.table({"id": ids, "text": texts}, schema=schema))
    return folder


def _texts(rng, n, spread=400):
    return ["x" * int(v) for v in rng.integers(0, spread, n)]


def _chars(path):
    """Per row, the characters of its text, read plain and whole (as the planner did)."""
    return pc.fill_null(pc.utf8_length(pq.read_table(path, columns=["text"]).column(0)), 0).to_numpy()


def _compare(tmp_path, folder, sharding):
    spec = make_spec(folder, tmp_path / "out", sharding=sharding)
    new = build_plan(spec)
    # the reference: every row's estimate in one array, cut as before
    chars = np.concatenate([_chars(folder / f.path) for f in new.files]) if new.files else []
    values = plan_mod.estimate_tokens(np.asarray(chars, np.int64), spec.sharding.chars_per_token)
    file_rows = [pq.ParquetFile(folder / f.path).metadata.num_rows for f in new.files]
    old = _old_cut(spec, new.fingerprint, values, np.asarray(file_rows, np.int64))
    assert [s.model_dump() for s in new.shards] == [s.model_dump() for s in old]
    assert new.est_tokens == int(values.sum())
    return new


SHARDINGS = [
    {"target_rows": None, "target_tokens": 2_000},
    {"target_rows": None, "target_tokens": 2_000, "long_row_tokens": 60},
    {"target_rows": 37, "long_row_tokens": 60},
    {"target_rows": None, "target_tokens": 500, "long_row_tokens": 60, "max_shards": 7},
    {"target_rows": None, "target_tokens": 10**9, "long_row_tokens": 60},
    {"target_rows": None, "target_tokens": 1, "max_shards": 40},
    {"target_rows": None, "target_tokens": 3_000, "long_row_tokens": 1},  # every row long
    {"target_rows": None, "target_tokens": 3_000, "long_row_tokens": 10**6},  # every row short
]


@pytest.mark.parametrize("use_dictionary", [True, False])
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_cuts_equal_the_per_row_cut_on_multi_row_group_files(tmp_path, monkeypatch, sharding, use_dictionary):
    monkeypatch.setattr(groups_mod, "CACHED_GROUPS", 1)  # every boundary lookup reads its group again
    rng = np.random.default_rng(3)
    files = [
        [_texts(rng, 50), _texts(rng, 13), [], _texts(rng, 77)],  # a row group with zero rows
        [_texts(rng, 1)],
        [],  # a file with no row group at all
        [_texts(rng, 64, spread=30), _texts(rng, 64, spread=900), _texts(rng, 5)],
    ]
    folder = _write(tmp_path / "in", files, use_dictionary)
    assert [pq.ParquetFile(folder / "p00.parquet").metadata.row_group(g).num_rows for g in range(4)] == [50, 13, 0, 77]
    plan = _compare(tmp_path, folder, sharding)
    assert sum(s.rows for s in plan.shards) == 274


def test_null_texts_and_a_huge_single_row_under_long_row_tokens(tmp_path):
    """A 2 MB row among short ones and null texts: the long row gets its own shard, sized as before."""
    folder = tmp_path / "in"
    folder.mkdir()
    texts = ["short"] * 40 + ["y" * 2_000_000] + [None] * 9 + ["mid " * 20] * 30
    pq.write_table(
        pa.table({"id": [f"r{i:04d}" for i in range(80)], "text": texts}), folder / "a.parquet", row_group_size=9
    )
    plan = _compare(tmp_path, folder, {"target_rows": None, "target_tokens": 100, "long_row_tokens": 1000})
    long = [s for s in plan.shards if s.bucket == "long"]
    assert len(long) == 1 and long[0].rows == 1 and long[0].est_tokens == 500_000
    assert long[0].segments[0].start == 40 and long[0].segments[0].count == 1


def test_dictionary_read_measures_as_plain_strings(tmp_path):
    """The plan reads text dictionary-encoded; the worker reads it plain: the same characters per row."""
    from airflow_provider_vllm.core.formats.parquet import _text_chars

    t = pa.table({"text": ["é" * 3, None, "", "日本語", "é" * 3, "a"]})
    pq.write_table(t, tmp_path / "a.parquet")
    dict_read = pq.ParquetFile(tmp_path / "a.parquet", read_dictionary=["text"]).read()
    assert pa.types.is_dictionary(dict_read.column("text").type)
    assert _text_chars(dict_read, ["text"]).tolist() == _text_chars(t, ["text"]).tolist() == [3, 0, 0, 3, 3, 1]


def test_group_tokens_refuses_a_group_that_reads_other_than_its_footer(tmp_path):
    groups = RowGroups(
        np.asarray([3], np.int64), [[0]], lambda g: np.zeros(2, np.int64), lambda f: iter([(0, np.zeros(2, np.int64))])
    )
    with pytest.raises(ValueError, match="2 rows read, 3 in the footer"):
        GroupTokens(groups, 4.0, None)


def test_array_groups_split_at_file_boundaries():
    chars = np.arange(10, dtype=np.int64)
    g = array_groups(chars, [4, 0, 6], rows_per_group=3)
    assert g.files == [[0, 1], [], [2, 3]]
    assert g.counts.tolist() == [3, 1, 3, 3]
    assert [g.chars(i).tolist() for i in range(4)] == [[0, 1, 2], [3], [4, 5, 6], [7, 8, 9]]
    gt = GroupTokens(g, 1.0, 5)
    assert gt.total == 45 and len(gt) == 10
    long = gt.bucket("long")
    assert long.rows == 4 and [long.row_at(p) for p in range(4)] == [6, 7, 8, 9]
    assert list(long.file_ranges(0, 4)) == [(2, 6, 10)]
