"""QA sample: deterministic, seeded, stratified; allocation over strata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa import sample as sample_mod
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from airflow_provider_vllm.steps.qa.sample import SAMPLE_KEY, allocate, sample_key
from tests.support.qa_rows import LABELS, empty_tables, err_row, labelled_tables, ok_row, sample_ids, split


def test_sample_deterministic_and_seeded():
    results, errors = labelled_tables(500, 40)
    a = evaluate(results, errors, spec=QASpec(sample_size=50, seed=1), labels=LABELS, structured=True)
    b = evaluate(results, errors, spec=QASpec(sample_size=50, seed=1), labels=LABELS, structured=True)
    c = evaluate(results, errors, spec=QASpec(sample_size=50, seed=2), labels=LABELS, structured=True)
    assert sample_ids(a) == sample_ids(b)
    assert set(sample_ids(a)) != set(sample_ids(c))
    assert a.sample.num_rows == 50
    # order of the input does not matter
    rev = evaluate(
        results.take(pa.array(range(499, -1, -1))),
        errors,
        spec=QASpec(sample_size=50, seed=1),
        labels=LABELS,
        structured=True,
    )
    assert sample_ids(rev) == sample_ids(a)
    # errors are in the sample, about 10%
    st_ = a.sample.column("status").to_pylist()
    assert st_.count("error") == 5 and st_.count("ok") == 45
    assert a.metrics["sample"]["ids"] == sample_ids(a)


def test_sample_stable_across_processes(tmp_path):
    results, errors = labelled_tables(300, 10)
    pq.write_table(results, tmp_path / "r.parquet")
    pq.write_table(errors, tmp_path / "e.parquet")
    rep = evaluate(results, errors, spec=QASpec(sample_size=30, seed=7), labels=LABELS, structured=True)
    code = textwrap.dedent(
        f"""
        import json, sys
        import pyarrow.parquet as pq
        from airflow_provider_vllm.steps.qa.evaluate import evaluate
        from airflow_provider_vllm.core.spec import QASpec
        r = pq.read_table({str(tmp_path / "r.parquet")!r})
        e = pq.read_table({str(tmp_path / "e.parquet")!r})
        rep = evaluate(r, e, spec=QASpec(sample_size=30, seed=7), labels={LABELS!r}, structured=True)
        print(json.dumps(rep.sample.column("id").to_pylist()))
        """
    )
    env = {"PYTHONHASHSEED": "123", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout) == sample_ids(rep)


def test_sample_keys_are_duckdb_hash_of_id_and_seed():
    results, errors = labelled_tables(200)
    rep = evaluate(results, errors, spec=QASpec(sample_size=10, seed=3), labels=LABELS, structured=True)
    ids = sample_ids(rep)
    assert rep.sample.column("qa_sample_key").to_pylist() == [sample_key(3, i) for i in ids]
    assert int(sample_key(3, "r1"), 16) == duckdb.sql("SELECT hash(xor(hash('r1'), hash('3')))").fetchall()[0][0]
    assert rep.metrics["sample"]["key"] == SAMPLE_KEY == "duckdb-hash-v1"
    assert rep.metrics["sample"]["duckdb"] == duckdb.__version__
    assert sample_key(2**70, "r1") != sample_key(-(2**70), "r1")  # any int seed
    # within each stratum the chosen ids are those with the smallest keys
    all_ids = results.column("id").to_pylist()
    all_labels = results.column("label").to_pylist()
    for lab in LABELS:
        chosen = [i for i, s in zip(ids, rep.sample.column("qa_stratum").to_pylist()) if s == lab]
        pool = sorted((sample_key(3, i) for i, lb in zip(all_ids, all_labels) if lb == lab))
        assert sorted(sample_key(3, i) for i in chosen) == pool[: len(chosen)]


def test_ties_at_the_cut_go_by_id_whatever_the_scan_order(monkeypatch):
    """A key collision at a stratum's cut (64-bit: practically never) is forced with a 3-valued key."""
    monkeypatch.setattr(sample_mod, "_KEY_SQL", "(hash(CAST(id AS VARCHAR), $seed) % 3)")
    results, errors = labelled_tables(300, 0)
    spec = QASpec(sample_size=12, seed=5)
    a = evaluate(results, errors, spec=spec, labels=LABELS, structured=True)
    b = evaluate(results.take(pa.array(range(299, -1, -1))), errors, spec=spec, labels=LABELS, structured=True)
    assert sample_ids(a) == sample_ids(b) and len(sample_ids(a)) == 12
    keys = dict(zip(results.column("id").to_pylist(), sample_mod.sample_keys(5, results.column("id").to_pylist())))
    for lab in LABELS:
        chosen = [i for i, s in zip(sample_ids(a), a.sample.column("qa_stratum").to_pylist()) if s == lab]
        pool = sorted((keys[i], i) for i, lb in zip(keys, results.column("label").to_pylist()) if lb == lab)
        assert [(keys[i], i) for i in chosen] == pool[: len(chosen)]


