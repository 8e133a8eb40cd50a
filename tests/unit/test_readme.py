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


@pytest.mark.parametrize(
    "code, missing",
    [
        (
            "from airflow_provider_vllm.task_groups.batch_job import no_such_builder",
            ["airflow_provider_vllm.task_groups.batch_job.no_such_builder"],
        ),
        ("import airflow_provider_vllm.no_such_module", ["airflow_provider_vllm.no_such_module: "]),
        ("from airflow_provider_vllm.core.spec import JobSpec\nimport os", []),
    ],
)
def test_a_stale_import_is_caught(code, missing):
    found = missing_names(code)
    assert [f.split("No module")[0] for f in found] == missing


def test_the_extractor_reads_only_python_blocks():
    md = "x\n```python\na = 1\n```\n```bash\nmake demo\n```\n```python\nb = (\n```\n"
    assert python_blocks(md) == ["a = 1\n", "b = (\n"]
    with pytest.raises(SyntaxError):
        compile(python_blocks(md)[1], "README.md", "exec")


def relative_links(markdown: str) -> list[str]:
    """Targets of the Markdown links and images that point into the repository (no scheme, anchor dropped)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [t.split("#", 1)[0] for t in targets if "://" not in t and not t.startswith("#")]


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", "docs/airflow.md"])
def test_links_and_pictures_point_at_files_that_exist(page):
    path = ROOT / page
    links = relative_links(path.read_text())
    assert links
    assert [t for t in links if not (path.parent / t).exists()] == []


def test_the_readme_shows_a_picture_from_docs():
    pictures = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert len(pictures) == 1 and pictures[0].startswith("docs/img/") and (ROOT / pictures[0]).is_file()


def test_the_link_finder_sees_a_missing_target():
    assert relative_links("[a](docs/nope.md#x) [b](https://x.org/y) ![c](img/p.png) [d](#top)") == [
        "docs/nope.md",
        "img/p.png",
    ]


def test_the_install_lines_are_true_today():
    """Not on PyPI yet: a wheel of this version, Airflow's constraints of the locked Airflow, extras that exist,
    and the PyPI line only as what comes once published; the [cpu] extra names PyTorch's CPU index."""
    import configparser

    from airflow_provider_vllm import __version__
    from airflow_provider_vllm.core.compat import PYTORCH_CPU_INDEX
    from tests.support.locks import airflow_lock, lock_entries

    text = (ROOT / "README.md").read_text()
    install = text[text.index("## Install") : text.index("## A DAG")]
    airflow = lock_entries(airflow_lock())["apache-airflow"].split("==", 1)[1].split()[0]
    wheel = f"dist/airflow_provider_vllm-{__version__}-py3-none-any.whl"
    assert "pip wheel --no-deps -w dist ." in install and f'"{wheel}[s3]"' in install
    assert f"https://raw.githubusercontent.com/apache/airflow/constraints-{airflow}/constraints-3.11.txt" in install
    assert install.count(f'"apache-airflow=={airflow}"') >= 3  # both steps and the checkout line keep that Airflow
    assert re.search(r"Once the package is published: `pip install 'airflow-provider-vllm\[s3\]'`", install)
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = set(cfg["options.extras_require"])
    for named in re.findall(r"`(\w+)` for|`\[([\w,]+)\]`", install):
        for extra in ",".join(n for n in named if n).split(","):
            assert extra in extras, extra
    assert f'[s3,cpu]" --extra-index-url {PYTORCH_CPU_INDEX}' in install
