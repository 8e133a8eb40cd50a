"""Shard sizing from throughput history: records written by merge, read by the planner."""

from __future__ import annotations

import json

import pytest

from airflow_provider_vllm.core.records import ThroughputRecord
from airflow_provider_vllm.steps.plan.planner import DEFAULT_TARGET_ROWS, build_plan, plan_job
from airflow_provider_vllm.steps.plan.sizing import (
    HISTORY_VERSION,
    estimate_workload,
    find_evidence,
    prompt_overhead_tokens,
    read_history,
    size_shards,
)
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import history_line, make_spec, merge, shard_task, write_parquet


def record(spec, **over):
    r = {
        "version": HISTORY_VERSION,
        "recorded_at": "2026-11-28T03:00:00Z",
        "job": spec.name,
        "task": spec.task,
        "model": spec.model.name,
        "model_revision": None,
        "hardware": "1x NVIDIA H200",
        "tensor_parallel_size": 1,
        "config_hash": spec.output_hash(),
        "spec_hash": "s" * 64,
        "shards": 4,
        "rows": 10_000,
        "infer_s": 1000.0,
        "prompt_tokens": 1_500_000,
        "completion_tokens": 20_000,
        "engine_start_s": 30.0,
        "rows_per_s": 10.0,
        "tokens_per_s": 1520.0,
        "prompt_tokens_per_row": 150.0,
        "completion_tokens_per_row": 2.0,
        "est_prompt_tokens_per_row": 20.0,
    }
    r.update(over)
    return ThroughputRecord.model_validate(r)


