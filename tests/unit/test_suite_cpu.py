"""scripts/suite_cpu.py: a real pytest run under the sampler charges each process's CPU to the test that started
it, including a process that test never waits for, and a test process's own CPU to the test it was running."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n    pass\n"

TESTS = f"""
import subprocess, sys, time

def test_a_quiet_one():
    time.sleep(1.2)

def test_b_waits_for_a_child():
    subprocess.run([sys.executable, "-c", {SPIN.format(s=1.5)!r}], check=True)

def test_c_leaves_a_child_running():
    # a new session and an environment of its own, never waited for: what pytest's rusage would never count
    time.sleep(0.3)
    subprocess.Popen([sys.executable, "-c", {SPIN.format(s=1.5)!r}], start_new_session=True, env={{}})
    time.sleep(0.3)

def test_d_spins_in_process():
    exec({SPIN.format(s=3.0)!r})
"""


@pytest.fixture(scope="module")
def suite_cpu():
    spec = importlib.util.spec_from_file_location("suite_cpu", ROOT / "scripts" / "suite_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["suite_cpu"] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_cpu_is_charged_to_the_test_that_started_it(tmp_path):
    (tmp_path / "tests" / "demo").mkdir(parents=True)
    (tmp_path / "tests" / "demo" / "test_demo.py").write_text(TESTS)
    # the suite's timeline plugin (tests/conftest.py loads it the same way); the demo tests sit under tests/<tier>/
    (tmp_path / "tests" / "conftest.py").write_text("from tests.support.timeline import pytest_runtest_protocol\n")
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "tests/demo"]
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "suite_cpu.py"), "--json", str(out), "--", *cmd],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "CPU-s by tier" in p.stdout and "demo" in p.stdout
    figures = json.loads(out.read_text())
    tests = figures["tests"]
    assert len(figures["reference_loop_cpu_s"]) == 2 and all(x > 0 for x in figures["reference_loop_cpu_s"])
    assert "machine speed: the reference loop took" in p.stdout
    cpu = {nodeid.rsplit("::", 1)[1]: sum(kinds.values()) for nodeid, kinds in tests.items() if "::" in nodeid}
    assert cpu.get("test_a_quiet_one", 0) < 0.6, cpu
    # a child's 1.5 CPU-s, less what it used after the last sample before it ended (at most one interval)
    for name in ("test_b_waits_for_a_child", "test_c_leaves_a_child_running"):
        assert 0.9 < cpu[name] < 2.5, (name, cpu)
    assert 2.3 < cpu["test_d_spins_in_process"] < 4.0, cpu  # sampled: a share of an interval may go elsewhere
    kinds = {nodeid.rsplit("::", 1)[1]: k for nodeid, k in tests.items() if "::" in nodeid}
    assert kinds["test_c_leaves_a_child_running"].get("python -c", 0) > 0.9, kinds
    assert kinds["test_d_spins_in_process"].get("test process (pytest, xdist)", 0) > 2.3, kinds


def test_the_command_is_required_and_its_status_is_returned(suite_cpu, tmp_path):
    with pytest.raises(SystemExit):
        suite_cpu.main([])
    assert suite_cpu.main(["--", sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_kinds(suite_cpu):
    assert suite_cpu.kind("/v/bin/python -m airflow_provider_vllm.worker {}") == "vllm worker"
    assert suite_cpu.kind("/v/bin/python /v/bin/airflow dags test x") == "airflow dags"
    assert suite_cpu.kind("/v/bin/python -m pytest -q") == "test process (pytest, xdist)"
    assert suite_cpu.kind("/v/bin/python /tmp/pytest-of-root/x/script.py") == "python script.py"
    assert suite_cpu.kind("") == "(unnamed)"
