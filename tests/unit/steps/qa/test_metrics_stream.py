"""The streamed QA path (``evaluate_stream``: bounded memory for 100M-row runs) reports what the
in-memory ``evaluate`` reports, on files read in many small batches."""

from __future__ import annotations

import random

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa import evaluate as evaluate_mod
from airflow_provider_vllm.steps.qa import metrics_stream as ms
from airflow_provider_vllm.steps.qa.evaluate import evaluate, evaluate_stream
from airflow_provider_vllm.steps.qa.metrics_stream import SPACE_CLASS, Radix, ResultTally
from tests.support.data import shard_task
from tests.support.qa_rows import LABELS, err_row, ok_row, split


def _never(*a, **kw):
    raise AssertionError("a latency was kept in memory")


def _tables(n_ok=5000, n_err=300, seed=3):
    rnd = random.Random(seed)
    recs = [
        ok_row(
            i,
            label=rnd.choice(LABELS + [None]),
            valid=rnd.choice([True, True, False, None]),
            finish_reason=rnd.choice(["stop", "length", None]),
            truncated=rnd.random() < 0.05,
            output=rnd.choice(["x", "", "  ", None, "positive"]),
            prompt_tokens=rnd.choice([None, rnd.randint(1, 900)]),
            latency_ms=rnd.choice([None, float("nan"), rnd.expovariate(0.01)]),
            model=rnd.choice(["m", "m2"]),
            model_revision=rnd.choice(["r1", "r2"]),
        )
        for i in range(n_ok)
    ]
    recs += [
        err_row(i, rnd.choice(["ENGINE_ERROR", "EMPTY_INPUT", "PROMPT_TOO_LONG"]), shard_id=f"s{i % 4}")
        for i in range(n_err)
    ]
    return split(recs)


def _streamed(tmp_path, results, errors, **kw):
    pq.write_table(results, tmp_path / "r.parquet", row_group_size=700)  # many row groups
    pq.write_table(errors, tmp_path / "e.parquet", row_group_size=50)
    con = duckdb.connect()
    try:
        con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{tmp_path / 'r.parquet'}')")
        con.execute(f"CREATE VIEW e AS SELECT * FROM read_parquet('{tmp_path / 'e.parquet'}')")
        return evaluate_stream(con, result_rows=results.num_rows, batch_rows=512, **kw)
    finally:
        con.close()


@pytest.mark.parametrize("passes", [False, True], ids=["kept", "passes"])
@pytest.mark.parametrize("labels", [LABELS, None])
def test_streamed_report_equals_the_in_memory_report(tmp_path, monkeypatch, labels, passes):
    """Also with the latencies' statistics from passes over the column (a run past KEEP_LATENCIES rows)."""
    if passes:
        monkeypatch.setattr(ms, "KEEP_LATENCIES", 0)
        monkeypatch.setattr(ResultTally, "_keep_latency", _never)
    results, errors = _tables()
    kw = dict(
        spec=QASpec(sample_size=60, seed=9),
        labels=labels,
        structured=True,
        duplicates={"ids": 0, "rows_dropped": 0, "examples": []},
    )
    mem = evaluate(results, errors, **kw)
    streamed = _streamed(tmp_path, results, errors, **kw)
    a, b = mem.to_dict(), streamed.to_dict()
    # the mean is summed per batch: equal up to float rounding; everything else exactly
    assert b["metrics"]["latency_ms"].pop("mean") == pytest.approx(a["metrics"]["latency_ms"].pop("mean"), rel=1e-12)
    assert a["metrics"]["latency_ms"]["count"] > 1000 and len(a["metrics"]["models"]) == 4
    assert b == a
    assert streamed.sample.schema == mem.sample.schema and streamed.sample.num_rows == 60
    assert str(streamed.sample.to_pylist()) == str(mem.sample.to_pylist())  # str: NaN latencies compare equal


