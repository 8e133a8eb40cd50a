"""What an Airflow metadata DB holds about a DAG's runs: runs, task instances, their earlier tries,
XCom values and asset events, through Airflow's own models.

``read(db_url, dag_id)`` runs in the test process over the sandbox's SQLite file (its own engine,
disposed after the read, so no connection is left open while the next ``airflow`` command writes);
``python inspect_db.py DAG_ID`` prints the same as JSON for the DB of ``$AIRFLOW_HOME``."""

from __future__ import annotations

import json
import sys

from airflow.models.asset import AssetEvent, AssetModel
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance
from airflow.models.taskinstancehistory import TaskInstanceHistory
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from sqlalchemy import select


def _decoded(value):
    if isinstance(value, (bytes, str)):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def collect(s, dag_id: str) -> dict:
    """The DAG's rows from the session ``s``, JSON-ready (datetimes are written as strings)."""
    runs = s.scalars(select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.id)).all()
    out = {"runs": [{"run_id": r.run_id, "state": str(r.state), "conf": r.conf} for r in runs]}
    tis = s.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id)).all()
    out["tis"] = [
        {
            "run_id": t.run_id,
            "task_id": t.task_id,
            "map_index": t.map_index,
            "state": str(t.state),
            "try_number": t.try_number,
            "rendered_map_index": t.rendered_map_index,
        }
        for t in tis
    ]
    hist = s.scalars(select(TaskInstanceHistory).where(TaskInstanceHistory.dag_id == dag_id)).all()
    out["history"] = [
        {
            "run_id": h.run_id,
            "task_id": h.task_id,
            "map_index": h.map_index,
            "state": str(h.state),
            "try_number": h.try_number,
        }
        for h in hist
    ]
    xcoms = s.scalars(select(XComModel).where(XComModel.dag_id == dag_id)).all()
    out["xcoms"] = [
        {
            "run_id": x.run_id,
            "task_id": x.task_id,
            "map_index": x.map_index,
            "key": x.key,
            "value": _decoded(x.value),
        }
        for x in xcoms
    ]
    events = s.execute(
        select(AssetModel.uri, AssetEvent.extra, AssetEvent.source_run_id, AssetEvent.id, AssetEvent.source_task_id)
        .join(AssetEvent, AssetEvent.asset_id == AssetModel.id)
        .where(AssetEvent.source_dag_id == dag_id)
    ).all()
    out["asset_events"] = [{"uri": u, "extra": e, "run_id": r, "id": i, "task_id": t} for u, e, r, i, t in events]
    return json.loads(json.dumps(out, default=str))


def read(db_url: str, dag_id: str) -> dict:
    """``collect`` over the DB at ``db_url``, with an engine of its own (not Airflow's configured one)."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    engine = create_engine(db_url)
    try:
        with Session(engine) as s:
            return collect(s, dag_id)
    finally:
        engine.dispose()


def main(dag_id: str) -> None:
    with create_session() as s:
        json.dump(collect(s, dag_id), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
