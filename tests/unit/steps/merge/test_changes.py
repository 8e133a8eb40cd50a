"""The changes output: kinds per id, churn, the label matrix, refusals, crash drills (real DuckDB, local files).

Merged runs are written as merge writes them (results/errors Parquet with the row schema and a
``_MERGED.json``); one test runs the whole pipeline (plan, the fake engine's worker, merge, QA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.records import ChangesSummary, MergeSummary
from airflow_provider_vllm.core.rows import ERROR_SCHEMA, RESULT_SCHEMA
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.changes import CHANGES, SUMMARY, compared_column, compute_changes, read_changes
from airflow_provider_vllm.steps.merge.merger import ERRORS, MERGED, RESULTS, read_manifest
from tests.support.data import (
    LABELS,
    make_spec,
    merge_summary,
    shard_task,
    vouch_cache,
    write_merged_folder,
    write_merged_summary,
)
from tests.support.ledger import record_fault

pytestmark = pytest.mark.unit


def write_run(
    out: Path,
    ok: dict[str, object],
    errors: dict[str, str] | None = None,
    *,
    col: str = "label",
    task: str | None = "chat",
    id_column: str | None = "id",
    config_hash: str = "c",
    hashes: dict[str, int] | None = None,
    configs: dict[str, str] | None = None,
    adapter_of: dict[str, str] | None = None,
    adapters: dict[str, str] | None = None,
) -> Path:
    """A merged run under ``out``: ``ok`` id -> value of ``col``, ``errors`` id -> error code; ``hashes``:
    id -> prompt_hash, ``configs``: id -> config_hash (default ``config_hash``), ``adapter_of``: id -> the LoRA
    adapter the row ran with, ``adapters``: the summary's adapter name -> identity."""
    errors = errors or {}
    hashes, configs, adapter_of = hashes or {}, configs or {}, adapter_of or {}
    rows = [
        {
            "id": i,
            col: v,
            "model": "fake",
            "config_hash": configs.get(i, config_hash),
            "prompt_hash": hashes.get(i),
            "adapter": adapter_of.get(i),
        }
        for i, v in ok.items()
    ]
    write_merged_folder(out, RESULTS, pa.Table.from_pylist(rows, schema=RESULT_SCHEMA))
    write_merged_folder(
        out,
        ERRORS,
        pa.Table.from_pylist(
            [{"id": i, "error_code": c, "error_message": "x"} for i, c in errors.items()], schema=ERROR_SCHEMA
        ),
    )
    summary = merge_summary(len(ok) + len(errors), len(ok), len(errors))
    summary = summary.model_copy(update={"config_hash": config_hash, "task": task, "id_column": id_column})
    if adapters is not None:
        summary = summary.model_copy(update={"adapters": adapters})
    write_merged_summary(out, summary)
    return out


def changes_of(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(out / CHANGES).to_pylist()}


@pytest.fixture
def spec_for(tmp_path):
    def make(prev: Path | str | None = None, **over):
        s = make_spec(tmp_path / "in.parquet", tmp_path / "now", **over)
        return (
            s.model_copy(update={"changes": s.changes.model_copy(update={"previous_uri": str(prev)})})
            if prev is not None
            else s
        )

    return make