def test_streamed_latency_buffer_grows_past_a_wrong_capacity(tmp_path):
    results, errors = _tables(n_ok=3000, n_err=0)
    kw = dict(spec=QASpec(sample_size=10), labels=None, structured=False)
    mem = evaluate(results, errors, **kw).metrics["latency_ms"]
    pq.write_table(results, tmp_path / "r.parquet", row_group_size=700)
    pq.write_table(errors, tmp_path / "e.parquet")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{tmp_path / 'r.parquet'}')")
    con.execute(f"CREATE VIEW e AS SELECT * FROM read_parquet('{tmp_path / 'e.parquet'}')")
    got = evaluate_stream(con, result_rows=1, batch_rows=256, **kw).metrics["latency_ms"]
    assert got.pop("mean") == pytest.approx(mem.pop("mean"), rel=1e-12)
    assert got == mem


def test_the_streamed_path_never_builds_the_whole_tables(tmp_path, monkeypatch):
    """Bounded memory by construction: counts come from DuckDB aggregates, latencies in batches of at
    most batch_rows, and the only rows fetched whole are the sample's."""
    results, errors = _tables(n_ok=4000, n_err=100)
    batches, fetched = [], []
    real_keep, real_conform = evaluate_mod.ResultTally._keep_latency, evaluate_mod.conform

    def keep(self, x, exact32):
        batches.append(len(x))
        return real_keep(self, x, exact32)

    def conform(table, needs):
        fetched.append(table.num_rows)
        return real_conform(table, needs)

    monkeypatch.setattr(evaluate_mod.ResultTally, "_keep_latency", keep)
    monkeypatch.setattr(evaluate_mod, "conform", conform)
    rep = _streamed(tmp_path, results, errors, spec=QASpec(sample_size=20), labels=LABELS, structured=True)
    assert sum(batches) == rep.metrics["latency_ms"]["count"] > 1000 and max(batches) <= 512 and len(batches) >= 3
    assert fetched and max(fetched) <= 20 and sum(fetched) == 20
    assert rep.metrics["ok"] == 4000 and rep.metrics["errors"] == 100


def test_empty_outputs_are_counted_as_arrow_counts_them(tmp_path):
    """Unicode space, mixed strings and rows that carry vectors: streamed == in memory."""
    outputs = [
        "",
        " ",
        "\u3000",
        " \u00a0\t",
        "\u200b",
        "\ufeff",
        "x",
        " x",
        "\u2003y",
        "é",
        "\u0085",
        None,
        "\x1c",
        "\u180e",
        "\u205f\u2029",
    ]  # ok_row: None -> 'text i'
    recs = [ok_row(i, output=o) for i, o in enumerate(outputs)]
    recs += [ok_row(100 + i, output=o, scores=[0.5]) for i, o in enumerate(outputs)]
    results, errors = split(recs)
    kw = dict(spec=QASpec(sample_size=5), labels=None, structured=False)
    mem = evaluate(results, errors, **kw).metrics["rates"]["empty_rate"]
    assert _streamed(tmp_path, results, errors, **kw).metrics["rates"]["empty_rate"] == mem
    assert mem["of"] == len(outputs) and mem["count"] == 7  # '', 4 all-space, NEL, FS; not ZWSP, BOM, MVS


def test_space_class_is_arrows_utf8_is_space_over_every_code_point():
    chars = pa.array([chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF])
    arrow = pc.utf8_is_space(chars)
    con = duckdb.connect()
    con.register("t", pa.table({"s": chars}))
    duck = con.sql(f"SELECT regexp_full_match(s, '{SPACE_CLASS}+') AS m FROM t").to_arrow_table().column("m")
    assert duck.combine_chunks().equals(arrow)


