"""The Airflow side of the pinned environment, for tests that install the provider into a clean venv."""

from __future__ import annotations

import re
from pathlib import Path

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