def test_every_kind_with_old_and_new_values(tmp_path, spec_for):
    write_run(
        tmp_path / "prev",
        {"a": "bug", "b": "billing", "c": "other", "e": "bug"},
        {"f": "ENGINE_ERROR", "g": "EMPTY_INPUT"},
    )
    write_run(
        tmp_path / "now",
        {"a": "bug", "b": "bug", "d": "account", "f": "billing"},
        {"e": "ENGINE_OOM", "h": "EMPTY_INPUT"},
    )
    s = compute_changes(spec_for(tmp_path / "prev"))
    rows = changes_of(tmp_path / "now")
    kinds = {i: r["change"] for i, r in rows.items()}
    assert kinds == {
        "a": "unchanged",
        "b": "changed",
        "c": "removed",
        "d": "added",
        "e": "error",
        "f": "recovered",
        "g": "removed",
        "h": "error",
    }
    assert (rows["b"]["old_value"], rows["b"]["new_value"]) == ("billing", "bug")
    assert (rows["e"]["old_status"], rows["e"]["new_status"], rows["e"]["new_error_code"]) == (
        "ok",
        "error",
        "ENGINE_OOM",
    )
    assert rows["h"]["old_status"] is None and rows["g"]["old_error_code"] == "EMPTY_INPUT"
    assert s.counts.model_dump() == {"added": 1, "removed": 2, "changed": 1, "unchanged": 1, "error": 2, "recovered": 1}
    assert (s.in_both, s.churn_rate, s.ids, s.previous_state, s.compared) == (2, 0.5, 8, "complete", "label")
    # the matrix: answers on both sides or one side absent; errors on either side left out
    cells = {(c.old, c.new): c.count for c in s.matrix}
    assert cells == {("bug", "bug"): 1, ("billing", "bug"): 1, ("other", None): 1, (None, "account"): 1}
    assert read_changes(Storage(str(tmp_path / "now"))) == s
    assert list(pq.read_table(tmp_path / "now" / CHANGES).column("id").to_pylist()) == sorted(kinds)
    assert s.checksums[CHANGES] == Storage(str(tmp_path / "now")).sha256(CHANGES)


def test_a_planted_terabyte_change_set_is_refused_unread(tmp_path, spec_for, monkeypatch):
    """The sealed ``_changes.json`` records the size of ``changes.parquet`` beside its sha256: a sparse terabyte put in
    its place is refused without reading it (the code before hashed it whole: hours of QA or publish)."""
    from tests.support.security import counted_reads

    write_run(tmp_path / "prev", {"a": "bug", "b": "billing"})
    write_run(tmp_path / "now", {"a": "bug", "b": "bug"})
    s = compute_changes(spec_for(tmp_path / "prev"))
    assert s.sizes == {CHANGES: (tmp_path / "now" / CHANGES).stat().st_size}
    with open(tmp_path / "now" / CHANGES, "wb") as f:
        f.truncate(1 << 40)
    read = counted_reads(monkeypatch)
    with pytest.raises(CommitError, match="changes.parquet is not the file the sealed"):
        read_changes(Storage(str(tmp_path / "now")))
    assert sum(read) < 1 << 20


def test_rerun_is_safe_and_identical(tmp_path, spec_for):
    write_run(tmp_path / "prev", {"a": "bug", "b": "billing"})
    write_run(tmp_path / "now", {"a": "bug", "b": "bug"})
    first = compute_changes(spec_for(tmp_path / "prev"))
    data = (tmp_path / "now" / CHANGES).read_bytes()
    assert compute_changes(spec_for(tmp_path / "prev")) == first
    assert (tmp_path / "now" / CHANGES).read_bytes() == data


@pytest.mark.parametrize("state", ["absent", "incomplete"])
def test_no_complete_previous_run_makes_every_id_added(tmp_path, spec_for, state):
    write_run(tmp_path / "now", {"a": "bug", "b": "bug"}, {"c": "EMPTY_INPUT"})
    if state == "incomplete":
        write_run(tmp_path / "prev", {"a": "other"})
        (tmp_path / "prev" / MERGED).unlink()
        (tmp_path / "prev" / "_plan.json").write_text("{}")
    s = compute_changes(spec_for(tmp_path / "prev"))
    assert s.previous_state == state and s.churn_rate is None and s.previous_config_hash is None
    assert (s.counts.added, s.counts.error, s.in_both) == (2, 1, 0)
    assert "no previous run" in s.notes[0] and ("not complete" in s.notes[0]) == (state == "incomplete")
    assert {(c.old, c.new): c.count for c in s.matrix} == {(None, "bug"): 2}