def test_qa_run_streams_above_the_threshold_and_reports_the_same(tmp_path, monkeypatch):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa import stage
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import LABELS as INPUT_LABELS
    from tests.support.data import make_spec, merge, write_parquet
    from tests.support.fakes import FakeEngine

    write_parquet(
        tmp_path / "in" / "a.parquet",
        [f"row-{i}" for i in range(300)],
        [f"ticket {i} " + "x" * (i % 13) for i in range(300)],
        row_group_size=64,
    )
    spec = make_spec(
        tmp_path / "in",
        tmp_path / "out",
        sampling={"structured": {"choice": INPUT_LABELS}},
        sharding={"target_rows": 80, "chunk_rows": 16},
        qa={"sample_size": 24},
    )
    for shard in plan_job(spec).shards:
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=FakeEngine)
    merge(spec)
    mem, _ = stage.qa_run(spec)
    calls = []
    real = stage.evaluate_stream
    monkeypatch.setattr(stage, "evaluate_stream", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(stage, "STREAM_ABOVE_ROWS", 0)
    streamed, _ = stage.qa_run(spec)
    assert calls == [1]
    a, b = mem.to_dict(), streamed.to_dict()
    assert b["metrics"]["latency_ms"].pop("mean") == pytest.approx(a["metrics"]["latency_ms"].pop("mean"), rel=1e-12)
    assert b == a and a["metrics"]["ok"] + a["metrics"]["errors"] == 300
    assert str(streamed.sample.to_pylist()) == str(mem.sample.to_pylist())
    assert "input_excerpt" in streamed.sample.column_names


@pytest.mark.parametrize("chunk", [1 << 16, 999])
@pytest.mark.parametrize("kind", ["uniform", "ties", "sorted", "negative", "miss"])
def test_order_stats_are_exact(monkeypatch, kind, chunk):
    """The bracketed selection of the latency quantiles returns what a full sort returns, also when
    the subsample's bracket misses (forced: every draw is the first value) and it falls back; in one
    chunk and in many (the last one shorter)."""
    import numpy as np

    from airflow_provider_vllm.steps.qa import metrics_stream as ms

    monkeypatch.setattr(ms, "_SUBSAMPLE", 256)
    monkeypatch.setattr(ms, "_CHUNK", chunk)
    rng = np.random.default_rng(1)
    x = {
        "uniform": rng.random(20_000),
        "ties": rng.integers(0, 7, 20_000).astype(np.float64),
        "sorted": np.arange(20_000, dtype=np.float64),
        "negative": -rng.exponential(3, 20_000),
        "miss": rng.random(20_000),
    }[kind].astype(np.float32)
    if kind == "miss":

        class FirstOnly:
            def integers(self, lo, hi, size):
                return np.zeros(size, np.int64)

        monkeypatch.setattr(ms.np.random, "default_rng", lambda seed: FirstOnly())
    want = np.sort(x)
    pairs = {q: ms._ranks(q, len(x)) for q in (0.5, 0.9, 0.99)}
    got = ms._order_stats(x.copy(), pairs)
    assert got == {r: float(want[r]) for pair in pairs.values() for r in pair}


def test_hostile_ids_and_labels_stream_like_in_memory(tmp_path):
    """Quotes, backslashes, SQL and non-ASCII in ids, labels and error codes: same report, same sample."""
    odd = ["o'brien", "a\\b", "x'); DROP TABLE r; --", "é ü", "日本", "", " "]
    recs = [ok_row(i, id=f"{odd[i % len(odd)]}#{i}", label=odd[i % 3] if i % 5 else None) for i in range(400)]
    recs += [err_row(i, odd[i % 4], id=f"err'{i}") for i in range(40)]
    results, errors = split(recs)
    kw = dict(spec=QASpec(sample_size=30, seed=4), labels=None, structured=True)
    mem = evaluate(results, errors, **kw)
    streamed = _streamed(tmp_path, results, errors, **kw)
    a, b = mem.to_dict(), streamed.to_dict()
    assert b["metrics"]["latency_ms"].pop("mean") == pytest.approx(a["metrics"]["latency_ms"].pop("mean"), rel=1e-12)
    assert b == a and streamed.sample.num_rows == 30
    assert str(streamed.sample.to_pylist()) == str(mem.sample.to_pylist())


def test_a_sample_over_the_in_list_limit_reads_the_rows_by_a_join(tmp_path, monkeypatch):
    results, errors = _tables(n_ok=600, n_err=50)
    kw = dict(spec=QASpec(sample_size=40, seed=2), labels=LABELS, structured=True)
    listed = _streamed(tmp_path, results, errors, **kw)
    monkeypatch.setattr(evaluate_mod, "IN_LIST_MAX", 3)
    joined = _streamed(tmp_path, results, errors, **kw)
    assert str(joined.sample.to_pylist()) == str(listed.sample.to_pylist()) and joined.sample.num_rows == 40


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_job_compares_its_parsed_json(tmp_path, monkeypatch, stream):
    """A json_schema job's answers are its parsed JSON (``changes.compared_column``): QA reads that column for the
    consistency of repeated prompts on both paths (it was missing from what QA read: a BinderException)."""
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa import stage
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import make_spec, merge, write_parquet
    from tests.support.fakes import FakeEngine

    write_parquet(
        tmp_path / "in" / "a.parquet", [f"row-{i}" for i in range(40)], [f"ticket {i % 7}" for i in range(40)]
    )
    spec = make_spec(
        tmp_path / "in",
        tmp_path / "out",
        sampling={"structured": {"json_schema": {"type": "object"}}, "max_tokens": 16},
        qa={"sample_size": 10},
    )
    for shard in plan_job(spec).shards:
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=FakeEngine)
    merge(spec)
    if stream:
        monkeypatch.setattr(stage, "STREAM_ABOVE_ROWS", 0)
    report, _ = stage.qa_run(spec)
    c = report.metrics["consistency"]
    assert c["compared"] == "parsed_json" and c["rows_hashed"] == 40 and c["repeated_prompts"] == 7
    assert "parsed_json" in report.sample.column_names


