import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_provider_vllm.core.errors import DatasetError, SpecError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.plan.planner import build_plan, plan_job
from airflow_provider_vllm.worker.shard import read_shard_rows
from tests.support.data import make_spec, write_parquet
from tests.support.security import base_doc


def _all_rows(spec, plan):
    root = Storage(plan.input_root)
    ids = []
    for s in plan.shards:
        b = read_shard_rows(spec, plan, s, root)
        assert len(b) == s.rows
        ids += b.ids
    return ids


def test_duplicate_ids_named(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", ["x", "y", "x", "z", "y", "x"], ["t"] * 6)
    with pytest.raises(DatasetError) as e:
        build_plan(make_spec(tmp_path / "in", tmp_path / "out"))
    assert "3 duplicate id(s)" in str(e.value) and "'x' x3" in str(e.value)


def test_duplicates_across_files(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", ["1", "2"], ["t", "t"])
    write_parquet(tmp_path / "in" / "b.parquet", ["2", "3"], ["t", "t"])
    with pytest.raises(DatasetError, match="duplicate"):
        build_plan(make_spec(tmp_path / "in", tmp_path / "out"))


def test_plan_is_written_once_and_guards_the_prefix(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [str(i) for i in range(50)], ["t"] * 50)
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    p1 = plan_job(spec)
    p2 = plan_job(spec)
    assert p1 == p2
    assert json.loads((tmp_path / "out" / PLAN_FILE).read_text())["fingerprint"] == p1.fingerprint
    other = make_spec(tmp_path / "in", tmp_path / "out", sampling={"max_tokens": 3})
    with pytest.raises(SpecError, match="already holds a run"):
        plan_job(other)


def test_a_rerun_with_a_json_schema_reordered_does_not_reuse_the_prefix(tmp_path):
    """vLLM writes a schema's properties in its order: the old plan (and its answers) is another spec's."""
    write_parquet(tmp_path / "in" / "a.parquet", [str(i) for i in range(20)], ["t"] * 20)
    props = {"label": {"enum": ["a", "b"]}, "reason": {"type": "string"}}

    def spec(order):
        schema = {"type": "object", "properties": {k: props[k] for k in order}}
        return make_spec(tmp_path / "in", tmp_path / "out", sampling={"structured": {"json_schema": schema}})

    plan_job(spec(["reason", "label"]))
    assert plan_job(spec(["reason", "label"])).spec_hash == spec(["reason", "label"]).content_hash()
    with pytest.raises(SpecError, match="already holds a run"):
        plan_job(spec(["label", "reason"]))


def test_length_bucketing_isolates_long_rows(tmp_path):
    texts = ["short text"] * 200
    for i in (5, 77, 150):
        texts[i] = "long " * 400
    write_parquet(tmp_path / "in" / "a.parquet", [f"r{i}" for i in range(200)], texts)
    spec = make_spec(tmp_path / "in", tmp_path / "out", sharding={"target_rows": 50, "long_row_tokens": 100})
    plan = build_plan(spec)
    long = [s for s in plan.shards if s.bucket == "long"]
    assert sum(s.rows for s in long) == 3
    ids = _all_rows(spec, plan)
    assert sorted(ids) == sorted(f"r{i}" for i in range(200))
    long_ids = {i for s in long for i in read_shard_rows(spec, plan, s, Storage(plan.input_root)).ids}
    assert long_ids == {"r5", "r77", "r150"}


def test_target_tokens(tmp_path):
    texts = ["x" * 400] * 100  # ~100 tokens each
    write_parquet(tmp_path / "in.parquet", [str(i) for i in range(100)], texts, row_group_size=10)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "o", sharding={"target_tokens": 2000, "target_rows": None})
    plan = build_plan(spec)
    assert len(plan.shards) == 5
    assert all(s.rows == 20 for s in plan.shards)


@st.composite
def datasets(draw):
    n_files = draw(st.integers(1, 4))
    sizes = [draw(st.integers(0, 60)) for _ in range(n_files)]
    lengths = [
        [draw(st.integers(0, 3000)) if draw(st.booleans()) else draw(st.integers(0, 40)) for _ in range(n)]
        for n in sizes
    ]
    rg = draw(st.integers(1, 25))
    target = draw(st.integers(1, 80))
    max_shards = draw(st.integers(1, 12))
    bucket = draw(st.sampled_from([None, 200]))
    fmt = draw(st.sampled_from(["parquet", "jsonl"]))
    return lengths, rg, target, max_shards, bucket, fmt


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(datasets())
@example(([[]], 1, 1, 1, None, "parquet"))  # empty input
@example(([[7]], 1, 1, 1, None, "jsonl"))  # a single row
@example(([[3000], [5, 5], []], 1, 1, 2, 200, "parquet"))  # one long row, an empty file, bucketing at the cap
def test_property_every_row_in_exactly_one_shard(tmp_path_factory, data):
    lengths, rg, target, max_shards, bucket, fmt = data
    d = tmp_path_factory.mktemp("ds")
    expected, k = [], 0
    (d / "in").mkdir()
    for f, lens in enumerate(lengths):
        ids = [f"id{k + j}" for j in range(len(lens))]
        k += len(lens)
        expected += ids
        texts = ["y" * n if n else "z" for n in lens]
        if fmt == "parquet":
            pq.write_table(
                pa.table({"id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string())}),
                d / "in" / f"part-{f}.parquet",
                row_group_size=rg,
            )
        else:
            (d / "in" / f"part-{f}.jsonl").write_text(
                "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts))
            )
    spec = make_spec(
        d / "in", d / "out", sharding={"target_rows": target, "max_shards": max_shards, "long_row_tokens": bucket}
    )
    plan = build_plan(spec)
    again = build_plan(spec)
    assert [s.model_dump() for s in plan.shards] == [s.model_dump() for s in again.shards]  # deterministic
    assert len(plan.shards) <= max_shards
    assert plan.total_rows == len(expected)
    assert all(s.rows > 0 for s in plan.shards)
    assert len({s.shard_id for s in plan.shards}) == len(plan.shards)
    got = _all_rows(spec, plan)
    assert sorted(got) == sorted(expected)  # every row once, none twice
    assert len(got) == len(set(got))
    if not expected:
        assert plan.shards == []


def test_footer_sizing_never_builds_per_row_arrays_and_cuts_the_same(tmp_path, monkeypatch):
    """Sized by rows from Parquet footers, the planner keeps one token estimate per row group
    (memory bounded by row groups, not rows: 100M-row inputs) and cuts exactly the shards that
    per-row arrays would."""
    from airflow_provider_vllm.core.formats.base import RowRuns
    from airflow_provider_vllm.steps.plan import planner as plan_mod

    for f in range(3):
        n = 500 + 137 * f
        write_parquet(
            tmp_path / "in" / f"p{f}.parquet",
            [f"{f}-{i}" for i in range(n)],
            ["t" * (1 + (i // 50) % 9 * 20) for i in range(n)],
            row_group_size=50 + 13 * f,
        )
    spec = make_spec(tmp_path / "in", tmp_path / "out", sharding={"target_rows": 97})
    monkeypatch.setattr(RowRuns, "expand", lambda self: pytest.fail("expanded runs into a per-row array"))
    runs = plan_mod.build_plan(spec)
    monkeypatch.undo()
    real = plan_mod._row_tokens
    monkeypatch.setattr(
        plan_mod,
        "_row_tokens",
        lambda scan, cpt, lrt: plan_mod.RowTokens(
            real(scan, cpt, lrt).values if scan.runs is None else plan_mod.estimate_tokens(scan.chars, cpt)
        ),
    )
    per_row = plan_mod.build_plan(spec).model_dump()
    assert runs.model_dump() == per_row
    assert len(runs.shards) == 20 and len({s.est_tokens for s in runs.shards}) > 3
    assert runs.est_tokens == sum(s.est_tokens for s in runs.shards)


@pytest.mark.reliability
def test_non_empty_foreign_output_prefix_is_refused(allowed):
    from airflow_provider_vllm.steps.plan.planner import plan_job

    (allowed / "out").mkdir()
    (allowed / "out" / "someone-elses.parquet").write_bytes(b"PAR1")
    with pytest.raises(SpecError, match="not empty"):
        plan_job(JobSpec.load(base_doc(allowed)))
    assert not (allowed / "out" / "_plan.json").exists()


@pytest.mark.reliability
def test_a_plan_killed_while_writing_its_plan_file_is_planned_again(tmp_path):
    """kill -9 of a real plan process with _plan.json's temp copy half written: the rerun failed for good ("output
    ... is not empty"), the temp copy counting as another run's file; it plans now."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from airflow_provider_vllm.core import faults
    from tests.support.ledger import record_fault

    write_parquet(tmp_path / "in.parquet", ["a", "b", "c"], ["x", "y", "z"])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    code = (
        "import sys; from airflow_provider_vllm.core.spec import JobSpec; "
        "from airflow_provider_vllm.steps.plan.planner import plan_job; plan_job(JobSpec.load(sys.argv[1]))"
    )
    env = {**os.environ, faults.ENV: "plan.mid_marker=kill", "PYTHONPATH": str(Path(__file__).resolve().parents[4])}
    p = subprocess.run(
        [sys.executable, "-c", code, spec.model_dump_json()], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == -9, p.stderr[-2000:]
    left = sorted(f.name for f in (tmp_path / "out").iterdir())
    assert len(left) == 1 and left[0].startswith(PLAN_FILE + ".tmp-")
    plan = plan_job(spec)
    assert plan.total_rows == 3 and (tmp_path / "out" / PLAN_FILE).exists()
    record_fault("kill9.plan.mid_marker", 3, level="process")
    (tmp_path / "out" / "_plan.json.tmp-other").write_text("{}")  # not the storage layer's temp name: foreign
    (tmp_path / "out" / PLAN_FILE).unlink()
    with pytest.raises(SpecError, match=r"is not empty \(e.g. _plan.json.tmp-other\)"):
        plan_job(spec)


def test_an_output_prefix_flooded_where_a_killed_plan_leaves_files_is_refused_after_listing_its_bound(
    tmp_path, monkeypatch
):
    """A new run's output prefix is walked for files that are not a killed plan's own: one holding more entries than
    ``OUTPUT_LISTED_PER_SHARD`` per ``sharding.max_shards`` plus ``storage.LISTING_MAX`` is refused as not empty
    (naming the bound) without being listed further, even where all of them sit where a killed plan leaves files;
    the code before walked every one of them."""
    from airflow_provider_vllm.steps.plan import planner
    from airflow_provider_vllm.steps.plan.planner import PROBE_DIR

    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["x", "y"])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    monkeypatch.setattr(planner, "LISTING_MAX", 2, raising=False)
    monkeypatch.setattr(planner, "OUTPUT_LISTED_PER_SHARD", 0, raising=False)
    (tmp_path / "out" / PROBE_DIR).mkdir(parents=True)
    for i in range(2):
        (tmp_path / "out" / PROBE_DIR / f"planted-{i}").write_text("")
    with pytest.raises(SpecError, match=r"is not empty \(e.g. more than 2 entries\)"):
        plan_job(spec)
    (tmp_path / "out" / PROBE_DIR / "planted-0").unlink()
    assert plan_job(spec).total_rows == 2
