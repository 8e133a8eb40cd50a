"""The worker's logic around the engine, with a fake engine (fast). Real vLLM: test_worker_vllm.py."""

import json
import shutil
import threading

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.core.errors import CommitError, EngineError, SpecError, VerificationError
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import LABELS, make_spec, merge, shard_task, write_parquet
from tests.support.reconcile import check


def planted_parquet(tmp_path, n=300):
    ids = [f"t{i:04d}" for i in range(n)]
    texts = [f"my invoice number {i} was charged twice" for i in range(n)]
    texts[3] = None  # EMPTY_INPUT
    texts[10] = "   "  # EMPTY_INPUT
    texts[42] = "word " * 2000  # PROMPT_TOO_LONG (max_model_len 1024)
    texts[99] = "bad\x00byte"  # INVALID_ROW
    write_parquet(tmp_path / "in" / "part-0.parquet", ids[:200], texts[:200], row_group_size=32)
    write_parquet(tmp_path / "in" / "part-1.parquet", ids[200:], texts[200:], row_group_size=32)
    return {"t0003": "EMPTY_INPUT", "t0010": "EMPTY_INPUT", "t0042": "PROMPT_TOO_LONG", "t0099": "INVALID_ROW"}


def run_all(spec, factory, **kw):
    plan = plan_job(spec)
    return plan, [
        run_shard(shard_task(spec=spec, shard_id=s.shard_id, **kw), engine_factory=factory) for s in plan.shards
    ]


def read_out(out):
    return (pq.read_table(out / "results").to_pylist(), pq.read_table(out / "errors").to_pylist())


def test_planted_bad_rows_exactly_once(tmp_path, fake_engine_factory):
    planted = planted_parquet(tmp_path)
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    plan, manifests = run_all(spec, fake_engine_factory)
    assert all(m["status"] == "committed" for m in manifests)
    summary = merge(spec).dump()
    res, err = read_out(tmp_path / "out")
    assert summary["ok_rows"] == len(res) == 296 and summary["error_rows"] == len(err) == 4
    assert {e["id"]: e["error_code"] for e in err} == planted
    ids = [r["id"] for r in res] + [e["id"] for e in err]
    assert sorted(ids) == [f"t{i:04d}" for i in range(300)]
    assert all(r["label"] in LABELS and r["valid"] for r in res)
    r0 = res[0]
    assert r0["config_hash"] == spec.output_hash() and r0["engine_version"] == "fake-0"
    assert r0["shard_id"].startswith("shard-") and r0["attempt_id"].startswith("a")
    assert r0["prompt_tokens"] > 0 and r0["latency_ms"] >= 0 and r0["finish_reason"] == "stop"


def test_truncate_policy_cuts_long_rows(tmp_path, fake_engine_factory):
    planted_parquet(tmp_path)
    spec = make_spec(tmp_path / "in", tmp_path / "out", prompt={"truncation": "truncate"})
    run_all(spec, fake_engine_factory)
    merge(spec)
    res, err = read_out(tmp_path / "out")
    row = next(r for r in res if r["id"] == "t0042")
    assert row["truncated"] is True and row["prompt_tokens"] <= 1024 - 8
    assert "t0042" not in {e["id"] for e in err}


def test_jsonl_bad_lines(tmp_path, fake_engine_factory):
    p = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"j{i}", "text": f"ticket {i}"}) for i in range(40)]
    lines[5] = '{"id": "j5", "text": '  # truncated JSON
    lines[6] = json.dumps({"id": "j6", "text": 12345})  # int where text is expected
    lines[7] = json.dumps({"id": "j7", "text": ""})
    lines[8] = "[1, 2, 3]"  # valid JSON, not an object
    lines.insert(9, "")  # blank line: not a row
    p.write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode())  # BOM + CRLF
    spec = make_spec(p, tmp_path / "out")
    run_all(spec, fake_engine_factory)
    merge(spec)
    res, err = read_out(tmp_path / "out")
    codes = {e["id"]: e["error_code"] for e in err}
    assert codes == {
        "__line__:in.jsonl:6": "INVALID_JSON",
        "j6": "INVALID_ROW",
        "j7": "EMPTY_INPUT",
        "__line__:in.jsonl:9": "INVALID_JSON",
    }
    assert len(res) + len(err) == 40 and "j0" in {r["id"] for r in res}


