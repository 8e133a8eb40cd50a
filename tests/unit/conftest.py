"""The unit tier: tests import Airflow into the test process (no Airflow process, no metadata DB), so Airflow
gets a throwaway home first and never creates or reads ~/airflow."""

from __future__ import annotations

import os

from tests.support.airflow_home import throwaway_airflow_home
from tests.support.security import allowed  # noqa: F401 (fixtures)

throwaway_airflow_home()
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