def test_a_previous_run_of_another_task_or_id_column_is_refused(tmp_path, spec_for):
    write_run(tmp_path / "now", {"a": "bug"})
    write_run(tmp_path / "emb", {"a": [1.0, 2.0]}, col="embedding", task="embed")
    with pytest.raises(SpecError, match=r"changes.previous_uri .*emb.* task 'embed'"):
        compute_changes(spec_for(tmp_path / "emb"))
    write_run(tmp_path / "other_ids", {"a": "bug"}, id_column="ticket_no")
    with pytest.raises(SpecError, match=r"changes.previous_uri .*column 'ticket_no'"):
        compute_changes(spec_for(tmp_path / "other_ids"))
    # an older summary without task / id_column: the data says it is not a label job
    write_run(tmp_path / "old_text", {"a": "free text"}, col="output", task=None, id_column=None)
    with pytest.raises(SpecError, match=r"changes.previous_uri .*old_text.*'label'"):
        compute_changes(spec_for(tmp_path / "old_text"))
    # results of another schema (no label column at all), a _MERGED.json that is not ours
    write_run(tmp_path / "schema", {"a": "bug"})
    write_merged_folder(tmp_path / "schema", RESULTS, pa.table({"id": ["a"], "text": ["x"]}))
    with pytest.raises(CommitError, match=r"schema/results/_manifest.json is not the manifest the sealed"):
        compute_changes(spec_for(tmp_path / "schema"))  # a folder changed after its merge: not read at all
    merged = MergeSummary.model_validate_json((tmp_path / "schema" / MERGED).read_bytes())
    write_merged_summary(tmp_path / "schema", merged.model_copy(update={"seal": None}))
    with pytest.raises(SpecError, match=r"changes.previous_uri .*schema.*cannot be read as this job's"):
        compute_changes(spec_for(tmp_path / "schema"))
    write_run(tmp_path / "forged", {"a": "bug"})
    (tmp_path / "forged" / MERGED).write_text('{"rows": "many", "evil": true}')
    with pytest.raises(SpecError, match=r"changes.previous_uri .*forged.*not a merge summary"):
        compute_changes(spec_for(tmp_path / "forged"))
    with pytest.raises(SpecError, match="own output prefix"):
        compute_changes(spec_for(tmp_path / "now"))
    assert not (tmp_path / "now" / SUMMARY).exists()


def test_an_empty_run_removes_every_previous_id(tmp_path, spec_for):
    write_run(tmp_path / "prev", {"a": "bug", "b": "other"}, {"c": "EMPTY_INPUT"})
    write_run(tmp_path / "now", {})
    s = compute_changes(spec_for(tmp_path / "prev"))
    assert (s.counts.removed, s.ids, s.churn_rate) == (3, 3, None)
    assert {(c.old, c.new) for c in s.matrix} == {("bug", None), ("other", None)}  # the error side is left out


def test_hostile_ids_and_labels_round_trip(tmp_path, spec_for):
    ids = ["it's", 'say "hi"', "<script>alert(1)</script>", "x'); DROP TABLE r; --", "tab\there", "ü"]
    # the spec's labels are plain; the files may hold anything (an earlier label set, a classifier's names)
    labels = ["<b>bug</b>", "it's", 'quo"te']
    spec = spec_for(tmp_path / "prev")
    write_run(tmp_path / "prev", {i: labels[n % 3] for n, i in enumerate(ids)})
    write_run(tmp_path / "now", {i: labels[(n + (n % 2)) % 3] for n, i in enumerate(ids)})
    s = compute_changes(spec)
    rows = changes_of(tmp_path / "now")
    assert set(rows) == set(ids) and s.counts.changed == 3 and s.counts.unchanged == 3
    assert rows["<script>alert(1)</script>"]["new_value"] in labels
    assert {c.old for c in s.matrix} <= set(labels)


def test_a_quote_in_the_output_path(tmp_path, spec_for):
    prev, now = tmp_path / "it's prev", tmp_path / "it's now"
    write_run(prev, {"a": "bug"})
    write_run(now, {"a": "billing"})
    spec = make_spec(tmp_path / "in.parquet", now, changes={"previous_uri": str(prev)})
    assert compute_changes(spec).counts.changed == 1


@pytest.mark.parametrize(
    "task,structured,col",
    [
        ("chat", {"json_schema": {"type": "object"}}, "parsed_json"),
        ("chat", {"regex": "[a-z]+"}, "output"),
        ("generate", None, "output"),
        ("classify", None, "label"),
    ],
)
def test_compared_column_by_job(tmp_path, task, structured, col):
    over = {"task": task, "sampling": {"structured": structured, "max_tokens": 8}}
    if task == "classify":
        over["prompt"] = {"system_prompt": None, "template": "{text}"}
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "now", **over)
    assert compared_column(spec) == col


