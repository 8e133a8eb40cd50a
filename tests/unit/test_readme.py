"""The README's Python snippets compile, and every name they import from the provider exists."""

from __future__ import annotations

import ast
import importlib
import re

import pytest

from tests.support import ROOT

PACKAGE = "airflow_provider_vllm"


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced ```python blocks."""
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.S | re.M)


def provider_imports(code: str) -> list[tuple[str, str | None]]:
    """(module, name) for each ``from airflow_provider_vllm... import name``; (module, None) for ``import``."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE:
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == PACKAGE]
    return found


def missing_names(code: str) -> list[str]:
    missing = []
    for module, name in provider_imports(code):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{module}: {e}")
            continue
        if name is not None and not hasattr(mod, name):
            missing.append(f"{module}.{name}")
    return missing


def test_readme_snippets_compile_and_their_provider_imports_resolve():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert blocks, "the README lost its DAG"
    for code in blocks:
        compile(code, "README.md", "exec")
        assert missing_names(code) == [], code
    imported = {(m, n) for code in blocks for m, n in provider_imports(code)}
    assert ("airflow_provider_vllm.task_groups.batch_job", "vllm_batch_job") in imported


@pytest.mark.parametrize("code, missing", [
    ("from airflow_provider_vllm.task_groups.batch_job import no_such_builder",
     ["airflow_provider_vllm.task_groups.batch_job.no_such_builder"]),
    ("import airflow_provider_vllm.no_such_module", ["airflow_provider_vllm.no_such_module: "]),
    ("from airflow_provider_vllm.core.spec import JobSpec\nimport os", []),
])
def test_a_stale_import_is_caught(code, missing):
    found = missing_names(code)
    assert [f.split("No module")[0] for f in found] == missing


def test_the_extractor_reads_only_python_blocks():
    md = "x\n```python\na = 1\n```\n```bash\nmake demo\n```\n```python\nb = (\n```\n"
    assert python_blocks(md) == ["a = 1\n", "b = (\n"]
    with pytest.raises(SyntaxError):
        compile(python_blocks(md)[1], "README.md", "exec")
