"""The pod dry run (cli/pod_dry_run.py) checks the ``--conf`` it is given as the plan task checks a run's conf
(its Kubernetes manifests themselves are checked against a real Airflow in tests/airflow/test_kubernetes_dags.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


class Reached(Exception):
    """The dry run went on to build the spec."""


@pytest.fixture
def rerun(monkeypatch):
    """A DAG with a plan task and a Kubernetes shard task, served by stand-ins for Airflow's CLI helpers (no
    metadata database); building the spec raises ``Reached``."""
    import airflow.cli.commands.task_command as task_command
    import airflow.utils.cli as cli_utils
    from airflow.sdk import DAG, Param

    from airflow_provider_vllm.operators.kubernetes import VllmKubernetesShardOperator
    from airflow_provider_vllm.operators.plan import VllmPlanOperator

    with DAG("rerun", schedule=None, params={"input_uri": Param("/in", type="string")}) as dag:
        plan = VllmPlanOperator(
            task_id="plan",
            spec={"model": {"name": "m"}, "io": {"input_uri": "/in", "output_uri": "/out"}},
            param_overrides=["input_uri"],
        )
        VllmKubernetesShardOperator(task_id="shard", spec={}, shard="{{ ti.xcom_pull('plan') }}")

    def build_spec(self, params):
        raise Reached(params)

    monkeypatch.setattr(VllmPlanOperator, "build_spec", build_spec)
    monkeypatch.setattr(cli_utils, "get_bagged_dag", lambda bundle, dag_id: dag)
    monkeypatch.setattr(cli_utils, "get_db_dag", lambda bundle, dag_id: SimpleNamespace(get_task=lambda t: plan))
    monkeypatch.setattr(task_command, "_get_ti", lambda *a, **k: (SimpleNamespace(), None))
    monkeypatch.setattr(task_command, "_get_template_context", lambda ti, task: {"params": {"input_uri": "/in"}})
    return dag


@pytest.mark.reliability
def test_a_conf_key_the_dag_declares_no_param_for_is_refused_as_the_plan_refuses_it(rerun):
    """The plan task (and so its dry run) fails a run whose conf names a key the DAG declares no Param for; the pod
    dry run printed a pod of the defaults for the same conf (a typo, ``Input_uri``) instead of saying so."""
    from airflow_provider_vllm.cli.pod_dry_run import render_shard_pod
    from tests.support.ledger import record_malicious

    for conf in ({"Input_uri": "/elsewhere"}, {"input_uri": "/in", "sampling.seed": 7}):
        with pytest.raises(SystemExit, match=r"--conf: plan: the run's conf \(dag_run.conf\) names \['"):
            render_shard_pod("rerun", "2026-11-24", conf=conf)
    record_malicious("pod_dry_run_undeclared_conf", 2, 2)
    with pytest.raises(Reached) as reached:  # declared keys go on to the spec, with the conf's values
        render_shard_pod("rerun", "2026-11-24", conf={"input_uri": "/elsewhere"})
    assert reached.value.args[0]["input_uri"] == "/elsewhere"