def write_history(folder, files: dict[str, list[dict]]):
    """History files as merge writes them: each record of this version sealed for ``folder`` (others as given)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, recs in files.items():
        (folder / name).write_text(
            "".join(
                history_line(folder, r)
                if isinstance(r, ThroughputRecord) or r.get("version") == HISTORY_VERSION
                else json.dumps(r) + "\n"
                for r in recs
            )
        )


def spec_with_history(tmp_path, **sharding):
    return make_spec(
        tmp_path / "in",
        tmp_path / "out",
        sharding={"target_rows": 100, "history_uri": str(tmp_path / "history"), **sharding},
    )


def test_history_round_trip_merge_writes_a_record_that_the_next_plan_reads(tmp_path, fake_engine_factory):
    n = 300
    write_parquet(
        tmp_path / "in" / "a.parquet", [f"t{i:04d}" for i in range(n)], [f"ticket {i} text" for i in range(n)]
    )
    spec = spec_with_history(tmp_path)
    plan = plan_job(spec)
    assert plan.sizing is None and len(plan.shards) == 3  # empty history: target_rows 100 applies
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    marker = json.loads((tmp_path / "out" / "shards" / plan.shards[0].shard_id / "_COMMITTED.json").read_text())
    assert marker["stats"]["infer_rows"] == 100 and marker["stats"]["hardware"]  # what the worker now records
    summary = merge(spec).dump()
    files = sorted((tmp_path / "history").glob("*.jsonl"))
    assert len(files) == 1 and summary["history_record"].endswith(files[0].name)
    (rec,) = read_history(str(tmp_path / "history"))
    assert rec.rows == n and rec.shards == 3 and rec.model == "fake" and rec.task == "chat"
    assert rec.config_hash == spec.output_hash() and rec.hardware == marker["stats"]["hardware"]
    assert rec.completion_tokens_per_row == 2.0  # the fake engine's two tokens per row
    assert rec.prompt_tokens == sum(
        json.loads((tmp_path / "out" / "shards" / s.shard_id / "_COMMITTED.json").read_text())["stats"]["prompt_tokens"]
        for s in plan.shards
    )
    # re-merging the run replaces its record instead of adding a second one
    merge(spec)
    assert len(list((tmp_path / "history").glob("*.jsonl"))) == 1
    # the next run (new output prefix) is sized from the record: the fake engine is fast -> one shard
    nxt = spec.model_copy(update={"io": spec.io.model_copy(update={"output_uri": str(tmp_path / "out2")})})
    plan2 = build_plan(nxt)
    assert plan2.sizing is not None and plan2.sizing.evidence.basis == "config"
    assert len(plan2.shards) == 1 and plan2.shards[0].rows == n


def test_config_basis_sizes_to_the_default_target_with_start_at_most_10_percent(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:05d}" for i in range(10_000)], ["some ticket"] * 10_000)
    spec = spec_with_history(tmp_path)
    # 10 rows/s, 60 s engine start -> shards of >= 600 s, i.e. >= 540 s (5400 rows) of inference each
    write_history(tmp_path / "history", {"20261128T030000Z-a-b.jsonl": [record(spec, engine_start_s=60.0)]})
    plan = build_plan(spec)
    assert plan.sizing.target_s == 600.0 and plan.sizing.est_infer_s == 1000.0
    rows = [s.rows for s in plan.shards]
    assert sum(rows) == 10_000 and len(rows) == 1  # floor(1000 / 540) = 1: two shards would each start > 10%
    for r in rows:
        infer = r / 10.0
        assert 60.0 / (60.0 + infer) <= 0.10

    # engine start 30 s -> the 5-minute floor rules: 270 s of inference per shard -> 3 shards
    write_history(tmp_path / "history", {"20261128T030000Z-a-b.jsonl": [record(spec)]})
    plan = build_plan(spec)
    assert plan.sizing.target_s == 300.0 and len(plan.shards) == 3
    assert all(30.0 / (30.0 + s.rows / 10.0) <= 0.10 for s in plan.shards)


def test_explicit_target_minutes_and_max_shards(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:05d}" for i in range(10_000)], ["some ticket"] * 10_000)
    spec = spec_with_history(tmp_path, target_minutes=2.0)
    write_history(tmp_path / "history", {"20261128T030000Z-a-b.jsonl": [record(spec)]})
    plan = build_plan(spec)
    # 120 s shards, 30 s start: 90 s of inference = 900 rows at most -> ceil(1000 / 90) = 12 shards
    assert plan.sizing.shards == 12 and plan.sizing.target_rows == 834
    assert all(s.rows <= 900 for s in plan.shards) and sum(s.rows for s in plan.shards) == 10_000
    capped = spec_with_history(tmp_path, target_minutes=2.0, max_shards=5)
    assert len(build_plan(capped).shards) == 5


def test_model_basis_uses_tokens_per_s_and_the_jobs_own_token_estimate(tmp_path):
    spec = spec_with_history(tmp_path)
    other_job = record(spec, config_hash="x" * 64, rows_per_s=99.0)  # same model, another prompt
    ev = find_evidence(spec, [other_job])
    assert ev.basis == "model" and ev.tokens_per_s == pytest.approx(1520.0)
    work = estimate_workload(
        spec, rows=1000, est_text_tokens=50_000, evidence=ev, assumed_tokens_per_s=1.0, assumed_engine_start_s=0.0
    )
    overhead = prompt_overhead_tokens(spec)  # system prompt + "Ticket: " of make_spec
    assert overhead == -(-len("Classify the ticket.Ticket: ") // 4)
    assert work.prompt_tokens == 50_000 + 1000 * overhead
    assert work.completion_tokens == 2000 and work.completion_basis == "history"
    assert work.infer_s == pytest.approx((work.prompt_tokens + 2000) / 1520.0)
    assert work.throughput_basis == "history:model" and work.engine_start_s == 30.0
    # completion per row never exceeds this job's max_tokens
    long_gen = record(spec, config_hash="y" * 64, completion_tokens=10_000_000, completion_tokens_per_row=1000.0)
    assert estimate_workload(spec, 1000, 0, find_evidence(spec, [long_gen]), 1.0, 0.0).completion_tokens == 8 * 1000


def test_evidence_matches_model_task_tp_and_hardware(tmp_path):
    spec = spec_with_history(tmp_path)
    newest_a100 = record(spec, hardware="1x NVIDIA A100-SXM4-80GB", rows=100, infer_s=100.0)
    older_h200 = record(spec, rows=1000, infer_s=50.0)
    other_model = record(spec, model="other", rows=1, infer_s=1.0)
    tp2 = record(spec, tensor_parallel_size=2, rows=1, infer_s=1.0)
    recs = [other_model, tp2, newest_a100, older_h200]
    assert find_evidence(spec, recs).hardware == "1x NVIDIA A100-SXM4-80GB"  # default: the newest's hardware
    h200 = spec_with_history(tmp_path, hardware="1x NVIDIA H200")
    ev = find_evidence(h200, recs)
    assert ev.hardware == "1x NVIDIA H200" and ev.rows_per_s == 20.0 and ev.records == 1
    assert find_evidence(spec_with_history(tmp_path, hardware="8x B200"), recs) is None
    assert find_evidence(spec, [other_model, tp2]) is None


def test_no_matching_history_falls_back_to_target_rows(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:05d}" for i in range(250)], ["x y"] * 250)
    spec = spec_with_history(tmp_path)
    write_history(tmp_path / "history", {"20261128T030000Z-a-b.jsonl": [record(spec, model="another-model")]})
    plan = build_plan(spec)
    assert plan.sizing is None and sorted(s.rows for s in plan.shards) == [83, 83, 84]  # ceil(250/100) = 3
    no_history = make_spec(tmp_path / "in", tmp_path / "out", sharding={"target_rows": None})
    assert size_shards(no_history, 250, 1000) is None
    assert len(build_plan(no_history).shards) == -(-250 // DEFAULT_TARGET_ROWS)


def test_read_history_skips_bad_lines_and_files(tmp_path):
    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    write_history(
        h,
        {
            "20261127T030000Z-a-b.jsonl": [record(spec, rows=7)],
            "20261128T030000Z-a-b.jsonl": [record(spec, rows=8), {"version": 99, "rows": 1, "infer_s": 1}],
        },
    )
    (h / "20261129T030000Z-c-d.jsonl").write_text('not json\n{"version": 1, "rows": 0, "infer_s": 1}\n[1, 2]\n')
    (h / "notes.txt").write_text("ignored")
    assert [r.rows for r in read_history(str(h))] == [8, 7]  # newest file first
    assert read_history(str(tmp_path / "absent")) == []


def test_a_history_folder_flooded_with_objects_is_skipped_with_a_warning_after_listing_no_more_than_its_bound(
    tmp_path, monkeypatch, caplog
):
    """The history is advisory: a folder holding more than ``HISTORY_LISTED`` entries (any names) is not read, a
    warning names it and the bound, and its listing stops there; the code before listed all of them and read the
    genuine records among them."""
    from airflow_provider_vllm.steps.plan import sizing

    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    write_history(h, {"20261127T030000Z-a-b.jsonl": [record(spec, rows=7)]})
    monkeypatch.setattr(sizing, "HISTORY_LISTED", 4, raising=False)
    for i in range(4):
        (h / f"planted-{i}.txt").write_text("")
    with caplog.at_level("WARNING"):
        assert read_history(str(h)) == []
    assert f"{h} holds more than 4 entries" in caplog.text and "sized without it" in caplog.text
    (h / "planted-0.txt").unlink()
    assert [r.rows for r in read_history(str(h))] == [7]


def test_history_on_s3(tmp_path, fake_engine_factory, monkeypatch):
    """The record is written and read through fsspec/DuckDB on a local S3 server (moto), reached the
    deployment way: AWS_ENDPOINT_URL and keys in the environment, nothing in the spec."""
    from airflow_provider_vllm.core.spec_guard import check_deployment
    from tests.support.s3server import MotoServer

    with MotoServer() as s3:
        s3.make_bucket("hist")
        for k, v in s3.deployment_env.items():
            monkeypatch.setenv(k, v)
        opts = {}
        write_parquet(tmp_path / "in" / "a.parquet", [f"t{i}" for i in range(40)], [f"ticket {i}" for i in range(40)])
        spec = make_spec(
            tmp_path / "in", tmp_path / "out", sharding={"target_rows": 20, "history_uri": "s3://hist/throughput"}
        )
        check_deployment(spec, [str(tmp_path), "s3://hist/throughput"])
        plan = plan_job(spec)
        for s in plan.shards:
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
        merge(spec)
        (rec,) = read_history("s3://hist/throughput", opts)
        assert rec.rows == 40 and rec.shards == 2


def test_unreadable_history_falls_back_with_a_warning(tmp_path, caplog, monkeypatch):
    from airflow_provider_vllm.core.storage import Storage

    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i}" for i in range(150)], ["x"] * 150)
    (tmp_path / "h" / "20261128T000000Z-a-b.jsonl").mkdir(parents=True)  # a folder DuckDB cannot read as a file
    spec = make_spec(
        tmp_path / "in", tmp_path / "out", sharding={"target_rows": 100, "history_uri": str(tmp_path / "h")}
    )
    with caplog.at_level("WARNING"):
        assert size_shards(spec, 150, 1000) is None
    assert "20261128T000000Z-a-b.jsonl (not a plain file" in caplog.text  # left out unread, named

    def unlistable(self, rel="", limit=0):
        raise PermissionError(f"list {self.uri(rel)}: access denied")

    monkeypatch.setattr(Storage, "listdir_sizes", unlistable)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert size_shards(spec, 150, 1000) is None
    assert "cannot read the throughput history" in caplog.text and "access denied" in caplog.text


# ---- engine start: warm (a restored shared compile cache) or cold -------------------------------------
def test_start_estimate_takes_the_warm_or_cold_starts_the_shards_will_pay():
    from airflow_provider_vllm.core.plan import Evidence
    from airflow_provider_vllm.steps.plan.sizing import (
        ASSUMED_COLD_START_S,
        ASSUMED_WARM_START_S,
        start_estimate,
    )

    def ev(**starts):
        base = {"basis": "config", "hardware": "1x NVIDIA H200", "records": 1, "rows": 1, "infer_s": 1.0}
        rates = {"rows_per_s": 1.0, "tokens_per_s": 1.0, "prompt_tokens_per_row": 1.0, "completion_tokens_per_row": 1.0}
        return Evidence(**base, **rates, **{"engine_start_s": None, **starts})

    both = ev(engine_start_s=75.0, engine_start_warm_s=41.0, engine_start_cold_s=110.0)
    assert (start_estimate(both, True).seconds, start_estimate(both, True).basis) == (41.0, "history:warm")
    assert (start_estimate(both, False).seconds, start_estimate(both, False).basis) == (110.0, "history:cold")
    assert (start_estimate(both, None).seconds, start_estimate(both, None).basis) == (75.0, "history")
    only_all = ev(engine_start_s=30.0)  # history from before the shared cache: a small model's starts
    assert (start_estimate(only_all, True).seconds, start_estimate(only_all, True).basis) == (30.0, "assumed:warm")
    assert start_estimate(ev(engine_start_s=300.0), True).seconds == ASSUMED_WARM_START_S
    assert (start_estimate(only_all, False).seconds, start_estimate(only_all, False).basis) == (30.0, "history")
    assert start_estimate(None, False).seconds == ASSUMED_COLD_START_S
    assert start_estimate(None, True).seconds == ASSUMED_WARM_START_S
    assert start_estimate(None, None) == start_estimate(ev(), None) and start_estimate(None, None).seconds == 0.0
    assert start_estimate(None, False, 55.0).seconds == 55.0  # the caller's assumption wins over the measured one


def test_shards_are_sized_for_the_start_they_will_pay_warm_or_cold(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:05d}" for i in range(10_000)], ["some ticket"] * 10_000)
    spec = spec_with_history(tmp_path)
    # 10 rows/s: 1000 s of inference; starts 41 s warm, 110 s cold
    rec = record(spec, engine_start_s=75.0, engine_start_warm_s=41.0, engine_start_cold_s=110.0)
    write_history(tmp_path / "history", {"20261128T030000Z-a-b.jsonl": [rec]})
    warm = build_plan(spec, warm_starts=True)
    cold = build_plan(spec, warm_starts=False)
    assert (warm.sizing.engine_start_s, warm.sizing.engine_start_basis) == (41.0, "history:warm")
    assert (cold.sizing.engine_start_s, cold.sizing.engine_start_basis) == (110.0, "history:cold")
    assert warm.sizing.target_s == 410.0 and cold.sizing.target_s == 1100.0
    assert len(warm.shards) == 2 and len(cold.shards) == 1  # floor(1000 / 369) = 2; floor(1000 / 990) = 1
    for plan in (warm, cold):
        start = plan.sizing.engine_start_s
        assert all(start / (start + s.rows / 10.0) <= 0.10 for s in plan.shards)
    assert build_plan(spec).sizing.engine_start_basis == "history"  # the local runner: all starts pooled


def test_merged_runs_record_warm_and_cold_starts_apart(tmp_path, fake_engine_factory, monkeypatch):
    """A worker with the shared compile cache says whether it restored a snapshot; the history keeps the
    medians of warm and cold starts apart (restore and publish seconds counted in)."""
    from airflow_provider_vllm.steps.plan.sizing import run_records
    from airflow_provider_vllm.worker import compile_cache

    n = 200
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:04d}" for i in range(n)], [f"ticket {i}" for i in range(n)])
    spec = spec_with_history(tmp_path)
    shared = tmp_path / "compile-cache"
    shared.mkdir()
    for name, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "ind"), ("TRITON_CACHE_DIR", "tri")):
        monkeypatch.setenv(name, str(tmp_path / "pod" / sub))
    monkeypatch.setenv("VLLM_BATCH_COMPILE_CACHE", str(shared))
    monkeypatch.setattr(compile_cache, "accelerator", lambda: "cpu:test")
    plan = plan_job(spec)
    for s in plan.shards:  # one after the other: the first compiles and publishes, the second restores
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    markers = []
    from airflow_provider_vllm.core.commit import CommitMarker

    for s in plan.shards:
        raw = (tmp_path / "out" / "shards" / s.shard_id / "_COMMITTED.json").read_text()
        markers.append(CommitMarker.model_validate_json(raw))
    assert [m.stats.compile_cache for m in markers] == ["cold", "warm"]
    assert all(m.stats.compile_cache_s is not None for m in markers)
    # the fake engine starts in no time: give the markers a real engine's starts
    markers = [
        m.model_copy(update={"stats": m.stats.model_copy(update={"engine_start_s": s})})
        for m, s in zip(markers, (110.0, 41.0))
    ]
    (rec,) = run_records(spec, plan, markers)
    cold, warm = (m.stats.engine_start_s + m.stats.compile_cache_s for m in markers)
    assert rec.engine_start_cold_s == round(cold, 3) and rec.engine_start_warm_s == round(warm, 3)
    assert rec.engine_start_s == round((cold + warm) / 2, 3)  # the median of all starts, as before


def test_history_records_this_deployment_did_not_seal_for_the_folder_are_not_used(tmp_path, caplog):
    """Whoever else can write the history folder chose the shards' size: a record of enormous throughput made the
    next plan one shard of every row (hours on one GPU), a record of a trickle made max_shards of them. A record is
    used only with the seal of this deployment's merge for that folder."""
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:04d}" for i in range(300)], ["ticket text"] * 300)
    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    genuine = record(spec, rows=8)
    forged = json.dumps(record(spec, rows=10**9, infer_s=1.0).dump()) + "\n"  # no seal
    elsewhere = history_line(tmp_path / "other-history", record(spec, rows=10**9, infer_s=1.0))  # another folder's
    tampered = json.loads(history_line(h, record(spec)))
    tampered["rows_per_s"] = 1e9  # changed after the merge sealed it
    h.mkdir()
    (h / "20261127T030000Z-a-b.jsonl").write_text(history_line(h, genuine))
    (h / "20261128T030000Z-c-d.jsonl").write_text(forged + elsewhere + json.dumps(tampered) + "\n")
    with caplog.at_level("WARNING"):
        assert [r.rows for r in read_history(str(h))] == [8]
    assert "3 throughput record(s) under" in caplog.text and "not used for sizing" in caplog.text
    (h / "20261127T030000Z-a-b.jsonl").unlink()  # only the forged ones left: the plan sizes by target_rows
    plan = build_plan(spec)
    assert plan.sizing is None and len(plan.shards) == 3