def test_a_column_fetched_with_the_latencies_leaves_them_as_they_were(tmp_path):
    """``ResultTally.tally(also=...)``: the latency fetch reads every row then (for the other column), and keeps
    the same latencies as its filtered fetch (null, NaN and infinite ones dropped); the other column reaches the
    function whole, in order, nulls as NaN."""
    results, errors = _tables(n_ok=3000, n_err=10)
    lat = results.column("latency_ms").to_pylist()
    lat[::97] = [float("inf")] * len(lat[::97])
    lat[1::89] = [float("-inf")] * len(lat[1::89])
    results = results.set_column(
        results.schema.get_field_index("latency_ms"), "latency_ms", pa.array(lat, pa.float32())
    )
    pq.write_table(results, tmp_path / "r.parquet", row_group_size=700)
    pq.write_table(errors, tmp_path / "e.parquet")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{tmp_path / 'r.parquet'}')")
    con.execute(f"CREATE VIEW e AS SELECT * FROM read_parquet('{tmp_path / 'e.parquet'}')")
    plain, both = ResultTally(3000), ResultTally(3000)
    plain.tally(con, batch_rows=256)
    seen = []
    both.tally(con, batch_rows=256, also=("latency_ms", seen.append))
    kw = dict(labels=None, structured=False, notes=[])
    assert both.metrics(**kw)["latency_ms"] == plain.metrics(**kw)["latency_ms"]
    got = np.concatenate(seen)
    want = results.column("latency_ms").to_numpy(zero_copy_only=False)
    assert len(got) == results.num_rows and np.array_equal(got, want, equal_nan=True)
    # a column without a value in any row (a run without confidence) is not fetched at all
    none = []
    ResultTally(3000).tally(con, batch_rows=256, also=("prompt_hash", none.append))
    assert none == [] and results.column("prompt_hash").null_count == results.num_rows


