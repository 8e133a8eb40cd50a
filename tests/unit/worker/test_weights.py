"""A local model or tokenizer folder changed between the plan and the shards (worker/weights.py, core/weights.py).

With the result cache on, the plan seals each file of a local model folder (name, size, sha256); the worker
checks the folder it loads against them and fails the shard (terminal) before it seals or commits anything.
The fake engine does not read the folder; the check does, which is what these tests exercise.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.core.errors import InputChangedError, SpecError
from airflow_provider_vllm.core.exit_codes import ExitCode
from airflow_provider_vllm.core.plan import PLAN_FILE, Plan
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker import weights as worker_weights
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import PINNED_REVISION, make_spec, shard_task

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"W" * 4096, "sub/extra.bin": b"x" * 100}


def folder(path: Path, files: dict[str, bytes] = FILES) -> Path:
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return path


def spec_for(tmp_path: Path, run: str = "a", cache: bool = True, **model):
    pq.write_table(
        pa.table({"id": [f"r{i}" for i in range(6)], "text": [f"t{i}" for i in range(6)]}), tmp_path / "in.parquet"
    )
    return make_spec(
        tmp_path / "in.parquet",
        tmp_path / f"out-{run}",
        model={"name": str(tmp_path / "model"), **model},
        sharding={"target_rows": 100, "chunk_rows": 2},
        **({"cache": {"uri": str(tmp_path / "cache")}} if cache else {}),
    )


def shard(spec, plan, factory, attempt=None):
    return run_shard(
        shard_task(spec=spec, shard_id=plan.shards[0].shard_id, attempt_id=attempt), engine_factory=factory
    )


def left(spec) -> tuple[list[str], list[str]]:
    """(commit markers, chunk seals) under the run's output prefix."""
    out = Path(spec.io.output_uri)
    return [str(p) for p in out.rglob(MARKER)], [str(p) for p in out.rglob("*.seal.json")]


def swap_same_size_and_mtime(path: Path, data: bytes) -> None:
    st = path.stat()
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_the_plan_pins_each_file_of_a_local_model_folder_and_the_shard_checks_it(tmp_path, fake_engine_factory):
    folder(tmp_path / "model")
    spec = spec_for(tmp_path)
    plan = plan_job(spec)
    [pin] = plan.weights
    assert pin.role == "model" and [f.path for f in pin.files] == sorted(FILES)
    assert pin.fingerprint() == plan.cache.key_config["model"]["weights_sha256"]
    assert shard(spec, plan, fake_engine_factory)["status"] == "committed"


def test_a_file_swapped_after_the_plan_with_the_same_size_and_mtime_fails_the_shard_and_seals_nothing(
    tmp_path, fake_engine_factory
):
    folder(tmp_path / "model")
    spec = spec_for(tmp_path)
    plan = plan_job(spec)
    swap_same_size_and_mtime(tmp_path / "model" / "model.safetensors", b"V" * 4096)
    with pytest.raises(InputChangedError, match=r"model\.safetensors is not the file the plan hashed") as e:
        shard(spec, plan, fake_engine_factory)
    assert e.value.exit_code == ExitCode.TERMINAL  # no retry
    assert fake_engine_factory.made  # it ran (the check costs no engine start) ...
    markers, seals = left(spec)
    assert markers == [] and seals == []  # ... and nothing of it can be committed or reused

    # a retry after the folder is put back redoes every chunk: none of the refused attempt's is reused
    swap_same_size_and_mtime(tmp_path / "model" / "model.safetensors", b"W" * 4096)
    got = shard(spec, plan, fake_engine_factory)
    assert got["status"] == "committed" and got["stats"]["reused_chunks"] == 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: (m / "added.bin").write_bytes(b"new"), r"added\.bin was added since the plan"),
        (lambda m: (m / "sub" / "extra.bin").unlink(), r"sub/extra\.bin was removed since the plan"),
        (lambda m: (m / "planted.safetensors").symlink_to(m.parent / "elsewhere"), r"planted\.safetensors was added"),
        (lambda m: os.truncate(m / "model.safetensors", 1 << 40), r"model\.safetensors is 1099511627776 bytes"),
    ],
    ids=["added", "removed", "symlink-planted", "huge-sparse"],
)
def test_a_model_folder_changed_after_the_plan_fails_the_shard_naming_the_file(
    tmp_path, fake_engine_factory, change, match
):
    folder(tmp_path / "model")
    (tmp_path / "elsewhere").write_bytes(b"other weights")
    spec = spec_for(tmp_path)
    plan = plan_job(spec)
    change(tmp_path / "model")
    t0 = time.monotonic()
    with pytest.raises(InputChangedError, match=match):
        shard(spec, plan, fake_engine_factory)
    assert time.monotonic() - t0 < 60  # the 1 TiB sparse file is refused by its size, unread
    assert left(spec) == ([], [])


