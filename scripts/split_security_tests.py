#!/usr/bin/env python
"""Split tests/unit/test_security.py into test files by the module each test guards (mechanical, re-runnable).

    python scripts/split_security_tests.py [--check]

Every top-level statement of tests/unit/test_security.py (with the comments and decorators above it) goes,
verbatim, to the file ``TARGETS`` names for it; shared helpers go to tests/support/security.py. A test file
made only of moved tests gets ``pytestmark = pytest.mark.reliability`` (as test_security.py had); a test
appended to an existing file gets ``@pytest.mark.reliability`` on itself, so that file's other tests keep
their marks. Imports: every import of test_security.py that a moved statement uses is added unless the
target already binds the name; the shared fixtures are registered by tests/unit/conftest.py (a test file
importing one would shadow it); then ``ruff format`` and ``ruff check --fix`` tidy the files. A name the
script does not know fails it (add it to TARGETS), so a test added to test_security.py is never dropped.
Re-runnable after a merge: a statement already moved with the same code is skipped, one changed on both
sides stops the script (merge it by hand), a new one is moved. Prints the old -> new node-id prefix of every
test (for documents that name tests) as JSON.
"""

from __future__ import annotations

import ast
import copy
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "unit" / "test_security.py"
SUPPORT = "tests/support/security.py"
ALLOW_LIST = "tests/unit/core/test_allow_list.py"
SPEC_GUARD = "tests/unit/core/test_spec_guard.py"
SPEC = "tests/unit/core/test_spec.py"
WORKER_CLI = "tests/unit/worker/test___main__.py"
PROMPTS = "tests/unit/worker/test_prompts.py"
REDACT = "tests/unit/worker/test_redact.py"
AUDIT = "tests/unit/test_code_audit.py"
PLAN_OPERATOR = "tests/unit/operators/test_plan.py"
SHARD_OPERATOR = "tests/unit/operators/test_shard.py"
PLANNER = "tests/unit/steps/plan/test_planner.py"
DEPLOYMENT = "tests/unit/utils/test_deployment.py"
PROVENANCE = "tests/unit/utils/test_provenance.py"

# target file -> docstring of a new file (None: the file exists; moved tests are appended)
FILES = {
    SUPPORT: (
        "What the security tests share: an allowed local folder holding an input, a spec inside it, the\n"
        "deployment's prefixes, and the refusal (if any) the spec meets at validation and the deployment check."
    ),
    ALLOW_LIST: (
        "The URI allow-list (``core/allow_list.py``): malicious URIs, whole-segment prefixes and\n"
        "symlinks that would lead out of an allowed folder are refused before any worker or pod spec exists."
    ),
    SPEC_GUARD: (
        "Every string and location of a job spec checked at validation and by the deployment's\n"
        "rules (``core/spec_guard.py``): shell and Jinja payloads, oversized values, every location field held to\n"
        "the allow-list, storage options that would choose an endpoint, credentials or access control, and\n"
        "code-loading engine options. Free text is the exception by design: shell metacharacters in a prompt are\n"
        "data and reach the engine verbatim (tests/unit/worker/test_prompts.py); Jinja delimiters are refused\n"
        "everywhere. The real DAGs' param validation: tests/airflow/test_security_dags.py."
    ),
    SPEC: None,
    WORKER_CLI: (
        "The worker's command line (``python -m airflow_provider_vllm.worker``) with forged shard tasks:\n"
        "exit 2 before it reads or writes anything, the allow-list only from the Airflow side's environment."
    ),
    PROMPTS: (
        "Prompts are data: shell text in a row, the template or the system prompt reaches the engine\n"
        "verbatim, and the worker's command line is an argv list (no shell)."
    ),
    REDACT: "Secrets in the worker's environment never reach its log records or its printed manifest.",
    AUDIT: "An AST audit of the package and the DAGs: no shell, no eval, no second template render.",
    PLAN_OPERATOR: None,
    SHARD_OPERATOR: None,
    PLANNER: None,
    DEPLOYMENT: None,
    PROVENANCE: (
        "Deployment-owned settings: who set the value (``utils/provenance.py``). The plan operator reads\n"
        "the DAG file's unrendered values; a trigger (params, ``dag_run.conf``), an XCom or a Variable without\n"
        "the deployment's opt-in never sets one."
    ),
}