def test_a_copied_old_record_under_a_newer_name_neither_leads_nor_outweighs_the_history(tmp_path, caplog):
    """Files were taken newest first by name, which whoever can write the folder chooses: 30 copies of one old sealed
    record (another GPU, a trickle) named after every merge made it the newest, picked its hardware and filled
    all 20 pooled places (250 shards instead of 3). Records are ordered by their sealed time, each counted once,
    and files named after now are not read."""
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:05d}" for i in range(10_000)], ["some ticket"] * 10_000)
    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    old = record(spec, recorded_at="2020-01-01T00:00:00Z", hardware="1x NVIDIA A10", rows=10, infer_s=1e4)
    write_history(h, {"20200101T000000Z-a-b.jsonl": [old], "20261128T030000Z-c-d.jsonl": [record(spec)]})
    assert len(build_plan(spec).shards) == 3
    for i in range(30):
        (h / f"20261201T0000{i:02d}Z-a-b.jsonl").write_bytes((h / "20200101T000000Z-a-b.jsonl").read_bytes())
    (h / "99991231T000000Z-a-b.jsonl").write_bytes((h / "20200101T000000Z-a-b.jsonl").read_bytes())
    with caplog.at_level("WARNING"):
        assert [r.recorded_at for r in read_history(str(h))] == ["2026-11-28T03:00:00Z", "2020-01-01T00:00:00Z"]
    assert "30 throughput record(s) under" in caplog.text and "copies of a record already read" in caplog.text
    assert "99991231T000000Z-a-b.jsonl (named after now" in caplog.text
    plan = build_plan(spec)
    assert plan.sizing.evidence.hardware == "1x NVIDIA H200" and plan.sizing.evidence.records == 1
    assert len(plan.shards) == 3


