"""The QA task: report files, an XCom summary, and a gate before publication."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.hooks.filesystems import task_filesystems
from airflow_provider_vllm.links.report import VllmQAReportLink
from airflow_provider_vllm.steps.lineage import qa_lineage
from airflow_provider_vllm.steps.qa.report import QAFailed
from airflow_provider_vllm.steps.qa.stage import qa_run, qa_summary
from airflow_provider_vllm.utils.deployment import check_spec_allowed, signing_keyring
from airflow_provider_vllm.utils.job_spec import data_plane_errors, load_spec
from airflow_provider_vllm.utils.run_binding import this_dag_run, this_task_group


class VllmQAFailed(QAFailed, AirflowFailException):
    """QA crossed a fail threshold; carries the report and the failing checks; not retried."""

    def serialize(self):
        cls = type(self)
        return f"{cls.__module__}.{cls.__name__}", (self.report, self.failing), {}


class VllmQAOperator(BaseOperator):
    """Run ``qa_run(spec)``: write ``qa/report.{json,html}`` and ``qa/sample.parquet``.

    Pushes ``qa_summary(...)`` (status, summary line, checks, report paths) as the XCom
    return value first, then, when the verdict is 'fail', raises ``VllmQAFailed`` (a
    ``QAFailed`` and an ``AirflowFailException``: the verdict would not change on retry),
    so publish does not run. A 'warn' verdict is logged and the run goes on (to the
    review task when the builder adds one). Its "QA report" extra link opens the report.

    ``merge_result``: the merge task's XCom (``merge.output``; ``vllm_batch_job`` passes it): QA measures only
    the ``_MERGED.json`` whose seal it names, not an earlier merge of the folder put back. None: not checked,
    unless ``require_merge_result`` (set by ``vllm_batch_job``): then a missing XCom fails.

    The sealed verdict (``qa/_QA.json``) names this task's DAG run (``dag_id``, ``run_id``) and its task group and
    map index: the review and publish tasks take no verdict made in another run, nor by another job's QA task of the
    same run (they must be in this task's group, as ``vllm_batch_job`` puts them).

    ``aws_conn_id`` / ``gcp_conn_id``: the Airflow Connections through which this task reaches
    ``s3://`` / ``gs://`` locations (DAG-file settings, never templated; None: ``[vllm_batch]
    aws_conn_id`` / ``gcp_conn_id``, else ``aws_default`` / ``google_cloud_default``). See
    ``airflow_provider_vllm.hooks.filesystems``.
    """

    template_fields: Sequence[str] = ("spec", "merge_result")
    template_fields_renderers = {"spec": "json", "merge_result": "json"}
    ui_color = "#fce8e6"
    operator_extra_links = (VllmQAReportLink(),)

    def __init__(
        self,
        *,
        spec: Any,
        merge_result: Any = None,
        require_merge_result: bool = False,
        aws_conn_id: str | None = None,
        gcp_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self.spec = spec
        self.merge_result = merge_result
        self.require_merge_result = require_merge_result

    def execute(self, context: Any) -> dict[str, Any]:
        spec = load_spec(self.spec, "qa")
        check_spec_allowed(spec, "qa")  # the spec came through XCom: the deployment's rules again
        with data_plane_errors("qa"):
            report, paths = qa_run(
                spec,
                filesystems=task_filesystems(self.aws_conn_id, self.gcp_conn_id),
                keyring=signing_keyring(),
                merged_mac=self._merged_mac(),
                dag_run=this_dag_run(context),  # named in the sealed verdict: review and publish take no other run's
                task_group=this_task_group(self, context),  # nor another job's of this run
            )
        summary = qa_summary(report, paths, spec.io.output_uri)
        self._lineage = qa_lineage(spec, summary)  # before a 'fail' raises: the failure event carries it too
        self.log.info("%s", summary["summary"])
        self.log.info("QA report: %s", summary["report_html"])
        for c in report.warning_checks:
            self.log.warning("QA warning: %s=%s above warn threshold %s", c["name"], c["value"], c["warn"])
        if report.status == "fail":
            context["ti"].xcom_push(key="return_value", value=summary)
            raise VllmQAFailed(report.to_dict(), report.failing_checks)
        return summary

    def _merged_mac(self) -> str | None:
        """The seal of the merge this run's merge task wrote (its XCom), when given."""
        if self.merge_result is None and not self.require_merge_result:
            return None
        told = self.merge_result.get("merged_mac") if isinstance(self.merge_result, Mapping) else None
        if not isinstance(told, str) or not told:
            raise AirflowFailException(
                "qa: the merge task's result names no sealed merge (a merge of an earlier version); run the merge "
                "task again, then QA"
            )
        return told

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: the results in, with the QA checks and verdict as data-quality assertions; the report out.

        Recorded by ``execute``.
        """
        from airflow_provider_vllm.utils.openlineage_facets import operator_lineage

        return operator_lineage(getattr(self, "_lineage", None))