@pytest.mark.reliability
def test_crash_then_resume_reuses_finished_chunks(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(100)], [f"text {i}" for i in range(100)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 100, "chunk_rows": 10})
    plan = plan_job(spec)
    (shard,) = plan.shards
    # every step fails from the 46th row on: bisected down to one request, then the probe fails
    # too, so it is the engine (exit 75), not a row
    with pytest.raises(EngineError, match=r"probe request failed .*injected"):
        run_shard(
            shard_task(spec=spec, shard_id=shard.shard_id),
            engine_factory=lambda s: fake_engine_factory(s, crash_after=45),
        )
    shard_dir = tmp_path / "out" / "shards" / shard.shard_id
    assert not (shard_dir / MARKER).exists()
    done_before = list(shard_dir.glob("attempts/*/chunk-?????.parquet"))  # ok parts: complete chunks
    assert 1 <= len(done_before) < 10
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    assert m["status"] == "committed" and m["stats"]["reused_chunks"] == len(done_before)
    assert fake_engine_factory.made[-1].submitted == 100 - 10 * len(done_before)
    marker = json.loads((shard_dir / MARKER).read_text())
    assert len({f["path"].split("/")[3] for f in marker["files"]}) == 2  # chunks of both attempts
    merge(spec)
    res, err = read_out(tmp_path / "out")
    assert sorted(r["id"] for r in res) == sorted(f"r{i}" for i in range(100)) and not err
    check(tmp_path / "out", [f"r{i}" for i in range(100)], kind="engine_crash_mid_shard")


@pytest.mark.reliability
def test_rerun_after_success_is_a_noop(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(30)], ["x"] * 30)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    plan, _ = run_all(spec, fake_engine_factory)
    n = len(fake_engine_factory.made)
    marker_before = (tmp_path / "out" / "shards" / plan.shards[0].shard_id / MARKER).read_bytes()
    _, again = run_all(spec, fake_engine_factory)
    assert [m["status"] for m in again] == ["already_committed"]
    assert len(fake_engine_factory.made) == n  # no engine started
    assert (tmp_path / "out" / "shards" / plan.shards[0].shard_id / MARKER).read_bytes() == marker_before
    first = merge(spec).dump()
    second = merge(spec).dump()
    assert first["checksums"] == second["checksums"]  # byte-identical merged output
    check(tmp_path / "out", [f"r{i}" for i in range(30)], kind="rerun_after_success")


@pytest.mark.reliability
def test_two_concurrent_attempts_commit_once(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(200)], ["some text"] * 200)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 200, "chunk_rows": 20})
    (shard,) = plan_job(spec).shards
    barrier = threading.Barrier(2)
    results = {}

    def attempt(name):
        def factory(s):
            barrier.wait()  # both attempts are past the marker check before either infers
            return fake_engine_factory(s, per_step=3)

        results[name] = run_shard(
            shard_task(spec=spec, shard_id=shard.shard_id, attempt_id=name), engine_factory=factory
        )

    threads = [threading.Thread(target=attempt, args=(n,)) for n in ("attempt-a", "attempt-b")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    statuses = sorted(r["status"] for r in results.values())
    assert statuses == ["already_committed", "committed"]
    winner = json.loads((tmp_path / "out" / "shards" / shard.shard_id / MARKER).read_text())["attempt_id"]
    assert {r["attempt_id"] for r in results.values()} == {winner}
    merge(spec)
    res, _ = read_out(tmp_path / "out")
    assert len(res) == 200 and len({r["id"] for r in res}) == 200
    assert {r["attempt_id"] for r in res} == {winner}
    check(tmp_path / "out", [f"r{i}" for i in range(200)], kind="concurrent_attempts")


@pytest.mark.reliability
def test_an_attempt_that_outlives_its_run_never_commits_into_the_run_planned_after_it(tmp_path, fake_engine_factory):
    """A worker of a run (a zombie pod) is still inferring when its output prefix is emptied and the job planned
    again there with another prompt (the same shard ids: the input and sharding did not change). It must not take
    the shard's create-only marker in the new run's folder: the new run's worker commits, and merge publishes the
    new prompt's answers."""
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(40)], [f"text {i}" for i in range(40)])
    sharding = {"target_rows": 40, "chunk_rows": 10}
    old = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding=sharding)
    (shard,) = plan_job(old).shards
    started, go = threading.Event(), threading.Event()
    outcome = {}

    def paused(s):  # the old run's engine starts only once the folder was planned again
        started.set()
        assert go.wait(60)
        return fake_engine_factory(s)

    def zombie():
        try:
            outcome["old"] = run_shard(shard_task(spec=old, shard_id=shard.shard_id), engine_factory=paused)
        except CommitError as e:
            outcome["old"] = e

    t = threading.Thread(target=zombie)
    t.start()
    assert started.wait(60)
    shutil.rmtree(tmp_path / "out")
    new = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding=sharding, prompt={"template": "Q: {text}"})
    (again,) = plan_job(new).shards
    assert again.shard_id == shard.shard_id
    go.set()
    t.join()
    assert isinstance(outcome["old"], CommitError) and "planned again" in str(outcome["old"])
    assert not (tmp_path / "out" / "shards" / shard.shard_id / MARKER).exists()
    assert run_shard(shard_task(spec=new, shard_id=again.shard_id), engine_factory=fake_engine_factory)["status"] == (
        "committed"
    )
    merge(new)
    res, err = read_out(tmp_path / "out")
    assert sorted(r["id"] for r in res) == sorted(f"r{i}" for i in range(40)) and not err
    assert {r["config_hash"] for r in res} == {new.output_hash()} != {old.output_hash()}


