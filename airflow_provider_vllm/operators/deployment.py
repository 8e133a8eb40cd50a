"""The deployment's limits on where jobs may read and write (Airflow side).

``allowed_prefixes()`` reads, at task run time, the provider config option
``[vllm_batch] allowed_uri_prefixes`` (``AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES``: set by
whoever deploys Airflow) and, when that is empty, the Airflow Variable
``vllm_batch_allowed_prefixes``. Either holds a JSON list or comma-separated prefixes such as
``s3://ml-batch/``. The config wins over the Variable because Variables can be edited by
more people than the deployment's configuration.
"""

from __future__ import annotations

import logging

from airflow.sdk import Variable
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.errors import SpecError
from airflow_provider_vllm.paths import ALLOWED_PREFIXES_ENV, canonical_prefixes, parse_prefixes
from airflow_provider_vllm.spec import JobSpec
from airflow_provider_vllm.spec_guard import check_deployment

CONFIG_SECTION, CONFIG_OPTION = "vllm_batch", "allowed_uri_prefixes"
VARIABLE = "vllm_batch_allowed_prefixes"
log = logging.getLogger(__name__)


def allowed_prefixes() -> list[str]:
    """The canonical allow-list of URI prefixes; empty when the deployment set none."""
    from airflow.sdk.configuration import conf

    raw = conf.get(CONFIG_SECTION, CONFIG_OPTION, fallback="") or ""
    source = f"[{CONFIG_SECTION}] {CONFIG_OPTION}"
    if not raw.strip():
        raw = Variable.get(VARIABLE, default="") or ""
        source = f"Variable {VARIABLE}"
    try:
        prefixes = canonical_prefixes(parse_prefixes(raw))
    except SpecError as e:
        raise AirflowFailException(f"{source} is malformed: {e}") from None
    if not prefixes:
        log.warning("no allow-list of URI prefixes is set ([%s] %s or Variable %s): jobs may read and write "
                    "any location that passes the syntax checks", CONFIG_SECTION, CONFIG_OPTION, VARIABLE)
    return prefixes


def check_spec_allowed(spec: JobSpec, what: str) -> list[str]:
    """Fail the task (no retry) when the spec reaches outside the allow-list; returns the list."""
    prefixes = allowed_prefixes()
    try:
        check_deployment(spec, prefixes)
    except SpecError as e:
        raise AirflowFailException(f"{what}: {e}") from None
    return prefixes


def worker_env(prefixes: list[str]) -> dict[str, str]:
    """Environment that hands the allow-list to the worker process (never the shard task JSON)."""
    import json

    return {ALLOWED_PREFIXES_ENV: json.dumps(prefixes)} if prefixes else {}
