"""A throwaway ``AIRFLOW_HOME`` for test processes that import Airflow without running it."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def throwaway_airflow_home() -> str:
    """Point ``AIRFLOW_HOME`` at a fresh temporary folder unless it is set already (Airflow would otherwise
    create and read ``~/airflow``); the process that made the folder removes it when it exits. Processes that
    inherit the variable (pytest-xdist's workers) use the same folder and make none of their own."""
    home = os.environ.get("AIRFLOW_HOME")
    if home:
        return home
    home = tempfile.mkdtemp(prefix="airflow-unit-")
    os.environ["AIRFLOW_HOME"] = home
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    return home
