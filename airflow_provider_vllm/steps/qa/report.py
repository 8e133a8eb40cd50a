"""The QA report: ``QAReport`` (what ``evaluate`` returns) and ``QAFailed`` (raised on a fail verdict).

``QAReport.to_dict()`` is the JSON form stored as ``qa/report.json`` (``REPORT_FORMAT`` /
``REPORT_VERSION``); ``from_dict`` reads it back without the sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from airflow_provider_vllm.core.errors import VllmBatchError

REPORT_FORMAT = "airflow-provider-vllm/qa-report"
REPORT_VERSION = 1
REFUSED = "refused"  # the key of a previous report that was not used (``refused_previous``)


@dataclass
class QAReport:
    """The outcome of ``evaluate``. ``to_dict()`` is JSON-serialisable; ``sample`` is not part of it."""

    status: str
    checks: list[dict[str, Any]]
    metrics: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    run_info: dict[str, Any] = field(default_factory=dict)
    sample: pa.Table = field(default_factory=lambda: pa.table({}), repr=False, compare=False)

    @property
    def failing_checks(self) -> list[dict[str, Any]]:
        return [c for c in self.checks if c["status"] == "fail"]

    @property
    def warning_checks(self) -> list[dict[str, Any]]:
        return [c for c in self.checks if c["status"] == "warn"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "status": self.status,
            "summary": self.summary_line(),
            "run": dict(self.run_info),
            "checks": [dict(c) for c in self.checks],
            "metrics": self.metrics,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QAReport:
        """Back from ``to_dict()`` (e.g. a stored report.json); the sample is empty."""
        return cls(
            status=d["status"],
            checks=list(d.get("checks", [])),
            metrics=dict(d.get("metrics", {})),
            notes=list(d.get("notes", [])),
            run_info=dict(d.get("run", {})),
        )

    def summary_line(self) -> str:
        m = self.metrics
        parts = [f"QA {self.status.upper()}: rows={m.get('total', 0)} ok={m.get('ok', 0)} errors={m.get('errors', 0)}"]
        if m.get("duplicates") is not None:
            parts.append(f"duplicates={m['duplicates']['ids']}")
        for c in self.checks:
            if c["status"] == "skip":
                continue
            v = c["value"]
            val = "n/a" if v is None else f"{v:.4f}" if c["name"] == "label_drift" else f"{100 * v:.2f}%"
            parts.append(f"{c['name']}={val}({c['status']})")
        s = m.get("sample", {})
        parts.append(f"sample={s.get('rows', 0)}")
        return " ".join(parts)

    def raise_on_fail(self) -> None:
        """Raise ``QAFailed`` when any check failed."""
        if self.status == "fail":
            raise QAFailed(self.to_dict(), self.failing_checks)


def refused_previous(uri: str, why: str) -> dict[str, Any]:
    """What stands for a previous report that was not used (``store.load_previous_report``): no metrics, only
    where it was and why; the checks that needed it warn instead of passing (``checks.run_checks``)."""
    return {REFUSED: {"uri": uri, "why": why}}


def previous_refusal(previous: Any) -> dict[str, str] | None:
    """``{uri, why}`` when ``previous`` stands for a report that was not used, else None."""
    return previous.get(REFUSED) if isinstance(previous, dict) else None


def of_this_job(previous: Any, run_info: dict[str, Any] | None, uri: str | None) -> Any:
    """``previous`` when it is a report of this run's job (``run_info["job"]``), else a refusal: another job's
    labels and known labels are no baseline for this one (label drift and the change in accuracy then warn)."""
    if not isinstance(previous, dict) or previous_refusal(previous) is not None:
        return previous
    job, other = (run_info or {}).get("job"), (previous.get("run") or {}).get("job")
    if job is None or other == job:
        return previous
    return refused_previous(
        uri or "(the previous report)", f"it is the report of job {other!r}, not of this job {job!r}"
    )


class QAFailed(VllmBatchError):
    """The QA stage crossed a fail threshold; carries the report dict and the failing checks."""

    def __init__(self, report: dict[str, Any], failing: list[dict[str, Any]] | None = None):
        if failing is None:
            failing = [c for c in report.get("checks", []) if c.get("status") == "fail"]
        self.report = report
        self.failing = list(failing)
        listed = "; ".join(
            f"{c['name']}={_fmt_check_value(c)} {'<' if c.get('direction') == 'below' else '>'} fail {c['fail']}"
            for c in self.failing
        )
        super().__init__(f"QA failed {len(self.failing)} check(s): {listed or '(none listed)'}")

    def __reduce__(self):  # picklable with its payload (Airflow may pickle exceptions)
        return (type(self), (self.report, self.failing))


def _fmt_check_value(c: dict[str, Any]) -> str:
    v = c.get("value")
    if v is None:
        return "n/a"
    return f"{v:.4f}" if c.get("name") == "label_drift" else f"{v:.4%}"