def test_a_file_replaced_by_a_fifo_is_refused_unopened(tmp_path, fake_engine_factory):
    folder(tmp_path / "model")
    spec = spec_for(tmp_path)
    plan = plan_job(spec)
    (tmp_path / "model" / "config.json").unlink()
    os.mkfifo(tmp_path / "model" / "config.json")
    with pytest.raises(InputChangedError, match=r"config\.json cannot be read as a regular file"):
        shard(spec, plan, fake_engine_factory)


def test_a_swap_while_the_engine_loads_is_seen(tmp_path, fake_engine_factory):
    folder(tmp_path / "model")
    spec = spec_for(tmp_path)
    plan = plan_job(spec)

    def loads_other_weights(s, **kw):  # the folder changes while the engine starts (after the plan's check)
        swap_same_size_and_mtime(tmp_path / "model" / "config.json", b'{"model_type": "other"}')
        return fake_engine_factory(s, **kw)

    with pytest.raises(InputChangedError, match=r"config\.json is not the file the plan hashed"):
        shard(spec, plan, loads_other_weights)
    assert left(spec) == ([], [])


def test_a_changed_tokenizer_folder_fails_the_shard(tmp_path, fake_engine_factory):
    folder(tmp_path / "model")
    folder(tmp_path / "tok", {"tokenizer.json": b"{}", "tokenizer_config.json": b"{}"})
    spec = spec_for(tmp_path, tokenizer=str(tmp_path / "tok"))
    plan = plan_job(spec)
    assert [p.role for p in plan.weights] == ["model", "tokenizer"]
    swap_same_size_and_mtime(tmp_path / "tok" / "tokenizer.json", b"[]")
    with pytest.raises(InputChangedError, match=r"model\.tokenizer .*tokenizer\.json is not the file"):
        shard(spec, plan, fake_engine_factory)


def test_a_hub_model_has_no_folder_to_check(tmp_path, fake_engine_factory):
    spec = spec_for(tmp_path, name="org/model", revision=PINNED_REVISION)
    plan = plan_job(spec)
    assert plan.weights == []
    assert shard(spec, plan, fake_engine_factory)["status"] == "committed"


