"""Passthrough columns (io.passthrough): typed input columns in every row of results/ and errors/.

Through plan, the worker (fake engine), merge, the result cache, QA, the change set and the OpenAI
output; read back by pandas, DuckDB and pyarrow.dataset with the input's own types (timestamps with
a time zone, dates, decimals, nested lists, structs) and its nulls, in results/ and in errors/.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import DatasetError, SpecError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.core.rows import ERROR_SCHEMA, RESULT_SCHEMA
from airflow_provider_vllm.steps.cache.result_cache import ENTRY_SCHEMA
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import PINNED_REVISION, make_spec, merge, shard_task, vouch_cache

UTC = dt.UTC
TYPES = {
    "queue": pa.string(),
    "opened": pa.timestamp("ms", tz="America/New_York"),
    "closed": pa.timestamp("us", tz="UTC"),
    "day": pa.date32(),
    "amount": pa.decimal128(12, 2),
    "tags": pa.list_(pa.string()),
    "scores": pa.list_(pa.list_(pa.int16())),
    "customer": pa.struct([("name", pa.string()), ("tier", pa.int8())]),
    "label": pa.string(),  # scores and label clash with result columns: they need a prefix
}
NULLS = (1, 4)  # every passed-through value is null in an ok row (t1) and in an error row (t4)
INNER = 7  # a null inside a list and inside a struct (t7)


def input_table(n: int = 10) -> pa.Table:
    texts = [f"ticket {i}" if i % 4 else "" for i in range(n)]  # every 4th row is an error row (EMPTY_INPUT)

    def col(name, values):
        return pa.array([None if i in NULLS else v for i, v in enumerate(values)], TYPES[name])

    cols = {
        "id": pa.array([f"t{i}" for i in range(n)]),
        "text": pa.array(texts),
        "queue": col("queue", [f"q{i % 3}" for i in range(n)]),
        "opened": col("opened", [dt.datetime(2026, 1, 1 + i, 12, 30, 15, 123000, tzinfo=UTC) for i in range(n)]),
        "closed": col("closed", [dt.datetime(2026, 2, 1 + i, 23, 59, 59, 999999, tzinfo=UTC) for i in range(n)]),
        "day": col("day", [dt.date(2025, 12, i + 1) for i in range(n)]),
        "amount": col("amount", [decimal.Decimal(f"{i}1234567.{i:02d}") for i in range(n)]),
        "tags": col("tags", [[None, "b"] if i == INNER else [f"a{i}", "b"] if i % 2 else [] for i in range(n)]),
        "scores": col("scores", [[[i, -i], [32767]] for i in range(n)]),
        "customer": col("customer", [{"name": None if i == INNER else f"c{i}", "tier": i % 3} for i in range(n)]),
        "label": col("label", [f"gold{i % 2}" for i in range(n)]),
    }
    return pa.table(cols)


def spec_for(tmp: Path, run: str = "a", **io):
    return make_spec(
        tmp / f"in-{run}.parquet",
        tmp / f"out-{run}",
        io={"passthrough": "all", "passthrough_prefix": "in_", **io},
        sharding={"target_rows": 4, "chunk_rows": 3},
    )


def run(spec, factory):
    plan = plan_job(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    merge(spec)
    vouch_cache(spec)  # publish's step for the cache (none without cache.uri)
    return plan


def test_passthrough_columns_keep_their_types_in_results_and_errors(tmp_path, fake_engine_factory):
    table = input_table()
    pq.write_table(table, tmp_path / "in-a.parquet")
    spec = spec_for(tmp_path)
    plan = run(spec, fake_engine_factory)
    carried = ["text", *TYPES]  # 'all': every column but the id, in input order
    assert plan.passthrough.columns == carried and plan.passthrough.names == [f"in_{c}" for c in carried]
    out = tmp_path / "out-a"
    want = {f"in_{c}": table.schema.field(c).type for c in carried}
    for kind, base in ((RESULTS, RESULT_SCHEMA), (ERRORS, ERROR_SCHEMA)):
        schema = pq.read_schema(next((out / kind).glob("part-*.parquet")))
        assert schema.names == base.names + list(want)
        assert {f.name: f.type for f in schema if f.name in want} == want

    by_id = {r["id"]: r for r in table.to_pylist()}
    kinds = {RESULTS: {"t1", "t2", "t3", "t5", "t6", "t7", "t9"}, ERRORS: {"t0", "t4", "t8"}}

    # pyarrow.dataset: the input's types, and by id the input's values (nulls, inner nulls included)
    for kind, ids in kinds.items():
        got = ds.dataset(str(out / kind), format="parquet").to_table()
        assert {f.name: f.type for f in got.schema if f.name in want} == want
        rows = {r["id"]: r for r in got.to_pylist()}
        assert set(rows) == ids
        for i, r in rows.items():
            assert {c: r[f"in_{c}"] for c in carried} == {c: by_id[i][c] for c in carried}, i

    # pandas (pyarrow engine): tz-aware timestamps, Decimal objects, lists and dicts; nulls as NaT / None
    for kind in kinds:
        frame = pd.read_parquet(out / kind).set_index("id")
        assert str(frame["in_opened"].dtype) == "datetime64[ms, America/New_York]"
        assert str(frame["in_closed"].dtype) == "datetime64[us, UTC]"
        null_id = "t1" if kind == RESULTS else "t4"
        row = frame.loc[null_id]
        assert row[[f"in_{c}" for c in TYPES]].isna().all(), row
    res = pd.read_parquet(out / RESULTS).set_index("id")
    t5 = res.loc["t5"]
    assert t5["in_amount"] == decimal.Decimal("51234567.05") and list(t5["in_tags"]) == ["a5", "b"]
    assert t5["in_opened"] == pd.Timestamp("2026-01-06 12:30:15.123", tz="UTC")
    assert t5["in_closed"] == pd.Timestamp("2026-02-06 23:59:59.999999", tz="UTC")
    assert t5["in_customer"] == {"name": "c5", "tier": 2} and [list(x) for x in t5["in_scores"]] == [[5, -5], [32767]]
    assert list(res.loc["t7", "in_tags"]) == [None, "b"] and res.loc["t7", "in_customer"] == {"name": None, "tier": 1}
    err = pd.read_parquet(out / ERRORS).set_index("id")
    assert err.loc["t8", "in_amount"] == decimal.Decimal("81234567.08") and err.loc["t8", "error_code"] == "EMPTY_INPUT"

    # DuckDB: the types, and every passed-through value equal to the input's, joined by id (nulls included)
    con = duckdb.connect()
    src = f"read_parquet('{tmp_path / 'in-a.parquet'}')"
    same = " AND ".join(f'o."in_{c}" IS NOT DISTINCT FROM i."{c}"' for c in carried)
    for kind, ids in kinds.items():
        rel = f"read_parquet('{out / kind}/*.parquet')"
        n, equal = con.execute(
            f"SELECT count(*), count(*) FILTER (WHERE {same}) FROM {rel} o JOIN {src} i USING (id)"
        ).fetchone()
        assert n == equal == len(ids), kind
        types = con.execute(
            f"SELECT typeof(in_opened), typeof(in_closed), typeof(in_day), typeof(in_amount), typeof(in_tags), "
            f"typeof(in_scores), typeof(in_customer) FROM {rel} LIMIT 1"
        ).fetchone()
        assert types == (
            "TIMESTAMP WITH TIME ZONE",
            "TIMESTAMP WITH TIME ZONE",
            "DATE",
            "DECIMAL(12,2)",
            "VARCHAR[]",
            "SMALLINT[][]",
            'STRUCT("name" VARCHAR, tier TINYINT)',
        )
    got = con.execute(
        f"SELECT in_customer.name, epoch_ms(in_opened), in_amount IS NULL, in_tags IS NULL "
        f"FROM read_parquet('{out / RESULTS}/*.parquet') WHERE id IN ('t5', 't1') ORDER BY id"
    ).fetchall()
    opened = int(dt.datetime(2026, 1, 6, 12, 30, 15, 123000, tzinfo=UTC).timestamp() * 1000)
    assert got == [(None, None, True, True), ("c5", opened, False, False)]


def test_named_columns_only_and_no_columns_by_default(tmp_path, fake_engine_factory):
    pq.write_table(input_table(), tmp_path / "in-a.parquet")
    spec = make_spec(tmp_path / "in-a.parquet", tmp_path / "out-a", io={"passthrough": ["amount", "queue"]})
    plan = run(spec, fake_engine_factory)
    assert plan.passthrough.names == ["amount", "queue"]
    assert pq.read_schema(next((tmp_path / "out-a" / RESULTS).glob("*.parquet"))).names[-2:] == ["amount", "queue"]
    plain = make_spec(tmp_path / "in-a.parquet", tmp_path / "out-b")
    plan = run(plain, fake_engine_factory)
    assert plan.passthrough is None and "passthrough" not in json.loads((tmp_path / "out-b" / PLAN_FILE).read_text())
    assert pq.read_schema(next((tmp_path / "out-b" / RESULTS).glob("*.parquet"))).names == RESULT_SCHEMA.names


def test_an_empty_folder_still_has_the_per_job_schema(tmp_path, fake_engine_factory):
    t = input_table(4).slice(1, 3)  # no empty text: no error rows
    pq.write_table(t, tmp_path / "in-a.parquet")
    spec = make_spec(tmp_path / "in-a.parquet", tmp_path / "out-a", io={"passthrough": ["opened"]})
    run(spec, fake_engine_factory)
    errors = list((tmp_path / "out-a" / ERRORS).glob("*.parquet"))
    assert len(errors) == 1 and pq.read_metadata(errors[0]).num_rows == 0
    assert pq.read_schema(errors[0]).field("opened").type == TYPES["opened"]


@pytest.mark.parametrize(
    "io, error, match",
    [
        ({"passthrough": "all"}, SpecError, r"'scores' would be 'scores'.*io.passthrough_prefix"),
        ({"passthrough": ["nope"]}, DatasetError, r"no column\(s\) \['nope'\]"),
        ({"passthrough": ["queue", "queue"]}, SpecError, "more than once"),
        ({"passthrough": ["queue"], "passthrough_prefix": "_vllm_"}, SpecError, "reserved by the result cache"),
        ({"passthrough": ["id"], "passthrough_prefix": ""}, SpecError, "'id' would be 'id'"),
    ],
)
def test_what_the_plan_refuses(tmp_path, io, error, match):
    pq.write_table(input_table(), tmp_path / "in-a.parquet")
    with pytest.raises(error, match=match):
        plan_job(make_spec(tmp_path / "in-a.parquet", tmp_path / "out-a", io=io))
    assert not (tmp_path / "out-a" / PLAN_FILE).exists()


@pytest.mark.parametrize(
    "column, prefix, match",
    [
        (
            "LABEL",
            "",
            r"'LABEL' would be 'LABEL' .* equals 'label', a column of results/ or errors/, ignoring the case",
        ),
        ("Model", "", "equals 'model'"),
        ("queue", "_VLLM_", "reserved by the result cache"),
        ("LABELS", "", None),
        ("LABEL", "input_", None),
    ],
)
def test_a_passthrough_name_equal_to_a_result_column_ignoring_ascii_case_is_refused(tmp_path, column, prefix, match):
    """results/ with ``label`` and ``LABEL``: DuckDB reads the second as ``LABEL_1``. The plan accepted it (only
    exact names were compared)."""
    t = pa.table({"id": ["a", "b"], "text": ["x", "y"], column: ["p", "q"]})
    pq.write_table(t, tmp_path / "in.parquet")
    spec = make_spec(
        tmp_path / "in.parquet", tmp_path / "out", io={"passthrough": [column], "passthrough_prefix": prefix}
    )
    if match is None:
        assert plan_job(spec).passthrough.names == [prefix + column]
        return
    with pytest.raises(SpecError, match=match):
        plan_job(spec)
    assert not (tmp_path / "out" / PLAN_FILE).exists()


def test_files_that_type_a_column_differently_are_refused(tmp_path):
    (tmp_path / "in").mkdir()
    t = input_table()
    pq.write_table(t.slice(0, 5), tmp_path / "in" / "a.parquet")
    pq.write_table(t.slice(5).set_column(2, "queue", pa.array(range(5), pa.int64())), tmp_path / "in" / "b.parquet")
    with pytest.raises(DatasetError, match=r"'queue' is int64 in b.parquet but string in a.parquet"):
        plan_job(make_spec(tmp_path / "in", tmp_path / "out", io={"passthrough": ["queue"]}))


def test_jsonl_input_cannot_pass_columns_through(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "text": "x"}) + "\n")
    with pytest.raises(SpecError, match="needs Parquet input"):
        plan_job(make_spec(tmp_path / "in.jsonl", tmp_path / "out", io={"passthrough": ["text"]}))
    with pytest.raises(SpecError, match="needs Parquet input"):
        make_spec(tmp_path / "in.jsonl", tmp_path / "out", io={"passthrough": ["text"], "input_format": "jsonl"})


def test_the_cache_serves_hits_with_this_runs_columns_and_never_stores_them(tmp_path, fake_engine_factory):
    table = input_table(12)
    pq.write_table(table, tmp_path / "in-a.parquet")
    # the second run: the same texts, other passthrough values (a later day's rows of the same tickets)
    later = table.set_column(table.schema.get_field_index("queue"), "queue", pa.array([f"later{i}" for i in range(12)]))
    pq.write_table(later, tmp_path / "in-b.parquet")

    def spec(run_name):
        return spec_for(tmp_path, run_name).model_copy(
            update={
                "cache": make_spec("/i", "/o", cache={"uri": str(tmp_path / "cache")}).cache,
                "model": make_spec("/i", "/o", model={"revision": PINNED_REVISION}).model,
            }
        )

    run(spec("a"), fake_engine_factory)
    plan_b = run(spec("b"), fake_engine_factory)
    assert plan_b.cache.hits == 9  # every ok row of run a
    res = ds.dataset(str(tmp_path / "out-b" / RESULTS), format="parquet").to_table()
    assert (
        res.schema.field("in_opened").type == TYPES["opened"] and res.schema.field("in_amount").type == TYPES["amount"]
    )
    rows = {r["id"]: r for r in res.to_pylist()}
    assert all(r["cached_from"] for r in rows.values())
    assert {i: r["in_queue"] for i, r in rows.items()} == {i: f"later{i[1:]}" for i in rows}  # this run's values
    assert rows["t5"]["in_customer"] == {"name": "c5", "tier": 2} and rows["t5"]["in_scores"] == [[5, -5], [32767]]
    for entry in (tmp_path / "cache").rglob("*.parquet"):
        assert pq.read_schema(entry).names == ENTRY_SCHEMA.names  # no passthrough column is cached


def test_readers_of_the_merged_run_ignore_the_passthrough_columns(tmp_path, fake_engine_factory):
    pq.write_table(input_table(), tmp_path / "in-a.parquet")
    pq.write_table(input_table(), tmp_path / "in-b.parquet")
    spec_a = spec_for(tmp_path, "a", output_format="openai_batch")
    run(spec_a, fake_engine_factory)
    lines = (tmp_path / "out-a" / "openai" / "output.jsonl").read_text().splitlines()
    assert len(lines) == 7 and "in_amount" not in lines[0]
    spec_b = spec_for(tmp_path, "b").model_copy(
        update={"changes": make_spec("/i", "/o", changes={"previous_uri": str(tmp_path / "out-a")}).changes}
    )
    run(spec_b, fake_engine_factory)
    report, _ = qa_run(spec_b)
    assert report.metrics["total"] == 10 and report.metrics["changes"]["counts"]["unchanged"] == 7