# top-level name of test_security.py -> target file
TARGETS = {
    # shared
    "A": SUPPORT,
    "allowed": SUPPORT,
    "base_doc": SUPPORT,
    "prefixes": SUPPORT,
    "refused": SUPPORT,
    "with_value": SUPPORT,
    "_ti": SUPPORT,
    # core/allow_list.py
    "MALICIOUS_URIS": ALLOW_LIST,
    "test_malicious_uris_are_refused": ALLOW_LIST,
    "test_allowed_uris_pass_and_prefixes_match_whole_segments": ALLOW_LIST,
    "test_symlinks_cannot_lead_out_of_the_allowed_prefix": ALLOW_LIST,
    # core/spec_guard.py
    "SHELL": SPEC_GUARD,
    "JINJA": SPEC_GUARD,
    "IDENTIFIER_FIELDS": SPEC_GUARD,
    "FREE_TEXT_FIELDS": SPEC_GUARD,
    "test_overlapping_input_and_output_and_credentials_in_the_spec_are_refused": SPEC_GUARD,
    "test_shell_and_jinja_payloads_in_identifier_params_are_refused": SPEC_GUARD,
    "test_jinja_in_free_text_is_refused_shell_text_is_kept_as_data": SPEC_GUARD,
    "test_oversized_params_are_refused": SPEC_GUARD,
    "HOSTILE_LOCATIONS": SPEC_GUARD,
    "LOCATION_FIELDS": SPEC_GUARD,
    "RELATIVE_MODEL_PATHS": SPEC_GUARD,
    "test_every_location_field_is_held_to_the_allow_list": SPEC_GUARD,
    "HOSTILE_STORAGE_OPTIONS": SPEC_GUARD,
    "HOSTILE_ACCESS_OPTIONS": SPEC_GUARD,
    "test_storage_endpoints_and_credentials_come_from_the_deployment_only": SPEC_GUARD,
    "test_access_control_on_objects_is_the_deployments": SPEC_GUARD,
    "_Recorder": SPEC_GUARD,
    "test_a_spec_endpoint_never_reaches_a_server": SPEC_GUARD,
    "CODE_LOADING_ENGINE_KWARGS": SPEC_GUARD,
    "test_code_loading_engine_options_and_remote_code_need_the_deployment": SPEC_GUARD,
    # core/spec.py (JobSpec.from_params: the trigger form's path)
    "test_from_params_refuses_the_forms_payloads": SPEC,
    # worker/__main__.py (the worker's command line)
    "test_worker_refuses_forged_shard_tasks": WORKER_CLI,
    "test_worker_without_an_allow_list_from_airflow_refuses": WORKER_CLI,
    # worker/prompts.py
    "test_shell_text_reaches_the_engine_verbatim": PROMPTS,
    # worker/redact.py
    "test_worker_log_redacts_secret_environment_values": REDACT,
    "test_worker_cli_never_prints_a_secret_from_its_environment": REDACT,
    # the package as a whole
    "_calls": AUDIT,
    "test_audit_no_shell_no_eval_no_second_template_render": AUDIT,
    # operators/plan.py
    "test_plan_operator_refuses_before_planning": PLAN_OPERATOR,
    "test_param_overrides_cannot_name_deployment_owned_settings": PLAN_OPERATOR,
    # operators/shard.py
    "test_shard_operator_refuses_a_forged_spec_before_starting_a_worker": SHARD_OPERATOR,
    "test_shard_operator_hands_the_deployment_allow_list_to_the_worker": SHARD_OPERATOR,
    # steps/plan/planner.py
    "test_non_empty_foreign_output_prefix_is_refused": PLANNER,
    # utils/deployment.py
    "test_allow_list_is_deployment_config_only": DEPLOYMENT,
    "test_no_allow_list_refuses_every_task_naming_the_setting": DEPLOYMENT,
    # utils/provenance.py
    "_plan": PROVENANCE,
    "_PLANS": PROVENANCE,
    "_set": PROVENANCE,
    "OWNED_VALUES": PROVENANCE,
    "test_deployment_owned_settings_from_a_trigger_or_a_variable_are_refused": PROVENANCE,
    "test_deployment_owned_settings_from_the_dag_file_or_an_opted_in_variable_pass": PROVENANCE,
    "test_an_included_spec_file_is_the_dag_files_unless_it_reads_params": PROVENANCE,
}
# statements of test_security.py that stay behind (its module set-up; the support module does it now)
SETUP = ("os.environ.setdefault", "pytestmark")


