"""scripts/torch_source.py: torch's +cpu build comes from PyTorch's CPU index unless pip's own configuration
already offers it (then that source, and the index is never named), for `make venv` (pip) and `make lock` (uv)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile

import pytest

from tests.support import ROOT

INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def ts():
    spec = importlib.util.spec_from_file_location("torch_source", ROOT / "scripts" / "torch_source.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_pin_is_the_engine_locks(ts):
    req = ts.torch_requirement()
    assert req == "torch==2.13.0+cpu"
    assert f"\n{req} \\\n" in (ROOT / "requirements" / "engine.txt").read_text()
    assert "--find-links" not in (ROOT / "requirements" / "engine.txt").read_text()  # no location in the lock


@pytest.mark.parametrize(
    "tool, index, found, expected",
    [
        ("pip", "auto", "file:///srv/wheels/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl", []),
        (
            "uv",
            "auto",
            "file:///srv/wheels/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl",
            ["--find-links", "/srv/wheels"],
        ),
        ("pip", "auto", "https://mirror.example/simple/torch/torch-2.13.0%2Bcpu.whl", []),  # pip's mirror: pip finds it
        (
            "uv",
            "auto",
            "https://mirror.example/simple/torch/torch-2.13.0%2Bcpu.whl",
            ["--find-links", f"{INDEX}/torch/"],
        ),
        ("pip", "auto", None, ["--extra-index-url", INDEX]),
        ("uv", "auto", None, ["--find-links", f"{INDEX}/torch/"]),
        ("pip", "https://mirror.example/whl/cpu/", None, ["--extra-index-url", "https://mirror.example/whl/cpu/"]),
        ("uv", "https://mirror.example/whl/cpu/", None, ["--find-links", "https://mirror.example/whl/cpu/torch/"]),
        ("pip", "", None, []),
        ("uv", "", None, []),
    ],
)
def test_where_each_tool_gets_torch(ts, tool, index, found, expected):
    assert ts.arguments(tool, index, found)[0] == expected


def _wheel(folder, name="torch", version="2.13.0+cpu"):
    """A minimal valid wheel (metadata only), enough for pip to resolve it."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(c.encode()).digest()).rstrip(b'=').decode()},{len(c)}"
        for p, c in files.items()
    ]
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, c in files.items():
            z.writestr(p, c)
    return path


def test_pip_is_asked_with_its_own_configuration_only(ts, tmp_path, monkeypatch):
    """Real pip, offline: a configured wheel folder is found (make venv adds nothing, make lock hands uv
    the folder); without one, nothing is found and PyTorch's index is used."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no pip.conf of this machine
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(folder)
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    found = ts.pip_finds("torch==2.13.0+cpu")
    assert found is not None and found.startswith("file://") and "torch-2.13.0" in found
    assert ts.arguments("pip", "auto", found)[0] == []
    assert ts.arguments("uv", "auto", found)[0] == ["--find-links", str(folder)]
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    assert ts.pip_finds("torch==2.13.0+cpu") is None
