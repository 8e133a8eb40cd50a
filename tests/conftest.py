from __future__ import annotations

import base64
import hashlib
import hmac
import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# One temporary folder per run of the suite, removed when the run ends: what the tests and every process they start
# put under TMPDIR (pytest's tmp_path, vLLM's IPC sockets and `vllm_dist_*` folders, the copies and locks of tasks
# that a test kills on purpose, Chromium's profiles) no longer piles up in the machine's /tmp, about a thousand
# entries a run. The xdist workers inherit it; the process that made it removes it (pytest_sessionfinish).
SUITE_TMPDIR = "VLLM_BATCH_SUITE_TMPDIR"
_OWN_TMPDIR = not os.environ.get(SUITE_TMPDIR)
if _OWN_TMPDIR:
    os.environ[SUITE_TMPDIR] = tempfile.mkdtemp(prefix="vbt-")
os.environ["TMPDIR"] = os.environ[SUITE_TMPDIR]
tempfile.tempdir = os.environ[SUITE_TMPDIR]  # this process: gettempdir() may have been computed already
from tests.support.airflow_env import LOADED_MACHINE  # noqa: E402  (needs ROOT on sys.path)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _name, _value in LOADED_MACHINE.items():  # DAG files parsed in a test process (airflow_env.py says why)
    os.environ.setdefault(_name, _value)
# vLLM's engine in the process that made it (vLLM's own switch; on the CPU build it also keeps the executor
# in process): an engine start costs one `import vllm` instead of three (vLLM's CPU platform spawns its engine
# core and that one spawns its worker, each importing vLLM again), ~15 s instead of ~45 s here. Every process
# a test starts inherits it (workers, `airflow dags test`, airflow standalone). Tests of what the worker does
# with vLLM's own processes (an engine core that dies, kill -9 and SIGTERM of the task, OOM rebuilds, what
# the engine core logs) set ENGINE_PROCESSES, the production layout; `VLLM_ENABLE_V1_MULTIPROCESSING=1 make
# test` runs the whole suite so.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ENGINE_PROCESSES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
# No compiler in the tests' engines: vLLM's own switch for CPU CI (vllm/platforms/cpu.py) runs the graph that torch
# dynamo traces eagerly instead of compiling it with inductor, and torch's own switch (TORCHDYNAMO_DISABLE) skips
# the trace too, which vLLM's AOT compile path refuses (hence VLLM_USE_AOT_COMPILE=0): the model runs as with
# `enforce_eager`. An engine start of the tiny model in process: ~14 CPU-s, against ~16 with vLLM's switch alone,
# ~23 compiled with inductor's cache warm and ~43 cold (the first start of each model and setting on a fresh
# machine). No test here is about the compiler's artefacts (the compile cache's tests work on its folders);
# `VLLM_CPU_CI_ENV=0 make test` compiles as a deployment does. VLLM_* variables are part of the engine's identity
# (core/engine_identity.py), the same for every process of a run.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
if os.environ["VLLM_CPU_CI_ENV"] == "1":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def _cores_of_this_xdist_process() -> list[int] | None:
    """Under pytest-xdist, this test process's share of the cores: ``gwN`` takes slice N of the cores it may run
    on. ``[]`` with more processes than cores (none has a core of its own), None outside xdist."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or int(count) < 2:
        return None
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // int(count)
    if per < 1:
        return []
    n = int(worker[2:]) % int(count)
    return cores[n * per : (n + 1) * per]


# The engines of the test processes. vLLM's automatic binding gives an engine that runs in its own processes
# (ENGINE_PROCESSES) the first cores of the NUMA node less one for its scheduler: core 0 on a 2-core machine, for
# every such engine of every test process at once. With at least a core per process, vLLM's variable names the
# process's cores instead; with more processes than cores (the default on 2 cores, where a third process fills
# the time the other two wait on Airflow's scheduler, timeouts and subprocesses), no engine is bound and the
# kernel spreads them. OMP_NUM_THREADS keeps torch's OpenMP to the process's share (vLLM sets an in-process
# engine's torch threads to 1 for serving, but not for what runs before). What the processes a test starts
# inherit (workers, `airflow dags test`, airflow standalone).
_CORES = _cores_of_this_xdist_process()
if _CORES:
    os.environ.setdefault("OMP_NUM_THREADS", str(len(_CORES)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, _CORES)))
elif _CORES == []:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _minilm_prefixes() -> list[str]:
    """MiniLM's folder in its installed package: inside this checkout's .venv on a fresh clone, elsewhere
    when the tests run with another checkout's venv (a worktree, CONTRIBUTING.md)."""
    from airflow_provider_vllm.testing.local_models import LocalModelError, minilm_path

    try:
        return [os.path.realpath(minilm_path())]
    except LocalModelError:
        return []


