"""No worker outlives its task; stopping always works (real processes, no mocks of the OS).

* ``kill -9`` of the Airflow task process mid-shard: a stand-in task process runs the real
  ``VllmLocalShardOperator.execute`` (local runner, real worker CLI); the worker and its engine
  process (the fake engine forks one like vLLM's engine core; the real-vLLM test has vLLM's
  own) are gone within a bound, asserted by pid; the retry completes; nothing lost or duplicated.
* A retry never runs next to a live earlier attempt on one host: the per-shard lock kills a
  stale attempt (its task process gone) and waits for, then refuses to run beside, a live one.
* SIGTERM during the plan load, row reads, the reuse scan, chunk writes and the commit (the
  fault harness parks the worker there): exit 75 within a bound; the rerun completes. The
  same parked points without SIGTERM: the watchdog stops the worker (exit 75, ``Stalled``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.lifecycle import LOCK_DIR_ENV, LOCK_WAIT_ENV, lock_path, start_time
from airflow_provider_vllm.worker.task import worker_command
from tests.conftest import ENGINE_PROCESSES, worker_environ
from tests.support.data import make_spec, shard_task, write_parquet
from tests.support.ledger import record_fault
from tests.support.reconcile import check, check_no_partial

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

from tests.support import ROOT  # noqa: E402

STOP_BOUND_S = 60.0  # generous for a loaded 2-core CI machine; the stop itself takes well under a second
# The watchdog of the hang tests. Their retry runs under the same spec (the same limit) and must not be stopped by
# a loaded machine's pause: 2 s was, once (no progress for 2.1 s, with two test processes beside other work).
HANG_WATCHDOG_S = 8.0

# Stands in for `python`: runs the real worker entrypoint with the fake engine, which forks a
# sleeping child process the way vLLM forks its engine core. FAKE_BLOCK_SIGTERM=1 blocks
# SIGTERM in every thread, as a main thread stuck in native code never runs Python's handler.
FAKE_PYTHON = f"""#!{sys.executable}
import multiprocessing, os, signal, sys, time
sys.path.insert(0, {str(ROOT)!r})
from airflow_provider_vllm.worker import __main__ as worker_main
from airflow_provider_vllm.worker import shard
from tests.support.fakes import FakeEngine

def engine(spec):
    e = FakeEngine(spec, real_vllm=False)  # no `import vllm` (seconds per worker): these jobs set no per-row options
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
    p.start()
    print(f"fake engine core pid={{p.pid}}", file=sys.stderr, flush=True)
    e.core = p
    return e

if __name__ == "__main__":
    assert sys.argv[1:3] == ["-m", "airflow_provider_vllm.worker"], sys.argv
    if os.environ.get("FAKE_BLOCK_SIGTERM") == "1":
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
    shard._default_engine = engine
    worker_main.entrypoint(sys.argv[3:])
