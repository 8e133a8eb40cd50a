"""An AST audit of the package and the DAGs: no shell, no eval, no second template render."""

from __future__ import annotations

import ast

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.reliability


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


def test_audit_no_shell_no_eval_no_second_template_render():
    """AST audit of the package and the DAGs: subprocesses get argv lists, never a shell."""
    files = sorted((ROOT / "airflow_provider_vllm").rglob("*.py")) + sorted((ROOT / "dags").glob("*.py"))
    problems = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module == "jinja2"
                    and [a.name for a in node.names] == ["meta"]
                ):
                    continue  # utils/provenance.py: static analysis of templates (parse, never render)
                if any(m.split(".")[0] in ("jinja2", "commands", "pty") for m in mods):
                    problems.append(f"{path.name}:{node.lineno} imports {mods}")
        for node, owner, name in _calls(tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if any(
                k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                for k in node.keywords
            ):
                problems.append(f"{where} shell=")
            if owner == "os" and (name in ("system", "popen") or name.startswith(("exec", "spawn"))):
                problems.append(f"{where} os.{name}")
            if owner == "subprocess" and name in ("getoutput", "getstatusoutput"):
                problems.append(f"{where} subprocess.{name}")
            if (
                owner == "subprocess"
                and name in ("run", "Popen", "call", "check_call", "check_output")
                and node.args
                and isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp))
            ):
                problems.append(f"{where} subprocess.{name} with a string command")
            if isinstance(node.func, ast.Name) and name in ("eval", "exec", "compile", "__import__"):
                problems.append(f"{where} {name}()")
            # ``super().render_template(...)``: an override handing Airflow's one rendering on (operators/merge.py
            # keeps a missing XCom for execute), never a second render of what was rendered
            delegated = (
                isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Call)
                and isinstance(node.func.value.func, ast.Name)
                and node.func.value.func.id == "super"
            )
            if name in ("from_string", "render_template", "render_template_as_native", "Template") and not delegated:
                problems.append(f"{where} {name}()")
    assert problems == []
    # the one process launch in the package takes argv from worker_command (a list)
    src = (ROOT / "airflow_provider_vllm" / "utils" / "worker_process.py").read_text()
    assert "argv = list(self.argv)" in src and "subprocess.Popen(\n            argv," in src