@pytest.mark.parametrize("chunk", [1 << 16, 777])
@pytest.mark.parametrize("integer", [False, True])
def test_streamed_float_stats_equal_the_in_memory_ones_chunk_by_chunk(monkeypatch, chunk, integer):
    """The latency statistics and histogram, computed in chunks of ``_CHUNK`` values (the float32 values
    taken to float64 before the bin arithmetic), equal the in-memory statistics of the same values."""
    import numpy as np
    import pyarrow as pa

    from airflow_provider_vllm.steps.qa import metrics as m
    from airflow_provider_vllm.steps.qa import metrics_stream as ms

    monkeypatch.setattr(ms, "_SUBSAMPLE", 256)
    monkeypatch.setattr(ms, "_CHUNK", chunk)
    rng = np.random.default_rng(3)
    x = rng.exponential(700.0, 5_000).astype(np.float32)  # values that float32 rounds: lo, w are float64
    x[:7] = [0.1, 1e-3, 5e3, 5e3, 0.30000001, 1e4, 200.0]
    edges = np.arange(1, 40, dtype=np.float32) * np.float32(200.0)
    x[7 : 7 + 39] = np.nextafter(edges, np.float32(0))  # just under a bin edge
    if integer:
        x = np.floor(x).astype(np.float64)
    want = m._float_stats(pa.chunked_array([pa.array(x)]), integer=integer)
    got = ms._float_stats(x.copy(), float(x.astype(np.float64).sum()), integer=integer)
    assert got.pop("mean") == pytest.approx(want.pop("mean"), rel=1e-12)
    assert got == want and sum(got["histogram"]["counts"]) + got["histogram"].get("overflow", 0) == 5_000


def test_a_large_latency_buffer_keeps_every_value_across_growth_and_widening():
    """The latency buffer of a large run (an anonymous mapping of its own, past 4 MiB): float32 batches, a
    growth past a wrong capacity and a float64 batch (the buffer widens) keep every value, in order."""
    import numpy as np

    from airflow_provider_vllm.steps.qa.metrics_stream import ResultTally

    rng = np.random.default_rng(5)
    batches = [rng.random(900_000).astype(np.float32) * 1e4 for _ in range(2)] + [rng.random(700_000) * 1e4]
    t = ResultTally(capacity=1_500_000)  # 6 MB: a mapping; the second batch grows it
    assert not t._lat.flags.owndata and t._lat.flags.writeable
    for i, x in enumerate(batches):
        t._keep_latency(x, exact32=i < 2)
        assert t._lat.dtype == (np.float32 if i < 2 else np.float64)
    want = np.concatenate([b.astype(np.float64) for b in batches])
    assert t._n_lat == len(want) and np.array_equal(t._lat[: t._n_lat], want)
    t.latency_sum = float(want.sum())
    stats = t._latency_stats()
    assert stats["count"] == len(want) and stats["max"] == float(want.max())
    assert stats["p50"] == pytest.approx(float(np.quantile(want, 0.5)), rel=1e-12)


@pytest.mark.parametrize("hashes", [True, False])
def test_the_least_confident_rows_found_by_the_ranking_scan_equal_the_in_memory_ones(tmp_path, hashes):
    """With prompts answered differently (their rows ride along the sample's ranking scan, confidence with them)
    the least confident ids come from that scan: the same ids, in the same order, as ``ORDER BY confidence, id``
    in memory, with ties at the cut across labels, -0.0 equal to 0.0, and NaN, infinities, nulls and values
    outside [0, 1] counting as none; without prompt hashes (no ride) from a query of their own."""
    rnd = random.Random(11)
    odd = [0.25, 0.25, 0.25, -0.0, 0.0, float("nan"), float("inf"), -0.5, 1.5, None, 0.9, 0.7]
    recs = [
        ok_row(
            i,
            id=f"r{(i * 7919) % 2000}'x",  # ids out of order, with a quote
            label=rnd.choice(LABELS),
            confidence=odd[i % len(odd)] if i % 3 == 0 else rnd.choice([0.25, 0.5, 0.8, 1.0]),
            prompt_hash=(i % 40) if hashes else None,
        )
        for i in range(2000)
    ]
    results, errors = split(recs)
    kw = dict(spec=QASpec(sample_size=12, least_confident=7), labels=LABELS, structured=True)
    mem = evaluate(results, errors, **kw)
    streamed = _streamed(tmp_path, results, errors, **kw)
    a, b = mem.to_dict(), streamed.to_dict()
    least = a["metrics"]["confidence"]["least_confident_ids"]
    assert len(least) == 7 and least == b["metrics"]["confidence"]["least_confident_ids"]
    assert (a["metrics"]["consistency"] is not None) == hashes
    for d in (a, b):
        d["metrics"]["latency_ms"].pop("mean")
        d["metrics"]["confidence"].pop("mean")
    assert b == a
    assert str(streamed.sample.to_pylist()) == str(mem.sample.to_pylist())


