"""Environment variables: read only through core/envs.py, every VLLM_BATCH_* name declared there, the docs table
generated from it."""

from __future__ import annotations

import ast
import re

import pytest

from airflow_provider_vllm.core import envs
from tests.support import ROOT

PACKAGE = ROOT / "airflow_provider_vllm"
ENVS = "core/envs.py"
# The only other touches of os.environ: writes to this process's own environment for vLLM, by name.
WRITES = {
    ("worker/engine.py", "VLLM_CPU_KVCACHE_SPACE"),
    ("worker/engine.py", "VLLM_BATCH_INVARIANT"),
    ("worker/__main__.py", "VLLM_LOGGING_STREAM"),
    ("cli/dry_run.py", "AIRFLOW__LOGGING__LOGGING_LEVEL"),  # the dry run's own process: Airflow's INFO lines off
}
# vLLM's own variables whose names happen to start with this package's prefix (written, never read here)
VLLMS_OWN = {"VLLM_BATCH_INVARIANT"}
NAME = re.compile(r"(?<![A-Z0-9_])VLLM_BATCH_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])")


def environ_uses(source: str) -> list[tuple[str, str | None, int]]:
    """(kind, variable, line) for each use of os.environ / os.getenv: kind 'write' or 'read'."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            uses += [("read", a.name, node.lineno) for a in node.names if a.name in ("environ", "getenv", "environb")]
        if not (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and node.attr in ("environ", "getenv", "environb", "putenv", "unsetenv")
        ):
            continue
        parent = parents.get(node)
        call = parents.get(parent)
        if (
            isinstance(parent, ast.Attribute)
            and parent.attr == "setdefault"
            and isinstance(call, ast.Call)
            and call.args
            and isinstance(call.args[0], ast.Constant)
        ):
            uses.append(("write", call.args[0].value, node.lineno))
        elif isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store):
            key = parent.slice.value if isinstance(parent.slice, ast.Constant) else None
            uses.append(("write", key, node.lineno))
        else:
            uses.append(("read", None, node.lineno))
    return uses


def sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_only_envs_reads_the_environment():
    reads, writes = [], set()
    for rel, text in sources():
        if rel == ENVS:
            continue
        for kind, var, line in environ_uses(text):
            if kind == "read":
                reads.append(f"{rel}:{line}")
            else:
                writes.add((rel, var))
    assert reads == [], "read environment variables through airflow_provider_vllm.core.envs"
    assert writes == WRITES


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("import os\nx = os.environ.get('A')", "read"),
        ("import os\nx = os.getenv('A')", "read"),
        ("import os\nenv = {**os.environ}", "read"),
        ("from os import environ", "read"),
        ("import os\nos.environ.setdefault('A', '1')", "write"),
        ("import os\nos.environ['A'] = '1'", "write"),
    ],
)
def test_the_scan_tells_reads_from_writes(source, kind):
    assert [u[0] for u in environ_uses(source)] == [kind]


def test_every_vllm_batch_name_in_the_package_is_declared():
    declared = set(envs.by_name())
    used = {m for _, text in sources() for m in NAME.findall(text)} - VLLMS_OWN
    assert used and used <= declared, sorted(used - declared)
    assert {v.name for v in envs.VARS if v.name.startswith("VLLM_BATCH_")} <= used  # none declared but unused
    assert NAME.findall("AIRFLOW__VLLM_BATCH__X VLLM_BATCH_METRICS_* VLLM_BATCH_HARDWARE") == ["VLLM_BATCH_HARDWARE"]


def test_names_are_declared_once_with_a_description():
    names = [v.name for v in envs.VARS]
    assert len(names) == len(set(names))
    assert all(v.description and v.read_by for v in envs.VARS)


def test_values_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_STORAGE_ATTEMPTS", raising=False)
    assert envs.STORAGE_ATTEMPTS.get() == "6"
    monkeypatch.setenv("VLLM_BATCH_STORAGE_ATTEMPTS", " 3 ")
    assert envs.STORAGE_ATTEMPTS.get() == "3"
    monkeypatch.setenv("VLLM_BATCH_STORAGE_ATTEMPTS", "")
    assert envs.STORAGE_ATTEMPTS.get() == "6"  # empty is unset
    assert envs.HARDWARE.get({"VLLM_BATCH_HARDWARE": "8x B200"}) == "8x B200"  # an explicit mapping wins
    assert envs.ALLOW_ANY_LOCATION.flag({"VLLM_BATCH_ALLOW_ANY_LOCATION": "True"})
    assert not envs.ALLOW_ANY_LOCATION.flag({"VLLM_BATCH_ALLOW_ANY_LOCATION": "0"})


def test_the_docs_table_is_generated_from_envs():
    doc = (ROOT / "docs" / "environment.md").read_text()
    assert doc.endswith(envs.markdown_table())
    readme = (ROOT / "README.md").read_text()
    assert "docs/environment.md" in readme


def test_both_keys_are_secrets_the_worker_masks_by_their_names():
    """The worker masks the values of variables whose names say they hold secrets (worker/redact.py): its own key
    (``VLLM_BATCH_WORKER_KEY``) and the deployment's, which it refuses (``VLLM_BATCH_SIGNING_KEY``)."""
    env = {"VLLM_BATCH_WORKER_KEY": "vbw1.x", "VLLM_BATCH_SIGNING_KEY": "k", "VLLM_BATCH_LOG_LEVEL": "INFO"}
    assert envs.secret_names(env) == {"VLLM_BATCH_WORKER_KEY", "VLLM_BATCH_SIGNING_KEY"}