def _name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _bound(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif _name(node):
            out.add(_name(node))
    return out


def _used(segments: list[str]) -> set[str]:
    names = set()
    for seg in segments:
        for node in ast.walk(ast.parse(seg)):
            if isinstance(node, ast.Name):
                names.add(node.id)
    return names


def main(check: bool = False) -> int:
    text = SOURCE.read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    imports: list[tuple[set[str], str]] = []  # (names bound, statement) for each top-level import
    moved: dict[str, list[str]] = {f: [] for f in FILES}
    tests: dict[str, str] = {}
    prev_end = 0
    for node in tree.body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        seg = "".join(lines[prev_end : node.end_lineno])  # comments above it belong to it
        own = "".join(lines[start - 1 : node.end_lineno])
        prev_end = node.end_lineno
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]:
            continue  # the module docstring
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not own.startswith(SETUP):
                names = {(a.asname or a.name).split(".")[0] for a in node.names}
                imports.append((names, own.replace("  # noqa: E402", "")))
            continue
        if own.startswith(SETUP):
            continue
        name = _name(node)
        if name is None or name not in TARGETS:
            raise SystemExit(f"test_security.py:{start}: {name or own.splitlines()[0]!r} has no target in TARGETS")
        target = TARGETS[name]
        seg = seg.lstrip("\n")
        if name.startswith("test_"):
            tests[f"tests/unit/test_security.py::{name}"] = f"{target}::{name}"
        path = ROOT / target
        if path.exists():  # an existing file (or one an earlier split made): moved tests are appended
            there = ast.parse(path.read_text())
            done = next((n for n in there.body if _name(n) == name), None)
            if done is not None:  # moved by an earlier split: the same code is skipped, a changed one is not
                if _code(done) != _code(node):
                    raise SystemExit(f"{name} differs in test_security.py and {target}: merge it by hand first")
                continue
            if name.startswith("test_") and not _marked(there):
                seg = seg.replace(own, "@pytest.mark.reliability\n" + own, 1)
        moved[target].append(seg)
    if check:
        print(json.dumps(tests, indent=1))
        return 0
    shared = {n for n, t in TARGETS.items() if t == SUPPORT}
    fixtures = {n for n in shared if n in _fixtures(tree)}
    shared -= fixtures  # registered for the unit tests by tests/unit/conftest.py, never imported by a test file
    _register_fixtures(fixtures)
    written = []
    for target, segs in moved.items():
        if not segs:
            continue
        path = ROOT / target
        existing = path.read_text() if path.exists() else ""
        bound = _bound(ast.parse(existing)) if existing else set()
        clash = bound & {_name(ast.parse(x).body[-1]) for x in segs}
        if clash:
            raise SystemExit(f"{target} already defines {sorted(clash)}: rename before splitting")
        used = _used(segs) - bound
        adds = [stmt for names, stmt in imports if names & used]
        support = sorted(used & shared) if target != SUPPORT else []
        if support:
            adds.append(f"from tests.support.security import {', '.join(support)}\n")
        body = "\n\n".join(s.rstrip("\n") + "\n" for s in segs)
        if existing:
            new = existing.rstrip("\n") + "\n\n\n" + body
            new = _add_imports(new, adds)
        else:
            setup = ""
            mark = "" if target == SUPPORT else "\npytestmark = pytest.mark.reliability\n"
            if target != SUPPORT and "import pytest\n" not in adds:
                adds.append("import pytest\n")
            new = f'"""{FILES[target]}\n"""\n\nfrom __future__ import annotations\n\n' + "".join(adds) + setup
            new += mark + "\n\n" + body
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(new)
        written.append(str(path))
    SOURCE.unlink()
    ruff = (
        [sys.executable, "-m", "ruff"]
        if not Path(sys.executable).with_name("ruff").exists()
        else [str(Path(sys.executable).with_name("ruff"))]
    )
    written.append(str(ROOT / "tests" / "unit" / "conftest.py"))
    subprocess.run([*ruff, "check", "--fix", "-q", "--select", "F401,I001", *written], cwd=ROOT)
    subprocess.run([*ruff, "format", "-q", *written], cwd=ROOT)
    print(json.dumps(tests, indent=1))
    return 0


def _code(node: ast.stmt) -> str:
    """A statement's code, without a ``pytest.mark.reliability`` decorator (the split adds one)."""
    node = copy.deepcopy(node)
    if hasattr(node, "decorator_list"):
        node.decorator_list = [d for d in node.decorator_list if ast.unparse(d) != "pytest.mark.reliability"]
    return ast.dump(node, include_attributes=False)


def _marked(tree: ast.Module) -> bool:
    """The module marks all its tests ``reliability`` (``pytestmark``)."""
    return any(_name(n) == "pytestmark" and "reliability" in ast.unparse(n) for n in tree.body)


def _fixtures(tree: ast.Module) -> set[str]:
    """Names of the module's functions decorated as pytest fixtures."""
    return {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in n.decorator_list)
    }


def _register_fixtures(names: set[str]) -> None:
    """tests/unit/conftest.py imports the shared fixtures (a test file importing one would shadow it)."""
    if not names:
        return
    conftest = ROOT / "tests" / "unit" / "conftest.py"
    text = conftest.read_text() if conftest.exists() else '"""Fixtures of the unit tests."""\n'
    missing = sorted(n for n in names if n not in _bound(ast.parse(text)))
    if missing:
        line = f"from tests.support.security import {', '.join(missing)}  # noqa: F401 (fixtures)\n"
        conftest.write_text(_add_imports(text, [line]))


def _add_imports(text: str, adds: list[str]) -> str:
    """``adds`` after the last top-level import of ``text`` (ruff sorts them afterwards)."""
    if not adds:
        return text
    tree = ast.parse(text)
    last = max((n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))), default=None)
    lines = text.splitlines(keepends=True)
    if last is None:  # no imports: after the docstring
        last = tree.body[0].end_lineno if tree.body and isinstance(tree.body[0], ast.Expr) else 0
    return "".join(lines[:last]) + "".join(adds) + "".join(lines[last:])


if __name__ == "__main__":
    sys.exit(main(check="--check" in sys.argv))