"""

# The Airflow task process: the shard operator's execute() as Airflow runs it for one try.
TASK = """
import json, sys
from types import SimpleNamespace
from airflow_provider_vllm.operators import VllmLocalShardOperator
spec, shard, python, try_number = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
op = VllmLocalShardOperator(task_id="shard", spec=spec, shard=shard, python=python or None, progress_interval_s=0.2)
op._worker_line = lambda line: print("worker | " + line, file=sys.stderr, flush=True)
m = op.execute({"ti": SimpleNamespace(map_index=0, try_number=try_number)})
print("MANIFEST " + json.dumps(m), flush=True)
"""


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def reap_started():
    """Whatever a failing test leaves running is killed (process trees, by pid)."""
    yield
    while _STARTED:
        p = _STARTED.pop()
        try:
            tree = psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for c in tree + [p]:
            try:
                c.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        p.wait(timeout=30)
        if getattr(p, "own_group", False):  # engine processes a killed worker left in its group
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def started(p: subprocess.Popen, own_group: bool = False) -> subprocess.Popen:
    p.own_group = own_group
    _STARTED.append(p)
    return p


@pytest.fixture
def fake_python(tmp_path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    return {
        **os.environ,  # the task process's (the Airflow side's signing key); a worker started here: worker_environ
        **ENGINE_PROCESSES,  # what a killed or stopped task leaves of vLLM's own processes
        "PYTHONPATH": str(ROOT),
        LOCK_DIR_ENV: str(tmp_path / "locks"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def job(tmp_path: Path, n: int = 160, **over) -> tuple[JobSpec, dict, list[str]]:
    ids = [f"t{i:04d}" for i in range(n)]
    half = n // 2  # two input files: two segments to read
    for k, part in enumerate((ids[:half], ids[half:])):
        write_parquet(
            tmp_path / "in" / f"part-{k}.parquet",
            part,
            [f"ticket {i}: I was charged twice" for i in part],
            row_group_size=32,
        )
    spec = make_spec(tmp_path / "in", tmp_path / "out", sharding={"target_rows": 10_000, "chunk_rows": 16}, **over)
    (shard,) = plan_job(spec).mapped_shards()  # the plan task's value: it names the sealed plan
    return spec, shard.dump(), ids


def chunks(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "out" / "shards").glob("*/attempts/*/chunk-?????.parquet"))


def sealed_chunks(tmp_path: Path) -> list[Path]:
    """Complete chunks: a chunk's files come before its seal, and a kill between the two leaves one to redo."""
    return sorted((tmp_path / "out" / "shards").glob("*/attempts/*/chunk-?????.seal.json"))