@pytest.mark.parametrize("known", [False, True])
def test_the_streamed_consistency_examples_equal_pandas(tmp_path, known):
    """The examples' rows ride the ranking scan by a semi-join on the picked prompt hashes, grouped there by
    stratum, prompt and answer: each example equals a naive pandas computation (the 10 inconsistent prompts
    with the most rows, ties by hash; per prompt the 6 smallest ids and the distinct answers, no answer counting
    as one of its own), with a golden set (some of its ids absent from the run) or without one, and labels with
    no row (empty strata)."""
    from airflow_provider_vllm.steps.qa.reference import References

    rnd = random.Random(5)
    recs = []
    for i in range(3000):
        h = (i * 7) % 37  # 37 prompts; most answered one way, some two ways, some with no answer
        label = LABELS[h % 2] if rnd.random() < 0.9 or h % 5 == 0 else rnd.choice([*LABELS[:3], None])
        recs.append(ok_row(i, id=f"r{(i * 7919) % 3000:05d}", label=label, prompt_hash=h - 18, confidence=0.5))
    results, errors = split(recs)
    con = duckdb.connect()
    pq.write_table(results, tmp_path / "r.parquet", row_group_size=700)
    pq.write_table(errors, tmp_path / "e.parquet", row_group_size=50)
    con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{tmp_path / 'r.parquet'}')")
    con.execute(f"CREATE VIEW e AS SELECT * FROM read_parquet('{tmp_path / 'e.parquet'}')")
    refs = References()
    if known:
        con.execute(
            "CREATE TABLE ref AS SELECT id, label FROM "
            "(VALUES ('r00001', 'a'), ('r00002', 'b'), ('absent', 'a')) t(id, label)"
        )
        refs.run_source, refs.known = "golden_set", {"golden_set": 3}
    report = evaluate_stream(
        con,
        result_rows=results.num_rows,
        batch_rows=512,
        refs=refs,
        spec=QASpec(sample_size=20),
        labels=LABELS,
        structured=True,
    )
    got = report.metrics["consistency"]["examples"]
    df = results.to_pandas()
    df["answer"] = df["label"].fillna("\0none")
    per = df.groupby("prompt_hash").agg(n=("id", "size"), k=("answer", "nunique"))
    bad = per[(per.n > 1) & (per.k > 1)].reset_index().sort_values(["n", "prompt_hash"], ascending=[False, True])
    picked = sorted(bad.prompt_hash.head(10))
    want = [
        {
            "ids": sorted(df[df.prompt_hash == h].id)[:6],
            "answers": sorted({a for a in df[df.prompt_hash == h].label if isinstance(a, str)}),
            "answers_total": len({a for a in df[df.prompt_hash == h].label if isinstance(a, str)}),
        }
        for h in picked
    ]
    assert len(want) == 10 and got == want
    assert (report.metrics.get("quality") is not None) == known


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "kind", ["one", "signed_zeros", "ties", "negative", "ulps", "huge", "sorted", "uniform", "same_top_bits"]
)
def test_radix_selects_the_exact_order_statistics(kind, dtype):
    """``Radix``: the values at the quantiles' ranks (and the ends) equal a full sort's, for values in any order and
    batches, negative, tied, one ulp apart (the keys differ only in their last bits), huge, and all sharing their
    top 16 key bits; -0.0 counts as 0.0. Each ``select`` pass reads the values in another order than the first."""
    rng = np.random.default_rng(11)
    n = 40_000
    x = {
        "one": np.array([3.5]),
        "signed_zeros": np.array([-0.0, 0.0, -0.0, 1.0, -1.0]),
        "ties": rng.integers(-3, 3, n).astype(np.float64),
        "negative": -rng.exponential(5, n),
        "ulps": 1 + np.arange(n) * np.finfo(dtype).eps,
        "huge": rng.standard_normal(n) * 1e30,
        "sorted": np.arange(n, dtype=np.float64),
        "uniform": rng.random(n),
        "same_top_bits": 1000 + rng.random(n) * 1e-3,
    }[kind].astype(dtype)
    radix = Radix(dtype)
    for batch in np.array_split(x, 7):
        radix.add(batch)
    assert radix.n == len(x) and radix.mn == float(x.min()) and radix.mx == float(x.max())
    ranks = sorted({r for q in (0.5, 0.9, 0.99) for r in ms._ranks(q, len(x))} | {0, len(x) - 1})
    passes = []

    def scan():
        passes.append(1)
        return iter(np.array_split(rng.permutation(x), 3))

    got = radix.select(ranks, scan)
    want = np.sort(x)
    assert got == {r: float(want[r]) for r in ranks}
    assert all(str(v) != "-0.0" for v in got.values())
    assert len(passes) == (1 if dtype == np.float32 else 3)