def test_the_worker_runs_under_the_plan_the_plan_tasks_value_names(tmp_path, fake_engine_factory):
    """What the operators hand the worker: the plan task's value (XCom) names the sealed plan, as written."""
    from airflow_provider_vllm.core.plan import plan_sha256, read_plan
    from airflow_provider_vllm.worker.task import ShardTask

    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(20)], [f"x{i}" for i in range(20)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    (summary,) = plan_job(spec).mapped_shards()
    on_disk, _ = read_plan(spec)
    assert (summary.plan_mac, summary.plan_sha256) == (on_disk.seal.mac, plan_sha256(on_disk))
    task = ShardTask(spec=spec, shard_id=summary.shard_id, plan_mac=summary.plan_mac, plan_sha256=summary.plan_sha256)
    assert run_shard(task, engine_factory=fake_engine_factory)["status"] == "committed"


@pytest.mark.reliability
def test_a_worker_refuses_a_plan_swapped_for_another_sealed_plan_or_a_forged_one(tmp_path, fake_engine_factory):
    """The worker holds no key that checks a plan: it takes ``_plan.json`` only when it is the record its task
    names. Another sealed plan of the same output (an earlier plan of the folder put back: its seal is good for this
    folder, so the HMAC alone would take it), the right plan with its seal kept and its content changed, and a plan
    sealed by hand with the worker key (what code in a worker could compute) are refused before a row is read;
    nothing is written under shards/."""
    import hashlib
    import hmac

    from airflow_provider_vllm.core import seal as seals
    from airflow_provider_vllm.core.errors import SealError
    from airflow_provider_vllm.core.plan import PLAN_FILE, Plan, load_plan
    from airflow_provider_vllm.core.seal import Keyring
    from tests.conftest import TEST_WORKER_KEY

    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(40)], [f"text {i}" for i in range(40)])
    out = tmp_path / "out"
    other = make_spec(tmp_path / "in.parquet", out, prompt={"template": "Q: {text}"})
    (other_shard,) = plan_job(other).shards
    earlier = (out / PLAN_FILE).read_bytes()  # a sealed plan of this folder, from a run before
    shutil.rmtree(out)
    spec = make_spec(tmp_path / "in.parquet", out)
    (shard,) = plan_job(spec).shards
    assert shard.shard_id == other_shard.shard_id
    task = shard_task(spec=spec, shard_id=shard.shard_id)
    mine = (out / PLAN_FILE).read_bytes()
    plan = Plan.model_validate_json(mine)
    changed = plan.model_copy(update={"total_rows": plan.total_rows + 1})  # the seal kept, the content not
    with pytest.raises(SealError, match="cannot seal or check 'plan' records"):
        plan.sealed(Keyring.from_text(TEST_WORKER_KEY, worker=True), str(out))
    doc = seals.sealed_doc(changed)
    msg = b"\x00".join([seals.FORMAT, seals.PLAN.encode(), seals.scope_of(str(out)).encode(), seals.canonical(doc)])
    mac = hmac.new(TEST_WORKER_KEY.encode(), msg, hashlib.sha256).hexdigest()
    forged = changed.model_copy(update={"seal": seals.Seal(kid=seals.kid_of(TEST_WORKER_KEY.encode()), mac=mac)})
    deployment = Keyring.from_env()
    for planted in (earlier, changed.dump_json(), forged.dump_json()):
        (out / PLAN_FILE).write_bytes(planted)
        with pytest.raises(CommitError, match="not the plan this shard task was started for"):
            run_shard(task, engine_factory=fake_engine_factory)
        assert not (out / "shards").exists()
        if planted is earlier:  # sealed for this folder: only the task's naming of the plan tells them apart
            load_plan(other, keyring=deployment)
        else:  # nor does the Airflow side take a changed or forged plan
            with pytest.raises(SealError):
                load_plan(spec, keyring=deployment)
    (out / PLAN_FILE).write_bytes(mine)
    assert run_shard(task, engine_factory=fake_engine_factory)["status"] == "committed"


