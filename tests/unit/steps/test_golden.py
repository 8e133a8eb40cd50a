"""Golden rows that ride along (steps/golden.py), with the fake engine: planned, inferred, merged and
scored apart from the input's rows; never in results/, errors/, changes/ or the cache, never counted
as input rows; a run that fails or is cut short anywhere converges on a rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.engine_identity import local_engine_identity
from airflow_provider_vllm.core.errors import CommitError, DatasetError, SpecError, TransientError
from airflow_provider_vllm.core.plan import PLAN_FILE
from airflow_provider_vllm.core.shard_names import shard_display_names
from airflow_provider_vllm.core.spec import RESERVED_ID_PREFIX
from airflow_provider_vllm.steps.golden import ERRORS_FILE, GOLDEN_IN, RESULTS_FILE, SUMMARY_FILE
from airflow_provider_vllm.steps.merge.changes import CHANGES
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import LABELS, PINNED_REVISION, make_spec, merge, shard_task, vouch_cache, write_parquet
from tests.support.fakes import FakeEngine
from tests.support.ledger import record_fault, record_malicious
from tests.support.reconcile import reconcile
from tests.support.security import PLANTED_KINDS, plant, untouched

N_IN, N_GOLD = 90, 45


def _golden_file(path: Path, n: int = N_GOLD, **over) -> Path:
    cols = {
        "id": [f"g{i:03d}" for i in range(n)],
        "text": [f"golden ticket {i} about {LABELS[i % 5]}" if i % 11 else "" for i in range(n)],  # some empty
        "label": [LABELS[(i * 3) % 5] for i in range(n)],
        "extra": list(range(n)),
    }
    cols.update(over)
    pq.write_table(pa.table(cols), path)
    return path


def _input(tmp_path: Path, run: str = "d1", ids=None, texts=None) -> Path:
    ids = ids or [f"t{i:03d}" for i in range(N_IN)]
    texts = texts or [f"ticket {i}: {LABELS[i % 5]}" for i in range(len(ids))]
    return write_parquet(tmp_path / run / "in" / "a.parquet", ids, texts)


def _spec(tmp_path: Path, run: str = "d1", **over):
    over.setdefault("sharding", {"target_rows": 40, "chunk_rows": 8})
    qa = {"reference": {"ride_along_uri": str(tmp_path / "golden.parquet")}, "sample_size": 10, **over.pop("qa", {})}
    return make_spec(tmp_path / run / "in", tmp_path / run / "out", qa=qa, **over)


def _run_shards(spec, plan, only=None):
    for s in plan.mapped_shards():
        if only is None or only(s):
            run_shard(
                shard_task(spec=spec, shard_id=s.shard_id), engine_factory=lambda sp: FakeEngine(sp, real_vllm=False)
            )


def _all(spec):
    plan = plan_job(spec)
    _run_shards(spec, plan)
    return plan, merge(spec).dump()


def _ids(folder: Path) -> list[str]:
    return [i for p in sorted(folder.glob("*.parquet")) for i in pq.read_table(p, columns=["id"]).column(0).to_pylist()]


def test_the_plan_adds_golden_rows_apart_from_the_input(tmp_path):
    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    plan = plan_job(spec)
    g = plan.golden
    assert plan.total_rows == N_IN and sum(s.rows for s in plan.shards) == N_IN  # the input's accounting
    assert g.rows == N_GOLD and sum(s.rows for s in g.shards) == N_GOLD and len(g.shards) == 2  # target_rows 40
    assert all(s.shard_id.startswith("golden-") for s in g.shards)
    golden_in = pq.read_table(Path(spec.io.output_uri) / g.input_file.path)
    assert golden_in.column_names == ["id", "text", "_vllm_golden_label"]  # the template's columns, no extras
    assert all(i.startswith(RESERVED_ID_PREFIX) for i in golden_in.column("id").to_pylist())
    summaries = plan.mapped_shards()
    assert [bool(s.golden) for s in summaries] == [False] * len(plan.shards) + [True] * 2
    assert shard_display_names(summaries)[-2:] == ["golden rows 0, 22 rows", "golden rows 1, 23 rows"]
    assert json.loads((Path(spec.io.output_uri) / PLAN_FILE).read_text())["golden"]["rows"] == N_GOLD
    assert plan_job(spec).golden == g  # a rerun finds the same plan


def test_golden_rows_are_inferred_merged_and_scored_but_never_published(tmp_path):
    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    plan, summary = _all(spec)
    out = Path(spec.io.output_uri)
    rec = reconcile(out, [f"t{i:03d}" for i in range(N_IN)])
    assert rec.clean, str(rec)  # every input id exactly once, nothing else in results/ or errors/
    assert summary["rows"] == N_IN and summary["ok_rows"] + summary["error_rows"] == N_IN
    g = summary["golden"]
    assert g["rows"] == N_GOLD and g["ok_rows"] + g["error_rows"] == N_GOLD and g["error_rows"] == 5  # empty texts
    golden_ids = _ids(out / "golden")
    assert sorted(golden_ids) == sorted(f"{RESERVED_ID_PREFIX}g{i:03d}" for i in range(N_GOLD))
    for folder in ("results", "errors"):
        assert not any(i.startswith(RESERVED_ID_PREFIX) for i in _ids(out / folder))
    assert json.loads((out / SUMMARY_FILE).read_text())["files"] == {"results": RESULTS_FILE, "errors": ERRORS_FILE}

    report, _ = qa_run(spec)
    q = report.metrics["quality"]
    ride = q["sources"]["ride_along"]
    res = pq.read_table(out / RESULTS_FILE).to_pylist()
    truth = {f"{RESERVED_ID_PREFIX}g{i:03d}": LABELS[(i * 3) % 5] for i in range(N_GOLD)}
    right = sum(r["label"] == truth[r["id"]] for r in res)
    assert (ride["count"], ride["of"], ride["known"]) == (right, N_GOLD, N_GOLD) and q["labelled"] == N_GOLD
    assert q["locations"] == {"ride_along": str(tmp_path / "golden.parquet")}
    sample_ids = report.sample.column("id").to_pylist()
    assert not any(i.startswith(RESERVED_ID_PREFIX) for i in sample_ids)  # the review sample is the run's
    assert report.metrics["total"] == N_IN  # the plumbing checks count the input's rows only


def test_no_golden_id_in_changes_or_the_cache_across_two_nights(tmp_path):
    _golden_file(tmp_path / "golden.parquet")
    over = {
        "cache": {"uri": str(tmp_path / "cache")},
        "model": {"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
    }
    for run, prev in (("d1", None), ("d2", "d1")):
        _input(tmp_path, run)
        spec = _spec(tmp_path, run, changes={"previous_uri": str(tmp_path / prev / "out") if prev else None}, **over)
        plan = plan_job(spec, engine_identity=local_engine_identity())  # what the in-process workers seal
        _run_shards(spec, plan)
        summary = merge(spec).dump()
        qa_run(spec)
        vouch_cache(spec)  # published: its entry serves the next night
        assert summary["golden"]["rows"] == N_GOLD
    # night 2: every input row from the cache, no shard of the input; the golden rows inferred again
    assert plan.cache.hits == N_IN and plan.shards == [] and plan.golden.rows == N_GOLD
    changes = pq.read_table(tmp_path / "d2" / "out" / CHANGES).column("id").to_pylist()
    assert len(changes) == N_IN and not any(i.startswith(RESERVED_ID_PREFIX) for i in changes)
    cached = [
        i
        for p in (tmp_path / "cache" / "entries").rglob("*.parquet")
        for i in pq.read_table(p, columns=["source_id"]).column(0).to_pylist()
    ]
    assert len(cached) == N_IN and not any(i.startswith(RESERVED_ID_PREFIX) for i in cached)
    hits = pq.read_table(tmp_path / "d2" / "out" / "results", columns=["id", "cached_from"]).to_pylist()
    assert all(not r["id"].startswith(RESERVED_ID_PREFIX) for r in hits)
    golden_d2 = pq.read_table(tmp_path / "d2" / "out" / RESULTS_FILE).column("cached_from").to_pylist()
    assert set(golden_d2) == {None}  # inferred every night, never served from the cache


def test_merge_refuses_while_a_golden_shard_is_not_committed(tmp_path):
    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    plan = plan_job(spec)
    _run_shards(spec, plan, only=lambda s: s.shard_id != plan.golden.shards[1].shard_id)
    with pytest.raises(CommitError, match=r"1 of 2 shard\(s\) not committed: \['golden-00001"):
        merge(spec).dump()
    assert not (Path(spec.io.output_uri) / "_MERGED.json").exists()


@pytest.mark.parametrize(
    "point", ["chunk.mid_file", "commit.after_data", "golden.before_write", "golden.before_summary"]
)
def test_a_golden_run_cut_short_converges(tmp_path, set_faults, point):
    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    plan = plan_job(spec)
    golden = {s.shard_id for s in plan.golden.shards}
    _run_shards(spec, plan, only=lambda s: s.shard_id not in golden)
    set_faults(f"{point}=raise")
    with pytest.raises(faults.InjectedFault):
        _run_shards(spec, plan, only=lambda s: s.shard_id in golden)
        merge(spec).dump()
    set_faults("")
    _run_shards(spec, plan, only=lambda s: s.shard_id in golden)  # the retry
    summary = merge(spec).dump()
    out = Path(spec.io.output_uri)
    rec = reconcile(out, [f"t{i:03d}" for i in range(N_IN)])
    golden_ids = _ids(out / "golden")
    want = {f"{RESERVED_ID_PREFIX}g{i:03d}" for i in range(N_GOLD)}
    lost = len(rec.lost) + len(want - set(golden_ids))
    dup = len(rec.duplicates) + len(golden_ids) - len(set(golden_ids))
    record_fault(
        f"golden_rows_{point}", N_IN + N_GOLD, lost=lost, duplicates=dup, partial_visible=len(rec.partial_visible)
    )
    assert rec.clean and sorted(golden_ids) == sorted(want) and summary["golden"]["rows"] == N_GOLD


def test_a_plan_killed_after_the_golden_file_converges(tmp_path, set_faults):
    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    set_faults("golden.before_file=raise")
    with pytest.raises(faults.InjectedFault):
        plan_job(spec)
    set_faults("")
    assert not (Path(spec.io.output_uri) / PLAN_FILE).exists()
    plan = plan_job(spec)  # a non-empty prefix of the plan's own orphans is not another run's
    assert plan.golden.rows == N_GOLD and (Path(spec.io.output_uri) / GOLDEN_IN).is_dir()


def test_a_file_planted_at_the_golden_files_name_is_rewritten_not_pinned(tmp_path):
    """``_golden/`` is a plan's own (a killed plan leaves it; the next plan of the prefix goes on), and its file's
    name, ``input-<sha16>.parquet``, is predictable from the golden rows and the spec. A file at that name is kept
    only when it has the bytes the name says: one of the same size that another writer of the prefix put there is
    replaced, so the golden shards read the plan's rows and the merge's sha256 check of them passes."""
    import hashlib

    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path, "d0")
    name = plan_job(_spec(tmp_path, "d0")).golden.input_file  # the same golden rows and spec: the same file
    _input(tmp_path)
    spec = _spec(tmp_path)
    planted = Path(spec.io.output_uri) / name.path
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"\0" * name.bytes)  # the same size, other bytes
    plan = plan_job(spec)
    assert plan.golden.input_file.path == name.path
    assert hashlib.sha256(planted.read_bytes()).hexdigest() == plan.golden.input_file.sha256 == name.sha256
    _run_shards(spec, plan)
    assert merge(spec).golden.rows == N_GOLD


@pytest.mark.parametrize("kind", PLANTED_KINDS)
def test_a_link_fifo_or_folder_at_the_golden_files_name_is_replaced(tmp_path, kind):
    """A link (even to the very bytes the plan writes), a FIFO or a folder (with links out of the prefix inside)
    that another writer of the prefix put at ``_golden/input-<sha16>.parquet`` is replaced by the plan's own file,
    never followed, opened or read (before, each failed the plan); nothing outside that one name is touched."""
    import hashlib
    import os

    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path, "d0")
    name = plan_job(_spec(tmp_path, "d0")).golden.input_file  # the same golden rows and spec: the same file
    real = (tmp_path / "d0" / "out" / name.path).read_bytes()
    _input(tmp_path)
    spec = _spec(tmp_path)
    planted = Path(spec.io.output_uri) / name.path
    plant(planted, kind, tmp_path / "outside", real)
    plan = plan_job(spec)
    assert plan.golden.input_file.path == name.path and plan.golden.input_file.sha256 == name.sha256
    assert planted.is_file() and not planted.is_symlink()
    assert hashlib.sha256(planted.read_bytes()).hexdigest() == name.sha256
    assert untouched(tmp_path / "outside", real)
    assert not [n for n in os.listdir(planted.parent) if "displaced" in n]
    _run_shards(spec, plan)
    assert merge(spec).golden.rows == N_GOLD


def test_input_ids_may_not_use_the_reserved_prefix(tmp_path):
    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path, ids=["t1", f"{RESERVED_ID_PREFIX}x"], texts=["a", "b"])
    with pytest.raises(DatasetError, match="may not start with '_vllm_golden:'"):
        plan_job(_spec(tmp_path))
    assert not (tmp_path / "d1" / "out" / PLAN_FILE).exists()


@pytest.mark.parametrize(
    "over, message",
    [
        ({"text": None}, r"missing column\(s\) \['text'\]"),
        ({"id": ["g0"] * N_GOLD}, r"repeated id\(s\) in 'id'"),
        ({"label": [None] + ["bug"] * (N_GOLD - 1)}, r"1 row\(s\) without a label"),
    ],
)
def test_a_golden_file_that_cannot_be_trusted_is_refused_at_plan(tmp_path, over, message):
    cols = {k: v for k, v in over.items() if v is not None}
    path = _golden_file(tmp_path / "golden.parquet", **cols)
    if over.get("text", 1) is None:
        pq.write_table(pq.read_table(path).drop_columns(["text"]), path)
    _input(tmp_path)
    with pytest.raises(SpecError, match=message) as e:
        plan_job(_spec(tmp_path))
    assert "qa.reference.ride_along_uri" in str(e.value)


def test_an_input_column_of_labels_is_checked_before_any_worker(tmp_path):
    _input(tmp_path)
    spec = make_spec(tmp_path / "d1" / "in", tmp_path / "d1" / "out", qa={"reference": {"input_column": "truth"}})
    with pytest.raises(SpecError, match="qa.reference.input_column 'truth' is not a column of input file a.parquet"):
        plan_job(spec)


def test_qa_refuses_golden_outputs_that_do_not_match(tmp_path):
    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    _all(spec)
    out = Path(spec.io.output_uri)
    pq.write_table(pq.read_table(out / RESULTS_FILE).slice(0, 3), out / RESULTS_FILE)
    with pytest.raises(CommitError, match="does not match the merge.s sealed summary"):
        qa_run(spec)
    (out / RESULTS_FILE).unlink()
    with pytest.raises(CommitError, match="does not match the merge.s sealed summary"):
        qa_run(spec)


@pytest.mark.reliability
@pytest.mark.parametrize("target", ["results", "input", "summary"])
def test_qa_scores_only_golden_rows_the_merge_sealed(tmp_path, target):
    """A writer of the output prefix (no signing key) who rewrites the published golden answers, the plan's
    golden input (the known labels) or the unsealed golden/_golden.json (with matching sha256s) cannot raise
    the accuracy QA reports: QA checks both files against the sealed merge summary and the sealed plan."""
    import hashlib

    from airflow_provider_vllm.core.errors import VllmBatchError

    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    plan, _ = _all(spec)
    out = Path(spec.io.output_uri)
    truth = pq.read_table(out / plan.golden.input_file.path)
    if target == "results":  # every golden answer set to its known label
        t = pq.read_table(out / RESULTS_FILE)
        known = dict(zip(truth.column("id").to_pylist(), truth.column("_vllm_golden_label").to_pylist()))
        forged = t.set_column(
            t.schema.get_field_index("label"), "label", pa.array([known[i] for i in t.column("id").to_pylist()])
        )
        pq.write_table(forged, out / RESULTS_FILE)
        doc = json.loads((out / SUMMARY_FILE).read_text())
        doc["checksums"][RESULTS_FILE] = hashlib.sha256((out / RESULTS_FILE).read_bytes()).hexdigest()
        (out / SUMMARY_FILE).write_text(json.dumps(doc))
    elif target == "input":  # the known labels set to what the engine answered
        answers = {r["id"]: r["label"] for r in pq.read_table(out / RESULTS_FILE).to_pylist()}
        labels = [answers.get(i, "x") for i in truth.column("id").to_pylist()]
        pq.write_table(truth.set_column(2, "_vllm_golden_label", pa.array(labels)), out / plan.golden.input_file.path)
    else:  # the plain summary names other checksums: QA never reads it
        (out / SUMMARY_FILE).write_text("{}")
    if target == "summary":
        report, _ = qa_run(spec)
        assert report.metrics["quality"]["labelled"] == N_GOLD
        return
    with pytest.raises(VllmBatchError, match="does not match"):
        qa_run(spec)


# ---- with passthrough columns and LoRA adapters -----------------------------------------------
def test_golden_rows_pass_no_columns_through_and_need_none(tmp_path):
    """The golden file carries the template's columns only: a job that passes input columns through still plans,
    runs and merges its golden rows (golden parts in the plain schemas), and results/ keeps the typed columns."""
    import datetime as dt
    from decimal import Decimal

    from airflow_provider_vllm.core.rows import ERROR_SCHEMA, RESULT_SCHEMA

    _golden_file(tmp_path / "golden.parquet")  # no "queue", no "opened"
    ids = [f"t{i:03d}" for i in range(N_IN)]
    write_parquet(
        tmp_path / "d1" / "in" / "a.parquet",
        ids,
        [f"ticket {i}: {LABELS[i % 5]}" if i % 9 else "" for i in range(N_IN)],  # some errors
        queue=pa.array([Decimal(i) / 4 for i in range(N_IN)], pa.decimal128(9, 2)),
        opened=pa.array([dt.datetime(2026, 1, 1, i % 24) for i in range(N_IN)], pa.timestamp("us", "UTC")),
    )
    spec = _spec(tmp_path, io={"passthrough": ["queue", "opened"], "passthrough_prefix": "in_"})
    plan, summary = _all(spec)
    assert plan.passthrough is not None and plan.for_shard(plan.golden.shards[0].shard_id).passthrough is None
    out = Path(spec.io.output_uri)
    assert summary["golden"]["rows"] == N_GOLD and summary["rows"] == N_IN
    res = pq.read_table(out / "results")
    assert res.schema.field("in_queue").type == pa.decimal128(9, 2)
    assert res.schema.field("in_opened").type == pa.timestamp("us", "UTC")
    row = {r["id"]: r for r in res.to_pylist()}["t001"]
    assert row["in_queue"] == Decimal("0.25") and row["in_opened"].hour == 1
    err = pq.read_table(out / "errors")
    assert {r["id"]: r["in_queue"] for r in err.to_pylist()}["t000"] == Decimal(0)  # errors carry them too
    assert pq.read_schema(out / RESULTS_FILE).names == RESULT_SCHEMA.names  # golden parts: nothing passed through
    assert pq.read_schema(out / ERRORS_FILE).names == ERROR_SCHEMA.names
    report, _ = qa_run(spec)
    assert report.metrics["quality"]["labelled"] == N_GOLD


@pytest.fixture
def lora(tmp_path):
    from tests.support.lora import write_adapter
    from tests.unit.core.test_adapters import LLAMA

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    names = ("billing", "refunds")
    return [{"name": n, "source": str(write_adapter(tmp_path / "ad" / n, model, seed=i))} for i, n in enumerate(names)]


def test_golden_rows_name_their_adapter_like_the_input_rows(tmp_path, lora):
    """With model.adapter_column a golden row runs with the adapter its own column names (the golden rows score
    the adapters the job's rows run with); a golden file without that column is refused at plan."""
    which = ["billing", "refunds", None]
    _golden_file(tmp_path / "golden.parquet", which=[which[i % 3] for i in range(N_GOLD)])
    write_parquet(
        tmp_path / "d1" / "in" / "a.parquet",
        [f"t{i:03d}" for i in range(N_IN)],
        [f"ticket {i}: {LABELS[i % 5]}" for i in range(N_IN)],
        which=[which[i % 3] for i in range(N_IN)],
    )
    spec = _spec(tmp_path, model={"adapters": lora, "adapter_column": "which"})
    plan, summary = _all(spec)
    out = Path(spec.io.output_uri)
    golden_in = pq.read_table(out / plan.golden.input_file.path)
    assert golden_in.column_names == ["id", "text", "which", "_vllm_golden_label"]
    got = {r["id"]: r["adapter"] for r in pq.read_table(out / RESULTS_FILE).to_pylist()}
    assert got and all(a == which[int(i[-3:]) % 3] for i, a in got.items())
    assert {r["adapter"] for r in pq.read_table(out / "results").to_pylist()} == {"billing", "refunds", None}

    _golden_file(tmp_path / "golden2.parquet")  # no "which"
    spec2 = _spec(
        tmp_path,
        run="d2",
        model={"adapters": lora, "adapter_column": "which"},
        qa={"reference": {"ride_along_uri": str(tmp_path / "golden2.parquet")}},
    )
    write_parquet(tmp_path / "d2" / "in" / "a.parquet", ["t0"], ["ticket"], which=["billing"])
    with pytest.raises(SpecError, match=r"missing column\(s\) \['which'\]"):
        plan_job(spec2)


def test_golden_files_replaced_right_after_merge_wrote_them_are_not_sealed_or_scored(tmp_path, monkeypatch):
    """A writer of the output prefix replaces golden/results.parquet right after merge wrote it, with every golden
    answer right. Merge seals the size and sha256 of the bytes it wrote, so QA refuses the replaced file, naming it.
    The code before sealed the sha256 of a second read of the bucket: the forged labels were sealed and QA scored
    them (40 of 45 right against 10)."""
    from airflow_provider_vllm.core.storage import Storage

    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    _run_shards(spec, plan_job(spec))
    out = Path(spec.io.output_uri)
    truth = dict(zip(*(pq.read_table(tmp_path / "golden.parquet").column(c).to_pylist() for c in ("id", "label"))))
    real_write = Storage.write_parquet_atomic

    def write_then_forge(self, rel, table, *a, **kw):
        got = real_write(self, rel, table, *a, **kw)
        if rel == RESULTS_FILE:  # the other writer's PUT lands right after merge's
            t = pq.read_table(out / RESULTS_FILE)
            labels = pa.array([truth[i.removeprefix(RESERVED_ID_PREFIX)] for i in t["id"].to_pylist()])
            (out / RESULTS_FILE).unlink()
            pq.write_table(t.set_column(t.column_names.index("label"), "label", labels), out / RESULTS_FILE)
        return got

    monkeypatch.setattr(Storage, "write_parquet_atomic", write_then_forge)
    summary = merge(spec)
    monkeypatch.undo()
    with pytest.raises(CommitError, match=rf"{RESULTS_FILE} does not match the merge's sealed summary"):
        qa_run(spec)
    assert summary.golden is not None and summary.golden.sizes is not None
    assert summary.golden.sizes[ERRORS_FILE] == (out / ERRORS_FILE).stat().st_size  # the file left alone
    record_malicious("golden_file_replaced_after_merge_wrote_it", 1, 1)


def test_a_planted_huge_ride_along_file_is_refused_by_the_plan_before_it_reads_a_byte(tmp_path, monkeypatch):
    """The ride-along golden rows have the golden set's bounds (``steps/qa/golden_set.py``: ``MAX_BYTES`` in all,
    ``MAX_FILES`` files), checked on the sizes the store states before a byte is read; before, the plan handed the
    location to DuckDB whole, whatever its size."""
    from airflow_provider_vllm.core import duck
    from airflow_provider_vllm.steps.qa import golden_set

    folder = tmp_path / "golden"
    folder.mkdir()
    _golden_file(folder / "a.parquet")
    with open(folder / "huge.parquet", "wb") as f:  # sparse: no disk used
        f.truncate(golden_set.MAX_BYTES)
    _input(tmp_path)
    spec = _spec(tmp_path, qa={"reference": {"ride_along_uri": str(folder)}})

    real = duck.connect

    def never(*a, **k):
        assert not (a and "golden" in str(getattr(a[0], "root", ""))), "DuckDB was asked to read the golden rows"
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(duck, "connect", never)
        with pytest.raises(
            SpecError, match=r"huge\.parquet \(\d+ bytes\) takes the ride-along golden rows over .* refused unread"
        ) as e:
            plan_job(spec)
    assert "qa.reference.ride_along_uri" in str(e.value)
    (folder / "huge.parquet").unlink()
    _golden_file(folder / "b.parquet")
    _golden_file(folder / "c.parquet")
    monkeypatch.setattr(golden_set, "MAX_FILES", 2)
    with pytest.raises(SpecError, match=r"3 files, more than 2"):
        plan_job(spec)
    assert not (tmp_path / "d1" / "out" / PLAN_FILE).exists()


def test_a_link_inside_a_ride_along_folder_or_a_file_grown_after_it_was_listed_is_refused(tmp_path, monkeypatch):
    """A symbolic link below the ride-along location (a file of its folder, or a folder above it below the location)
    is refused naming it, as in the golden set; and the plan reads no further than the size the store stated when
    it listed the file (it reads a private copy, not the location again): bytes added in between are refused."""
    import airflow_provider_vllm.steps.golden as golden_mod

    _input(tmp_path)
    folder = tmp_path / "golden"
    folder.mkdir()
    _golden_file(tmp_path / "elsewhere.parquet")
    (folder / "g.parquet").symlink_to(tmp_path / "elsewhere.parquet")
    with pytest.raises(SpecError, match=r"g\.parquet is a symbolic link"):
        plan_job(_spec(tmp_path, qa={"reference": {"ride_along_uri": str(folder)}}))
    _golden_file(tmp_path / "golden.parquet")
    real = golden_mod.find_input

    def listed_then_grown(*a, **k):
        found = real(*a, **k)
        with open(tmp_path / "golden.parquet", "ab") as f:
            f.write(b"\0" * 4096)
        return found

    monkeypatch.setattr(golden_mod, "find_input", listed_then_grown)
    # its writer at work: a retry of the plan lists it again (TransientError), as for a file removed after the listing
    with pytest.raises(TransientError, match=r"golden\.parquet is larger than the \d+ bytes stated when it was listed"):
        plan_job(_spec(tmp_path))
    assert not (tmp_path / "d1" / "out" / PLAN_FILE).exists()


def test_a_ride_along_file_removed_after_the_plan_listed_it_is_a_transient_error_naming_the_field_and_file(
    tmp_path, monkeypatch
):
    """A ride-along file removed between the plan's listing and its copy failed the plan with a bare
    FileNotFoundError that named neither ``qa.reference.ride_along_uri`` nor the file. It is a TransientError naming
    both: a retry of the plan lists the folder again."""
    import airflow_provider_vllm.steps.golden as golden_mod
    from airflow_provider_vllm.core.errors import TransientError

    _input(tmp_path)
    folder = tmp_path / "golden"
    folder.mkdir()
    _golden_file(folder / "a.parquet")
    _golden_file(folder / "b.parquet", ids=[f"h{i:03d}" for i in range(N_GOLD)])
    real = golden_mod.find_input

    def listed_then_removed(*a, **k):
        found = real(*a, **k)
        if a[0] == str(folder):
            (folder / "b.parquet").unlink()
        return found

    monkeypatch.setattr(golden_mod, "find_input", listed_then_removed)
    with pytest.raises(TransientError, match=r"qa\.reference\.ride_along_uri .*golden/b\.parquet was removed after"):
        plan_job(_spec(tmp_path, qa={"reference": {"ride_along_uri": str(folder)}}))
    assert not (tmp_path / "d1" / "out" / PLAN_FILE).exists()


@pytest.mark.parametrize("when", ["before the plan", "swapped in after the plan's check", "a FIFO"])
def test_a_link_or_fifo_inside_a_ride_along_folder_is_refused_in_the_users_terms(tmp_path, monkeypatch, when):
    """The ride-along folder is the user's: a link inside it (there before the plan, or swapped in between the
    plan's link check and its read) or a FIFO is refused naming ``qa.reference.ride_along_uri``, the entry and what
    to do. Before, the link swapped in and the FIFO got the storage layer's text ("no file or folder this provider
    writes below ... is", "another writer of the folder put it there?"), which speaks of the provider's own
    folders, and a link there before the plan a clumsy one."""
    import os

    from airflow_provider_vllm.core.storage import Storage

    _input(tmp_path)
    folder = tmp_path / "golden"
    folder.mkdir()
    _golden_file(tmp_path / "elsewhere.parquet")
    g = folder / "g.parquet"
    if when == "before the plan":
        g.symlink_to(tmp_path / "elsewhere.parquet")
    elif when == "a FIFO":
        os.mkfifo(g)
    else:
        _golden_file(g)
        real_open_read = Storage._open_read

        def swap_then_open(self, rel):
            if rel == g.name and not g.is_symlink():
                (folder / ".swap").symlink_to(tmp_path / "elsewhere.parquet")
                os.replace(folder / ".swap", g)
            return real_open_read(self, rel)

        monkeypatch.setattr(Storage, "_open_read", swap_then_open)
    with pytest.raises(SpecError) as e:
        plan_job(_spec(tmp_path, qa={"reference": {"ride_along_uri": str(folder)}}))
    msg = str(e.value)
    assert msg.startswith(f"qa.reference.ride_along_uri {folder}: {g} is ")
    assert "this provider writes" not in msg and "another writer" not in msg
    if when == "a FIFO":
        assert "is not a regular file" in msg and "Replace it with the file itself" in msg
    else:
        assert g.is_symlink() and "is a symbolic link" in msg
        assert "Replace the link with a copy of the file it points to, or set qa.reference.ride_along_uri" in msg
    assert not (tmp_path / "d1" / "out" / PLAN_FILE).exists()


def test_a_ride_along_uri_naming_one_linked_file_is_the_users_and_is_followed(tmp_path):
    """``ride_along_uri`` naming a link (``golden/current.parquet -> v7.parquet``) was refused, while ``golden_uri``
    naming one is followed (the user's own link, as an input URI's): now both follow it, and the plan copies the
    rows it points to. A FIFO there is still refused unopened; links inside a ride-along folder stay refused (the
    test above)."""
    import os

    _input(tmp_path)
    versions = tmp_path / "golden"
    versions.mkdir()
    _golden_file(versions / "v7.parquet")
    (versions / "current.parquet").symlink_to(versions / "v7.parquet")
    spec = _spec(tmp_path, qa={"reference": {"ride_along_uri": str(versions / "current.parquet")}})
    plan = plan_job(spec)
    assert plan.golden is not None and plan.golden.rows == N_GOLD
    golden_in = pq.read_table(tmp_path / "d1" / "out" / plan.golden.input_file.path).to_pylist()
    assert sorted(r["id"] for r in golden_in) == sorted(f"{RESERVED_ID_PREFIX}g{i:03d}" for i in range(N_GOLD))
    os.mkfifo(tmp_path / "fifo.parquet")
    (versions / "current.parquet").unlink()
    (versions / "current.parquet").symlink_to(tmp_path / "fifo.parquet")
    _input(tmp_path, "d2")
    with pytest.raises(SpecError, match=r"current\.parquet is not a regular file"):
        plan_job(_spec(tmp_path, "d2", qa={"reference": {"ride_along_uri": str(versions / "current.parquet")}}))


def test_a_golden_shard_infers_only_the_pinned_golden_rows_when_they_are_swapped_after_its_check(tmp_path, monkeypatch):
    """The golden rows' file lies under the output prefix (other writers). A golden shard reads it only as the sealed
    plan pins it (size and sha256, ``ShardPlan.input_file``: a checked local copy), never by a check of its size and
    version followed by another read of the prefix: rows swapped in right after such a check (same ids, other
    prompts) would be inferred, and scored against the known labels."""
    from airflow_provider_vllm.worker import shard as worker_shard

    _golden_file(tmp_path / "golden.parquet")
    _input(tmp_path)
    spec = _spec(tmp_path)
    plan = plan_job(spec)
    path = Path(spec.io.output_uri) / plan.golden.input_file.path
    forged = pq.read_table(path)
    forged = forged.set_column(
        forged.column_names.index("text"), "text", pa.array(["forged prompt"] * forged.num_rows, pa.string())
    )
    read = []
    real_read = worker_shard.read_shard_rows

    def swap_then_read(spec, plan, shard, root, beat=lambda: None):
        pq.write_table(forged, path)  # another writer of the prefix, right before the shard reads its rows
        batch = real_read(spec, plan, shard, root, beat)
        read.extend(batch.values["text"])
        return batch

    monkeypatch.setattr(worker_shard, "read_shard_rows", swap_then_read)
    _run_shards(spec, plan, only=lambda s: s.shard_id == plan.golden.shards[0].shard_id)
    assert read and "forged prompt" not in read  # the checked copy's rows, fetched before the swap
    record_malicious("golden rows swapped after the golden shard's check", 1, 1)


@pytest.mark.parametrize("row_filter", [None, "lang = 'fr'"])  # the table's files by reference; materialized
def test_golden_rows_ride_along_with_a_table_input(tmp_path, row_filter, fake_engine_factory):
    """The table nightly (io.input_table) takes the golden rows of vllm_batch_golden_uri as the folder one does: they
    are planned apart from the snapshot's rows, inferred, merged and scored by QA."""
    from airflow_provider_vllm.steps.tables.access import Tables
    from tests.support.iceberg import source_table, sql_catalog

    catalog = sql_catalog(tmp_path)
    source_table(catalog)
    lake = Tables(catalog=catalog, allowed=["lake.*"])
    _golden_file(tmp_path / "golden.parquet")
    out = tmp_path / "run"
    table = {"identifier": "lake.tickets", **({"row_filter": row_filter} if row_filter else {})}
    spec = make_spec(
        "/unused",
        out,
        io={"input_uri": None, "input_table": table, "output_uri": str(out)},
        sharding={"target_rows": 10, "chunk_rows": 4},
        qa={"reference": {"ride_along_uri": str(tmp_path / "golden.parquet")}, "sample_size": 10},
    )
    plan = plan_job(spec, tables=lake)
    assert plan.table is not None and plan.golden is not None and plan.golden.rows == N_GOLD
    assert plan.table.read == ("materialized" if row_filter else "reference")
    for s in plan.mapped_shards():
        assert run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)["status"]
    summary = merge(spec).dump()
    assert summary["rows"] == plan.total_rows and summary["golden"]["rows"] == N_GOLD
    report, _ = qa_run(spec)
    ride = report.metrics["quality"]["sources"]["ride_along"]
    assert (ride["known"], ride["unmatched"], ride["of"]) == (N_GOLD, 0, N_GOLD)
    assert next(c for c in report.checks if c["name"] == "accuracy")["status"] != "skip"
