"""Which QA report a request may read: pure checks, no Airflow.

A request names a task instance (DAG, run, QA task), never a path. The report's location
comes from that task's own XCom (``qa_summary``'s ``report_html``) and must equal the run's
output prefix (the plan task's validated spec) + ``qa/report.html``. When allowed roots are
configured (``[vllm_batch] report_roots``), the prefix must also lie under one of them.
So the endpoint can only ever read ``qa/report.{html,json}`` of a run's own output.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

REPORT_FILES = {"html": "qa/report.html", "json": "qa/report.json"}
PLAN_TASK = "plan"


class ReportAccessError(Exception):
    """The request may not read a report (or there is none); ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ReportLocation:
    """Where a run's report lives: its output prefix and the fsspec options to read it."""

    output_uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def rel(self, kind: str) -> str:
        return REPORT_FILES[kind]


def plan_task_id(qa_task_id: str) -> str:
    """The plan task of the same job: ``<group>.plan`` for ``<group>.qa`` (builder names)."""
    group, _, _ = qa_task_id.rpartition(".")
    return f"{group}.{PLAN_TASK}" if group else PLAN_TASK


def parse_roots(value: str | None) -> list[str]:
    """``[vllm_batch] report_roots``: comma- or newline-separated URIs; empty -> no restriction."""
    if not value:
        return []
    return [r.strip() for r in value.replace("\n", ",").split(",") if r.strip()]


def _norm(uri: str) -> str:
    """A prefix in one spelling: ``file://`` dropped, ``.``/``..`` resolved, no trailing slash."""
    uri = uri.strip()
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    scheme, sep, rest = uri.partition("://")
    if sep:
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
    return posixpath.normpath(uri)


def under_roots(output_uri: str, roots: Iterable[str]) -> bool:
    """True when ``output_uri`` is one of ``roots`` or lies below one (no ``..`` escapes)."""
    out = _norm(output_uri)
    for root in roots:
        r = _norm(root)
        if out == r or out.startswith(r.rstrip("/") + "/"):
            return True
    return False


def resolve_report(qa_result: Any, plan_spec: Any, roots: Iterable[str] = ()) -> ReportLocation:
    """The report location of one run, or ``ReportAccessError`` (404 none yet, 403 refused).

    :param qa_result: the QA task's XCom return value (``qa_summary``), or None.
    :param plan_spec: the plan task's ``spec`` XCom (the run's validated spec), or None.
    :param roots: allowed output roots; empty allows any run's own output.
    """
    if not isinstance(qa_result, Mapping) or not isinstance(qa_result.get("report_html"), str):
        raise ReportAccessError(404, "this task has no QA report (yet): it pushed no qa summary")
    if not isinstance(plan_spec, Mapping) or not isinstance(plan_spec.get("io"), Mapping):
        raise ReportAccessError(404, "this run has no validated spec from its plan task")
    io = plan_spec["io"]
    output_uri = io.get("output_uri")
    if not isinstance(output_uri, str) or not output_uri:
        raise ReportAccessError(404, "the run's spec names no output_uri")
    expected = f"{output_uri.rstrip('/')}/{REPORT_FILES['html']}"
    if _norm(qa_result["report_html"]) != _norm(expected):
        raise ReportAccessError(403, "the QA summary's report is not under this run's output prefix")
    roots = list(roots)
    if roots and not under_roots(output_uri, roots):
        raise ReportAccessError(403, "the run's output prefix is not under [vllm_batch] report_roots")
    options = io.get("storage_options") or {}
    return ReportLocation(output_uri=output_uri, storage_options=dict(options))
