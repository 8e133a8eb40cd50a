"""The Airflow side of the pinned environment, for tests that install the provider into a clean venv."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import ROOT


def airflow_lock(root: Path = ROOT) -> Path:
    """The lock of the Airflow side: ``requirements/airflow.txt`` where it exists, else ``requirements.lock``."""
    split = root / "requirements" / "airflow.txt"
    return split if split.is_file() else root / "requirements.lock"


def lock_entries(lock: Path) -> dict[str, str]:
    """Pinned entries by canonical name, each with its continuation lines (``--hash=...``) kept."""
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in lock.read_text().splitlines() + [""]:
        if current and (current[-1].endswith("\\") or line.lstrip().startswith("--hash")):
            current.append(line)
            continue
        if current:
            entry = "\n".join(current).rstrip("\\ \n")
            entries[canonicalize_name(re.split(r"[=<>!~;\[ ]", current[0].strip(), maxsplit=1)[0])] = entry
            current = []
        stripped = line.split("#", 1)[0].strip()
        if stripped and not stripped.startswith("-"):
            current = [line.split(" #", 1)[0].rstrip()]
    return entries


def dependency_closure(requirements: list[str]) -> set[str]:
    """Canonical names of ``requirements`` and everything they need, read from this interpreter's installed
    metadata (which the lock installed), with markers evaluated for this interpreter."""
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({**default_environment(), "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for extra_name in ("", *sorted(req.extras)):  # the markers pick what each extra adds
            todo.extend((Requirement(r), extra_name) for r in requires)
    return {k.split("[", 1)[0] for k in seen}


def airflow_side(requirements: list[str], lock: Path) -> list[str]:
    """The lock's entries that ``requirements`` need: what ``pip install --no-deps -r`` must get for them."""
    needed = dependency_closure(requirements)
    return [entry for name, entry in lock_entries(lock).items() if name in needed]