def test_json_outputs_compare_parsed_json(tmp_path):
    write_run(tmp_path / "prev", {"a": '{"k":1}', "b": '{"k":2}'}, col="parsed_json")
    write_run(tmp_path / "now", {"a": '{"k":1}', "b": '{"k":3}'}, col="parsed_json")
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "now",
        sampling={"structured": {"json_schema": {}}},
        changes={"previous_uri": str(tmp_path / "prev")},
    )
    s = compute_changes(spec)
    assert (s.compared, s.counts.changed, s.counts.unchanged, s.matrix) == ("parsed_json", 1, 1, None)
    assert changes_of(tmp_path / "now")["b"]["old_value"] == '{"k":2}'


def test_embeddings_compare_equal_or_not_without_values(tmp_path):
    write_run(tmp_path / "prev", {"a": [1.0, 2.0], "b": [0.5, 0.5]}, col="embedding", task="embed")
    write_run(tmp_path / "now", {"a": [1.0, 2.0], "b": [0.5, 0.25]}, col="embedding", task="embed")
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "now",
        task="embed",
        prompt={"system_prompt": None, "template": "{text}"},
        sampling={"structured": None},
        changes={"previous_uri": str(tmp_path / "prev")},
    )
    s = compute_changes(spec)
    assert (s.compared, s.counts.changed, s.counts.unchanged) == ("embedding", 1, 1)
    cols = pq.read_schema(tmp_path / "now" / CHANGES).names
    assert "old_value" not in cols and "new_value" not in cols


def test_a_changed_config_is_noted(tmp_path, spec_for):
    write_run(tmp_path / "prev", {"a": "bug"}, config_hash="old")
    write_run(tmp_path / "now", {"a": "bug"}, config_hash="new")
    s = compute_changes(spec_for(tmp_path / "prev"))
    assert s.previous_config_hash == "old" and s.config_hash == "new"
    assert any("another config" in n for n in s.notes)


def test_a_summary_with_an_unknown_field_is_refused():
    with pytest.raises(Exception, match="extra"):
        ChangesSummary.model_validate({"surprise": 1})