def test_a_history_file_bigger_than_a_merge_writes_is_not_read_and_is_named(tmp_path, caplog):
    """A planted file of millions of lines was read whole (DuckDB, then every line validated and its seal checked)
    before any was refused: the plan's memory and time. A file over HISTORY_FILE_BYTES (64 KiB; a merge writes
    about 1 KB per hardware) is not read, and the warning names it."""
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:05d}" for i in range(10_000)], ["some ticket"] * 10_000)
    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    write_history(h, {"20261128T030000Z-c-d.jsonl": [record(spec)]})
    big_line = history_line(h, record(spec, recorded_at="2026-11-29T00:00:00Z", rows=10, infer_s=1e4))
    pad = "{}\n" * 30_000  # 90,000 bytes
    (h / "20261129T000000Z-e-f.jsonl").write_text(big_line + pad)  # sealed, but in no file a merge writes
    with caplog.at_level("WARNING"):
        assert [r.recorded_at for r in read_history(str(h))] == ["2026-11-28T03:00:00Z"]
    assert f"20261129T000000Z-e-f.jsonl ({len(big_line) + len(pad)} bytes" in caplog.text
    assert len(build_plan(spec).shards) == 3


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs")
def test_a_fifo_in_the_history_folder_is_not_read_and_is_named(tmp_path, caplog):
    """A FIFO named like a history file blocked the plan's read of the history for as long as no one wrote to it."""
    import os

    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    write_history(h, {"20261128T030000Z-c-d.jsonl": [record(spec)]})
    os.mkfifo(h / "20261130T000000Z-g-h.jsonl")
    with caplog.at_level("WARNING"):
        assert [r.recorded_at for r in read_history(str(h))] == ["2026-11-28T03:00:00Z"]
    assert "20261130T000000Z-g-h.jsonl (not a plain file" in caplog.text