def test_chunks_are_not_sealed_while_the_check_runs(tmp_path, fake_engine_factory, monkeypatch):
    """A worker killed (kill -9) while it hashes leaves chunks no retry reuses and no marker."""
    folder(tmp_path / "model")
    spec = spec_for(tmp_path)
    plan = plan_job(spec)
    release = threading.Event()

    def slow_check(pin, stop):
        release.wait(30)
        raise InputChangedError("model.name: model.safetensors is not the file the plan hashed")

    monkeypatch.setattr(worker_weights, "check_folder", slow_check)
    failed: list[BaseException] = []

    def work():
        try:
            shard(spec, plan, fake_engine_factory)
        except BaseException as e:
            failed.append(e)

    t = threading.Thread(target=work)
    t.start()
    out = Path(spec.io.output_uri)
    deadline = time.monotonic() + 30
    while len(list(out.rglob("chunk-*.parquet"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(out.rglob("chunk-0000*.parquet"))) >= 3  # every chunk was written while the check ran ...
    assert left(spec) == ([], [])  # ... none sealed: a kill now leaves nothing a retry reuses or merge reads
    release.set()
    t.join(30)
    assert failed and isinstance(failed[0], InputChangedError)
    assert left(spec) == ([], [])


def test_a_plan_that_keys_the_weights_but_pins_no_files_is_refused(tmp_path, fake_engine_factory):
    folder(tmp_path / "model")
    spec = spec_for(tmp_path)
    plan = plan_job(spec)
    old = plan.model_copy(update={"weights": [], "seal": None}).sealed(Keyring.from_env(), spec.io.output_uri)
    (Path(spec.io.output_uri) / PLAN_FILE).write_bytes(old.dump_json())
    assert Plan.model_validate_json((Path(spec.io.output_uri) / PLAN_FILE).read_bytes()).weights == []
    with pytest.raises(SpecError, match="pins no files"):
        shard(spec, plan, fake_engine_factory)
    assert not fake_engine_factory.made


def test_without_the_cache_the_plan_hashes_no_weights(tmp_path, fake_engine_factory):
    folder(tmp_path / "model")
    spec = spec_for(tmp_path, cache=False)
    assert plan_job(spec).weights == []


def test_a_check_that_still_hashes_when_the_rows_are_done_is_progress_for_the_watchdog(tmp_path, monkeypatch):
    """The commit waits for the check (``WeightsCheck.wait``, which the shard gives its watchdog's beat): hashing
    that moves is not a stall (exit 75 and a retry that hashes again); a hashing pass that stops moving is."""
    folder(tmp_path / "model")
    plan = plan_job(spec_for(tmp_path))

    def slow_check(pin, tick):
        for _ in range(10):  # a block each 0.1 s
            time.sleep(0.1)
            tick()

    monkeypatch.setattr(worker_weights, "check_folder", slow_check)
    check = worker_weights.WeightsCheck(plan.weights)
    check.start("after load")
    beats: list[float] = []
    check.wait(lambda: beats.append(time.monotonic()))
    assert len(beats) >= 5  # a beat as blocks are hashed, not one at the end


@pytest.mark.parametrize("cache", [True, False])
def test_an_attempt_killed_before_its_seals_is_redone_by_the_retry_and_merged_once(
    tmp_path, fake_engine_factory, monkeypatch, cache
):
    """An attempt that wrote its chunks and died before sealing them (here: the first seal raises, as a kill there
    would stop it) leaves unsealed parts in its attempt folder; the retry redoes them, commits, and merge publishes
    every row exactly once (and, with the cache, files nothing of the dead attempt)."""
    from airflow_provider_vllm.core import faults
    from tests.support.data import merge

    folder(tmp_path / "model")
    spec = spec_for(tmp_path, cache=cache)
    plan = plan_job(spec)
    monkeypatch.setenv("VLLM_BATCH_FAULTS", "chunk.before_seal#1=raise")
    faults.reload()
    with pytest.raises(faults.InjectedFault):
        shard(spec, plan, fake_engine_factory, attempt="a1")
    assert left(spec)[0] == []
    out = Path(spec.io.output_uri)
    assert list(out.rglob("a1/chunk-*.parquet"))  # the dead attempt's unsealed parts are left behind
    monkeypatch.delenv("VLLM_BATCH_FAULTS")
    faults.reload()
    assert shard(spec, plan, fake_engine_factory, attempt="a2")["status"] == "committed"
    merge(spec)
    ids = pq.read_table(out / "results", columns=["id"]).column("id").to_pylist()
    errors = pq.read_table(out / "errors").num_rows if (out / "errors").exists() else 0
    assert sorted(ids) == [f"r{i}" for i in range(6)] and errors == 0


def test_a_hub_cache_snapshot_folder_of_links_into_blobs_is_pinned_and_checked(tmp_path, fake_engine_factory):
    """``model.name`` a Hugging Face hub cache snapshot (``snapshots/<rev>/<file> -> ../../blobs/<sha>``), with the
    result cache on: the plan pins the files the links reach and the shard's check follows them as vLLM does."""
    hub = tmp_path / "hub" / "models--org--m"
    snap = hub / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (hub / "blobs").mkdir()
    for i, (rel, data) in enumerate(FILES.items()):
        (hub / "blobs" / f"b{i}").write_bytes(data)
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).symlink_to(os.path.relpath(hub / "blobs" / f"b{i}", (snap / rel).parent))
    (tmp_path / "model").symlink_to(snap)
    spec = spec_for(tmp_path)
    plan = plan_job(spec)
    assert sorted(f.path for f in plan.weights[0].files) == sorted(FILES)
    assert shard(spec, plan, fake_engine_factory)["status"] == "committed"
    other = spec_for(tmp_path, run="b")
    plan_b = plan_job(other)
    swap_same_size_and_mtime(hub / "blobs" / "b1", b"V" * 4096)  # the blob behind model.safetensors
    with pytest.raises(InputChangedError, match=r"model\.safetensors"):
        shard(other, plan_b, fake_engine_factory)


class HeldPasses:
    """``check_folder`` that holds each pass, once it has read the folder, until ``release`` is set; counts the
    passes running at once (``peak``) and each file's opens (``reads``)."""

    def __init__(self, monkeypatch) -> None:
        from collections import Counter

        from airflow_provider_vllm.core import weights as core_weights

        self.release = threading.Event()
        self.read_all = threading.Semaphore(0)  # one per pass that has read the folder (or failed)
        self.reads: Counter[str] = Counter()
        self.running = self.peak = 0
        lock = threading.Lock()
        real_check, real_open = worker_weights.check_folder, core_weights._open_regular

        def opened(path: str) -> int:
            with lock:
                self.reads[Path(path).name] += 1
            return real_open(path)

        def held(pin, tick):
            with lock:
                self.running += 1
                self.peak = max(self.peak, self.running)
            try:
                real_check(pin, tick)
            finally:
                self.read_all.release()
                self.release.wait(30)
                with lock:
                    self.running -= 1

        monkeypatch.setattr(core_weights, "_open_regular", opened)
        monkeypatch.setattr(worker_weights, "check_folder", held)

    def wait_read(self, passes: int) -> None:
        for _ in range(passes):
            assert self.read_all.acquire(timeout=30)


def test_three_engine_starts_read_each_file_at_most_four_times_and_hash_with_two_passes_at_most(tmp_path, monkeypatch):
    """An engine rebuilt twice (three loads) while the passes still run: a load that finds a pass running starts
    no pass of its own; each load's after pass still comes (queued behind the two running, shared by the two
    queued); never more than two at once, and nothing settles before the last pass has read the folder."""
    folder(tmp_path / "model")
    plan = plan_job(spec_for(tmp_path))
    held = HeldPasses(monkeypatch)
    check = worker_weights.WeightsCheck(plan.weights)
    make = check.bracket(lambda spec: object())
    for _ in range(3):
        make(None)
    held.wait_read(2)
    assert not check.settled()
    held.release.set()
    check.wait()
    assert check.settled()
    assert held.peak <= 2
    assert set(held.reads) == {Path(f).name for f in FILES} and max(held.reads.values()) <= 1 + 3
    assert held.reads["model.safetensors"] >= 3  # the before pass, the first after pass, one after the last load


@pytest.mark.parametrize("when", ["between the 1st and 2nd loads", "during the 2nd load", "during the 3rd load"])
def test_a_swap_left_in_place_after_the_first_engines_check_read_the_folder_is_found_with_passes_coalesced(
    tmp_path, monkeypatch, when
):
    """The passes of the first engine have read the planned bytes and still run when the file is swapped: the
    after pass of a later load, queued behind them, reads the swapped bytes and fails the check."""
    folder(tmp_path / "model")
    plan = plan_job(spec_for(tmp_path))
    held = HeldPasses(monkeypatch)
    check = worker_weights.WeightsCheck(plan.weights)
    loads = 0

    def factory(spec):
        nonlocal loads
        loads += 1
        if when == {2: "during the 2nd load", 3: "during the 3rd load"}.get(loads):
            swap_same_size_and_mtime(tmp_path / "model" / "model.safetensors", b"V" * 4096)
        return object()

    make = check.bracket(factory)
    make(None)
    held.wait_read(2)  # the before and the after pass of the first engine found the planned bytes
    assert check.settled() is False
    if when == "between the 1st and 2nd loads":
        swap_same_size_and_mtime(tmp_path / "model" / "model.safetensors", b"V" * 4096)
    make(None)
    make(None)
    held.release.set()
    with pytest.raises(InputChangedError, match=r"model\.safetensors is not the file the plan hashed"):
        check.wait()
    assert held.peak <= 2 and max(held.reads.values()) <= 1 + 3


def test_a_pass_cut_short_by_close_never_counts_as_settled(tmp_path, monkeypatch):
    """close() stops the running passes at their next block: a pass stopped before it read every file vouches for
    nothing, so the check is not settled (nothing may be sealed on it), though no pass runs any more."""
    folder(tmp_path / "model")
    plan = plan_job(spec_for(tmp_path))
    started, ended = threading.Event(), threading.Event()

    def endless(pin, tick):  # a folder that takes forever to hash: blocks until close() says stop
        started.set()
        try:
            while not tick():
                started.wait(0.01)
        finally:
            ended.set()

    monkeypatch.setattr(worker_weights, "check_folder", endless)
    check = worker_weights.WeightsCheck(plan.weights)
    check.start("after load")
    assert started.wait(30)
    check.close()
    assert ended.wait(30)
    check.wait()  # no pass runs or is queued
    assert not check.settled()


def test_a_queued_pass_dropped_by_close_never_counts_as_settled(tmp_path, monkeypatch):
    """close() comes after both running passes read every file and before they end: the after passes queued
    behind them (the 2nd and 3rd loads') never start, so the check vouches for nothing those loads read."""
    folder(tmp_path / "model")
    plan = plan_job(spec_for(tmp_path))
    check = worker_weights.WeightsCheck(plan.weights)
    both_read = threading.Barrier(2, timeout=30)
    info = worker_weights.log.info

    def at_the_end(msg, *args):  # each pass that read every file logs it before it ends: close() between the two
        if msg.startswith("weights check (%s)"):
            if both_read.wait() == 0:
                check.close()
            both_read.wait()
        info(msg, *args)

    gate = threading.Event()
    real_check = worker_weights.check_folder

    def held(pin, tick):  # both passes of the first load run while the 2nd and 3rd loads ask for theirs
        gate.wait(30)
        real_check(pin, tick)

    monkeypatch.setattr(worker_weights.log, "info", at_the_end)
    monkeypatch.setattr(worker_weights, "check_folder", held)
    make = check.bracket(lambda spec: object())
    for _ in range(3):
        make(None)
    gate.set()
    check.wait()
    assert not check.settled()


def test_blocks_hashed_by_several_passes_at_once_are_all_counted():
    """``_tick`` is called by every pass's hashing thread (up to ``MAX_PASSES`` at once): the progress count that
    ``wait`` turns into watchdog beats must count each block once. An unlocked ``+= 1`` is a read, an add and a
    write; a thread switch between the read and the write loses a count. Here the read of the count lets other
    threads run (as a switch there would), so an unlocked increment loses counts every time."""

    class SwitchingRead(worker_weights.WeightsCheck):
        @property
        def _blocks(self) -> int:
            n = self.__dict__["_n"]
            time.sleep(0.0005)  # another thread runs here, between the read and the write
            return n

        @_blocks.setter
        def _blocks(self, n: int) -> None:
            self.__dict__["_n"] = n

    check = SwitchingRead([])
    threads, ticks = 8, 25
    go = threading.Barrier(threads)

    def hash_blocks() -> None:
        go.wait()
        for _ in range(ticks):
            assert check._tick() is False

    workers = [threading.Thread(target=hash_blocks) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert check.__dict__["_n"] == threads * ticks


def test_blocks_counted_from_many_threads_at_the_interpreters_fastest_switching():
    """The real class, hammered from many threads with the interpreter switching as often as it can. With the GIL
    (CPython 3.11) an unlocked ``+= 1`` rarely loses a count this way, so this passed before the lock by luck; it
    matters on a free-threaded build. The test above is the one that fails without the lock."""
    import sys

    check = worker_weights.WeightsCheck([])
    threads, ticks = 16, 5_000
    go = threading.Barrier(threads)

    def hash_blocks() -> None:
        go.wait()
        for _ in range(ticks):
            check._tick()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=hash_blocks) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)
    assert check._blocks == threads * ticks
