"""The fault-injection harness, the OOM classifier and the watchdog as units (fast, no engine)."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.worker.guard import classify
from airflow_provider_vllm.worker.watchdog import Watchdog


def test_unset_means_inactive_and_every_hook_is_a_no_op(tmp_path):
    faults.reload({})
    assert not faults.active()
    assert faults.hit("chunk.before_write") is None
    Storage(str(tmp_path)).write_atomic("a/b.bin", b"x" * 100)
    assert (tmp_path / "a" / "b.bin").read_bytes() == b"x" * 100


def test_parse_rejects_typos_and_names_the_item():
    with pytest.raises(ValueError, match="unknown point 'chunk.mid_fil'"):
        faults.parse("chunk.mid_fil=kill")
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        faults.parse("engine.step#3=explode")
    with pytest.raises(ValueError, match=r"POINT\[@ROW_ID\]"):
        faults.parse("engine.step#x=oom")
    with pytest.raises(ValueError, match="count from 1"):
        faults.parse("engine.step#0=oom")
    items = faults.parse(" commit.after_data=kill ; engine.step@t0007#2+=oom,")
    assert [(i.point, i.row, i.n, i.plus, i.action) for i in items] == [
        ("commit.after_data", None, None, False, "kill"),
        ("engine.step", "t0007", 2, True, "oom"),
    ]


def test_hit_counts_per_item_and_honours_row_selectors(set_faults):
    set_faults("engine.step#2=oom,engine.step@r5=dead,chunk.before_write#1+=raise")
    handles = ("oom", "dead")
    assert faults.hit("engine.step", {"r1"}, handles) is None
    assert faults.hit("engine.step", {"r1"}, handles) == "oom"
    assert faults.hit("engine.step", {"r1"}, handles) is None  # only the 2nd
    assert faults.hit("engine.step", {"r4", "r5"}, handles) == "dead"  # the row is running
    with pytest.raises(faults.InjectedFault, match="raise injected at chunk.before_write"):
        faults.hit("chunk.before_write")
    with pytest.raises(faults.InjectedFault):
        faults.hit("chunk.before_write")  # 1+: every later hit too
    with pytest.raises(MemoryError if _no_torch() else RuntimeError, match="out of memory"):
        faults.perform("oom", "engine.step")  # outside the engine an OOM is raised, not handled


def _no_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return True
    return False


def test_mid_file_fault_leaves_half_a_temp_file_and_no_final_name(tmp_path, set_faults):
    set_faults("chunk.mid_file=raise")
    store = Storage(str(tmp_path))
    data = bytes(range(256)) * 40
    with faults.writing("chunk.mid_file"), pytest.raises(faults.InjectedFault):
        store.write_atomic("d/chunk-00000.parquet", data)
    assert not (tmp_path / "d" / "chunk-00000.parquet").exists()
    (tmp,) = (tmp_path / "d").glob("chunk-00000.parquet.tmp-*")
    assert tmp.read_bytes() == data[: len(data) // 2]
    store.write_atomic("d/other.bin", data)  # outside the block: written whole, no fault
    assert (tmp_path / "d" / "other.bin").read_bytes() == data


def test_classify_out_of_memory_and_engine_death():
    torch = pytest.importorskip("torch")

    class EngineDeadError(Exception):
        pass

    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "oom"
    assert (
        classify(
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 1 bytes. Error code 12 (Cannot allocate memory) out of memory"
            )
        )
        == "oom"
    )
    assert classify(MemoryError()) == "oom"
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except Exception as inner:
            raise EngineDeadError("EngineCore encountered an issue") from inner
    except EngineDeadError as e:
        assert classify(e) == "oom"  # a vLLM error caused by an OOM backs off
    assert classify(EngineDeadError("EngineCore encountered an issue")) == "dead"
    assert classify(ValueError("prompt too long")) is None
    assert classify(RuntimeError("expected scalar type")) is None


def test_watchdog_fires_once_after_the_timeout_and_not_while_paused():
    now = [0.0]
    stalls = []
    wd = Watchdog(10.0, stalls.append, clock=lambda: now[0])
    wd.beat()
    now[0] = 9.9
    assert not wd.check()
    with wd.paused():  # engine start or rebuild
        now[0] = 100.0
        assert not wd.check()
    now[0] = 105.0  # resumed at 100 (paused() ends with a beat)
    assert not wd.check()
    now[0] = 110.5
    assert wd.check() and stalls == [pytest.approx(10.5)]
    now[0] = 200.0
    assert not wd.check() and len(stalls) == 1
    off = Watchdog(None, stalls.append, clock=lambda: now[0])
    off.start()
    now[0] = 1e9
    assert not off.check() and off._thread is None


def test_watchdog_thread_calls_on_stall():
    import threading

    fired = threading.Event()
    with Watchdog(0.2, lambda idle: fired.set()):
        assert fired.wait(10)
