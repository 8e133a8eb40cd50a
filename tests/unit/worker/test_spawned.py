"""worker/spawned.py and ``imports.carry_to_spawned``: a process that multiprocessing spawns from the worker (vLLM's
engine core on the CPU build) marks the same modules absent before it unpickles its target; without the carry it
does not; a bad ``VLLM_BATCH_SKIP_IMPORTS`` (which the worker refuses itself) does not stop the child. (That real
vLLM's engine core and its worker process then load neither scikit-learn, scipy, Ray nor gRPC:
tests/vllm/test_reliability_lifecycle.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

# The parent as the worker's __main__ sets it up; the child's target is a builtin (what vLLM passes is a function
# of vLLM's own): it reports which names its sys.modules marks absent and whether json came in with spawned.py.
PARENT = """
import json, multiprocessing, sys
from airflow_provider_vllm.worker.imports import carry_to_spawned, skip_unused_imports
out, carry = sys.argv[1], sys.argv[2] == "carry"
try:
    skip_unused_imports()
except Exception as e:
    print("parent refused:", type(e).__name__)
if carry:
    carry_to_spawned()
code = (
    "import sys, json\\n"
    "names = ['sklearn', 'scipy', 'fake_mod_y']\\n"
    "absent = [n for n in names if n in sys.modules and sys.modules[n] is None]\\n"
    "open(OUT, 'w').write(json.dumps({'absent': absent, 'main': sys.modules['__main__'].__name__}))\\n"
).replace("OUT", repr(out))
p = multiprocessing.get_context("spawn").Process(target=exec, args=(code,))
p.start()
p.join(120)
print("exit", p.exitcode)
"""


def _spawn(tmp_path, carry: bool, skip: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "child.json"
    p = subprocess.run(
        [sys.executable, "-c", PARENT, str(out), "carry" if carry else "plain"],
        env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_BATCH_SKIP_IMPORTS": skip},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "exit 0" in p.stdout, p.stdout + p.stderr[-3000:]
    return p, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.parametrize("carry", [True, False])
def test_a_spawned_child_marks_the_same_modules_absent_only_when_carried(tmp_path, carry):
    _, child = _spawn(tmp_path, carry, "sklearn,fake_mod_y")
    assert child is not None
    if carry:
        assert child == {"absent": ["sklearn", "fake_mod_y"], "main": "__mp_main__"}
    else:
        assert child["absent"] == []


@pytest.mark.parametrize("skip", ["none", "sklearn.metrics", "vllm"])
def test_a_value_the_worker_refuses_or_none_marks_nothing_and_the_child_still_runs(tmp_path, skip):
    p, child = _spawn(tmp_path, True, skip)
    assert child is not None and child["absent"] == []
    assert ("parent refused: SpecError" in p.stdout) == (skip != "none")