# The deployment's allow-list for the tests (docs/security.md): the temp folder (pytest's
# tmp_path), the model cache, MiniLM's package folder and this checkout. Without it every plan is
# refused (fail closed); tests of that default remove both variables (the ``fail_closed`` fixture).
TEST_PREFIXES = json.dumps(
    [
        os.path.realpath(tempfile.gettempdir()),
        os.path.realpath(os.environ.get("VLLM_BATCH_MODEL_CACHE", ROOT / ".cache" / "models")),
        *_minilm_prefixes(),
        str(ROOT),
    ]
)
os.environ.setdefault("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", TEST_PREFIXES)
os.environ.setdefault("VLLM_BATCH_ALLOWED_PREFIXES", TEST_PREFIXES)  # a worker CLI a test starts itself
# The deployment's signing key for the tests (core/seal.py): the Airflow side's option and the steps' default
# outside Airflow; and its worker key, the variable of a worker run in the test process (run_shard). A worker a test
# starts itself gets worker_environ(): a worker refuses to start with the deployment's key in its environment.
# Tests of the unset default remove them.
TEST_SIGNING_KEY = "test-signing-key-" + "k" * 40
os.environ.setdefault("AIRFLOW__VLLM_BATCH__SIGNING_KEY", TEST_SIGNING_KEY)
os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", TEST_SIGNING_KEY)
# core/seal.worker_key_of written out: the derivation is a contract between the Airflow side and a pod's Secret
TEST_WORKER_KEY = "vbw1." + base64.urlsafe_b64encode(
    hmac.new(TEST_SIGNING_KEY.encode(), b"vllm-batch-worker-key/v1", hashlib.sha256).digest()
).decode().rstrip("=")
os.environ.setdefault("VLLM_BATCH_WORKER_KEY", TEST_WORKER_KEY)


def worker_environ(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) as a worker's: the worker key, no deployment key."""
    from tests.support.data import worker_env

    return worker_env(os.environ if env is None else env)


os.environ.setdefault("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", "vllm-batch-signing:key")
# The test deployment runs shards on both runners, and its DAGs choose one at run time (the re-run DAG's form, the
# nightly's Variable): with a kubernetes_* option set, [vllm_batch] allowed_runners unset would allow kubernetes only
os.environ.setdefault("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", "local,kubernetes")
# result caches may live under the test folders (the deployment's choice: [vllm_batch] cache_uri_prefixes)
os.environ.setdefault("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", TEST_PREFIXES)
# The weights fingerprint's memo (steps/cache/fingerprint_memo.py) of the tests: not the user's ~/.cache
os.environ.setdefault(
    "VLLM_BATCH_FINGERPRINT_MEMO",
    os.path.join(tempfile.gettempdir(), f"vllm-batch-test-fingerprints-{os.getuid()}.json"),
)


@pytest.fixture(autouse=True)
def _our_loggers_reach_caplog():
    """The package's log records reach pytest's caplog whatever logging setup an earlier test in the same
    process left behind: vLLM's and Airflow's ``dictConfig`` disable the loggers that exist by then and may
    stop a parent's propagation, so a test asserting a warning passed or failed with the test order. Airflow's
    logging setup can also leave the root logger at ERROR (``airflow vllm-batch dry-run`` asks for that level,
    and the dry-run tests call it in-process): our warnings would then never reach a handler. The root logger
    is at most WARNING during each test (its handlers keep their own levels), and restored after."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("airflow_provider_vllm") and isinstance(logger, logging.Logger):
            logger.disabled = False
            logger.propagate = True
    root_level = logging.root.level
    if root_level > logging.WARNING:
        logging.root.setLevel(logging.WARNING)
    yield
    logging.root.setLevel(root_level)


@pytest.fixture
def fail_closed(monkeypatch):
    """The default deployment: no allow-list, no "any location" (Airflow side and worker side)."""
    for name in (
        "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES",
        "AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION",
        "VLLM_BATCH_ALLOWED_PREFIXES",
        "VLLM_BATCH_ALLOW_ANY_LOCATION",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_engine_factory():
    from tests.support.fakes import FakeEngine

    made = []

    def factory(spec, **kw):
        e = FakeEngine(spec, **kw)
        made.append(e)
        return e

    factory.made = made
    return factory


@pytest.fixture
def set_faults():
    """``set_faults("engine.step#3=oom")``: arm the fault harness in this process (reset after the test)."""
    from airflow_provider_vllm.core import faults

    def set_(value: str) -> None:
        faults.reload({faults.ENV: value})

    yield set_
    faults.reload({})


TIERS = ("unit", "s3", "vllm", "airflow", "ui")  # also the run order: cheapest first, the browser last
# With pytest-xdist (`make test TEST_PROCESSES=2`), what the processes take first: the longest work first, so that
# the many short unit tests fill the end of both processes' queues instead of one long test trailing alone.
XDIST_ORDER = ("ui", "vllm", "airflow", "s3", "unit")
# Tests that must share one process under xdist, by file: the browser tests (a second sync Playwright in a
# process whose session-wide one runs fails, "Sync API inside the asyncio loop"), and the tests of the shared
# real-vLLM runs (session fixtures too costly to build once per process). Every other module is its own unit
# (its module fixtures are built once). The fixtures that demand a group (checked at collection):
SAME_PROCESS = {
    "browser": ("tests/ui/", "tests/unit/steps/qa/test_html.py"),
    "shared_vllm_runs": (
        "tests/vllm/test_worker_vllm.py",
        "tests/vllm/test_metrics_vllm.py",
        "tests/vllm/test_redaction.py",
    ),
}
GROUP_FIXTURES = {
    "browser": "browser",
    "airflow_ui": "browser",
    "tiny_run": "shared_vllm_runs",
    "raw_smollm2": "shared_vllm_runs",
}


def _tier(item) -> str | None:
    parts = Path(str(item.fspath)).resolve().relative_to(ROOT / "tests").parts
    return parts[0] if parts and parts[0] in TIERS else None


def xdist_scope(nodeid: str) -> str:
    """The unit of work one xdist process takes whole: the test's ``SAME_PROCESS`` group, else its module."""
    path = nodeid.split("::", 1)[0]
    for group, prefixes in SAME_PROCESS.items():
        if path.startswith(prefixes):
            return group
    return path