def test_radix_refuses_a_pass_that_saw_other_values_and_ranks_out_of_range():
    x = np.arange(1000, dtype=np.float32)
    radix = Radix(np.float32)
    radix.add(x)
    # a value missing or added where the rank is (a pass checks the counts of the keys it narrows down)
    with pytest.raises(ValueError, match="other values than the first"):
        radix.select([500], lambda: iter([np.delete(x, 500)]))
    with pytest.raises(ValueError, match="other values than the first"):
        radix.select([500], lambda: iter([x, np.float32([500.5])]))
    assert radix.select([500], lambda: iter([x[::-1]])) == {500: 500.0}
    with pytest.raises(ValueError, match="outside"):
        radix.select([1000], lambda: iter([x]))
    with pytest.raises(ValueError, match="float32 or float64"):
        Radix(np.int64)
    with pytest.raises(ValueError, match="a batch of float64"):
        radix.add(x.astype(np.float64))


@pytest.mark.parametrize("column_type", [pa.float32(), pa.float64(), pa.int64()])
def test_latency_statistics_from_passes_equal_the_kept_ones(tmp_path, monkeypatch, column_type):
    """A run past ``KEEP_LATENCIES`` rows keeps no latency: its statistics (quantiles, histogram, count, min, max)
    come from passes over the column and equal those of the kept latencies, for float32, float64 and integer
    columns with nulls, NaN and infinities among the values; with or without a column fetched alongside."""
    rng = np.random.default_rng(8)
    n = 20_000
    lat = rng.exponential(300.0, n) * rng.choice([1, 1, 1, 40], n)  # a heavy tail: the overflow bin
    lat = pa.array(lat).cast(column_type, safe=False)
    values = lat.to_pylist()
    if not pa.types.is_integer(column_type):
        for i in range(0, n, 101):
            values[i] = [None, float("nan"), float("inf"), float("-inf")][i % 4]
    else:
        values[::101] = [None] * len(values[::101])
    table = pa.table({"latency_ms": pa.array(values, column_type), "confidence": pa.array(rng.random(n), pa.float32())})
    pq.write_table(table, tmp_path / "r.parquet", row_group_size=1500)
    pq.write_table(pa.table({"error_code": pa.array([], pa.string())}), tmp_path / "e.parquet")
    con = duckdb.connect()
    con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{tmp_path / 'r.parquet'}')")
    con.execute(f"CREATE VIEW e AS SELECT * FROM read_parquet('{tmp_path / 'e.parquet'}')")
    got = {}
    for also in (None, ("confidence", lambda c: None)):
        kept = ResultTally(n)
        kept._count_results = lambda con, vectors=None: None  # only the latencies here
        kept.tally(con, batch_rows=999, also=also)
        monkeypatch.setattr(ms, "KEEP_LATENCIES", 0)
        passed = ResultTally(n)
        passed._count_results = lambda con, vectors=None: None
        passed._keep_latency = _never
        passed.tally(con, batch_rows=777, also=also)
        monkeypatch.setattr(ms, "KEEP_LATENCIES", 1 << 27)
        want, got[also is None] = kept._latency_stats(), passed._latency_stats()
        assert got[also is None].pop("mean") == pytest.approx(want.pop("mean"), rel=1e-12)
        assert got[also is None] == want and want["histogram"].get("overflow")
    assert got[True] == got[False]