def test_a_secret_in_the_engines_environment_reaches_neither_the_bucket_nor_the_xcom(
    tmp_path, fake_engine_factory, monkeypatch
):
    """The worker names its engine's environment in every chunk seal and its commit marker; until 2026-12 that
    named VLLM_API_KEY's value, for whoever reads the bucket."""
    key = "sk-LEAKCANARY-0123456789"
    monkeypatch.setenv("VLLM_API_KEY", key)
    write_parquet(tmp_path / "in" / "part-0.parquet", ["a", "b", "c"], ["x y", "z w", "v u"])
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    plan, manifests = run_all(spec, fake_engine_factory)
    assert all(m["status"] == "committed" for m in manifests)
    merge(spec)
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert any(p.name == MARKER for p in files)
    assert [str(p) for p in files if key.encode() in p.read_bytes()] == []
    assert key not in json.dumps(manifests)


def test_merge_refuses_uncommitted_and_tampered(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(50)], [f"x{i}" for i in range(50)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 25})
    plan = plan_job(spec)
    run_shard(shard_task(spec=spec, shard_id=plan.shards[0].shard_id), engine_factory=fake_engine_factory)
    with pytest.raises(CommitError, match="1 of 2 shard"):
        merge(spec)
    run_shard(shard_task(spec=spec, shard_id=plan.shards[1].shard_id), engine_factory=fake_engine_factory)
    marker = json.loads((tmp_path / "out" / "shards" / plan.shards[1].shard_id / MARKER).read_text())
    path = tmp_path / "out" / marker["files"][0]["path"]
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(CommitError, match="does not match its commit marker"):
        merge(spec)


@pytest.mark.reliability
def test_a_committed_chunk_replaced_afterwards_is_refused_with_a_way_to_resume(tmp_path, fake_engine_factory):
    """A chunk file a committed marker names is replaced in the bucket (a valid Parquet file of other rows). Merge
    refuses naming the part and the shard, and says how to go on: rerunning the shard task alone is a no-op (it is
    committed); once its marker is deleted, the rerun redoes only the replaced chunk and the merge publishes every
    row once."""
    ids = [f"r{i}" for i in range(40)]
    write_parquet(tmp_path / "in.parquet", ids, [f"text {i}" for i in range(40)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 40, "chunk_rows": 10})
    (shard,) = plan_job(spec).shards
    task = shard_task(spec=spec, shard_id=shard.shard_id)
    run_shard(task, engine_factory=fake_engine_factory)
    marker_path = tmp_path / "out" / "shards" / shard.shard_id / MARKER
    files = json.loads(marker_path.read_text())["files"]
    (tmp_path / "out" / files[1]["path"]).write_bytes((tmp_path / "out" / files[2]["path"]).read_bytes())
    with pytest.raises(CommitError, match="does not match its commit marker") as refused:
        merge(spec)
    told = str(refused.value)
    assert files[1]["path"] in told and f"delete shards/{shard.shard_id}/{MARKER}" in told
    assert run_shard(task, engine_factory=fake_engine_factory)["status"] == "already_committed"
    with pytest.raises(CommitError, match="does not match its commit marker"):
        merge(spec)
    marker_path.unlink()  # as the message says
    again = run_shard(task, engine_factory=fake_engine_factory)
    assert again["status"] == "committed" and again["stats"]["reused_chunks"] == 3
    assert fake_engine_factory.made[-1].submitted == 10
    merge(spec)
    res, err = read_out(tmp_path / "out")
    assert sorted(r["id"] for r in res) == sorted(ids) and not err
    check(tmp_path / "out", ids, kind="committed_chunk_replaced")


