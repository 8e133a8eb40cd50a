"""Which QA report a request may read: pure checks, no Airflow, no I/O but local ``realpath``.

A request names a task instance (DAG, run, QA task), never a path. The user must be allowed
to read that DAG's task instances (the plugin's route), and the metadata DB must tie the
report to that run (``tie_to_tasks``): the DAG run, its QA task instance and its plan task
instance exist; the plan task succeeded and the QA task finished; and each XCom used (the plan
task's ``spec``, the QA task's summary) was written while that task instance ran, which an
XCom set afterwards (e.g. through the REST API's XCom endpoints, by whoever may edit the DAG's
XComs) is not. The report's location is the run's output prefix from that ``spec``, and:

* it must pass the job's own URI rules (``allow_list.canonical_uri``: the ``SCHEMES`` list only, so
  no ``http://``; no ``..``, percent-encoded separators, credentials or ports in a bucket
  name, chained ``a::b`` URLs, relative paths);
* it must lie under the deployment's allow-list (``[vllm_batch] allowed_uri_prefixes``);
  with no allow-list the page refuses everything unless the deployment set
  ``[vllm_batch] allow_any_location = True``;
* when ``[vllm_batch] report_roots`` is set, it must also lie under one of those;
* the QA task's summary (``qa_summary``'s ``report_html``) must name that prefix +
  ``qa/report.html``, so the endpoint can only ever read ``qa/report.{html,json}`` of a
  run's own output; a local report file must not be a symlink leading out of the prefix.

Nothing else from XCom is used: no ``storage_options``, headers or endpoints. The file system
is the deployment's (its Airflow Connections, see ``connections``). Every refusal is a
``ReportAccessError(403, reason)`` raised before any file system exists.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from airflow_provider_vllm.core.allow_list import canonical_prefixes, canonical_uri, is_under, parse_prefixes
from airflow_provider_vllm.core.errors import SpecError

REPORT_FILES = {"html": "qa/report.html", "json": "qa/report.json"}
PLAN_TASK = "plan"
ALLOW_LIST_SETTING = "[vllm_batch] allowed_uri_prefixes"
ALLOW_ANY_SETTING = "[vllm_batch] allow_any_location"
ROOTS_SETTING = "[vllm_batch] report_roots"
# Task instance dates and XCom timestamps are taken by the API servers' clocks; replicas may differ
# by this much. An XCom written later than this after its task ended is not the task's.
CLOCK_SKEW = timedelta(seconds=2)


class ReportAccessError(Exception):
    """The request may not read a report (or there is none); ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ReportLocation:
    """Where a run's report lives: its canonical output prefix (nothing else comes from XCom)."""

    output_uri: str

    def rel(self, kind: str) -> str:
        return REPORT_FILES[kind]

    @property
    def is_local(self) -> bool:
        return self.output_uri.startswith("/")


@dataclass(frozen=True)
class ReportPolicy:
    """The deployment's rules, read from the API server's Airflow config (``ui.plugin``)."""

    allowed: tuple[str, ...] = ()
    allow_any: bool = False
    roots: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, allowed_raw: str | None, allow_any: bool, roots_raw: str | None) -> ReportPolicy:
        """From the raw option values; a malformed one refuses every request (403 naming it)."""
        try:
            allowed = tuple(canonical_prefixes(parse_prefixes(allowed_raw)))
        except SpecError as e:
            raise ReportAccessError(403, f"{ALLOW_LIST_SETTING} is malformed: {e}") from None
        try:
            roots = tuple(canonical_prefixes(parse_roots(roots_raw)))
        except SpecError as e:
            raise ReportAccessError(403, f"{ROOTS_SETTING} is malformed: {e}") from None
        return cls(allowed=allowed, allow_any=bool(allow_any), roots=roots)


@dataclass(frozen=True)
class TaskRecord:
    """One task instance of the run, as the metadata DB has it (never from the request or an XCom)."""

    task_id: str
    state: str | None
    start_date: datetime | None
    end_date: datetime | None


@dataclass(frozen=True)
class XComRecord:
    """An XCom's value and when it was written (the DB's timestamp, not the writer's claim)."""

    value: Any
    timestamp: datetime


@dataclass(frozen=True)
class RunRecords:
    """What the metadata DB holds for the request's DAG run: the run, its QA and plan tasks, their XComs."""

    run_found: bool
    qa: TaskRecord | None
    plan: TaskRecord | None
    qa_summary: XComRecord | None
    spec: XComRecord | None


def tie_to_tasks(records: RunRecords) -> tuple[Any, Any]:
    """``(qa summary, spec)`` when the DB ties both to this run's own task instances; ReportAccessError otherwise.

    404: the run, the QA task instance or the plan task instance does not exist, the plan task has
    not succeeded, the QA task has not finished, or an XCom is missing. 403: an XCom was not written
    while its task instance ran (set before it started or after it ended: not the task's).
    """
    if not records.run_found:
        raise ReportAccessError(404, "no such run of this DAG")
    if records.qa is None:
        raise ReportAccessError(404, "this run has no such task instance")
    if records.plan is None:
        raise ReportAccessError(404, f"this run has no plan task ({plan_task_id(records.qa.task_id)})")
    if records.plan.state != "success":
        raise ReportAccessError(404, f"the run's plan task is {records.plan.state or 'not run'}, not success")
    if records.qa.end_date is None:
        raise ReportAccessError(404, "the QA task has not finished")
    if records.qa_summary is None:
        raise ReportAccessError(404, "this task has no QA report (yet): it pushed no qa summary")
    if records.spec is None:
        raise ReportAccessError(404, "this run has no validated spec from its plan task")
    _written_by(records.spec, records.plan, "the plan task's spec XCom")
    _written_by(records.qa_summary, records.qa, "the QA task's summary XCom")
    return records.qa_summary.value, records.spec.value


