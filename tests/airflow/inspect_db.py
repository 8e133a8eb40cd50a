"""Print, as JSON, what the Airflow metadata DB holds about a DAG's runs (run by the tests as
a subprocess with the test's AIRFLOW_HOME): runs, task instances, their earlier tries,
XCom return values and asset events."""

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


def main(dag_id: str) -> None:
    with create_session() as s:
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
            select(AssetModel.uri, AssetEvent.extra, AssetEvent.source_run_id)
            .join(AssetEvent, AssetEvent.asset_id == AssetModel.id)
            .where(AssetEvent.source_dag_id == dag_id)
        ).all()
        out["asset_events"] = [{"uri": u, "extra": e, "run_id": r} for u, e, r in events]
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