def wait_for(cond, bound_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process ended first (rc {proc.returncode}): {log.read_text()[-3000:] if log else ''}")
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {bound_s} s; {log.read_text()[-3000:] if log else ''}")


def gone(pid: int) -> bool:
    """Ended (a zombie waiting for init to reap it has ended too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_task(spec: JobSpec, shard: dict, python: str, try_number: int, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return started(
            subprocess.Popen(
                [sys.executable, "-c", TASK, spec.model_dump_json(), json.dumps(shard), python, str(try_number)],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )


def task_manifest(log: Path) -> dict:
    lines = [x for x in log.read_text().splitlines() if x.startswith("MANIFEST ")]
    assert lines, log.read_text()[-3000:]
    return json.loads(lines[-1][len("MANIFEST ") :])


# ---- kill -9 of the Airflow task process ------------------------------------------------


@pytest.mark.parametrize("stuck", [False, True], ids=["signal_path", "main_thread_stuck"])
def test_kill9_of_the_task_process_ends_the_worker_and_its_engine_process_and_the_retry_completes(
    tmp_path, fake_python, env, stuck
):
    spec, shard, ids = job(tmp_path)
    log1 = tmp_path / "try1.log"
    # the worker parks after its 2nd chunk (mid-shard); stuck: with SIGTERM blocked in every thread
    task = start_task(
        spec,
        shard,
        fake_python,
        1,
        {**env, "VLLM_BATCH_FAULTS": "chunk.after_write#2=hang", "FAKE_BLOCK_SIGTERM": "1" if stuck else "0"},
        log1,
    )
    wait_for(lambda: "hang at chunk.after_write" in log1.read_text(), 120, "worker parked mid-shard", task, log1)
    procs = psutil.Process(task.pid).children(recursive=True)
    worker = [p for p in procs if p.ppid() == task.pid]
    assert len(worker) == 1 and len(procs) == 2, procs  # the worker and its (fake) engine core
    pids = [p.pid for p in procs]
    lock = json.loads(Path(lock_path(spec.io.output_uri, shard["shard_id"], env)).read_text())
    assert lock["pid"] == worker[0].pid and lock["parent_pid"] == task.pid  # the lock names its holder

    task.kill()  # kill -9 of the Airflow task process
    task.wait(timeout=30)
    wait_for(lambda: all(gone(p) for p in pids), STOP_BOUND_S, f"worker and engine processes {pids} ended")
    assert not (tmp_path / "out" / "shards" / shard["shard_id"] / "_COMMITTED.json").exists()
    assert len(chunks(tmp_path)) == 2
    check_no_partial(tmp_path / "out")

    log2 = tmp_path / "try2.log"
    retry = start_task(spec, shard, fake_python, 2, env, log2)
    assert retry.wait(timeout=300) == 0, log2.read_text()[-3000:]
    m = task_manifest(log2)
    assert m["status"] == "committed" and m["rows"] == len(ids) and m["stats"]["reused_chunks"] == 2
    assert "killing stale attempt" not in log2.read_text()  # nothing was left to kill
    check(
        tmp_path / "out",
        ids,
        kind="kill9.task_process" + (".stuck_main_thread" if stuck else ""),
        committed_only=True,
        level="process",
    )


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_kill9_of_the_task_process_on_real_vllm_leaves_no_engine_core_behind(tmp_path, env):
    from airflow_provider_vllm.testing.local_models import default_cache_dir, make_tiny_llama
    from tests.vllm.test_worker_vllm import TICKETS, spec_for

    model = str(make_tiny_llama(default_cache_dir() / "tiny-llama"))
    n = 240  # 15 chunks of 16: the kill after the 1st lands well before the last (the retry does the rest)
    ids = [f"t{i:04d}" for i in range(n)]
    write_parquet(tmp_path / "in" / "a.parquet", ids, [TICKETS[i % 8] + f" (ref {i})" for i in range(n)])
    doc = spec_for(model, tmp_path, chunk_rows=16).model_dump(mode="json")
    doc["engine"]["max_num_seqs"] = 8
    spec = JobSpec.load(doc)
    (s,) = plan_job(spec).mapped_shards()
    shard = s.dump()
    log1 = tmp_path / "try1.log"
    task = start_task(spec, shard, "", 1, env, log1)
    wait_for(lambda: sealed_chunks(tmp_path), 600, "a first chunk committed", task, log1)
    procs = psutil.Process(task.pid).children(recursive=True)
    pids = [p.pid for p in procs]
    assert len(procs) >= 2, procs  # the worker and vLLM's engine core (at least)
    assert any(
        "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM") or p.ppid() != task.pid for p in procs
    )
    # worker/imports.py: scikit-learn, scipy, Ray and OpenTelemetry (whose OTLP exporter loads gRPC), installed in
    # this venv, are loaded neither by the worker nor by the engine core vLLM spawns (worker/spawned.py runs there
    # first), both of which imported vLLM (their compiled modules would be mapped).
    compiled = {"sklearn": "sklearn", "scipy": "scipy", "ray": "ray", "opentelemetry": "grpc"}
    skipped = [f"/{compiled[m]}/" for m in compiled if importlib.util.find_spec(m) is not None]
    assert len(skipped) == 4, f"only {skipped} are installed here: not everything was tested"
    (worker,) = [p for p in procs if "airflow_provider_vllm.worker" in p.cmdline()]
    # the production layout: vLLM's engine core and its worker process, spawned (they name themselves VLLM::...)
    engines = [p for p in worker.children(recursive=True) if " ".join(p.cmdline()).startswith("VLLM::")]
    assert len(engines) >= 2, [p.cmdline() for p in procs]
    for p in [worker, *engines]:
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        assert "/torch/" in maps and not [m for m in skipped if m in maps], (p.cmdline(), skipped)
    task.kill()
    task.wait(timeout=30)
    wait_for(lambda: all(gone(p) for p in pids), STOP_BOUND_S, f"worker and vLLM engine processes {pids} ended")
    sd = tmp_path / "out" / "shards" / s.shard_id
    assert not (sd / "_COMMITTED.json").exists(), "the shard finished before the kill: nothing was tested"
    done = len(sealed_chunks(tmp_path))  # what the retry must reuse (a chunk killed before its seal is redone)
    check_no_partial(tmp_path / "out")

    log2 = tmp_path / "try2.log"
    # the retry only has to finish the shard: vLLM's engine in the worker's own process starts in half the time
    retry = start_task(spec, shard, "", 2, {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, log2)
    assert retry.wait(timeout=900) == 0, log2.read_text()[-4000:]
    m = task_manifest(log2)
    assert m["status"] == "committed" and m["rows"] == n and m["stats"]["reused_chunks"] >= done
    check(tmp_path / "out", ids, kind="kill9.task_process.real_engine", committed_only=True, level="process")


# ---- the per-shard lock: never two attempts side by side --------------------------------

HOLDER = """
import json, os, sys, time
from airflow_provider_vllm.worker.lifecycle import ShardLock, lock_path
out, shard_id, parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
lock = ShardLock(lock_path(out, shard_id), shard_id, parent)
lock.acquire(5)
child = os.fork()  # like vLLM's engine core: inherits the lock
if child == 0:
    time.sleep(600)
    os._exit(0)
print(json.dumps({"pid": os.getpid(), "child": child}), flush=True)
time.sleep(600)
"""


def start_holder(spec: JobSpec, shard: dict, parent: int, env: dict) -> tuple[subprocess.Popen, list[int]]:
    """An earlier attempt holding the shard's lock (leads its own group, as the local runner starts it)."""
    p = started(
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, spec.io.output_uri, shard["shard_id"], str(parent)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ),
        own_group=True,
    )
    doc = json.loads(p.stdout.readline())
    return p, [doc["pid"], doc["child"]]