def _swapped_after_listing(monkeypatch, h, name, swap):
    """``read_history`` with the file ``name`` of the history folder ``h`` replaced by ``swap(path)`` once the folder
    is listed: what a writer of the folder can do between the listing's checks and the read."""
    from airflow_provider_vllm.steps.plan import sizing

    real = sizing._window

    def window(store, uri):
        names = real(store, uri)
        assert name in names  # the listing saw a small plain file
        (h / name).unlink()
        swap(h / name)
        return names

    monkeypatch.setattr(sizing, "_window", window)


@pytest.mark.timeout(120)  # the read before followed the link: /dev/zero never ends
@pytest.mark.parametrize("target", ["/dev/zero", "sealed-elsewhere"])
def test_a_history_file_swapped_for_a_link_after_the_listing_is_not_followed(tmp_path, monkeypatch, caplog, target):
    """The listing refused links, then DuckDB opened each listed path itself: a name swapped for a link after the
    listing was followed (to /dev/zero: an endless read of the planning worker; to a file outside the folder: its
    records read). Each file is read with O_NOFOLLOW: the plan goes on without it, and a warning names it."""
    import os

    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    name = "20261129T000000Z-e-f.jsonl"
    write_history(h, {"20261128T030000Z-c-d.jsonl": [record(spec)], name: [record(spec, rows=5)]})
    if target != "/dev/zero":
        target = str(tmp_path / "outside.jsonl")
        with open(target, "w") as f:  # a record sealed for this folder, kept elsewhere
            f.write(history_line(h, record(spec, recorded_at="2026-11-29T00:00:00Z", rows=10, infer_s=1e4)))
    _swapped_after_listing(monkeypatch, h, name, lambda p: os.symlink(target, p))
    with caplog.at_level("WARNING"):
        assert [r.recorded_at for r in read_history(str(h))] == ["2026-11-28T03:00:00Z"]
    assert f"{name} (a symbolic link, refused unopened)" in caplog.text