def test_long_answers_are_cut_in_the_examples_and_counted_by_their_whole_value(tmp_path):
    """Free-text answers of 100,000 characters (a long generation): each example answer is cut to EXAMPLE_CHARS
    with '…' (the report lists up to 100 of them), equal on both paths. Two answers that differ only after the cut
    are two answers (listed twice); a short one is shown whole; a multi-byte text is cut by characters."""
    from airflow_provider_vllm.steps.qa.confidence import EXAMPLE_CHARS

    long_a, long_b = "é" * 100_000 + "a", "é" * 100_000 + "b"
    outs = [long_a, long_b, "short", long_a, long_b, "short"]
    recs = [ok_row(i, label=None, output=o, prompt_hash=9, confidence=0.5) for i, o in enumerate(outs)]
    results, errors = split(recs)
    pq.write_table(results, tmp_path / "r.parquet")
    pq.write_table(errors, tmp_path / "e.parquet")
    spec = QASpec(sample_size=4)
    cut = "é" * (EXAMPLE_CHARS - 1) + "…"
    want = [{"ids": [f"r{i}" for i in range(6)], "answers": ["short", cut, cut], "answers_total": 3}]
    mem = evaluate(results, errors, spec=spec, labels=None, structured=False, compared="output")
    assert mem.metrics["consistency"]["examples"] == want
    con = duckdb.connect()
    con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{tmp_path / 'r.parquet'}')")
    con.execute(f"CREATE VIEW e AS SELECT * FROM read_parquet('{tmp_path / 'e.parquet'}')")
    streamed = evaluate_stream(con, result_rows=6, spec=spec, labels=None, structured=False, compared="output")
    con.close()
    assert streamed.metrics["consistency"]["examples"] == want


def test_a_prompt_sent_very_often_costs_a_group_per_answer_not_a_row_per_row(tmp_path):
    """One prompt sent 400,000 times and answered 12 ways (a choice job whose greedy answers moved with the batch,
    or a template over the same text). Its example lists the 6 smallest ids and the first 10 answers with the
    total, equal on both paths and to pandas. The streamed QA runs under a DuckDB memory limit that the rows of
    the example (400,000 ids and answers, about 20 MB as a list) would exceed: the scan keeps a group per
    (stratum, prompt, answer) instead."""
    n, answers = 400_000, [f"answer {k:02d}" for k in range(12)]
    one, errors = split([ok_row(0, label="x", prompt_hash=7, confidence=0.5)])
    results = one.take(pa.array(np.zeros(n, np.int64)))
    rng = np.random.default_rng(3)
    ids = pa.array([f"p{i:07d}" for i in rng.permutation(n)], pa.string())
    labels = pa.array(np.array(answers, dtype=object)[rng.integers(0, len(answers), n)], pa.string())
    results = results.set_column(results.schema.get_field_index("id"), "id", ids)
    results = results.set_column(results.schema.get_field_index("label"), "label", labels)
    pq.write_table(results, tmp_path / "r.parquet", row_group_size=50_000)
    pq.write_table(errors, tmp_path / "e.parquet")
    con = duckdb.connect(config={"memory_limit": "24MB", "threads": 2})
    con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{tmp_path / 'r.parquet'}')")
    con.execute(f"CREATE VIEW e AS SELECT * FROM read_parquet('{tmp_path / 'e.parquet'}')")
    spec = QASpec(sample_size=20)
    streamed = evaluate_stream(con, result_rows=n, spec=spec, labels=None, structured=False)
    con.close()
    want = [{"ids": [f"p{i:07d}" for i in range(6)], "answers": answers[:10], "answers_total": 12}]
    assert streamed.metrics["consistency"]["examples"] == want
    assert streamed.metrics["consistency"]["inconsistent_rows"] == n
    mem = evaluate(results, errors, spec=spec, labels=None, structured=False)
    assert mem.metrics["consistency"]["examples"] == want
