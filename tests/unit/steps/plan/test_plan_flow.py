"""Following the spec through planning (and through the worker's row reads) enters each
package module once, and the input is read only through its format (``core.formats``).

The call stacks are recorded with ``sys.setprofile``: on every call, the chain of frames of
``airflow_provider_vllm`` modules (pydantic, pyarrow, the stdlib and the tests are left out),
with consecutive frames of one module merged. A module that appears twice in that chain is a
climb back (A -> B -> A: B calls back into the layer that called it); A -> A -> B is fine.
Every case runs once before it is recorded, so lazy imports do not change the stacks.

The same recording shows who reads the input: every call into a reader library (pyarrow,
DuckDB) is attributed to the innermost package module on the stack; the planner
(``steps.plan.planner``) and the worker's reader (``worker.shard``) must not be among them: they ask
``core.formats.input_format`` for the format once and go through its interface.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from airflow_provider_vllm.core.plan import load_plan
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import read_shard_rows, run_shard
from tests.support.data import make_spec, shard_task, write_parquet

PKG = "airflow_provider_vllm"


def _module_stack(frame) -> tuple[str, ...]:
    """Package modules on the stack, outermost first, consecutive repeats merged."""
    mods: list[str] = []
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if (mod == PKG or mod.startswith(PKG + ".")) and frame.f_code.co_name != "<module>":
            if not mods or mods[-1] != mod:
                mods.append(mod)
        frame = frame.f_back
    return tuple(reversed(mods))


def climbs_back(stack: tuple[str, ...]) -> bool:
    merged = [m for i, m in enumerate(stack) if i == 0 or stack[i - 1] != m]
    return len(set(merged)) != len(merged)


READERS = ("pyarrow", "duckdb")  # what reads input data (json also hashes plans; fsspec also writes them)
NO_READING = {PKG + ".steps.plan.planner", PKG + ".worker.shard"}  # they go through the format interface


def _library(frame, event, arg) -> str:
    """The library a call goes into (for C functions: their module, or their object's type's)."""
    if event == "call":
        return frame.f_globals.get("__name__", "")
    mod = getattr(arg, "__module__", None)
    if mod is None and getattr(arg, "__self__", None) is not None:
        mod = type(arg.__self__).__module__
    return mod if isinstance(mod, str) else ""  # some C functions' __module__ is a module object


def _innermost_package_module(frame) -> str | None:
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if mod.startswith(PKG):
            return mod
        frame = frame.f_back


class Recording(set):
    """The distinct module stacks of the calls; ``readers``: (package module, reader library) pairs."""

    readers: set[tuple[str, str]]


@contextmanager
def recorded_stacks(within: str | None = None):
    """Records every call (only those under a function named ``within``, if given)."""
    stacks = Recording()
    stacks.readers = set()

    def under(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_name == within and frame.f_globals.get("__name__", "").startswith(PKG):
                return True
            frame = frame.f_back
        return False

    def profile(frame, event, arg):
        # Cheap tests first (this runs on every call): a call into a module outside the package adds no new
        # stack (its package stack is its innermost package caller's, recorded when that one was called), so
        # only package calls and reader calls walk the stack.
        if event not in ("call", "c_call"):
            return
        lib = _library(frame, event, arg)
        reader = lib.split(".")[0] in READERS
        ours = event == "call" and (lib == PKG or lib.startswith(PKG + "."))
        if not (ours or reader) or (within is not None and not under(frame)):
            return
        if ours:
            stacks.add(_module_stack(frame))
        if reader:
            caller = _innermost_package_module(frame.f_back if event == "call" else frame)
            if caller is not None:
                stacks.readers.add((caller, lib.split(".")[0]))

    sys.setprofile(profile)
    try:
        yield stacks
    finally:
        sys.setprofile(None)


FORMATS = ["parquet", "jsonl", "openai_batch"]
SHARDING = {"target_rows": 4, "long_row_tokens": 30}  # several shards, long rows apart


def _write_input(d: Path, fmt: str) -> None:
    """An input of the format with every kind of row the planner and the reader treat apart."""
    texts = [("long text " * 40 if i % 5 == 2 else f"ticket {i}") for i in range(12)]
    if fmt == "parquet":
        write_parquet(d / "a.parquet", [f"r{i}" for i in range(8)], texts[:8], row_group_size=3)
        write_parquet(d / "b.parquet", [f"r{i}" for i in range(8, 12)], texts[8:], row_group_size=3)
        return
    d.mkdir(parents=True)
    if fmt == "jsonl":
        lines = [json.dumps({"id": f"r{i}", "text": t}) for i, t in enumerate(texts)]
    else:
        lines = [
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": t}]},
                }
            )
            for i, t in enumerate(texts)
        ]
    lines.insert(3, "{not json")
    (d / "a.jsonl").write_text("\n".join(lines) + "\n")


def _spec(tmp_path: Path, fmt: str, run: str):
    """The job over ``tmp_path/in`` (written on first use) with its output in ``tmp_path/run``."""
    if not (tmp_path / "in").exists():
        _write_input(tmp_path / "in", fmt)
    over = (
        {"sampling": {"max_tokens": 8, "structured": None}, "prompt": {"system_prompt": None}}
        if fmt == "openai_batch"
        else {}
    )
    return make_spec(tmp_path / "in", tmp_path / run, sharding=SHARDING, **over)


@pytest.mark.parametrize("fmt", FORMATS)
def test_planning_enters_each_module_once(tmp_path, fmt):
    plan_job(_spec(tmp_path, fmt, "warm"))
    spec = _spec(tmp_path, fmt, "out")
    with recorded_stacks() as stacks:
        plan = plan_job(spec)
    assert plan.total_rows >= 12 and plan.format == fmt
    assert any("airflow_provider_vllm.steps.plan.planner" in s for s in stacks)  # the recorder saw the planner
    back = sorted(s for s in stacks if climbs_back(s))
    assert back == [], "\n".join(" -> ".join(m.removeprefix(PKG + ".") for m in s) for s in back[:10])
    assert {lib for _, lib in stacks.readers} >= {"pyarrow"}  # the recorder saw the input being read
    assert sorted(r for r in stacks.readers if r[0] in NO_READING) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_worker_reads_its_rows_entering_each_module_once(tmp_path, fmt, fake_engine_factory):
    spec = _spec(tmp_path, fmt, "out")
    # the long texts repeat: without the dedupe every shard reads the input itself, which this test follows
    spec = spec.model_copy(update={"sharding": spec.sharding.model_copy(update={"dedupe": False})})
    plan = plan_job(spec)
    long = next(s for s in plan.shards if s.bucket == "long")
    read_shard_rows(spec, plan, long, Storage(plan.input_root))  # warm-up: lazy imports happen outside the recording
    fake_engine_factory(spec)  # the fake engine's lazy vLLM import (its request checks are vLLM's own)
    with recorded_stacks(within="read_shard_rows") as stacks:
        for s in plan.shards:
            run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    assert load_plan(spec).fingerprint == plan.fingerprint
    assert any("airflow_provider_vllm.worker.shard" in s and len(s) > 1 for s in stacks)
    back = sorted(s for s in stacks if climbs_back(s))
    assert back == [], "\n".join(" -> ".join(m.removeprefix(PKG + ".") for m in s) for s in back[:10])
    if fmt == "parquet":
        assert stacks.readers  # the recorder saw the input being read
    assert sorted(r for r in stacks.readers if r[0] in NO_READING) == []


def _fake_module(name: str, source: str) -> dict:
    """Functions whose frames belong to package module ``name`` (the recorder goes by ``__name__``)."""
    ns = {"__name__": f"{PKG}.{name}", "pa": pa, "pc": pc}
    exec(compile(source, f"<{name}>", "exec"), ns)  # noqa: S102
    return ns


def test_the_recorder_sees_a_climb_back_and_a_reader():
    """The checks can fail: a call chain A -> B -> A is a climb back, and a reader call is attributed."""
    a = _fake_module("a", "def outer(f):\n    return f()\n\ndef leaf():\n    return pc.utf8_length(pa.array(['x']))\n")
    b = _fake_module("b", "def middle(g):\n    return g()\n")
    assert climbs_back(("a", "b", "a")) and not climbs_back(("a", "a", "b"))
    with recorded_stacks() as stacks:
        a["outer"](lambda: b["middle"](a["leaf"]))
    assert (f"{PKG}.a", f"{PKG}.b", f"{PKG}.a") in stacks
    assert sorted(s for s in stacks if climbs_back(s)) == [(f"{PKG}.a", f"{PKG}.b", f"{PKG}.a")]
    assert (f"{PKG}.a", "pyarrow") in stacks.readers
