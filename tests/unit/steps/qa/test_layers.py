"""The QA modules import each other only downwards, in the order steps/qa/__init__.py lists them."""

from __future__ import annotations

import ast
from pathlib import Path

import airflow_provider_vllm.steps.qa as qa

ORDER = [
    "report",
    "metrics",
    "metrics_stream",
    "accuracy",
    "yardstick",
    "labelled",
    "confidence",
    "checks",
    "sample",
    "html_quality",
    "html",
    "store",
    "golden_set",
    "reference",
    "evaluate",
    "stage",
]
PKG = "airflow_provider_vllm.steps.qa"


def qa_imports(path: Path) -> set[str]:
    """The steps.qa modules that a source file imports (top-level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PKG:
                found |= {a.name for a in node.names}
            elif node.module.startswith(PKG + "."):
                found.add(node.module.removeprefix(PKG + ".").split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix(PKG + ".").split(".")[0] for a in node.names if a.name.startswith(PKG + ".")}
    return found


def test_order_lists_every_module():
    folder = Path(qa.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") == sorted(ORDER)
    assert all(f"``{m}``" in qa.__doc__ for m in ORDER)


def test_modules_import_only_lower_ones():
    folder = Path(qa.__file__).parent
    for i, name in enumerate(ORDER):
        higher = qa_imports(folder / f"{name}.py") - set(ORDER[:i])
        assert not higher, f"steps/qa/{name}.py imports {sorted(higher)}, which are not below it"


def test_qa_imports_sees_both_import_forms(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        f"from {PKG}.stage import qa_run\n\ndef f():\n    import {PKG}.store\n    from {PKG} import sample\n"
    )
    assert qa_imports(src) == {"stage", "store", "sample"}