def _under_xdist(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) or hasattr(config, "workerinput")


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        """Hand out work by ``xdist_scope`` (xdist's own ``xdist_group`` marks do nothing on pytest 9.2: they
        rename ``item._nodeid``, which pytest no longer reads), in collection order (``--no-loadscope-reorder``)."""
        from xdist.scheduler import LoadScopeScheduling

        class ByScope(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return xdist_scope(nodeid)

        return ByScope(config, log)


def _check_groups(items) -> None:
    """A test that uses a fixture demanding a group must live in a file of that group (else under xdist it would
    build a second Airflow standalone or vLLM run, or break the browser tests)."""
    wrong = []
    for item in items:
        names = set(getattr(getattr(item, "_fixtureinfo", None), "names_closure", ()) or ())
        for fixture, group in GROUP_FIXTURES.items():
            if fixture in names and xdist_scope(item.nodeid) != group:
                wrong.append(f"{item.nodeid} uses {fixture!r}: list its file in SAME_PROCESS[{group!r}]")
    if wrong:
        raise pytest.UsageError("tests/conftest.py: " + "; ".join(wrong))


def _xdist_rank(item) -> int:
    return XDIST_ORDER.index("ui" if xdist_scope(item.nodeid) == "browser" else _tier(item) or "unit")


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier, the folder under tests/ it lives in (``-m unit``, ``-m s3`` ...), and
    run the tiers in ``TIERS`` order. The ui tier goes last: its session-wide Playwright would make any
    later sync Playwright (tests/unit/steps/qa/test_html.py) fail with "Sync API inside the asyncio loop".

    Under pytest-xdist (``-n``) the order is ``XDIST_ORDER``, the order ``pytest_xdist_make_scheduler`` hands
    the scopes out in; within the browser group the unit tests come first."""
    _check_groups(items)
    for item in items:
        tier = _tier(item)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    if _under_xdist(config):
        items.sort(key=lambda item: (_xdist_rank(item), TIERS.index(_tier(item) or "unit")))
    else:
        items.sort(key=lambda item: TIERS.index(_tier(item) or "unit"))  # stable: file order within a tier


# scripts/suite_cpu.py: where the suite's CPU goes (tests/support/timeline.py, on when VLLM_BATCH_TEST_TIMELINE is set)
if os.environ.get("VLLM_BATCH_TEST_TIMELINE"):
    from tests.support.timeline import pytest_runtest_protocol  # noqa: F401  (a hook: pytest finds it here)


def pytest_sessionfinish(session, exitstatus):
    """The suite's temporary folder goes with the process that made it (not an xdist worker's), unless a test
    failed: then it stays, with the failed tests' tmp_path folders, and its path is printed."""
    if not _OWN_TMPDIR or hasattr(session.config, "workerinput"):
        return
    if exitstatus != pytest.ExitCode.TESTS_FAILED:
        import shutil

        shutil.rmtree(os.environ[SUITE_TMPDIR], ignore_errors=True)
    else:
        print(f"\nthe tests' temporary folder is kept: {os.environ[SUITE_TMPDIR]}", file=sys.stderr)