def test_merge_verification_catches_a_lost_row(tmp_path, fake_engine_factory):
    """If a committed chunk lacked a row (a bug), merge names the missing id."""
    import pyarrow as pa

    from airflow_provider_vllm.core.commit import ShardStore
    from airflow_provider_vllm.core.seal import COMMIT, record_bytes, scope_of, seal_record

    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(20)], [f"x{i}" for i in range(20)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"chunk_rows": 20})
    (shard,) = plan_job(spec).shards
    run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=fake_engine_factory)
    from tests.unit.steps.merge.test_merger import run_seal

    store = ShardStore(
        __import__("airflow_provider_vllm.core.storage", fromlist=["Storage"]).Storage(str(tmp_path / "out")),
        shard.shard_id,
        run_seal(tmp_path / "out"),
    )
    marker = store.marker()
    rel = marker.files[0].path
    t = pq.read_table(tmp_path / "out" / rel)
    t = t.filter(pa.compute.not_equal(t.column("id"), "r7"))
    t = pa.concat_tables([t, t.slice(0, 1)])  # same count, r0 twice, r7 lost
    pq.write_table(t, tmp_path / "out" / rel)
    marker.files[0] = marker.files[0].model_copy(
        update={"bytes": (tmp_path / "out" / rel).stat().st_size, "sha256": store.out.sha256(rel)}
    )
    # written and sealed by a worker with a bug: merge's own verification is what catches it
    unsealed = marker.model_copy(update={"seal": None})
    resealed = seal_record(store.run.keyring, COMMIT, scope_of(str(tmp_path / "out")), unsealed)
    (tmp_path / "out" / "shards" / shard.shard_id / MARKER).write_bytes(record_bytes(resealed))
    with pytest.raises(VerificationError, match=r"1 missing \(e.g. \['r7'\]\)"):
        merge(spec)


def test_openai_batch_in_and_out(tmp_path, fake_engine_factory):
    reqs = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "system", "content": "Classify."}, {"role": "user", "content": f"ticket {i}"}],
                "max_tokens": 5,
            },
        }
        for i in range(12)
    ]
    reqs[3]["body"]["messages"] = []
    reqs[4]["url"] = "/v1/completions"
    p = tmp_path / "batch.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    spec = make_spec(
        p, tmp_path / "out", io={"output_format": "openai_batch"}, prompt={"system_prompt": None, "template": "{text}"}
    )
    plan, _ = run_all(spec, fake_engine_factory)
    assert plan.format == "openai_batch"
    summary = merge(spec).dump()
    assert summary["ok_rows"] == 10 and summary["error_rows"] == 2
    out = [json.loads(x) for x in (tmp_path / "out" / "openai" / "output.jsonl").read_text().splitlines()]
    errs = [json.loads(x) for x in (tmp_path / "out" / "openai" / "errors.jsonl").read_text().splitlines()]
    assert len(out) == 10 and out[0]["response"]["status_code"] == 200
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] in LABELS
    assert {e["custom_id"]: e["error"]["code"] for e in errs} == {"req-3": "EMPTY_INPUT", "req-4": "INVALID_ROW"}