@pytest.mark.timeout(120)  # the read before blocked on the FIFO's open for as long as no one wrote to it
@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs")
def test_a_history_file_swapped_for_a_fifo_after_the_listing_is_not_read(tmp_path, monkeypatch, caplog):
    """A FIFO put in place of a listed file after the listing blocked DuckDB's open of it: the Airflow worker that
    plans hung. It is refused unopened (opened without blocking, then found no regular file), named in a warning."""
    import os

    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    name = "20261129T000000Z-e-f.jsonl"
    write_history(h, {"20261128T030000Z-c-d.jsonl": [record(spec)], name: [record(spec, rows=5)]})
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:05d}" for i in range(10_000)], ["some ticket"] * 10_000)
    _swapped_after_listing(monkeypatch, h, name, os.mkfifo)
    with caplog.at_level("WARNING"):
        plan = build_plan(spec)  # the plan finishes, sized by the file that was read
    assert plan.sizing.evidence.records == 1 and len(plan.shards) == 3
    assert f"{name} (is not a regular file" in caplog.text


def test_a_history_file_grown_over_the_bound_after_the_listing_is_not_read(tmp_path, monkeypatch, caplog):
    """The bound was checked on the size listed; the read had none (a file grown after the listing was read whole).
    No more than HISTORY_FILE_BYTES + 1 bytes of a file are read, and one over it is skipped, named."""
    from airflow_provider_vllm.steps.plan.sizing import HISTORY_FILE_BYTES

    spec = spec_with_history(tmp_path)
    h = tmp_path / "history"
    name = "20261129T000000Z-e-f.jsonl"
    write_history(h, {"20261128T030000Z-c-d.jsonl": [record(spec)], name: [record(spec, rows=5)]})
    line = history_line(h, record(spec, recorded_at="2026-11-29T00:00:00Z", rows=10, infer_s=1e4))

    def grown(p):
        with open(p, "w") as f:
            f.write(line)
            f.truncate(HISTORY_FILE_BYTES + 1)  # sparse past the sealed line: one byte over the bound
            f.seek(HISTORY_FILE_BYTES)
            f.write("\n")

    _swapped_after_listing(monkeypatch, h, name, grown)
    with caplog.at_level("WARNING"):
        assert [r.recorded_at for r in read_history(str(h))] == ["2026-11-28T03:00:00Z"]
    assert f"{name} (is larger than {HISTORY_FILE_BYTES} bytes" in caplog.text


def test_rows_refused_before_the_engine_are_not_throughput(tmp_path, fake_engine_factory):
    """A night of mostly empty rows (EMPTY_INPUT: never sent to the engine) was recorded as that many rows inferred
    in the few seconds the rest took: the history's rows/s was the empty rows', and the next normal night of the
    same job was cut into a few shards of hours each. Only rows the engine got count."""
    n, real = 300, 12
    write_parquet(
        tmp_path / "in" / "a.parquet",
        [f"t{i:04d}" for i in range(n)],
        [f"ticket {i} text" if i < real else " " * i for i in range(n)],  # blank, and distinct: not deduped
    )
    spec = spec_with_history(tmp_path)
    plan = plan_job(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    marker = json.loads((tmp_path / "out" / "shards" / plan.shards[0].shard_id / "_COMMITTED.json").read_text())
    assert marker["stats"]["infer_rows"] == real and marker["error_rows"] >= 1 and marker["rows"] == 100
    merge(spec)
    (rec,) = read_history(str(tmp_path / "history"))
    assert rec.rows == real and rec.shards == 1  # shards that sent no row to the engine are no evidence
    assert rec.completion_tokens_per_row == 2.0  # per row the engine answered: the fake engine's two tokens
