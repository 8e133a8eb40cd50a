"""scripts/torch_source.py: torch's +cpu build comes from PyTorch's CPU index unless pip's own configuration
already offers it (then that source, and the index is never named), for `make venv` (uv or pip) and `make lock` (uv);
uv, which reads no pip configuration, is handed pip's configured sources for `make venv`."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
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
        # make venv with uv: pip's sources are handed to uv (uv_sources), so what pip finds needs nothing more
        ("uv-install", "auto", "file:///srv/wheels/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl", []),
        ("uv-install", "auto", "https://mirror.example/simple/torch/torch-2.13.0%2Bcpu.whl", []),
        ("uv-install", "auto", None, ["--find-links", f"{INDEX}/torch/"]),
        (
            "uv-install",
            "https://mirror.example/whl/cpu/",
            None,
            ["--find-links", "https://mirror.example/whl/cpu/torch/"],
        ),
        ("uv-install", "", None, []),
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


def test_pip_config_list_is_read_as_pip_install_applies_it(ts):
    text = "\n".join(
        [
            "global.cert='/etc/ssl/certs/ca.crt'",
            "global.extra-index-url='file:///srv/simple https://mirror.example/simple'",
            "global.find-links='/srv/global-wheels'",
            "global.index-url='https://proxy.example/pypi/simple'",
            "install.find-links='/srv/install-wheels'",  # install. over global.
            ":env:.find-links='/srv/env-wheels'",  # PIP_FIND_LINKS over both
            ":env:.default-timeout='180'",
            "not a config line",
            "user.index-url='https://ignored.example'",  # not a section pip install reads
        ]
    )
    config = ts.parse_pip_config(text)
    assert config["find-links"] == "/srv/env-wheels"
    assert config["index-url"] == "https://proxy.example/pypi/simple"
    assert ts.uv_sources(config, ["https://download.pytorch.org/whl/cpu/torch/"]) == (
        [],
        {
            "UV_INDEX_URL": "https://proxy.example/pypi/simple",
            "UV_EXTRA_INDEX_URL": "file:///srv/simple https://mirror.example/simple",
            "UV_INDEX_STRATEGY": "unsafe-best-match",
            "UV_FIND_LINKS": "/srv/env-wheels,https://download.pytorch.org/whl/cpu/torch/",
        },
    )
    assert ts.uv_sources(ts.parse_pip_config("")) == ([], {})  # nothing configured: uv's PyPI, as pip's
    assert ts.uv_sources(ts.parse_pip_config(":env:.no-index='1'\n:env:.find-links='/w'")) == (
        ["--no-index"],
        {"UV_FIND_LINKS": "/w"},
    )
    with pytest.raises(SystemExit, match="comma"):  # uv would read two locations
        ts.uv_sources(ts.parse_pip_config("global.find-links='/srv/a,b'"))


def test_urls_are_printed_with_their_credentials_masked(ts):
    text = "UV_INDEX_URL=https://alice:s3cret@mirror.example/simple UV_FIND_LINKS=https://tok3n@files.example/w,/srv/w"
    masked = ts.redact(text)
    assert "s3cret" not in masked and "tok3n" not in masked
    assert "https://alice:****@mirror.example/simple" in masked and "https://****@files.example/w,/srv/w" in masked
    assert ts.redact("file:///srv/simple") == "file:///srv/simple"


def test_uv_runs_with_the_sources_of_the_real_pip_in_its_environment_only(ts, tmp_path, monkeypatch, capfd):
    """Real `pip config list` with a config file and PIP_* variables of this test; a stand-in for uv records the
    command line and the environment it was run with (main execs it, so it runs in a child here)."""
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nextra-index-url = file:///srv/a/simple\n    https://bob:hunter2@mirror.example/b/simple\n"
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    # the variables win over any pip.conf of the machine's own
    monkeypatch.setenv("PIP_INDEX_URL", "https://proxy.example/pypi/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "false")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    for name in [k for k in os.environ if k.startswith("UV_")]:  # only what main sets
        monkeypatch.delenv(name)
    fake_uv = tmp_path / "uv"
    fake_uv.write_text(
        f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/argv\nenv | grep '^UV_' | sort > {tmp_path}/env\n"
    )
    fake_uv.chmod(0o755)
    pid = os.fork()
    if pid == 0:  # the child execs the stand-in; the parent waits for it
        try:
            ts.main(["uv-install", "--index", "", "--run", str(fake_uv), "pip", "install", "-r", "x.txt"])
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "argv").read_text().split() == ["pip", "install", "-r", "x.txt"]  # no URL in the arguments
    assert (tmp_path / "env").read_text().splitlines() == [
        "UV_EXTRA_INDEX_URL=file:///srv/a/simple https://bob:hunter2@mirror.example/b/simple",
        f"UV_FIND_LINKS={tmp_path / 'wheels'}",
        "UV_INDEX_STRATEGY=unsafe-best-match",
        "UV_INDEX_URL=https://proxy.example/pypi/simple",
    ]
    printed = capfd.readouterr().err
    assert "bob:****@mirror.example" in printed and "hunter2" not in printed
