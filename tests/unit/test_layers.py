"""The package's import graph: layers, no cycles, no Airflow on the pod side (ADR 0001).

Low to high: core < worker | steps < hooks | links < utils < operators < task_groups < plugins | cli;
operators and utils take from the worker package only ``worker.task`` (its command line).
The contracts live in pyproject.toml ([tool.importlinter]) and are checked by import-linter;
cycles are checked here over grimp's graph (imports inside functions included). The worker
image does not ship Airflow, so the worker package must also import without it at run time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests.support import ROOT

PACKAGE = "airflow_provider_vllm"
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))

BLOCK_AIRFLOW = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "airflow" or name.startswith("airflow."):
            raise ImportError("airflow is not installed in the worker image: " + name)
sys.meta_path.insert(0, Block())
import airflow_provider_vllm.worker.__main__, airflow_provider_vllm.worker.shard
import airflow_provider_vllm.worker.engine
import airflow_provider_vllm.steps.merge.merger, airflow_provider_vllm.steps.plan.planner
loaded = sorted(m for m in sys.modules if m == "airflow" or m.startswith("airflow."))
assert not loaded, loaded
print("OK")
"""


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


def test_the_layer_contracts_hold():
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "4 kept, 0 broken" in r.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("core/errors.py", "import airflow_provider_vllm.operators", "Layers"),
        ("worker/progress.py", "import airflow_provider_vllm.steps.merge.merger", "Layers"),
        ("steps/plan/sizing.py", "import airflow_provider_vllm.task_groups.batch_job", "Layers"),
        ("worker/redact.py", "import airflow.sdk", "import no Airflow"),
        ("operators/review.py", "import airflow_provider_vllm.testing.local_models", "test/demo models"),
        ("utils/job_spec.py", "import airflow_provider_vllm.operators.plan", "Layers"),
        ("operators/shard.py", "import airflow_provider_vllm.worker.lifecycle", "only worker.task"),
        ("utils/worker_process.py", "from airflow_provider_vllm.worker import shard", "only worker.task"),
    ],
)
def test_the_contracts_catch_a_violation(tmp_path, module, line, contract):
    """The same contracts on a copy of the package with one forbidden import added: broken."""
    shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / PACKAGE / module
    target.write_text(target.read_text() + f"\n{line}  # the violation\n")
    r = _lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout[-3000:]
    broken = [ln for ln in r.stdout.splitlines() if " BROKEN" in ln]
    assert any(contract in b for b in broken), r.stdout[-3000:]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def _graph() -> dict[str, set[str]]:
    g = grimp.build_graph(PACKAGE, cache_dir=None)
    mods = set(g.modules)
    return {m: set(g.find_modules_directly_imported_by(m)) & mods for m in mods}


def test_no_import_cycles():
    edges = _graph()
    assert len(edges) > 50  # the whole package was read
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_worker_imports_without_airflow():
    r = subprocess.run([sys.executable, "-c", BLOCK_AIRFLOW], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"


def test_block_is_effective():
    """The blocker really blocks (so the test above could fail)."""
    r = subprocess.run(
        [sys.executable, "-c", BLOCK_AIRFLOW.replace('print("OK")', "import airflow")], capture_output=True, text=True
    )
    assert r.returncode != 0 and "not installed in the worker image" in r.stderr


def test_worker_cli_rejects_bad_task_with_terminal_exit():
    r = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.worker", '{"spec": {}, "shard_id": "x"}'],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "shard_id" in r.stderr and '"terminal": true' in r.stdout
