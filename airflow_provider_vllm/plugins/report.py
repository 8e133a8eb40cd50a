"""Airflow plugin: a FastAPI app under ``/vllm-batch`` that serves a run's QA report.

``GET /vllm-batch/report?dag_id=&run_id=&task_id=[&map_index=]`` returns that QA task's
``qa/report.html`` (``/report.json``: the JSON report). The caller must be logged in to
Airflow (the UI's session cookie or a ``Bearer`` token) and allowed to read the DAG's task
instances. The run and its QA and plan task instances must exist in the metadata DB, and the
XComs used must have been written by those task instances while they ran (``tie_to_tasks``);
the file is located from them (see ``report_access``), never from a path or a location in the
request, its bytes must be the ones the QA task wrote (the sha256 its summary XCom carries: a report
rewritten in the bucket after QA is refused), and it must pass the job's URI rules and the deployment's
allow-list (``[vllm_batch] allowed_uri_prefixes``; none configured -> 403 unless
``[vllm_batch] allow_any_location = True``); ``[vllm_batch] report_roots`` can narrow it
further. The file is read with the deployment's credentials only: the Airflow Connections
named by ``[vllm_batch] aws_conn_id`` / ``gcp_conn_id`` (defaults ``aws_default`` /
``google_cloud_default``), never with options, headers or endpoints taken from XCom or the
request. Every refusal is a 403 with its reason, answered before any file system exists.

Registered through the ``airflow.plugins`` entry point (``vllm_batch``).
"""

from __future__ import annotations

import time
from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from airflow.configuration import conf
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance
from airflow.models.xcom import XComModel
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import Response
from sqlalchemy import select

from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.hooks.filesystems import ConnectionFileSystems, conn_ids_from_config
from airflow_provider_vllm.links.report import URL_PREFIX
from airflow_provider_vllm.plugins.report_access import (
    ReportAccessError,
    ReportPolicy,
    RunRecords,
    TaskRecord,
    XComRecord,
    check_local_file,
    check_vouched,
    plan_task_id,
    resolve_report,
    tie_to_tasks,
    vouched_digest,
)
from airflow_provider_vllm.provider import ALLOW_ANY_LOCATION, ALLOWED_URI_PREFIXES, CONFIG_SECTION, REPORT_ROOTS

# The report is self-contained (inline CSS and SVG): nothing else may load, nor may it be framed elsewhere.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'self'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
MEDIA = {"html": "text/html; charset=utf-8", "json": "application/json"}

app = FastAPI(title="vLLM batch QA reports", docs_url=None, redoc_url=None, openapi_url=None)
_can_read_task_instances = Depends(requires_access_dag("GET", DagAccessEntity.TASK_INSTANCE))


def _xcom(session: Any, *, dag_id: str, run_id: str, task_id: str, key: str, map_index: int) -> XComRecord | None:
    query = XComModel.get_many(run_id=run_id, key=key, task_ids=task_id, dag_ids=dag_id, map_indexes=map_index).limit(1)
    row = session.scalar(query)
    return None if row is None else XComRecord(XComModel.deserialize_value(row), row.timestamp)


def _task(session: Any, *, dag_id: str, run_id: str, task_id: str, map_index: int) -> TaskRecord | None:
    ti = session.scalar(
        select(TaskInstance).where(
            TaskInstance.dag_id == dag_id,
            TaskInstance.run_id == run_id,
            TaskInstance.task_id == task_id,
            TaskInstance.map_index == map_index,
        )
    )
    return None if ti is None else TaskRecord(task_id, ti.state, ti.start_date, ti.end_date)


def _records(session: Any, dag_id: str, run_id: str, task_id: str, map_index: int) -> RunRecords:
    """The run, its QA task instance (the request's), its plan task instance and their XComs, from the DB."""
    run = session.scalar(select(DagRun.id).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    plan = plan_task_id(task_id)
    return RunRecords(
        run_found=run is not None,
        qa=_task(session, dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=map_index),
        plan=_task(session, dag_id=dag_id, run_id=run_id, task_id=plan, map_index=-1),
        qa_summary=_xcom(
            session, dag_id=dag_id, run_id=run_id, task_id=task_id, key="return_value", map_index=map_index
        ),
        spec=_xcom(session, dag_id=dag_id, run_id=run_id, task_id=plan, key="spec", map_index=-1),
    )


def policy() -> ReportPolicy:
    """The deployment's rules, from this API server's Airflow config (never a Variable)."""
    return ReportPolicy.from_settings(
        conf.get(CONFIG_SECTION, ALLOWED_URI_PREFIXES, fallback=""),
        conf.getboolean(CONFIG_SECTION, ALLOW_ANY_LOCATION, fallback=False),
        conf.get(CONFIG_SECTION, REPORT_ROOTS, fallback=""),
    )


_FS_TTL_S = 300.0
_fs_cache: dict[tuple[str, str], tuple[float, ConnectionFileSystems]] = {}


def filesystems() -> ConnectionFileSystems:
    """The deployment's object-store identity: the Connections named in ``[vllm_batch]``.

    Kept for a few minutes per pair of Connection ids (one client per store, not one per
    request); an edited Connection takes effect after that.
    """
    ids = conn_ids_from_config(conf)
    now = time.monotonic()
    hit = _fs_cache.get(ids)
    if hit is None or now - hit[0] > _FS_TTL_S:
        hit = _fs_cache[ids] = (now, ConnectionFileSystems(*ids))
    return hit[1]


def _serve(kind: str, session: Any, dag_id: str, run_id: str, task_id: str, map_index: int) -> Response:
    try:
        rules = policy()
        qa_summary, spec = tie_to_tasks(_records(session, dag_id, run_id, task_id, map_index))
        loc = resolve_report(qa_summary, spec, rules)
        check_local_file(loc, kind, rules)
        want = vouched_digest(qa_summary, kind)
        # no options from XCom: the location alone, opened with the deployment's Connections
        body = Storage(loc.output_uri, {}, filesystems()).read_bytes(loc.rel(kind))
        check_vouched(body, want, loc.rel(kind))
    except SpecError as e:  # e.g. the object store's provider package is missing
        raise HTTPException(status_code=403, detail=f"refused: {e}") from None
    except CommitError as e:  # a planted file larger than any report: refused unread
        raise HTTPException(status_code=403, detail=str(e)) from None
    except ReportAccessError as e:
        raise HTTPException(status_code=e.status, detail=str(e)) from None
    except FileNotFoundError:
        raise HTTPException(status_code=404, detail=f"{loc.rel(kind)} does not exist under the run's output") from None
    return Response(content=body, media_type=MEDIA[kind], headers=HEADERS)


@app.get("/report", dependencies=[_can_read_task_instances])
def report_html(dag_id: str, run_id: str, task_id: str, session: SessionDep, map_index: int = -1) -> Response:
    """The QA task's ``qa/report.html``."""
    return _serve("html", session, dag_id, run_id, task_id, map_index)


@app.get("/report.json", dependencies=[_can_read_task_instances])
def report_json(dag_id: str, run_id: str, task_id: str, session: SessionDep, map_index: int = -1) -> Response:
    """The QA task's ``qa/report.json``."""
    return _serve("json", session, dag_id, run_id, task_id, map_index)


class VllmBatchPlugin(AirflowPlugin):
    """Mounts the report app at ``/vllm-batch`` in Airflow's API server."""

    name = "vllm_batch"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "vLLM batch QA reports"}]