@pytest.mark.reliability
@pytest.mark.parametrize(
    "point",
    ["changes.before_write", "changes.mid_file", "changes.after_data", "changes.mid_marker", "changes.after_marker"],
)
def test_kill_at_each_write_step_then_rerun(tmp_path, point):
    """kill -9 at each commit step of the changes output; the rerun's outputs equal a clean run's."""
    write_run(tmp_path / "prev", {f"r{i}": LABELS[i % 5] for i in range(50)})
    write_run(tmp_path / "now", {f"r{i}": LABELS[(i // 2) % 5] for i in range(10, 60)})
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "now", changes={"previous_uri": str(tmp_path / "prev")})
    code = (
        "import sys; from airflow_provider_vllm.core.spec import JobSpec; "
        "from airflow_provider_vllm.steps.merge.changes import compute_changes; "
        "compute_changes(JobSpec.model_validate_json(sys.argv[1]))"
    )
    env = {**os.environ, "VLLM_BATCH_FAULTS": f"{point}=kill"}
    p = subprocess.run([sys.executable, "-c", code, spec.model_dump_json()], env=env, capture_output=True)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    partial = 0
    if (tmp_path / "now" / SUMMARY).exists():  # a visible summary is a whole one, naming the visible file
        s = read_changes(Storage(str(tmp_path / "now")))
        partial += s.checksums[CHANGES] != Storage(str(tmp_path / "now")).sha256(CHANGES)
    if (tmp_path / "now" / CHANGES).exists():  # a visible Parquet is a whole one
        partial += pq.read_metadata(tmp_path / "now" / CHANGES).num_rows != 60
    s = compute_changes(spec)
    ids = pq.read_table(tmp_path / "now" / CHANGES, columns=["id"]).column("id").to_pylist()
    expected = {f"r{i}" for i in range(60)}
    record_fault(
        f"kill9.{point}",
        rows=60,
        lost=len(expected - set(ids)),
        duplicates=len(ids) - len(set(ids)),
        partial_visible=partial,
        level="process",
    )
    assert partial == 0 and set(ids) == expected and len(ids) == 60
    assert s.ids == 60 and s.counts.added == 10 and s.counts.removed == 10
    assert read_changes(Storage(str(tmp_path / "now"))) == s
    leftovers = [f for f in os.listdir(tmp_path / "now" / "changes") if f not in ("changes.parquet", "_changes.json")]
    assert leftovers == [] or all(".tmp-" in f for f in leftovers)


@pytest.mark.parametrize("stream", [False, True])
def test_qa_of_a_second_run_reports_exactly_the_moved_labels(tmp_path, fake_engine_factory, monkeypatch, stream):
    """The whole pipeline twice (fake engine): 10% of texts edited, 5 rows new, 4 gone; QA computes the changes."""
    from airflow_provider_vllm.steps.merge import merger as merge_mod
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa import stage
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import merge, write_parquet

    if stream:
        monkeypatch.setattr(stage, "STREAM_ABOVE_ROWS", 0)
    ids1 = [f"t{i:03d}" for i in range(60)]
    texts1 = {i: f"ticket {i} about my invoice" for i in ids1}
    texts2 = {i: t + (" (edited)" if n % 10 == 3 else "") for n, (i, t) in enumerate(texts1.items()) if n >= 4}
    texts2.update({f"n{i}": f"new ticket {i}" for i in range(5)})
    texts2["t010"] = ""  # an error now (EMPTY_INPUT)

    def run(name, texts, previous=None):
        write_parquet(tmp_path / name / "in.parquet", list(texts), list(texts.values()))
        spec = make_spec(
            tmp_path / name / "in.parquet",
            tmp_path / name / "out",
            sharding={"target_rows": 25},
            changes={"previous_uri": previous},
            qa={"warn_churn_rate": 0.01, "fail_churn_rate": 0.9},
        )
        for s in plan_job(spec).shards:
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
        merge(spec)
        return spec, stage.qa_run(spec)[0]

    _, rep1 = run("d1", texts1, str(tmp_path / "d0" / "out"))  # the day before never ran
    assert rep1.metrics["changes"]["counts"]["added"] == 60 and rep1.metrics["changes"]["previous_state"] == "absent"
    assert next(c for c in rep1.checks if c["name"] == "churn_rate")["status"] == "skip"
    spec2, rep2 = run("d2", texts2, str(tmp_path / "d1" / "out"))

    def labels(day):
        return dict(
            zip(
                *pq.read_table(tmp_path / day / "out" / merge_mod.RESULTS, columns=["id", "label"]).to_pydict().values()
            )
        )

    old, new = labels("d1"), labels("d2")
    moved = {i for i in set(old) & set(new) if old[i] != new[i]}
    assert moved, "the edits should move some labels"
    rows = changes_of(tmp_path / "d2" / "out")
    assert {i for i, r in rows.items() if r["change"] == "changed"} == moved
    assert all(rows[i]["old_value"] == old[i] and rows[i]["new_value"] == new[i] for i in moved)
    assert {i for i, r in rows.items() if r["change"] == "added"} == {f"n{i}" for i in range(5)}
    assert {i for i, r in rows.items() if r["change"] == "removed"} == set(ids1[:4])
    assert rows["t010"]["change"] == "error" and rows["t010"]["new_error_code"] == "EMPTY_INPUT"
    ch = rep2.metrics["changes"]
    assert ch["churn_rate"] == len(moved) / ch["in_both"] and ch["in_both"] == 60 - 4 - 1
    c = next(c for c in rep2.checks if c["name"] == "churn_rate")
    assert c["status"] in ("warn", "fail") and c["value"] == ch["churn_rate"]
    assert sum(x["count"] for x in ch["matrix"] if x["old"] != x["new"] and x["old"] and x["new"]) == len(moved)
    html = (tmp_path / "d2" / "out" / "qa" / "report.html").read_text()
    assert "What changed since the last run" in html and 'data-chart="churn"' in html
    stored = json.loads((tmp_path / "d2" / "out" / "qa" / "report.json").read_text())
    assert stored["metrics"]["changes"] == ch


def test_qa_with_the_changes_reads_each_part_of_its_run_once(tmp_path, fake_engine_factory, monkeypatch):
    """QA checks this run's parts (size and sha256) and hands them to the change set, which does not hash them
    again; the previous run's parts are checked once too. The change set equals one computed on its own."""
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa import stage
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import merge, write_parquet

    def run(name, previous):
        ids = [f"t{i:03d}" for i in range(40)]
        write_parquet(tmp_path / name / "in.parquet", ids, [f"ticket {i} {name}" for i in ids])
        spec = make_spec(
            tmp_path / name / "in.parquet",
            tmp_path / name / "out",
            sharding={"target_rows": 10},
            changes={"previous_uri": previous},
        )
        for s in plan_job(spec).shards:
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
        merge(spec)
        return spec

    run("d1", None)
    spec = run("d2", str(tmp_path / "d1" / "out"))
    alone = compute_changes(spec)
    hashed: list[str] = []
    real = Storage.fetch_verified

    def spy(self, rel, *args):
        if rel.startswith(("results/part-", "errors/part-")):
            hashed.append(self.uri(rel))
        return real(self, rel, *args)

    monkeypatch.setattr(Storage, "fetch_verified", spy)
    report, _ = stage.qa_run(spec)
    parts = [
        Storage(str(tmp_path / d / "out")).uri(f"{kind}/{p.name}")
        for d in ("d1", "d2")
        for kind in (RESULTS, ERRORS)
        for p in read_manifest(Storage(str(tmp_path / d / "out")), kind).parts
    ]
    assert len(parts) > 8 and sorted(hashed) == sorted(parts)  # each part of both runs, copied (and checked) once
    assert read_changes(Storage(str(tmp_path / "d2" / "out"))).model_dump(exclude={"seal"}) == alone.model_dump(
        exclude={"seal"}
    )
    assert report.metrics["changes"]["counts"] == alone.counts.model_dump()


def test_a_changed_answer_says_why_it_moved(tmp_path, spec_for):
    write_run(
        tmp_path / "prev",
        {"a": "bug", "b": "bug", "c": "billing", "d": "other", "e": "bug", "f": "bug", "g": "bug"},
        hashes={"a": 1, "b": 2, "c": 2, "d": 3, "e": 4, "g": 7},  # prompt 2 answered two ways; f: no hash
    )
    write_run(
        tmp_path / "now",
        {"a": "billing", "b": "billing", "c": "billing", "d": "bug", "e": "other", "f": "other", "g": "bug"},
        hashes={"a": 1, "b": 2, "c": 2, "d": 33, "e": 4, "f": 5, "g": 7},
        configs={"e": "c2"},
    )
    summary = compute_changes(spec_for(tmp_path / "prev"))
    got = {i: (r["change"], r["reason"]) for i, r in changes_of(tmp_path / "now").items()}
    assert got == {
        "a": ("changed", "engine"),  # same request, same settings, consistent before: the engine's numerics
        "b": ("changed", "unified"),  # prompt 2 had two answers before; now one
        "c": ("unchanged", None),
        "d": ("changed", "input"),  # another request: the text was edited
        "e": ("changed", "settings"),  # made under another config
        "f": ("changed", "unknown"),  # the previous run did not hash its requests
        "g": ("unchanged", None),
    }
    assert summary.reasons == {"settings": 1, "input": 1, "unified": 1, "engine": 1, "unknown": 1}
    assert ChangesSummary.model_validate_json((tmp_path / "now" / SUMMARY).read_text()).reasons == summary.reasons


def test_an_adapter_with_other_files_moves_its_rows_for_the_settings(tmp_path, spec_for):
    """The config hash names adapters by name and source, so new weights in the same folder keep it: the rows
    that ran with that adapter moved for the settings (as with another model revision), named in the notes;
    rows of the base model or of an unchanged adapter keep their reasons."""
    answers = {"b": "bug", "r": "bug", "m": "bug", "x": "bug"}
    hashes = {"b": 1, "r": 2, "m": 3, "x": 4}
    ran = {"b": "billing", "r": "refunds", "x": "billing"}
    write_run(tmp_path / "prev", answers, hashes=hashes, adapter_of=ran, adapters={"billing": "s:1", "refunds": "s:2"})
    write_run(
        tmp_path / "now",
        dict.fromkeys(answers, "billing"),
        hashes={**hashes, "x": 44},  # x: another request (its text was edited) with the changed adapter
        adapter_of=ran,
        adapters={"billing": "s:9", "refunds": "s:2"},
    )
    summary = compute_changes(spec_for(tmp_path / "prev"))
    got = {i: r["reason"] for i, r in changes_of(tmp_path / "now").items()}
    assert got == {"b": "settings", "r": "engine", "m": "engine", "x": "settings"}
    assert summary.reasons == {"settings": 2, "input": 0, "unified": 0, "engine": 2, "unknown": 0}
    assert any("billing (s:1 -> s:9)" in n for n in summary.notes)

    # a previous run whose summary did not record its adapters' identities: their rows' reason is unknown
    write_run(tmp_path / "older", answers, hashes=hashes, adapter_of=ran)
    summary = compute_changes(spec_for(tmp_path / "older"))
    got = {i: r["reason"] for i, r in changes_of(tmp_path / "now").items()}
    assert got == {"b": "unknown", "r": "unknown", "m": "engine", "x": "unknown"}


def test_answers_without_a_prompt_hash_compare_with_reason_unknown(tmp_path, spec_for):
    """A previous answer without its request's hash (a row written before hashes existed) moves for a reason
    nobody can tell: 'unknown', never a guess."""
    write_run(tmp_path / "prev", {"a": "bug", "b": "bug"})  # prompt_hash null
    write_run(tmp_path / "now", {"a": "billing", "b": "bug"}, hashes={"a": 1, "b": 2})
    summary = compute_changes(spec_for(tmp_path / "prev"))
    assert changes_of(tmp_path / "now")["a"]["reason"] == "unknown" and summary.reasons["unknown"] == 1


def test_an_inconsistent_night_unified_by_the_cache_is_explained(tmp_path):
    """The demo's story: night 1 answers two identical tickets differently (batch-dependent numerics); QA
    reports the inconsistency; night 2's cache serves one answer to both, and the moved label says 'unified'."""
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa.stage import qa_run
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import PINNED_REVISION, merge, write_parquet
    from tests.support.fakes import FakeEngine

    texts = ["my card was charged twice"] * 2 + [f"ticket {i}" for i in range(10)]
    ids = [f"t{i:02d}" for i in range(12)]
    write_parquet(tmp_path / "d1" / "in.parquet", ids, texts)
    write_parquet(tmp_path / "d2" / "in.parquet", ids, texts)

    def night(day: str, prev: str | None, factory):
        spec = make_spec(
            tmp_path / day / "in.parquet",
            tmp_path / day / "out",
            model={"name": "fake", "max_model_len": 1024, "revision": PINNED_REVISION},
            cache={"uri": str(tmp_path / "cache")},
            changes={"previous_uri": str(tmp_path / prev / "out") if prev else None},
            # night 1 infers every row (a run before the dedupe, or with it off): each twin reaches the engine
            sharding={"target_rows": 100, "chunk_rows": 16, "dedupe": prev is not None},
        )
        plan = plan_job(spec, engine_identity=local_engine_identity())  # what the in-process workers seal
        for s in plan.shards:
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
        merge(spec).dump()
        qa = qa_run(spec)[0]
        vouch_cache(spec)  # published: its entry serves the next night
        return qa

    def first_two_disagree(spec):
        e = FakeEngine(spec, real_vllm=False)
        real_step = e.step

        def step():
            done = []
            for key, g in real_step():
                if key[1] == 1:  # row t01, the same text as t00: another label
                    g.text = next(lab for lab in LABELS if lab != g.text)
                done.append((key, g))
            return done

        e.step = step
        return e

    r1 = night("d1", None, first_two_disagree)
    c = r1.metrics["consistency"]
    assert (c["repeated_prompts"], c["inconsistent_prompts"]) == (1, 1) and c["examples"][0]["ids"] == ["t00", "t01"]
    r2 = night("d2", "d1", lambda spec: FakeEngine(spec, real_vllm=False))
    assert r2.metrics["cache"]["hits"] == 12  # the cache holds one answer per prompt: both repeated rows get it
    assert r2.metrics["consistency"]["inconsistent_prompts"] == 0
    moved = {i: r for i, r in changes_of(tmp_path / "d2" / "out").items() if r["change"] == "changed"}
    assert len(moved) == 1 and next(iter(moved.values()))["reason"] == "unified"
    assert r2.metrics["changes"]["reasons"]["unified"] == 1
