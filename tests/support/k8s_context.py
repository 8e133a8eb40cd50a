"""What the Kubernetes operator tests share: a task-instance context and a cluster that is not there."""

from __future__ import annotations

import json

import pendulum


def unreachable_cluster(tmp_path, monkeypatch):
    """Point KPO's default connection at a kubeconfig for 127.0.0.1:9, where nothing listens.

    Building a pod needs the hook (in-cluster or not, namespace); nothing may call the API.
    The kubernetes client reads ``$KUBECONFIG`` only when first imported, so the connection
    names the file instead.
    """
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        "clusters: [{name: test, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "users: [{name: test, user: {}}]\n"
        "contexts: [{name: test, context: {cluster: test, user: test}}]\n"
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_KUBERNETES_DEFAULT",
        json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(path)}}),
    )
    return path


def create_context(task, map_index: int | None = None, try_number: int = 1) -> dict:
    """A task-instance context for ``task`` (in a DAG ``dag``), as the provider's test_pod.py builds one."""
    from airflow.sdk import DAG
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    if not task.has_dag():
        dag = DAG(dag_id="dag", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"))
        dag.add_task(task)
    ti = RuntimeTaskInstance.model_construct(
        dag_id=task.dag.dag_id,
        task_id=task.task_id,
        run_id="test",
        try_number=try_number,
        map_index=-1 if map_index is None else map_index,
        task=task,
    )
    return {
        "dag": task.dag,
        "task": task,
        "ti": ti,
        "task_instance": ti,
        "run_id": "test",
        "ts": "2026-11-28T02:00:00+00:00",
    }