def test_worker_refuses_a_spec_that_does_not_match_the_plan(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in.parquet", ["a"], ["x"])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    (shard,) = plan_job(spec).shards
    other = make_spec(tmp_path / "in.parquet", tmp_path / "out", sampling={"max_tokens": 4})
    with pytest.raises(SpecError, match="another spec"):
        run_shard(shard_task(spec=other, shard_id=shard.shard_id), engine_factory=fake_engine_factory)


def test_empty_input_gives_no_shards_and_an_empty_merge(tmp_path, fake_engine_factory):
    import pyarrow as pa

    write_parquet(tmp_path / "in.parquet", pa.array([], pa.string()), pa.array([], pa.string()))
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    plan, _ = run_all(spec, fake_engine_factory)
    assert plan.shards == []
    s = merge(spec).dump()
    assert s["rows"] == 0 and s["ok_rows"] == 0
    res, err = read_out(tmp_path / "out")
    assert res == [] and err == []


def test_qa_stage_writes_report_with_input_excerpts(tmp_path, fake_engine_factory):
    from airflow_provider_vllm.steps.qa.stage import qa_run, qa_summary

    planted_parquet(tmp_path)
    spec = make_spec(tmp_path / "in", tmp_path / "out", qa={"sample_size": 20})
    run_all(spec, fake_engine_factory)
    merge(spec)
    report, paths = qa_run(spec)
    assert report.status in ("pass", "warn", "fail")
    html = (tmp_path / "out" / paths["report_html"]).read_text()
    assert "<svg" in html and "billing" in html
    sample = pq.read_table(tmp_path / "out" / paths["sample"]).to_pylist()
    drawn = [r for r in sample if r["qa_stratum"] != "least_confident"]  # + the least confident rows
    assert len(drawn) == 20 and len(sample) - len(drawn) == report.metrics["sample"]["least_confident"] > 0
    ok = [r for r in sample if r["status"] == "ok"]
    assert ok and all("invoice" in r["input_excerpt"] for r in ok)
    s = qa_summary(report, paths, str(tmp_path / "out"))
    assert s["report_html"].endswith("qa/report.html") and {c["name"] for c in s["checks"]} >= {"error_rate"}
    # 4 of 300 rows are errors: 1.3% > warn 1% -> warn
    err = next(c for c in s["checks"] if c["name"] == "error_rate")
    assert err["status"] == "warn"


# ---- confidence, prompt hashes, logprobs ----------------------------------------------------
def _engine_ids(spec, text):
    """The token ids the worker sends the fake engine for one template row."""
    from airflow_provider_vllm.worker.prompts import PromptBuilder
    from tests.support.fakes import FakeTokenizer

    return PromptBuilder(spec, FakeTokenizer(), 1024).prepare({"text": text}).token_ids


def test_structured_choice_rows_carry_the_engines_confidence(tmp_path, fake_engine_factory):
    from tests.support.fakes import confidence_of

    texts = [f"ticket {i % 7}" for i in range(40)]  # repeated texts: repeated prompts
    write_parquet(tmp_path / "in.parquet", [f"t{i}" for i in range(40)], texts)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    run_all(spec, fake_engine_factory)
    merge(spec).dump()
    res, _ = read_out(tmp_path / "out")
    by_text = {}
    for r in res:
        text = texts[int(r["id"][1:])]
        assert r["confidence"] == pytest.approx(confidence_of(spec, _engine_ids(spec, text)), rel=1e-6)
        by_text.setdefault(text, set()).add(r["prompt_hash"])
        assert r["logprobs"] is None  # no row asked for token logprobs
    assert all(len(h) == 1 for h in by_text.values()) and len({next(iter(h)) for h in by_text.values()}) == 7
    seen = [p for e in fake_engine_factory.made for _, p in e.params_seen]
    assert seen and all(p.logprobs == 0 for p in seen)  # the chosen tokens' logprobs only


@pytest.mark.parametrize(
    "sampling, hashed",
    [({"temperature": 0}, True), ({"temperature": 0.8}, False), ({"temperature": 0.8, "seed": 5}, True)],
)
def test_rows_of_requests_that_sample_at_random_get_no_prompt_hash(tmp_path, fake_engine_factory, sampling, hashed):
    """Two identical requests that sample at random (temperature > 0 without a seed) may get different answers by
    design: no prompt hash, so QA's consistency and the changes' reasons never compare them. Greedy and seeded
    requests keep theirs; the rows are the same otherwise."""
    texts = [f"ticket {i % 3}" for i in range(12)]
    write_parquet(tmp_path / "in.parquet", [f"t{i}" for i in range(12)], texts)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sampling=sampling, sharding={"dedupe": False})
    run_all(spec, fake_engine_factory)
    merge(spec).dump()
    res, err = read_out(tmp_path / "out")
    assert len(res) == 12 and not err
    if hashed:
        by_text = {}
        for r in res:
            by_text.setdefault(texts[int(r["id"][1:])], set()).add(r["prompt_hash"])
        assert all(len(h) == 1 and None not in h for h in by_text.values()) and len(by_text) == 3
    else:
        assert all(r["prompt_hash"] is None for r in res)


def test_an_openai_batch_rows_own_sampling_decides_its_prompt_hash(tmp_path, fake_engine_factory):
    """An OpenAI batch body's temperature and seed override the spec's, row by row."""

    def req(i, **extra):
        body = {"messages": [{"role": "user", "content": "the same ticket"}], "max_tokens": 5, **extra}
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}

    reqs = [
        req(0),  # the spec's: temperature 0
        req(1, temperature=0.7),
        req(2, temperature=0.7, seed=3),
        req(3, temperature=0),
        req(4, temperature=0.7),
    ]
    p = tmp_path / "batch.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    spec = make_spec(p, tmp_path / "out", prompt={"system_prompt": None, "template": "{text}"})
    run_all(spec, fake_engine_factory)
    merge(spec).dump()
    res, err = read_out(tmp_path / "out")
    assert not err
    got = {r["id"]: r["prompt_hash"] for r in res}
    assert got["req-1"] is None and got["req-4"] is None
    # the others are hashed, each with its own settings (one request's settings differ from the next one's)
    assert (
        None not in (got["req-0"], got["req-2"], got["req-3"]) and len({got["req-0"], got["req-2"], got["req-3"]}) == 3
    )


@pytest.mark.parametrize(
    "structured, confidence, asked",
    [(True, False, False), (False, None, False), (False, True, True)],
)
def test_logprobs_are_asked_for_only_when_needed(tmp_path, fake_engine_factory, structured, confidence, asked):
    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["x", "y"])
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out",
        sampling={"structured": {"choice": LABELS} if structured else None},
        qa={"confidence": confidence},
    )
    run_all(spec, fake_engine_factory)
    merge(spec).dump()
    res, _ = read_out(tmp_path / "out")
    assert all((r["confidence"] is not None) == asked for r in res)
    assert all((p.logprobs is not None) == asked for e in fake_engine_factory.made for _, p in e.params_seen)


