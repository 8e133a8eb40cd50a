"""Tests mirror the package: each module has ``tests/unit/<its path>/test_<name>.py``, or is listed
below with the test files that exercise it (a tier that needs Airflow, vLLM or S3, or a test
of the behaviour the module is one part of). A new module with neither fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGE = ROOT / "airflow_provider_vllm"

TESTED_ELSEWHERE: dict[str, list[str]] = {
    "core/errors.py": ["tests/unit/core/test_exit_codes.py", "tests/unit/test_bad_inputs.py"],
    "core/formats/base.py": ["tests/unit/core/formats/test_parquet.py", "tests/unit/steps/plan/test_plan_refusals.py"],
    "core/param_schemas.py": ["tests/unit/steps/plan/test_plan_refusals.py"],
    "core/pod_settings.py": ["tests/unit/utils/test_pod_spec.py"],
    "core/rows.py": ["tests/unit/core/test_commit.py", "tests/unit/worker/test_isolation.py"],
    "core/storage_retry.py": ["tests/s3/test_s3_faults.py"],
    "links/report.py": ["tests/unit/operators/test_review.py"],
    "plugins/report.py": ["tests/airflow/test_report_page_access.py", "tests/ui/test_airflow_ui.py"],
    "provider.py": ["tests/unit/test_provider_info.py"],
    "steps/plan/memory.py": ["tests/unit/steps/plan/test_dry_run.py", "tests/unit/utils/test_pod_spec.py"],
    "steps/qa/report.py": ["tests/unit/steps/qa/test_checks.py", "tests/unit/steps/qa/test_store.py"],
    "task_groups/batch_job.py": ["tests/airflow/test_operators.py", "tests/airflow/test_security_dags.py"],
    "testing/local_models.py": ["tests/vllm/test_local_models.py"],
    "utils/openlineage_facets.py": ["tests/airflow/test_openlineage.py"],
    "utils/published.py": ["tests/unit/operators/test_previous_published.py"],
    "worker/lifecycle.py": ["tests/vllm/test_reliability_lifecycle.py"],
    "worker/resources.py": ["tests/unit/worker/test_metrics.py"],
    "worker/task.py": ["tests/unit/operators/test_kubernetes.py", "tests/unit/worker/test_shard.py"],
    "worker/watchdog.py": ["tests/unit/core/test_faults.py", "tests/vllm/test_reliability_lifecycle.py"],
}


def _modules() -> list[str]:
    return sorted(
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts and "example_dags" not in p.parts
    )


def _mirror(rel: str) -> Path:
    path = Path(rel)
    return ROOT / "tests" / "unit" / path.parent / f"test_{path.stem}.py"


def _names(rel: str) -> set[str]:
    """How a test can name the module: its dotted path, its package's, or a public name it defines."""
    dotted = "airflow_provider_vllm." + rel[:-3].replace("/", ".")
    tree = ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))
    public = {
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
    }
    public |= {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and t.id.isupper()
    }
    return {dotted, dotted.rsplit(".", 1)[0] + " import", *public}


def test_every_module_is_mirrored_or_says_where_it_is_tested():
    unlisted = [m for m in _modules() if not _mirror(m).exists() and m not in TESTED_ELSEWHERE]
    assert unlisted == [], f"add tests/unit/<path>/test_<name>.py or a TESTED_ELSEWHERE entry for: {unlisted}"


def test_the_table_is_true():
    modules = set(_modules())
    for rel, files in TESTED_ELSEWHERE.items():
        assert rel in modules, f"{rel}: no such module (moved? update the table)"
        assert not _mirror(rel).exists(), f"{rel} has its mirror test now: drop it from the table"
        names = _names(rel)
        for f in files:
            text = (ROOT / f).read_text(encoding="utf-8")
            assert any(n in text for n in names), f"{f} names nothing of {rel}"


def test_most_modules_are_mirrored():
    mirrored = [m for m in _modules() if _mirror(m).exists()]
    assert len(mirrored) >= 38
