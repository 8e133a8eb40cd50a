"""The deployment's rules for vLLM batch jobs (Airflow side): the ``[vllm_batch]`` config section.

Everything here is read at task run time from the Airflow configuration (``airflow.cfg`` or
``AIRFLOW__VLLM_BATCH__<OPTION>`` environment variables), which only whoever deploys Airflow
can change; never from Variables, params or XCom. The options (declared with their defaults
in ``get_provider_info()``):

* ``allowed_uri_prefixes``: JSON list or comma-separated URI prefixes (``s3://ml-batch/``,
  ``/data/batch``) every location of a job must lie under. Unset: nothing is allowed (the
  plan and shard tasks fail naming this option) unless ``allow_any_location = True``.
* ``allowed_runners``: the runners a run-time (templated) runner may name; unset: the one this
  deployment configured (``kubernetes`` when a ``kubernetes_*`` option is set, else ``local``).
* ``allow_any_location``: explicit opt-out of the allow-list (syntax checks only).
* ``allow_remote_code``: ``model.trust_remote_code`` and code-loading engine options may run.
* ``deployment_settings_from_variables``: Variables (``vllm_batch_spec_overrides``,
  ``vllm_batch_kubernetes``) may set deployment-owned settings (pod image, env, secrets,
  service account, ...). Off: they may set the others only.
* ``qa_settings_from_variables``: Variables may also loosen what decides publication (QA thresholds, baselines,
  known labels, the review's ask); off: only make it stricter than the DAG file (``utils/provenance.gate_violations``).
* ``kubernetes_defaults``: JSON object of pod settings (``KubernetesSettings``) for every shard
  pod: the deployment's image, namespace, service account, Secret references, ...
* ``signing_key``: the key(s) the pipeline seals what it trusts with (``core/seal.py``); required.
* ``kubernetes_signing_secret``: ``<secret>:<key>`` holding that key for the shard pods.
* ``cache_uri_prefixes``: where result caches may live (empty: no cache).
* ``kubernetes_compile_cache_pvc``: the claim the shard pods share compile caches on (empty: none).
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime, timedelta

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.allow_list import (
    ALLOW_ANY_LOCATION_ENV,
    ALLOW_REMOTE_CODE_ENV,
    ALLOWED_PREFIXES_ENV,
    canonical_prefixes,
    canonical_uri,
    check_cache_location,
    is_under,
    overlap,
    parse_list_setting,
    parse_prefixes,
    store_form,
)
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import check_deployment, check_remote_code, code_loading_options
from airflow_provider_vllm.provider import ALLOW_ANY_LOCATION as ALLOW_ANY_OPTION
from airflow_provider_vllm.provider import ALLOW_REMOTE_CODE as REMOTE_CODE_OPTION
from airflow_provider_vllm.provider import (
    ALLOWED_RUNNERS,
    CACHE_URI_PREFIXES,
    CONFIG_SECTION,
    KUBERNETES_COMPILE_CACHE_PVC,
    KUBERNETES_SIGNING_SECRET,
    SCHEDULED_OUTPUT_PREFIXES,
    setting,
)
from airflow_provider_vllm.provider import ALLOWED_URI_PREFIXES as CONFIG_OPTION
from airflow_provider_vllm.provider import DEPLOYMENT_SETTINGS_FROM_VARIABLES as VARIABLES_OPTION
from airflow_provider_vllm.provider import KUBERNETES_DEFAULTS as KUBERNETES_OPTION
from airflow_provider_vllm.provider import QA_SETTINGS_FROM_VARIABLES as QA_VARIABLES_OPTION
from airflow_provider_vllm.provider import SIGNING_KEY as SIGNING_OPTION
from airflow_provider_vllm.utils import provenance
from airflow_provider_vllm.utils.job_spec import RUNNERS

log = logging.getLogger(__name__)


def _get(option: str) -> str:
    from airflow.sdk.configuration import conf

    return conf.get(CONFIG_SECTION, option, fallback="") or ""


def flag(option: str) -> bool:
    """A boolean ``[vllm_batch]`` option (default False; a malformed value fails the task)."""
    raw = _get(option).strip().lower()
    if raw in ("", "false", "0", "no", "off"):
        return False
    if raw in ("true", "1", "yes", "on"):
        return True
    raise AirflowFailException(f"{setting(option)}={raw!r} is not a boolean (True/False)")


def allowed_prefixes() -> list[str]:
    """The canonical allow-list of URI prefixes; empty when the deployment set none."""
    try:
        return canonical_prefixes(parse_prefixes(_get(CONFIG_OPTION)))
    except SpecError as e:
        raise AirflowFailException(f"{setting(CONFIG_OPTION)} is malformed: {e}") from None


def allow_any_location() -> bool:
    return flag(ALLOW_ANY_OPTION)


def allow_remote_code() -> bool:
    return flag(REMOTE_CODE_OPTION)


def variables_may_set_deployment_settings() -> bool:
    return flag(VARIABLES_OPTION)


def variables_may_loosen_qa() -> bool:
    """``[vllm_batch] qa_settings_from_variables``: Variables may loosen what decides publication."""
    return flag(QA_VARIABLES_OPTION)


def kubernetes_defaults() -> dict:
    """The deployment's pod settings (``[vllm_batch] kubernetes_defaults``, a JSON object)."""
    raw = _get(KUBERNETES_OPTION).strip()
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise AirflowFailException(f"{setting(KUBERNETES_OPTION)} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise AirflowFailException(f"{setting(KUBERNETES_OPTION)} must be a JSON object")
    return doc


def signing_keyring() -> Keyring:
    """The deployment's signing keys (``[vllm_batch] signing_key``); fails the task (no retry) when unset or weak."""
    from airflow_provider_vllm.core.errors import SealError

    try:
        return Keyring.from_text(_get(SIGNING_OPTION), setting(SIGNING_OPTION))
    except SealError as e:
        raise AirflowFailException(str(e)) from None


def kubernetes_signing_secret() -> tuple[str, str]:
    """``[vllm_batch] kubernetes_signing_secret`` as (Secret name, key); fails the task when unset or malformed."""
    raw = _get(KUBERNETES_SIGNING_SECRET).strip()
    name, _, key = raw.partition(":")
    if not raw or not name or not key:
        raise AirflowFailException(
            f"{setting(KUBERNETES_SIGNING_SECRET)} is {'not set' if not raw else f'{raw!r}, not <secret>:<key>'}: "
            "the shard pods need the worker key of the deployment's signing key from a Kubernetes Secret (a "
            "secretKeyRef) to seal their chunks and commit markers; create the Secret in the pods' namespace with the "
            "output of python -m airflow_provider_vllm.cli.worker_key, and name it here"
        )
    return name, key


def cache_prefixes() -> list[str]:
    """Where result caches may live (``[vllm_batch] cache_uri_prefixes``); empty: nowhere."""
    try:
        return canonical_prefixes(parse_prefixes(_get(CACHE_URI_PREFIXES)))
    except SpecError as e:
        raise AirflowFailException(f"{setting(CACHE_URI_PREFIXES)} is malformed: {e}") from None


# run types Airflow's scheduler makes (DagRunType values); a backfill cannot reach past today (but for a
# partitioned timetable, whose backfill Airflow does not stop at now: docs/security.md). Not
# "asset_materialization": POST /assets/{id}/materialize makes that run with the REST body's logical date, data
# interval, partition key, run id and conf, as a manual trigger does
SCHEDULER_RUN_TYPES = frozenset({"scheduled", "backfill", "asset_triggered"})


def run_kind(run_type: object) -> str:
    """A DagRun's ``run_type`` (a ``DagRunType`` or its value) as its value; '' when unknown."""
    return str(getattr(run_type, "value", run_type) or "")


# the DagRun's dates a manual trigger may choose; run_after only stands in for a missing logical date (an Iceberg
# output's date_column takes it then), since a manual run's run_after is the moment of the trigger by default
RUN_DATE_FIELDS = ("logical_date", "data_interval_start", "data_interval_end", "partition_date")


# run dates a template reads as text of the UTC day (``ds``, ``ts``: the logical date in UTC; an Iceberg output's
# date_column takes the UTC date too); any other read may be a datetime, put in any zone, or a partition key, which
# names a period of the timetable's own zone
_UTC_STRINGS = frozenset({"ds", "ds_nodash", "ts", "ts_nodash", "ts_nodash_with_tz", "task_instance_key_str"})
DATE_COLUMN_READ = "io.output_table.date_column="  # + the column: VllmPlanOperator.check_run_dates' mark


# names through which a template reaches the whole run (its partition key among the rest): provenance.RUN_DATES
_RUN_HOLDERS = frozenset({"dag_run", "ti", "task_instance"})


def _unread(name: str) -> bool:  # provenance's mark of a template it could not analyse (read as everything)
    return name.startswith("the trigger (")


def check_run_dates(reads: set[str], dag_run: object, what: str, now: datetime | None = None) -> None:
    """Fail the task (no retry) when a run Airflow did not schedule writes where its own dates say (``reads``: the
    names of run dates that choose the output, ``provenance.RUN_DATES``) and one of its dates (``RUN_DATE_FIELDS``
    of ``dag_run``) lies in the current UTC day (of ``now``) or later, or it has none (or it reads a partition key
    and has no partition date).

    A manual trigger chooses these dates (the REST API's ``logical_date``, data interval and partition key,
    ``airflow dags trigger -l``; the trigger form's logical date is *now* by default), so such a run could claim the
    folder of a date whose scheduled run is still to come, before that date's input is complete. No timetable is
    read here: a DAG whose scheduled run of a day starts after that day ends (the nightly's, at 02:00 the next day)
    leaves that gap open to a trigger, and ``[vllm_batch] scheduled_output_prefixes`` closes it.
    """
    kind = run_kind(getattr(dag_run, "run_type", None))
    if not reads or kind in SCHEDULER_RUN_TYPES:
        return
    now = (now or datetime.now(UTC)).astimezone(UTC)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    # a date read as a datetime may be put in any zone (``.in_timezone('Asia/Tokyo') | ds``): 24 hours behind it,
    # its day has ended in every zone (UTC-12 to UTC+14); the UTC strings (``ds``, ``ts``) keep the UTC day
    zoned = any(r not in _UTC_STRINGS and not r.startswith(DATE_COLUMN_READ) for r in reads)
    day_ago = now - timedelta(days=1)
    dates = {f: getattr(dag_run, f, None) for f in RUN_DATE_FIELDS}
    if dates["logical_date"] is None:
        dates["run_after"] = getattr(dag_run, "run_after", None)
    known = {f: d if d.tzinfo else d.replace(tzinfo=UTC) for f, d in dates.items() if d is not None}  # naive: UTC
    late = {f: d.isoformat() for f, d in known.items() if d >= today or (zoned and d > day_ago)}
    key = getattr(dag_run, "partition_key", None)
    # the key read by name, or through the run (``dag_run.partition_key``, the task instance's, a template not
    # analysed), with no date standing for it: any partition
    keyed = "partition_key" in reads or (key is not None and bool(reads & _RUN_HOLDERS or any(map(_unread, reads))))
    if keyed and dates["partition_date"] is None:
        late["partition_key"] = repr(key)
    if known and not late:
        return
    shown = ", ".join(f"{f} {d}" for f, d in late.items()) or "no date"
    raise AirflowFailException(
        f"{what}: the output of this run is named by its dates ({', '.join(sorted(reads))}) and the run is "
        f"{kind or 'of unknown type'}, not one Airflow scheduled, with {shown}: a triggered run may write a dated "
        f"output only of a day (UTC) that has ended before it runs ({today.date().isoformat()} has not)"
        + (
            ", and, where its template reads a date as a datetime (which it may put in any time zone), 24 hours "
            f"after that date (none after {day_ago.isoformat()})"
            if zoned
            else ""
        )
        + ", so that it never claims the folder of a scheduled run still to come. Re-run a scheduled date by "
        "clearing its run, run a backfill, or trigger with an earlier logical date"
    )


def check_run_may_write(output_uri: str, run_type: object, what: str) -> None:
    """Fail the task (no retry) when a run Airflow did not schedule (``run_type``: the DagRun's; manual,
    operator_triggered, or unknown) would write an output prefix under, or above, one of ``[vllm_batch]
    scheduled_output_prefixes``: it could claim a prefix a scheduled run writes later."""
    try:
        prefixes = canonical_prefixes(parse_prefixes(_get(SCHEDULED_OUTPUT_PREFIXES)))
    except SpecError as e:
        raise AirflowFailException(f"{what}: {setting(SCHEDULED_OUTPUT_PREFIXES)} is malformed: {e}") from None
    if not prefixes:
        return
    try:
        canon = canonical_uri(output_uri, "io.output_uri")
    except SpecError as e:
        raise AirflowFailException(f"{what}: {e}") from None
    hit = next((p for p in prefixes if overlap(canon, p)), None)
    kind = run_kind(run_type)
    if hit is None or kind in SCHEDULER_RUN_TYPES:
        return
    where = "under" if is_under(store_form(canon), store_form(hit)) else "above"
    raise AirflowFailException(
        f"{what}: io.output_uri={output_uri} lies {where} {hit}, which only runs Airflow schedules may write "
        f"({setting(SCHEDULED_OUTPUT_PREFIXES)}); this run is {kind or 'of unknown type'}. Re-run a scheduled date "
        "by clearing its run, or write to another prefix"
    )


_CLAIM_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def compile_cache_pvc() -> str | None:
    """``[vllm_batch] kubernetes_compile_cache_pvc``: the claim the shard pods share compile caches on (None: none,
    every pod compiles from scratch); fails the task (no retry) when it is not a claim name."""
    raw = _get(KUBERNETES_COMPILE_CACHE_PVC).strip()
    if not raw:
        return None
    if not _CLAIM_NAME.match(raw):
        raise AirflowFailException(
            f"{setting(KUBERNETES_COMPILE_CACHE_PVC)}={raw!r} is not a PersistentVolumeClaim name (lowercase letters, "
            "digits, '-' and '.')"
        )
    return raw


def warm_starts(spec: JobSpec, runner: str) -> bool | None:
    """Whether the shards of ``runner`` start from a shared compile cache, for sizing's engine start estimate.

    None for the local runner (the machine's own caches: unknown); for the Kubernetes runner True with
    ``[vllm_batch] kubernetes_compile_cache_pvc``, unless the job may run code from the model repo (its pods
    mount the cache read-only and never publish, so every one of them compiles), else False.
    """
    if runner != "kubernetes":
        return None
    return compile_cache_pvc() is not None and not code_loading_options(spec)


# The Kubernetes runner's options: a deployment that sets any of them runs shards in pods, and then a run-time
# runner may not move them onto the Airflow worker unless allowed_runners says so.
KUBERNETES_RUNNER_OPTIONS = (KUBERNETES_OPTION, KUBERNETES_SIGNING_SECRET, KUBERNETES_COMPILE_CACHE_PVC)


def allowed_runners() -> tuple[list[str], str]:
    """The runners a run-time (templated) runner value may name, and where that list came from (for messages).

    ``[vllm_batch] allowed_runners``: entries trimmed and lower-cased, blank ones dropped; an unknown name fails the
    task (no retry) naming the option. Unset (or only blanks): ``kubernetes`` when any ``KUBERNETES_RUNNER_OPTIONS``
    is set, else ``local``.
    """
    try:
        names = [n.lower() for n in parse_list_setting(_get(ALLOWED_RUNNERS), setting(ALLOWED_RUNNERS))]
    except SpecError as e:
        raise AirflowFailException(str(e)) from None
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise AirflowFailException(
            f"{setting(ALLOWED_RUNNERS)} names {unknown}, not runners; list some of {list(RUNNERS)}"
        )
    if names:
        return list(dict.fromkeys(names)), setting(ALLOWED_RUNNERS)
    configured = [o for o in KUBERNETES_RUNNER_OPTIONS if _get(o).strip()]
    if configured:
        return ["kubernetes"], f"{setting(ALLOWED_RUNNERS)} is unset and this deployment sets {configured[0]}"
    return ["local"], f"{setting(ALLOWED_RUNNERS)} is unset and this deployment sets no kubernetes_* option"


def check_runner_choice(raw: object, runner: str, what: str, env: object = None) -> None:
    """Fail the task (no retry) when ``runner`` (a checked runner name) was chosen at run time outside
    ``allowed_runners()``. ``raw`` is the DAG file's value before rendering: a literal runner is the DAG author's
    choice and is not restricted; any template is (whoever it reads: a trigger's params or conf, a Variable, an
    XCom). ``env``: the operator's Jinja environment, to name who chose the value."""
    if isinstance(raw, str) and raw.strip() in RUNNERS:
        return
    allowed, why = allowed_runners()
    if runner in allowed:
        return
    chosen_by = ", ".join(sorted(provenance.template_sources(raw, env))) or "the DAG file"
    raise AirflowFailException(
        f"{what}: runner={runner!r} (from {raw!r}: {chosen_by}) is not a runner this deployment lets a run choose; "
        f"allowed: {allowed} ({why}). To allow it, add {runner!r} to {setting(ALLOWED_RUNNERS)}, or name the runner "
        "as a literal in the DAG file"
    )


NO_ALLOW_LIST = (
    f"no allowed locations are configured: set {setting(CONFIG_OPTION)} to the URI prefixes jobs may "
    f"read and write, or {setting(ALLOW_ANY_OPTION)} = True to allow any location"
)


def check_spec_allowed(spec: JobSpec, what: str) -> list[str]:
    """Fail the task (no retry) when the spec reaches outside the deployment's rules; returns the allow-list.

    Fails closed: no ``allowed_uri_prefixes`` and no ``allow_any_location`` -> refused.
    """
    prefixes = allowed_prefixes()
    any_location = allow_any_location()
    try:
        check_deployment(spec, prefixes, allow_any=any_location, no_allow_list=NO_ALLOW_LIST)
        check_remote_code(spec, allow_remote_code(), f"{setting(REMOTE_CODE_OPTION)} = True")
        if spec.cache.uri is not None:
            check_cache_location(spec.cache.uri, cache_prefixes(), setting(CACHE_URI_PREFIXES))
    except SpecError as e:
        raise AirflowFailException(f"{what}: {e}") from None
    if not prefixes:
        log.warning(
            "%s = True: jobs may read and write any location that passes the syntax checks", setting(ALLOW_ANY_OPTION)
        )
    return prefixes


def worker_env(prefixes: list[str]) -> dict[str, str]:
    """Environment that hands the deployment's rules to the worker process (never the shard task JSON).

    Always holds every key of ``paths.DEPLOYMENT_ENV`` the worker reads, so that values inherited
    from elsewhere are overwritten (callers set it last).
    """
    return {
        ALLOWED_PREFIXES_ENV: json.dumps(prefixes),
        ALLOW_ANY_LOCATION_ENV: "1" if allow_any_location() else "0",
        ALLOW_REMOTE_CODE_ENV: "1" if allow_remote_code() else "0",
    }