def run_local(spec: JobSpec, shard: dict, python: str, env: dict) -> tuple[int, dict | None, list[str]]:
    from airflow_provider_vllm.utils.worker_process import LocalWorkerProcess

    lines: list[str] = []
    argv = worker_command(shard_task(spec=spec, shard_id=shard["shard_id"], progress_interval_s=0.2), python=python)
    r = LocalWorkerProcess(argv, worker_environ(env), lines.append).run()  # as the local runner starts it
    return r.returncode, r.manifest, lines


def test_a_stale_attempt_whose_task_process_is_gone_is_killed_and_the_new_one_runs(tmp_path, fake_python, env):
    spec, shard, ids = job(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert start_time(dead.pid) is None
    holder, pids = start_holder(spec, shard, dead.pid, env)  # its task process is gone
    try:
        rc, m, lines = run_local(spec, shard, fake_python, env)
        assert rc == 0 and m["status"] == "committed", lines[-20:]
        assert any("killing stale attempt" in x and "task process is gone" in x for x in lines), lines[-20:]
        holder.wait(timeout=30)
        assert holder.returncode == -signal.SIGKILL
        wait_for(lambda: all(gone(p) for p in pids), STOP_BOUND_S, "stale attempt's processes ended")
    finally:
        holder.kill()
    check(tmp_path / "out", ids, kind="stale_attempt_killed_by_lock", committed_only=True, level="process")


def test_a_live_earlier_attempt_is_waited_for_then_refused_with_exit_75_and_never_run_beside(
    tmp_path, fake_python, env
):
    spec, shard, ids = job(tmp_path)
    holder, pids = start_holder(spec, shard, os.getpid(), env)  # its task process (this one) is alive
    try:
        rc, m, lines = run_local(spec, shard, fake_python, {**env, LOCK_WAIT_ENV: "1"})
        assert rc == 75 and m["terminal"] is False, lines[-20:]
        assert "an earlier attempt still runs on this host" in m["message"] and str(pids[0]) in m["message"]
        assert not chunks(tmp_path)  # nothing of the shard ran
        assert all(not gone(p) for p in pids)  # a live attempt is not killed
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # the holder's forked child keeps the lock: its worker is gone, so it is stale and killed
    rc, m, lines = run_local(spec, shard, fake_python, env)
    assert rc == 0 and m["status"] == "committed", lines[-20:]
    assert any("killing stale attempt" in x and "worker is gone" in x for x in lines), lines[-20:]
    wait_for(lambda: gone(pids[1]), STOP_BOUND_S, "the orphaned child ended")
    check(tmp_path / "out", ids, kind="live_attempt_refused_by_lock", committed_only=True, level="process")


def test_a_worker_whose_parent_is_already_gone_does_not_start(tmp_path, fake_python, env):
    spec, shard, _ = job(tmp_path, 20)
    argv = worker_command(shard_task(spec=spec, shard_id=shard["shard_id"]), python=fake_python)
    p = subprocess.run(
        argv, env={**worker_environ(env), "VLLM_BATCH_PARENT_PID": "1"}, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 75 and "already gone: not starting" in p.stderr
    assert not (tmp_path / "out" / "shards").exists() or not chunks(tmp_path)


# ---- SIGTERM and the watchdog at every phase -------------------------------------------


def start_worker(spec: JobSpec, shard: dict, python: str, env: dict, faults: str, log: Path) -> subprocess.Popen:
    argv = worker_command(shard_task(spec=spec, shard_id=shard["shard_id"], progress_interval_s=0.2), python=python)
    with open(log, "w") as f:
        return started(
            subprocess.Popen(
                argv,
                env={**worker_environ(env), "VLLM_BATCH_FAULTS": faults},
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            ),
            own_group=True,
        )


def last_json(log: Path) -> dict:
    return json.loads([x for x in log.read_text().splitlines() if x.startswith("{")][-1])


# (point, what a rerun reuses): chunk.before_write#3 parks before the 3rd part file
PHASES = [
    ("plan.load", None),
    ("read.segment#2", None),
    ("chunk.before_write#3", 2),
    ("commit.after_data", 10),
    ("commit.mid_marker", 10),
]


@pytest.mark.parametrize("point, reused", PHASES, ids=[p for p, _ in PHASES])
def test_sigterm_while_parked_in_a_phase_exits_75_within_a_bound_and_the_rerun_completes(
    tmp_path, fake_python, env, point, reused
):
    spec, shard, ids = job(tmp_path)
    log = tmp_path / "w1.log"
    w = start_worker(spec, shard, fake_python, env, f"{point}=hang", log)
    wait_for(lambda: f"hang at {point.split('#')[0]}" in log.read_text(), 120, f"parked at {point}", w, log)
    t0 = time.monotonic()
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=STOP_BOUND_S) == 75, log.read_text()[-3000:]
    stop_s = time.monotonic() - t0
    m = last_json(log)
    assert m["error"] == "Preempted" and m["terminal"] is False, m
    assert not (tmp_path / "out" / "shards" / shard["shard_id"] / "_COMMITTED.json").exists()
    check_no_partial(tmp_path / "out")
    log2 = tmp_path / "w2.log"
    again = start_worker(spec, shard, fake_python, env, "", log2)
    assert again.wait(timeout=300) == 0, log2.read_text()[-3000:]
    m2 = last_json(log2)
    assert m2["status"] == "committed", m2
    if reused is not None:
        assert m2["stats"]["reused_chunks"] == reused
    check(tmp_path / "out", ids, kind=f"sigterm.{point.split('#')[0]}", committed_only=True, level="process")
    assert stop_s < STOP_BOUND_S


# kill -9 at each step of a chunk's write (the file protocol, whatever the engine): (point, chunks it adds)
CHUNK_KILLS = [
    ("chunk.before_write", 0),
    ("chunk.mid_file", 0),
    ("chunk.between_parts", 0),  # between a chunk's errors part and its ok part: not complete, not reused
    ("chunk.before_seal", 1),  # both files, no seal: not complete, redone by the next attempt
    ("chunk.after_write", 1),
]


def test_kill9_at_each_step_of_a_chunk_write_leaves_nothing_partial_and_the_retry_completes(tmp_path, fake_python, env):
    """One shard through a SIGKILL at each chunk write point in turn (the real worker CLI and chunk protocol; the
    fake engine: a kill at our files, not vLLM's; tests/vllm/test_reliability_worker.py kills one of these
    points on real vLLM), then a retry commits every row exactly once."""
    spec, shard, ids = job(tmp_path)
    sd = tmp_path / "out" / "shards" / shard["shard_id"]
    for n, (point, new_chunks) in enumerate(CHUNK_KILLS):
        before = len(chunks(tmp_path))
        log = tmp_path / f"w{n}.log"
        w = start_worker(spec, shard, fake_python, env, f"{point}#1=kill", log)
        assert w.wait(timeout=300) == -signal.SIGKILL, (point, log.read_text()[-3000:])
        os.killpg(w.pid, signal.SIGKILL)  # the fake engine core the killed worker left (as vLLM's would be)
        assert f"kill at {point}" in log.read_text()
        assert len(chunks(tmp_path)) == before + new_chunks and not (sd / "_COMMITTED.json").exists(), point
        if point == "chunk.mid_file":
            assert any(".tmp-" in p.name for p in sd.rglob("*")), "the killed writer left its temp file"
        check_no_partial(tmp_path / "out")
    complete = len(sealed_chunks(tmp_path))
    assert complete == 1  # only the kill after a chunk's write left a complete one
    log = tmp_path / "retry.log"
    again = start_worker(spec, shard, fake_python, env, "", log)
    assert again.wait(timeout=300) == 0, log.read_text()[-3000:]
    m = last_json(log)
    assert m["status"] == "committed" and m["stats"]["reused_chunks"] == complete, m
    check(tmp_path / "out", ids, committed_only=True)
    for point, _ in CHUNK_KILLS:  # each kill reconciled by the one check after the retry, as the real-vLLM chain
        record_fault(f"kill9.{point}", len(ids), level="process")


WATCHED = ["plan.load", "read.segment#2", "chunk.before_write#3", "commit.after_data", "commit.mid_marker"]


@pytest.mark.parametrize("point", WATCHED)
def test_the_watchdog_stops_a_worker_hung_in_any_phase_with_exit_75(tmp_path, fake_python, env, point):
    spec, shard, ids = job(tmp_path, worker={"watchdog_s": HANG_WATCHDOG_S})
    log = tmp_path / "w1.log"
    w = start_worker(spec, shard, fake_python, env, f"{point}=hang", log)
    assert w.wait(timeout=120) == 75, log.read_text()[-3000:]
    text = log.read_text()
    assert f"hang at {point.split('#')[0]}" in text and "watchdog: no progress" in text
    m = last_json(log)
    assert m["error"] == "Stalled" and m["terminal"] is False
    check_no_partial(tmp_path / "out")
    again = start_worker(spec, shard, fake_python, env, "", tmp_path / "w2.log")
    assert again.wait(timeout=300) == 0
    check(tmp_path / "out", ids, kind=f"hang_watchdog.{point.split('#')[0]}", committed_only=True, level="process")


@pytest.mark.parametrize("stop", ["sigterm", "watchdog"])
def test_the_reuse_scan_is_watched_and_stoppable(tmp_path, fake_python, env, stop):
    """The reuse scan reads earlier attempts' chunk footers: parked there, SIGTERM and the watchdog both stop it."""
    spec, shard, ids = job(tmp_path, worker={"watchdog_s": HANG_WATCHDOG_S if stop == "watchdog" else 600})
    w = start_worker(spec, shard, fake_python, env, "commit.after_data=kill", tmp_path / "w0.log")
    assert w.wait(timeout=120) == -signal.SIGKILL  # every chunk written, no marker: the next attempt scans them
    log = tmp_path / "w1.log"
    w = start_worker(spec, shard, fake_python, env, "reuse.footer#4=hang", log)
    wait_for(lambda: "hang at reuse.footer" in log.read_text(), 120, "parked in the reuse scan", w, log)
    if stop == "sigterm":
        w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=STOP_BOUND_S) == 75, log.read_text()[-3000:]
    assert last_json(log)["error"] == ("Preempted" if stop == "sigterm" else "Stalled")
    again = start_worker(spec, shard, fake_python, env, "", tmp_path / "w2.log")
    assert again.wait(timeout=300) == 0
    assert last_json(tmp_path / "w2.log")["stats"]["reused_chunks"] == 10
    check(
        tmp_path / "out",
        ids,
        kind=("sigterm" if stop == "sigterm" else "hang_watchdog") + ".reuse.footer",
        committed_only=True,
        level="process",
    )


