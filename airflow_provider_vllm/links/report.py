"""The "QA report" extra link on the QA and review tasks.

Airflow 3 computes extra links when the task finishes (in the worker) and stores them as
XCom; the link points at this provider's plugin (``/vllm-batch/report``), which looks the
report up from the task instance, so the URL carries ids only, never a file path.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from airflow.sdk import BaseOperatorLink

URL_PREFIX = "/vllm-batch"


def report_url(
    dag_id: str, run_id: str, task_id: str, map_index: int = -1, *, kind: str = "html", base_url: str | None = None
) -> str:
    """The plugin URL of a QA task's report; relative unless ``base_url`` is given."""
    query = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id}
    if map_index not in (-1, None):
        query["map_index"] = str(map_index)
    path = f"{URL_PREFIX}/report" + ("" if kind == "html" else f".{kind}")
    return f"{(base_url or '').rstrip('/')}{path}?{urlencode(query)}"


def base_url() -> str | None:
    """``[api] base_url`` (None when unset: links stay relative to the Airflow UI)."""
    from airflow.sdk.configuration import conf

    return conf.get("api", "base_url", fallback=None) or None


class VllmQAReportLink(BaseOperatorLink):
    """Opens ``qa/report.html`` of this run through the provider's plugin.

    On the QA task it names the task itself; on the review task, its ``qa_task_id``.
    """

    name = "QA report"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        qa_task_id = getattr(operator, "qa_task_id", None) or ti_key.task_id
        map_index = getattr(ti_key, "map_index", -1) if qa_task_id == ti_key.task_id else -1
        return report_url(ti_key.dag_id, ti_key.run_id, qa_task_id, map_index, base_url=base_url())