# (0.001, 1e-6): too few keys pass the filter, those strata are scanned again
@pytest.mark.parametrize(("share", "margin"), [(0.25, 0.01), (0.001, 1e-6)])
def test_the_prefilter_picks_what_a_whole_scan_picks(monkeypatch, share, margin):
    recs = [ok_row(i, label=LABELS[i % 3] if i % 50 else None) for i in range(3000)]
    recs += [err_row(i, ["ENGINE_ERROR", "EMPTY_INPUT"][i % 2]) for i in range(400)]
    results, errors = split(recs)
    kw = dict(spec=QASpec(sample_size=40, seed=11), labels=LABELS, structured=True)
    monkeypatch.setattr(sample_mod, "_PREFILTER_MAX", 0.0)  # every stratum scanned whole
    whole = evaluate(results, errors, **kw)
    calls = []
    real = sample_mod._top_query
    monkeypatch.setattr(sample_mod, "_top_query", lambda *a: calls.append(a[4]) or real(*a))
    monkeypatch.setattr(sample_mod, "_PREFILTER_MAX", share)
    monkeypatch.setattr(sample_mod, "_MARGIN", margin)
    filtered = evaluate(results, errors, **kw)
    assert sample_ids(filtered) == sample_ids(whole) and len(sample_ids(whole)) == 40
    assert all("$cut" in w for w in calls[:1]) and len(calls) == (2 if share > 0.1 else 4)  # ok, errors (+ again)
    assert filtered.sample.column("qa_sample_key").to_pylist() == whole.sample.column("qa_sample_key").to_pylist()


def test_sample_stratified_every_label_present():
    # a very skewed distribution: the rare labels still show up
    recs = [ok_row(i, label="positive") for i in range(1000)]
    recs += [ok_row(1000 + i, label="negative") for i in range(3)]
    recs += [ok_row(2000, label="neutral")]
    results, errors = split(recs)
    rep = evaluate(results, errors, spec=QASpec(sample_size=3), labels=LABELS, structured=True)
    assert sorted(rep.sample.column("label").to_pylist()) == sorted(LABELS)
    rep = evaluate(results, errors, spec=QASpec(sample_size=40), labels=LABELS, structured=True)
    assert set(rep.sample.column("label").to_pylist()) == set(LABELS)
    assert rep.metrics["sample"]["stratified_by"] == "label"


def test_sample_by_shard_without_labels():
    results, errors = split([ok_row(i, shard_id=f"s{i % 4}") for i in range(400)])
    rep = evaluate(results, errors, spec=QASpec(sample_size=8), labels=None, structured=False)
    assert rep.metrics["sample"]["stratified_by"] == "shard_id"
    assert rep.metrics["sample"]["allocation"] == {"s0": 2, "s1": 2, "s2": 2, "s3": 2}


def test_sample_larger_than_rows():
    results, errors = labelled_tables(7, 3)
    rep = evaluate(results, errors, spec=QASpec(sample_size=500), labels=LABELS, structured=True)
    assert rep.sample.num_rows == 10
    assert sorted(sample_ids(rep)) == sorted([f"r{i}" for i in range(7)] + [f"e{i}" for i in range(3)])


def test_sample_size_zero_and_only_errors():
    results, errors = labelled_tables(20, 5)
    assert evaluate(results, errors, spec=QASpec(sample_size=0), labels=LABELS, structured=True).sample.num_rows == 0
    r0, _ = empty_tables()
    rep = evaluate(r0, errors, spec=QASpec(sample_size=3), labels=LABELS, structured=True)
    assert rep.sample.num_rows == 3 and set(rep.sample.column("status").to_pylist()) == {"error"}
    assert rep.metrics["rates"]["error_rate"]["value"] == 1.0 and rep.status == "fail"


def test_allocate():
    assert allocate({"a": 90, "b": 9, "c": 1}, 10) == {"a": 8, "b": 1, "c": 1}
    assert allocate({"a": 50, "b": 50}, 3) in ({"a": 2, "b": 1}, {"a": 1, "b": 2})
    assert allocate({"a": 5, "b": 1, "c": 0}, 2) == {"a": 1, "b": 1, "c": 0}
    assert allocate({"a": 5, "b": 3, "c": 1}, 1) == {"a": 1, "b": 0, "c": 0}
    assert allocate({"a": 2, "b": 2}, 100) == {"a": 2, "b": 2}
    assert sum(allocate({i: i + 1 for i in range(50)}, 200).values()) == 200


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    labels=st.lists(st.sampled_from(["a", "b", "c", "d", None]), min_size=0, max_size=60),
    n_err=st.integers(0, 15),
    sample_size=st.integers(0, 80),
    seed=st.integers(-5, 10**6),
)
def test_property_sample_size_unique_from_input(labels, n_err, sample_size, seed):
    recs = [ok_row(i, label=lab) for i, lab in enumerate(labels)]
    recs += [err_row(i, ["ENGINE_ERROR", "INVALID_ROW", "EMPTY_INPUT"][i % 3]) for i in range(n_err)]
    results, errors = split(recs)
    rep = evaluate(results, errors, spec=QASpec(sample_size=sample_size, seed=seed), labels=None, structured=True)
    ids = sample_ids(rep)
    n = len(labels) + n_err
    assert len(ids) == min(sample_size, n)
    assert len(set(ids)) == len(ids)
    assert set(ids) <= {r["id"] for r in recs}
    present = set(labels)
    if any(lab is not None for lab in labels) and sample_size - min(
        n_err, max(1, round(0.1 * sample_size)) if sample_size >= 2 and n_err else 0
    ) >= len(present):
        assert set(rep.sample.filter(pa.compute.equal(rep.sample["status"], "ok"))["qa_stratum"].to_pylist()) == present