# ---- the lifecycle helpers as units ------------------------------------------------------


def test_holder_identity_uses_start_times_so_a_reused_pid_is_not_the_holder(tmp_path):
    from airflow_provider_vllm.worker.lifecycle import alive, stale

    me, parent = os.getpid(), os.getppid()
    assert isinstance(start_time(me), int) and start_time(2**22 + 12345) is None
    live = {"pid": me, "pid_start": start_time(me), "parent_pid": parent, "parent_start": start_time(parent)}
    assert alive(me, start_time(me)) and not alive(me, start_time(me) + 1) and not alive(None, 1)
    assert not stale(live)
    assert stale({**live, "pid_start": live["pid_start"] - 1})  # the holder's pid now names another process
    assert stale({**live, "parent_start": live["parent_start"] - 1})  # its task process was replaced
    assert stale({**live, "parent_pid": 2**22 + 12345, "parent_start": 1})  # its task process is gone


def test_a_live_holder_in_this_process_is_waited_for_with_a_bound(tmp_path):
    from airflow_provider_vllm.core.errors import TransientError
    from airflow_provider_vllm.worker.lifecycle import ShardLock

    path = str(tmp_path / "s.lock")
    first = ShardLock(path, "shard-00000-0123abcd", os.getppid())
    first.acquire(1)
    held = json.loads(Path(path).read_text())
    assert held["pid"] == os.getpid() and held["parent_pid"] == os.getppid()
    second = ShardLock(path, "shard-00000-0123abcd", os.getppid())
    t0 = time.monotonic()
    with pytest.raises(TransientError, match="an earlier attempt still runs on this host"):
        second.acquire(0.3)
    assert time.monotonic() - t0 < 30 and second.fd is None and not second.killed
    os.close(first.fd)  # released: the next attempt takes it at once
    second.acquire(0.3)
    os.close(second.fd)


