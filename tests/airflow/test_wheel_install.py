"""Acceptance: the wheel, installed as a user installs it (pip resolving its requirements and the
``[s3,openlineage]`` extras under Airflow-style constraints) into a clean venv, is a provider that
Airflow lists, its CLI command is there, and the example DAGs it ships parse from the installed package.

The constraints are Airflow's own file when ``VLLM_BATCH_AIRFLOW_CONSTRAINTS`` names it (a path or a
URL, e.g. https://raw.githubusercontent.com/apache/airflow/constraints-3.3.2/constraints-3.11.txt);
without it (GitHub cannot be reached from the machines this is developed on) a file in the same
format, one ``name==version`` a line, made from ``requirements/airflow.txt``, the Airflow side of
the locks. Slow (a venv and ~300 packages; pip's local cache makes later runs faster). No vLLM, no torch.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.airflow_env import LOADED_MACHINE
from tests.support.locks import airflow_lock, lock_entries

pytestmark = pytest.mark.slow

DAG_IDS = {"vllm_nightly_reclassification", "vllm_batch_rerun", "vllm_embeddings", "vllm_nightly_table"}
EXAMPLE_FILES = {
    "vllm_nightly_reclassification.py",
    "vllm_nightly_table.py",
    "vllm_batch_rerun.py",
    "vllm_embeddings.py",
    "vllm_dag_defaults.py",
    ".airflowignore",
}
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "airflow_provider_vllm", "dags")
EXTRAS = "s3,openlineage"
CONSTRAINTS_ENV = "VLLM_BATCH_AIRFLOW_CONSTRAINTS"


def run(argv: list, timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert p.returncode == 0, f"{argv}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


def cli_json(p: subprocess.CompletedProcess):
    """The JSON table of an ``airflow ... -o json`` command: its last stdout line (warnings are logged above it)."""
    return json.loads(p.stdout.strip().splitlines()[-1])


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the sources (not of the checkout, whose build/ may hold stale files)."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(ROOT / name, src / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src])
    (wheel,) = (tmp / "dist").glob("airflow_provider_vllm-*.whl")
    return wheel


def test_wheel_installs_into_a_clean_venv_as_a_provider_with_its_example_dags(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert {n.rsplit("/", 1)[1] for n in names if n.startswith("airflow_provider_vllm/example_dags/")} == EXAMPLE_FILES
    assert not [n for n in names if n.startswith(("tests/", "airflow_provider_vllm/testing/"))]
    assert not [n for n in names if n.endswith((".safetensors", ".gguf", ".bin", ".parquet"))]

    # As a user installs it: pip resolves the wheel's requirements and extras under the constraints.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV", "VLLM"))}
    # The DAG files parse in a venv that --no-compile left without bytecode: LOADED_MACHINE says why the timeout.
    env.update(AIRFLOW_HOME=str(tmp_path / "home"), AIRFLOW__CORE__LOAD_EXAMPLES="False", **LOADED_MACHINE)
    venv = tmp_path / "venv"
    # --without-pip: this pip installs into it (`pip --python`), as it would from inside; ensurepip would
    # install and byte-compile a second pip first.
    run([sys.executable, "-m", "venv", "--without-pip", venv], env=env, cwd=tmp_path)
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", py]
    airflow_pin = f"apache-airflow=={_locked('apache-airflow')}"
    # --no-compile: pip would byte-compile all ~300 packages up front (single-threaded); Python compiles what the
    # commands below import, as it goes. What is installed, and what they prove, is the same.
    pip_install = [*pip, "install", "-q", "--no-compile", airflow_pin, f"{wheel}[{EXTRAS}]"]
    run(
        [*pip_install, "--constraint", constraints(tmp_path)],
        env=env,
        cwd=tmp_path,
        timeout=1800,
    )
    listed = cli_json(run([*pip, "list", "--format", "json"], env=env, cwd=tmp_path))
    dists = {d["name"].lower().replace("_", "-"): d["version"] for d in listed}
    assert dists["apache-airflow-providers-amazon"] == _locked("apache-airflow-providers-amazon")
    assert dists["apache-airflow-providers-openlineage"] == _locked("apache-airflow-providers-openlineage")
    assert not [n for n in dists if n.startswith(("vllm", "torch"))]  # the Airflow side needs no engine
    run([*pip, "check"], env=env, cwd=tmp_path)

    installed = Path(
        run(
            [py, "-c", "import airflow_provider_vllm as p, pathlib; print(pathlib.Path(p.__file__).parent)"],
            env=env,
            cwd=tmp_path,
        ).stdout.strip()
    )
    assert installed.is_relative_to(venv) and not (installed / "testing").exists()
    airflow = venv / "bin" / "airflow"

    provider = cli_json(
        run([airflow, "providers", "get", "airflow-provider-vllm", "-o", "json"], env=env, cwd=tmp_path)
    )
    assert provider[0]["Provider"] == "airflow-provider-vllm" and provider[0]["Version"] == meta["Version"]
    # the provider's CLI command, registered through get_provider_info like amazon's and cncf's
    assert "dry-run" in run([airflow, "vllm-batch", "--help"], env=env, cwd=tmp_path).stdout

    run([airflow, "db", "migrate"], env=env, cwd=tmp_path)

    def parsed(dags_folder: Path) -> tuple[list, set]:
        folder_env = {**env, "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder)}
        errors = cli_json(
            run([airflow, "dags", "list-import-errors", "--local", "-o", "json"], env=folder_env, cwd=tmp_path)
        )
        dags = cli_json(run([airflow, "dags", "list", "--local", "-o", "json"], env=folder_env, cwd=tmp_path))
        return errors, {d["dag_id"] for d in dags}

    assert parsed(installed / "example_dags") == ([], DAG_IDS)
    # One template copied alone into a user's dags folder finds the shared defaults in the package.
    alone = tmp_path / "my_dags"
    alone.mkdir()
    shutil.copy2(installed / "example_dags" / "vllm_nightly_reclassification.py", alone)
    assert parsed(alone) == ([], {"vllm_nightly_reclassification"})


def _locked(name: str) -> str:
    entry = lock_entries(airflow_lock())[name]
    return entry.split("==", 1)[1].split()[0]


def constraints(tmp: Path) -> str:
    """Airflow's constraints file (``VLLM_BATCH_AIRFLOW_CONSTRAINTS``), else one in its format from the lock."""
    given = os.environ.get(CONSTRAINTS_ENV, "").strip()
    if given:
        return given
    path = tmp / "constraints-3.11.txt"
    pins = [entry.split(" ", 1)[0].rstrip("\\").strip() for entry in lock_entries(airflow_lock()).values()]
    path.write_text("\n".join(sorted(pins, key=str.lower)) + "\n")
    return str(path)
