"""The unit tier: tests import Airflow into the test process (no Airflow process, no metadata DB), so Airflow
gets a throwaway home first and never creates or reads ~/airflow."""

from __future__ import annotations

import os
import tempfile

from tests.support.security import allowed  # noqa: F401 (fixtures)

os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="airflow-unit-"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