def test_the_lock_folder_must_be_a_folder_of_this_user(tmp_path):
    from airflow_provider_vllm.core.errors import TransientError
    from airflow_provider_vllm.worker.lifecycle import lock_dir

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(TransientError, match="not a folder owned by this user"):
        lock_dir({LOCK_DIR_ENV: str(tmp_path / "link")})
    assert lock_dir({LOCK_DIR_ENV: str(tmp_path / "new")}) == str(tmp_path / "new")
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700


def test_preempted_is_not_an_exception():
    from airflow_provider_vllm.worker.__main__ import Preempted

    assert issubclass(Preempted, BaseException) and not issubclass(Preempted, Exception)
    try:
        try:
            raise Preempted("signal 15")
        except Exception:  # noqa: BLE001 - what the broad handlers in the worker look like
            pytest.fail("swallowed")
    except Preempted:
        pass


def test_exit_leaves_the_rest_of_a_shell_pipeline_alone():
    """Run by hand as ``worker ... | tee log`` under job control, the worker leads its group but not a
    session: its exit kills its own descendants only, never the pipeline's other commands."""
    script = (
        f"set -m\n{sys.executable} -c 'from airflow_provider_vllm.worker.exits import exit_hard; "
        "import os; print(os.getpid() == os.getpgrp(), flush=True); exit_hard(0)' "
        "| (sleep 1; cat; echo pipeline-survived)\n"
    )
    p = subprocess.run(
        ["bash", "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120
    )
    assert p.stdout.split() == ["True", "pipeline-survived"], (p.stdout, p.stderr)