def test_classify_confidence_is_the_top_class_probability(tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["x", "yy"])
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out",
        task="classify",
        sampling={"structured": None},
        prompt={"system_prompt": None},
    )
    run_all(spec, fake_engine_factory)
    merge(spec).dump()
    res, _ = read_out(tmp_path / "out")
    assert all(r["confidence"] == pytest.approx(max(r["scores"])) and r["prompt_hash"] is not None for r in res)


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_a_nan_or_infinite_vector_is_the_rows_engine_error_not_a_result(tmp_path, task):
    """NaN is no JSON (the OpenAI output line of such a row could not be parsed) and spoils every distance or
    argmax computed over the table: the row is an ENGINE_ERROR, the other rows are unchanged."""
    from tests.support.fakes import FakeEngine

    bad = {1: [float("nan"), 1.0, 0.5], 2: [1.0, float("inf"), 0.5], 3: [1e300, 1.0, 0.5], 4: []}

    class Broken(FakeEngine):
        def pool(self, prompts):
            out = super().pool(prompts)
            return [bad.get(p.count(ord("x") + 3), v) for p, v in zip(prompts, out)]  # by the row's n "x" tokens

    ids = [f"k{i}" for i in range(6)]
    write_parquet(tmp_path / "in.parquet", ids, ["x" * i for i in range(1, 7)])
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out",
        task=task,
        sampling={"structured": None},
        prompt={"system_prompt": None, "template": "{text}"},
        io={"output_format": "openai_batch"} if task == "embed" else {},
    )
    run_all(spec, lambda s: Broken(s, real_vllm=False))
    merge(spec).dump()
    res, err = read_out(tmp_path / "out")
    col = "embedding" if task == "embed" else "scores"
    assert {e["id"]: e["error_code"] for e in err} == {f"k{n - 1}": "ENGINE_ERROR" for n in bad}
    assert {r["id"] for r in res} == {"k4", "k5"} and all(len(r[col]) == 3 for r in res)
    assert "NaN or infinite" in next(e for e in err if e["id"] == "k0")["error_message"]
    if task == "embed":

        def strict(constant):  # strict JSON: no NaN / Infinity tokens
            raise AssertionError(f"{constant} in an OpenAI output line")

        for name in ("output.jsonl", "errors.jsonl"):
            for line in (tmp_path / "out" / "openai" / name).read_text().splitlines():
                json.loads(line, parse_constant=strict)


def test_openai_requests_get_logprobs_in_openais_shape(tmp_path, fake_engine_factory):
    def req(i, **extra):
        body = {"messages": [{"role": "user", "content": f"ticket {i}"}], "max_tokens": 5, **extra}
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}

    reqs = [req(0), req(1, logprobs=True), req(2, logprobs=True, top_logprobs=3), req(3, top_logprobs=2)]
    p = tmp_path / "batch.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    spec = make_spec(
        p, tmp_path / "out", io={"output_format": "openai_batch"}, prompt={"system_prompt": None, "template": "{text}"}
    )
    run_all(spec, fake_engine_factory)
    merge(spec).dump()
    out = {
        x["custom_id"]: x
        for x in map(json.loads, (tmp_path / "out" / "openai" / "output.jsonl").read_text().splitlines())
    }
    errs = [json.loads(x) for x in (tmp_path / "out" / "openai" / "errors.jsonl").read_text().splitlines()]
    assert [e["error"]["code"] for e in errs] == ["INVALID_REQUEST"]  # top_logprobs without logprobs
    choice = {k: v["response"]["body"]["choices"][0] for k, v in out.items()}
    assert choice["req-0"]["logprobs"] is None
    content = choice["req-1"]["logprobs"]["content"]
    assert [c["token"] for c in content] == [choice["req-1"]["message"]["content"], "<eos>"]
    assert all(set(c) == {"token", "logprob", "bytes", "top_logprobs"} and c["top_logprobs"] == [] for c in content)
    top = choice["req-2"]["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == 3 and top[0]["token"] == choice["req-2"]["message"]["content"]
    assert all(set(t) == {"token", "logprob", "bytes"} for t in top)


def test_a_rows_error_message_never_carries_a_secret_or_a_urls_credentials(tmp_path, fake_engine_factory, monkeypatch):
    """An engine's or a tokenizer's exception may echo a secret of the worker's environment (one the deployment set
    from a Secret under any name, ``VLLM_BATCH_MASKED_ENV``) or a URL with credentials; until 2026-12 the row's
    ``error_message`` took it whole into ``errors/`` (and an OpenAI batch's ``errors.jsonl``)."""
    from tests.support.fakes import FakeTokenizer

    secret = "db-SENTINEL-pass-77"
    monkeypatch.setenv("DB_PASS", secret)
    monkeypatch.setenv("VLLM_BATCH_MASKED_ENV", "DB_PASS")
    url = "https://user:URLSENTINEL@hub.internal/model"

    class Leaky(FakeTokenizer):
        def encode(self, text, add_special_tokens=True):
            if "LEAK" in text:
                raise TypeError(f"cannot encode with {secret} from {url}")
            return super().encode(text, add_special_tokens)

    def factory(s):
        e = fake_engine_factory(s)
        e.tokenizer = Leaky()
        return e

    write_parquet(tmp_path / "in.parquet", ["a", "b", "c"], ["x y", "LEAK here", "v u"])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    (shard,) = plan_job(spec).shards
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=factory)
    assert m["status"] == "committed"
    merge(spec)
    (err,) = pq.read_table(tmp_path / "out" / "errors").to_pylist()
    assert err["id"] == "b" and "cannot encode with *** from https://***@hub.internal/model" in err["error_message"]
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert [str(p) for p in files if b"SENTINEL" in p.read_bytes()] == []


