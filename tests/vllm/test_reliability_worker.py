"""Faults against real worker processes on real vLLM (CPU build, tiny random Llama).

``python -m airflow_provider_vllm.worker`` runs exactly as in a pod; faults come from
``VLLM_BATCH_FAULTS`` (airflow_provider_vllm.core.faults): SIGKILL mid-chunk and at each step of the
commit marker (each other step of a chunk's write is killed with the fake engine, in
test_reliability_lifecycle.py), SIGTERM mid-shard, engine death and a hung engine step inside our
engine wrapper while real vLLM runs, OOM with back-off (real engine rebuilds) and an OOM that
persists for one row at the floors, and merge killed at each of its writes. Engine starts
cost ~25 s each here, so one test walks one shard through a chain of faults, checking the
state after each, and ends with a reconciliation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.merge.merger import ERRORS, MERGED, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.testing.local_models import default_cache_dir, make_tiny_llama
from airflow_provider_vllm.worker.task import worker_command
from tests.conftest import ENGINE_PROCESSES, worker_environ
from tests.support.data import merge, shard_task, write_parquet
from tests.support.ledger import record_fault
from tests.support.reconcile import check, check_no_partial
from tests.vllm.test_worker_vllm import ENV, TICKETS, spec_for

pytestmark = [pytest.mark.vllm, pytest.mark.reliability, pytest.mark.timeout(1500)]

MERGE = (
    "import sys\nfrom airflow_provider_vllm.steps.merge.merger import merge\n"
    "from airflow_provider_vllm.core.spec import JobSpec\n"
    "from airflow_provider_vllm.core.plan import current_plan_ref\n"
    "s = JobSpec.load(sys.argv[1])\nmerge(s, plan=current_plan_ref(s))\n"
)


@pytest.fixture(scope="module")
def tiny_model():
    return str(make_tiny_llama(default_cache_dir() / "tiny-llama"))


def dataset(tmp_path: Path, n: int) -> list[str]:
    ids = [f"t{i:04d}" for i in range(n)]
    write_parquet(tmp_path / "in" / "a.parquet", ids, [TICKETS[i % 8] + f" (ref {i})" for i in range(n)])
    return ids


def make_job(model: str, tmp_path: Path, engine: dict, worker: dict, chunk_rows: int) -> JobSpec:
    doc = spec_for(model, tmp_path, chunk_rows=chunk_rows).model_dump(mode="json")
    doc["engine"].update(engine)
    doc["worker"].update(worker)
    return JobSpec.load(doc)


class Worker:
    """One worker process of one shard, with faults from VLLM_BATCH_FAULTS.

    ``processes``: vLLM's engine core in its own process, as in a pod (SIGTERM, engine core deaths, hangs, OOM
    rebuilds). The kill -9 points are about our files, not vLLM's processes: their workers run the engine in
    their own process, which starts in about half the time.
    """

    n = 0

    def __init__(self, spec: JobSpec, shard_id: str, faults: str = "", processes: bool = True):
        cmd = worker_command(shard_task(spec=spec, shard_id=shard_id, progress_interval_s=1))
        env = {**worker_environ(ENV), **(ENGINE_PROCESSES if processes else {}), "VLLM_BATCH_FAULTS": faults}
        Worker.n += 1
        # files, not pipes: a SIGKILLed worker's orphaned engine core would hold pipes open
        logs = Path(spec.io.output_uri).parent / "logs"
        logs.mkdir(exist_ok=True)
        self.out_path, self.err_path = logs / f"{Worker.n}.out", logs / f"{Worker.n}.err"
        with open(self.out_path, "w") as o, open(self.err_path, "w") as e:
            self.proc = subprocess.Popen(cmd, env=env, stdout=o, stderr=e, text=True, start_new_session=True)
        self.stdout = self.stderr = ""

    def wait(self, timeout: float = 600) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            _kill_group(self.proc.pid)  # a killed worker leaves vLLM's engine processes behind
            self.stdout, self.stderr = self.out_path.read_text(), self.err_path.read_text()
        return self.proc.returncode

    def manifest(self) -> dict:
        lines = [x for x in self.stdout.splitlines() if x.startswith("{")]
        assert lines, f"no manifest; rc={self.proc.returncode}; stderr tail:\n{self.stderr[-3000:]}"
        return json.loads(lines[-1])


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(spec: JobSpec, shard_id: str, faults: str = "", processes: bool = True) -> Worker:
    w = Worker(spec, shard_id, faults, processes)
    w.wait()
    return w


def chunks(shard_dir: Path) -> list[Path]:
    return sorted(shard_dir.glob("attempts/*/chunk-?????.parquet"))


def merged_files(out: Path) -> dict[str, bytes]:
    """Every file under results/ and errors/ (temp files too) -> its bytes."""
    return {
        f"{kind}/{p.name}": p.read_bytes()
        for kind in (RESULTS, ERRORS)
        if (out / kind).exists()
        for p in sorted((out / kind).iterdir())
    }


def clear_merged(out: Path) -> None:
    for kind in (RESULTS, ERRORS):
        for p in (out / kind).iterdir() if (out / kind).exists() else ():
            p.unlink()
    (out / MERGED).unlink(missing_ok=True)


def temps(shard_dir: Path) -> list[Path]:
    return sorted(p for p in shard_dir.rglob("*") if ".tmp-" in p.name)


def test_one_shard_through_every_process_fault_then_merge_killed_at_every_write(tmp_path, tiny_model):
    ids = dataset(tmp_path, 240)
    spec = make_job(tiny_model, tmp_path, {"max_num_seqs": 16}, {"watchdog_s": 20}, chunk_rows=20)
    (shard,) = plan_job(spec).shards
    sd = tmp_path / "out" / "shards" / shard.shard_id
    injected: list[str] = []

    # 1. SIGTERM (preemption) once a chunk is committed: stops, exit 75, no marker, nothing partial. The worker
    # waits after its first chunk (a hang that SIGTERM interrupts): in a fast hour the tiny model wrote all 12
    # chunks before a SIGTERM sent on seeing the first one landed
    w = Worker(spec, shard.shard_id, "chunk.after_write#1=hang")
    deadline = time.monotonic() + 300
    while not chunks(sd) and time.monotonic() < deadline:
        assert w.proc.poll() is None, w.err_path.read_text()[-3000:]
        time.sleep(0.05)
    w.proc.send_signal(signal.SIGTERM)  # to the worker only, as the kubelet does to PID 1
    rc = w.wait(timeout=120)
    assert rc == 75, w.stderr[-3000:]
    m = w.manifest()
    assert m["status"] == "failed" and m["error"] == "Preempted" and m["terminal"] is False
    assert "committed chunks are kept" in w.stderr
    assert not (sd / MARKER).exists() and 1 <= len(chunks(sd)) < 12
    check_no_partial(tmp_path / "out")
    injected.append("sigterm")

    # 2. SIGKILL with half a chunk in its temp file (every other step of a chunk's write is killed in turn with
    # the fake engine, test_reliability_lifecycle.py: a kill at our files; an engine start here costs ~17 s each)
    before = len(chunks(sd))
    w = run(spec, shard.shard_id, "chunk.mid_file#1=kill", processes=False)
    assert w.proc.returncode == -signal.SIGKILL, w.stderr[-3000:]
    assert "kill at chunk.mid_file" in w.stderr
    assert len(chunks(sd)) == before and not (sd / MARKER).exists()
    assert temps(sd), "the killed writer left its temp file"
    check_no_partial(tmp_path / "out")
    injected.append("kill9.chunk.mid_file")

    # 3. the engine core process dies at step 10: exit 75, committed chunks kept
    before = chunks(sd)
    w = run(spec, shard.shard_id, "engine.step#10=dead")
    assert w.proc.returncode == 75, w.stderr[-3000:]
    m = w.manifest()
    assert m["error"] == "EngineError" and "the engine died" in m["message"] and m["terminal"] is False
    assert set(before) <= set(chunks(sd)) and not (sd / MARKER).exists()
    check_no_partial(tmp_path / "out")
    injected.append("engine_death")

    # 4. an engine step hangs: the watchdog (20 s) stops the worker, exit 75 (the watchdog is the worker's; the
    # engine runs in the worker's process here, and every other phase's hang is watched in the lifecycle tests)
    before = chunks(sd)
    w = run(spec, shard.shard_id, "engine.step#10=hang", processes=False)
    assert w.proc.returncode == 75, w.stderr[-3000:]
    m = w.manifest()
    assert m["error"] == "Stalled" and m["terminal"] is False
    assert "watchdog: no progress" in w.stderr
    assert set(before) <= set(chunks(sd)) and not (sd / MARKER).exists()
    check_no_partial(tmp_path / "out")
    injected.append("engine_hang_watchdog")

    # 5-7. SIGKILL after every chunk is written (no marker), mid-marker, after the marker
    w = run(spec, shard.shard_id, "commit.after_data=kill", processes=False)
    assert w.proc.returncode == -signal.SIGKILL, w.stderr[-3000:]
    assert {p.name for p in chunks(sd)} == {f"chunk-{k:05d}.parquet" for k in range(12)}
    assert not (sd / MARKER).exists()
    w = run(spec, shard.shard_id, "commit.mid_marker=kill", processes=False)
    assert w.proc.returncode == -signal.SIGKILL and "reused" in w.stderr
    assert "Initializing a V1 LLM engine" not in w.stderr  # every chunk reused: no engine start
    assert not (sd / MARKER).exists() and any(MARKER in p.name for p in temps(sd))
    w = run(spec, shard.shard_id, "commit.after_marker=kill", processes=False)
    assert w.proc.returncode == -signal.SIGKILL
    marker = json.loads((sd / MARKER).read_text())
    assert marker["rows"] == 240
    check_no_partial(tmp_path / "out")
    injected += ["kill9.commit.after_data", "kill9.commit.mid_marker", "kill9.commit.after_marker"]

    # 8. the retry after the marker (and after success) is a no-op
    m = run(spec, shard.shard_id).manifest()
    assert m["status"] == "already_committed" and m["attempt_id"] == marker["attempt_id"]
    assert json.loads((sd / MARKER).read_text()) == marker
    check(tmp_path / "out", ids, committed_only=True)

    # merge: an uninterrupted merge is the reference; then kill merge at every write and re-run
    out = tmp_path / "out"
    ref = merge(spec).dump()
    ref_bytes = merged_files(out)
    clear_merged(out)
    steps = (
        "merge.before_write",
        "merge.mid_file#1",
        "merge.between_parts#1",
        "merge.between_parts#2",
        "merge.after_manifests",
        "merge.after_data",
        "merge.mid_marker",
        "merge.after_marker",
    )
    for point in steps:
        p = subprocess.run(
            [sys.executable, "-c", MERGE, spec.model_dump_json()],
            env={**ENV, "VLLM_BATCH_FAULTS": f"{point}=kill"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == -signal.SIGKILL, (point, p.stderr[-3000:])
        assert (out / MERGED).exists() == (point == "merge.after_marker"), point  # "complete" only at the end
        visible = {rel: data for rel, data in merged_files(out).items() if "/." not in rel}
        assert all(ref_bytes[rel] == data for rel, data in visible.items()), point  # visible means whole
        check_no_partial(out)
        if point == "merge.mid_file#1":
            assert any(".tmp-" in p.name for p in (out / RESULTS).iterdir())
        injected.append(f"kill9.{point.split('#')[0]}")
        if point != "merge.after_marker":
            clear_merged(out)  # the next kill starts from nothing again
    again = merge(spec).dump()
    assert merged_files(out) == ref_bytes  # byte-identical parts and manifests
    assert again["checksums"] == ref["checksums"]

    rec = check(out, ids)
    assert len(rec.ok_ids) == 240
    for kind in injected:  # real processes: the worker, its engine core, the merge process
        record_fault(kind, len(ids), level="process")


def test_real_engine_oom_back_off_and_an_oom_row_at_the_floor(tmp_path, tiny_model):
    """2 real engine starts in one worker, vLLM's engine core in its own processes as in a pod: 4 seqs -> OOM at
    step 3 -> rebuilt at 2 (the floor); row t0030 brings OOM whenever it runs -> at the floor the rows in flight
    run one at a time -> t0030 alone -> ENGINE_OOM; every other row ok. (Back-offs in a row: the unit tests.)"""
    ids = dataset(tmp_path, 60)
    spec = make_job(
        tiny_model,
        tmp_path,
        {"max_num_seqs": 4, "max_num_batched_tokens": 256},
        {"oom_min_num_seqs": 2, "oom_min_batched_tokens": 128},
        chunk_rows=20,
    )
    (shard,) = plan_job(spec).shards
    w = run(spec, shard.shard_id, "engine.step#3=oom,engine.step@t0030=oom")
    assert w.proc.returncode == 0, w.stderr[-4000:]
    m = w.manifest()
    s = m["stats"]
    assert m["status"] == "committed" and m["ok_rows"] == 59 and m["error_rows"] == 1
    assert s["engine_rebuilds"] == 1 and s["oom_events"] == 3 and s["oom_error_rows"] == 1
    assert s["engine_limits"] == {"max_num_seqs": 2, "max_num_batched_tokens": 128}  # read back from vLLM
    assert w.stderr.count("Initializing a V1 LLM engine") == 2
    merge(spec)
    rec = check(tmp_path / "out", ids)
    assert rec.error_codes == {"t0030": "ENGINE_OOM"}
    res = pq.read_table(tmp_path / "out" / "results").to_pylist()
    assert all(r["valid"] for r in res)  # rows redone after the rebuilds are complete outputs
    record_fault("oom_transient_real_engine", len(ids))
    record_fault("oom_persistent_row_real_engine", len(ids), faults=s["oom_events"] - 1)
