"""QA threshold checks: each metric against its warn / fail thresholds in ``QASpec``, and the
overall verdict (the worst check; ``pass`` when every check was skipped)."""

from __future__ import annotations

from typing import Any

from airflow_provider_vllm.core.spec import QASpec

CHECKS = ("error_rate", "empty_rate", "invalid_rate", "truncation_rate", "label_drift", "churn_rate")
STATUS_ORDER = {"skip": -1, "pass": 0, "warn": 1, "fail": 2}

_CHECK_TEXT = {
    "error_rate": "rows that failed (error rows / all rows)",
    "empty_rate": "ok rows with null or whitespace-only output",
    "invalid_rate": "structured outputs that do not parse / match",
    "truncation_rate": "ok rows whose prompt was truncated",
    "label_drift": "total variation distance of the label distribution vs the previous run",
    "churn_rate": "ids answered in both runs whose answer changed (changes.previous_uri)",
}


def run_checks(metrics: dict[str, Any], spec: QASpec, *, structured: bool) -> list[dict[str, Any]]:
    """One check dict per name in ``CHECKS`` (value, warn, fail, status, detail, description);
    a check whose metric is absent (not structured, no previous run, no changes) is ``skip``."""
    out = []
    for name in CHECKS:
        warn, fail = getattr(spec, f"warn_{name}"), getattr(spec, f"fail_{name}")
        if name == "label_drift":
            d = metrics.get("label_drift")
            value = None if d is None else d["tvd"]
            detail = "no previous run to compare" if d is None else "vs previous run"
        elif name == "churn_rate":
            ch = metrics.get("changes")
            value = None if ch is None else ch.get("churn_rate")
            if ch is None:
                detail = "changes.previous_uri not set"
            elif value is None:
                detail = (
                    "no id answered in both runs"
                    if ch.get("previous_state") == "complete"
                    else "no complete previous run"
                )
            else:
                detail = f"{ch['counts']['changed']} / {ch['in_both']}"
        else:
            r = metrics["rates"].get(name)
            value = None if r is None else r["value"]
            detail = "not a structured-output job" if r is None else f"{r['count']} / {r['of']}"
        if value is None:
            status = "skip"
        elif value > fail:
            status = "fail"
        elif value > warn:
            status = "warn"
        else:
            status = "pass"
        out.append(
            {
                "name": name,
                "value": value,
                "warn": warn,
                "fail": fail,
                "status": status,
                "detail": detail,
                "description": _CHECK_TEXT[name],
            }
        )
    return out


def overall_status(checks: list[dict[str, Any]]) -> str:
    """The worst status among ``checks``; ``pass`` when there are none or all were skipped."""
    status = max((c["status"] for c in checks), key=STATUS_ORDER.__getitem__, default="pass")
    return "pass" if status == "skip" else status