@pytest.mark.parametrize("planted", [b"not json", b"{}", b'{"seal": null}', b"[1, 2]"])
def test_a_worker_refuses_a_plan_that_is_no_plan_without_retry(tmp_path, fake_engine_factory, planted):
    """Bytes at _plan.json that are no plan at all (not JSON, not a plan's fields) are not the plan the task names
    either: a terminal CommitError naming the file, as for another plan, not pydantic's error as a transient failure
    retried until the task runs out of tries. The Airflow side's readers refuse it the same way."""
    from airflow_provider_vllm.core.plan import PLAN_FILE, load_plan

    write_parquet(tmp_path / "in.parquet", [f"r{i}" for i in range(10)], [f"text {i}" for i in range(10)])
    out = tmp_path / "out"
    spec = make_spec(tmp_path / "in.parquet", out)
    (shard,) = plan_job(spec).shards
    task = shard_task(spec=spec, shard_id=shard.shard_id)
    (out / PLAN_FILE).write_bytes(planted)
    with pytest.raises(CommitError, match=r"_plan\.json is not a plan") as e:
        run_shard(task, engine_factory=fake_engine_factory)
    assert e.value.terminal
    assert not (out / "shards").exists()
    with pytest.raises(CommitError, match=r"_plan\.json is not a plan"):
        load_plan(spec)


# ---- typed template columns --------------------------------------------------------------------
def test_date_timestamptz_and_decimal_template_columns_are_answered(tmp_path, fake_engine_factory):
    """A date, a timestamp with a time zone and a decimal column in the template: every row was an INVALID_ROW error
    ("holds datetime, expected a scalar") after the engine started. Through plan -> shard -> merge now every row is
    answered, with the values rendered as the worker's rule says (the instant in UTC, the decimal's scale kept);
    repeated rows (the dedupe's leaders file, written by DuckDB) render as the input's own."""
    import datetime as dt
    import decimal

    import pyarrow as pa

    from tests.support.fakes import recording

    n = 24
    write_parquet(
        tmp_path / "in" / "a.parquet",
        [f"t{i}" for i in range(n)],
        [f"ticket {i % 12}" for i in range(n)],
        due=pa.array([dt.date(2024, 3, 1 + i % 12) for i in range(n)], pa.date32()),
        opened=pa.array(
            [dt.datetime(2024, 3, 1, 9, i % 12, tzinfo=dt.UTC) for i in range(n)],
            pa.timestamp("us", tz="Europe/Berlin"),
        ),
        amount=pa.array([decimal.Decimal(f"{i % 12}.50") for i in range(n)], pa.decimal128(10, 2)),
    )
    spec = make_spec(
        tmp_path / "in",
        tmp_path / "out",
        prompt={"template": "Ticket: {text} due {due} opened {opened} amount {amount}", "text_columns": ["text"]},
    )
    factory = recording(fake_engine_factory)
    seen = factory.prompts
    plan, manifests = run_all(spec, factory)
    assert all(m["status"] == "committed" for m in manifests)
    summary = merge(spec).dump()
    res, err = read_out(tmp_path / "out")
    assert err == [] and summary["error_rows"] == 0
    assert summary["ok_rows"] == len(res) == n and {r["id"] for r in res} == {f"t{i}" for i in range(n)}
    assert len(seen) == 12  # each distinct prompt once
    assert "<user>Ticket: ticket 5 due 2024-03-06 opened 2024-03-01 09:05:00+00:00 amount 5.50\n" in "".join(seen)
