"""Every third-party module the worker can import is in its image.

The worker image is the official vLLM image plus docker/worker-requirements.txt (the package
itself goes in with --no-deps). The worker's import closure is followed statically from
``airflow_provider_vllm.worker.__main__`` through the package, including imports inside
functions (lazy ones fail only when that path runs: on the H200 the worker died on a lazy
``import jsonschema`` the device recipe lacked), and each third-party top-level module must
come from the requirements file or the vLLM image.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.support import ROOT  # noqa: E402

# What vllm/vllm-openai brings that the worker imports (vLLM's own requirements; pydantic_core is
# pydantic's own dependency, pinned by it; packaging is transformers' and torch's).
VLLM_IMAGE = {
    "vllm",
    "torch",
    "numpy",
    "pydantic",
    "pydantic_core",
    "annotated_types",  # pydantic's own dependency
    "yaml",
    "psutil",
    "pynvml",
    "transformers",
    "packaging",
    "huggingface_hub",  # vLLM's own dependency (it fetches models and adapters from the hub with it)
}
# Reached by the static walk but never run by the worker: planning imports DuckDB only inside
# plan_job's helpers (the plan task, on the Airflow side).
NOT_RUN_BY_WORKER = {"duckdb"}


def _module_file(name: str) -> Path | None:
    p = ROOT.joinpath(*name.split("."))
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").is_file() else None


def worker_third_party_imports() -> dict[str, set[str]]:
    seen: set[str] = set()
    found: dict[str, set[str]] = {}
    todo = ["airflow_provider_vllm.worker.__main__"]
    while todo:
        mod = todo.pop()
        if mod in seen or (path := _module_file(mod)) is None:
            continue
        seen.add(mod)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "airflow_provider_vllm":
                    todo.append(name)
                elif name.split(".")[0] not in sys.stdlib_module_names:
                    found.setdefault(name.split(".")[0], set()).add(mod)
    return found


def image_modules() -> set[str]:
    names = set()
    for line in (ROOT / "docker" / "worker-requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0].lower().replace("-", "_"))
    return names | VLLM_IMAGE


def test_the_worker_imports_only_what_its_image_has():
    found = worker_third_party_imports()
    assert {"vllm", "pyarrow", "fsspec", "jsonschema"} <= set(found)  # the walk sees lazy imports
    missing = {m: sorted(v) for m, v in found.items() if m not in image_modules() | NOT_RUN_BY_WORKER}
    assert not missing, f"add to docker/worker-requirements.txt (imported by): {missing}"


def test_airflow_is_not_reachable_from_the_worker():
    assert "airflow" not in worker_third_party_imports()
