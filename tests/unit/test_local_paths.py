"""No tracked file names a path of the machine it was written on: a fresh clone anywhere must work, and
a path like a wheel folder or a checkout location would only work (or only mean something) here.

Forbidden: the usual roots of developers' machines and data disks (``/work/``, ``/opt/``, ``/home/``,
``/Users/``), and this checkout's own location, the running venv and pip's configured wheel folders,
whatever they are on the machine that runs the test. Allowed: paths inside a
container image (``docker/``: ``/opt/airflow`` is the official Airflow image's home), and example
paths that are no machine's (``/data/in``, ``/models``, ``/tmp/vllm-batch``, ``s3://bucket/...``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

ROOTS = ("/work/", "/opt/", "/home/", "/Users/")
# (path prefix of the tracked file, forbidden root it may name, why)
ALLOWED = (("docker/", "/opt/", "paths inside the images (the Airflow image's AIRFLOW_HOME is /opt/airflow)"),)
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()


def local_roots() -> list[str]:
    """The static roots plus what is local to the machine running this: the checkout, the venv, wheel folders."""
    roots = set(ROOTS)
    places = [ROOT] + ([Path(sys.prefix)] if sys.prefix != sys.base_prefix else [])  # a venv, not /usr
    for p in places:
        if len(p.resolve().parts) > 2:  # a folder of its own, never "/" or a top-level system folder
            roots.add(str(p.resolve()).rstrip("/") + "/")
    for folder in (os.environ.get("PIP_FIND_LINKS") or "").split():
        if folder.startswith("/"):
            roots.add(folder.rstrip("/") + "/")
    return sorted(roots)


def offending(text: str, roots: list[str]) -> list[str]:
    """The local paths ``text`` names: a root at the start of a path (not inside a URL or a longer path)."""
    alternatives = "|".join(re.escape(r.rstrip("/")) for r in roots)
    pattern = re.compile(rf"(?:^|[^\w./~-]|file://)((?:{alternatives})/[^\s'\"`)\]>,;]*)", re.M)
    return [m.group(1) for m in pattern.finditer(text)]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def test_the_matcher_finds_local_paths_and_leaves_examples_alone():
    roots = local_roots()
    assert offending("--find-links /opt/wheels\n", roots) == ["/opt/wheels"]
    assert offending('"model": "/work/main/.cache/models/x"', roots) == ["/work/main/.cache/models/x"]
    assert offending("see file:///home/me/data.parquet", roots) == ["/home/me/data.parquet"]
    assert offending("s3://bucket/opt/x /data/in ./work/x https://h/home/y /models ~/work/z", roots) == []


def test_no_tracked_file_names_a_local_path():
    roots = local_roots()
    found = []
    for name in tracked_files():
        path = ROOT / name
        if name == THIS_FILE or path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (images)
        allowed = {root for prefix, root, _ in ALLOWED if name.startswith(prefix)}
        for hit in offending(text, roots):
            if not any(hit.startswith(root) for root in allowed):
                found.append(f"{name}: {hit}")
    assert found == [], "tracked files name local paths (use a relative path, a variable or an example path):\n" + (
        "\n".join(found[:50])
    )