def _written_by(x: XComRecord, ti: TaskRecord, what: str) -> None:
    start, end = ti.start_date, ti.end_date
    if start is None or end is None or not start - CLOCK_SKEW <= x.timestamp <= end + CLOCK_SKEW:
        raise ReportAccessError(
            403,
            f"{what} was not written by task {ti.task_id} while it ran (written {x.timestamp.isoformat()}, "
            f"the task ran {start.isoformat() if start else '-'} to {end.isoformat() if end else '-'}): "
            "an XCom set outside the task's own run is not trusted",
        )


def plan_task_id(qa_task_id: str) -> str:
    """The plan task of the same job: ``<group>.plan`` for ``<group>.qa`` (builder names)."""
    group, _, _ = qa_task_id.rpartition(".")
    return f"{group}.{PLAN_TASK}" if group else PLAN_TASK


def parse_roots(value: str | None) -> list[str]:
    """``[vllm_batch] report_roots``: comma- or newline-separated URIs; empty -> no extra restriction."""
    if not value:
        return []
    return [r.strip() for r in value.replace("\n", ",").split(",") if r.strip()]


def under_roots(output_uri: str, roots: Iterable[str]) -> bool:
    """True when ``output_uri`` is one of ``roots`` or lies below one (whole segments; ``..`` never passes)."""
    try:
        out = canonical_uri(output_uri, "output_uri", resolve=False)
        prefixes = [canonical_uri(r, "root", resolve=False) for r in roots]
    except SpecError:
        return False
    return any(is_under(out, p) for p in prefixes)


def resolve_report(qa_result: Any, plan_spec: Any, policy: ReportPolicy) -> ReportLocation:
    """The report location of one run, or ``ReportAccessError`` (404 none yet, 403 refused).

    :param qa_result: the QA task's XCom return value (``qa_summary``), or None.
    :param plan_spec: the plan task's ``spec`` XCom (the run's validated spec), or None.
    :param policy: the deployment's allow-list, ``allow_any_location`` and report roots.
    """
    if not isinstance(qa_result, Mapping) or not isinstance(qa_result.get("report_html"), str):
        raise ReportAccessError(404, "this task has no QA report (yet): it pushed no qa summary")
    if not isinstance(plan_spec, Mapping) or not isinstance(plan_spec.get("io"), Mapping):
        raise ReportAccessError(404, "this run has no validated spec from its plan task")
    output_uri = plan_spec["io"].get("output_uri")
    if not isinstance(output_uri, str) or not output_uri:
        raise ReportAccessError(404, "the run's spec names no output_uri")
    if not policy.allowed and not policy.allow_any:
        raise ReportAccessError(
            403,
            f"no allow-list of locations is configured: set {ALLOW_LIST_SETTING} "
            f"(or {ALLOW_ANY_SETTING} = True) for the API server to read QA reports",
        )
    try:
        syntax = canonical_uri(output_uri, "io.output_uri", resolve=False)
        canon = canonical_uri(output_uri, "io.output_uri")  # local: symlinks resolved
        report = canonical_uri(qa_result["report_html"], "report_html", resolve=False)
    except SpecError as e:
        raise ReportAccessError(403, f"refused: {e}") from None
    if report != f"{syntax.rstrip('/')}/{REPORT_FILES['html']}":
        raise ReportAccessError(403, "the QA summary's report is not under this run's output prefix")
    if policy.allowed and not any(is_under(canon, p) for p in policy.allowed):
        raise ReportAccessError(
            403, f"the run's output prefix {canon} is outside {ALLOW_LIST_SETTING} {list(policy.allowed)}"
        )
    if policy.roots and not any(is_under(canon, r) for r in policy.roots):
        raise ReportAccessError(403, f"the run's output prefix is not under {ROOTS_SETTING}")
    return ReportLocation(output_uri=canon)


def check_local_file(loc: ReportLocation, kind: str, policy: ReportPolicy) -> None:
    """A local report file must resolve inside the run's prefix (and the allow-list): no symlinked escapes."""
    if not loc.is_local:
        return
    real = os.path.realpath(posixpath.join(loc.output_uri, loc.rel(kind)))
    inside = is_under(real, loc.output_uri) and (not policy.allowed or any(is_under(real, p) for p in policy.allowed))
    if not inside:
        raise ReportAccessError(403, f"{loc.rel(kind)} leads outside the run's output prefix")


def vouched_digest(qa_result: Any, kind: str) -> str:
    """The sha256 of the ``kind`` ('html' | 'json') report that the QA task's summary XCom names; 403 when it names
    none (a summary of a provider before reports were vouched for: rerun the QA task)."""
    digests = qa_result.get("report_sha256") if isinstance(qa_result, Mapping) else None
    want = digests.get(kind) if isinstance(digests, Mapping) else None
    if not isinstance(want, str) or len(want) != 64:
        raise ReportAccessError(
            403, "the QA task's summary vouches for no report bytes (written before reports were checked): rerun QA"
        )
    return want


def check_vouched(body: bytes, want: str, rel: str) -> None:
    """403 unless ``body`` is the report the QA task wrote: anyone who can write the run's output prefix could
    otherwise show a reviewer another verdict than the one QA reached."""
    if hashlib.sha256(body).hexdigest() != want:
        raise ReportAccessError(
            403, f"{rel} is not the report the QA task wrote (sha256 differs): it was changed after QA; rerun QA"
        )
