"""Deployment-owned settings: who set the value (``utils/provenance.py``). The plan operator reads
the DAG file's unrendered values; a trigger (params, ``dag_run.conf``), an XCom or a Variable without
the deployment's opt-in never sets one.
"""

from __future__ import annotations

import itertools
import json

import pytest

from tests.support.ledger import record_malicious
from tests.support.security import _ti, base_doc, prefixes

pytestmark = pytest.mark.reliability


# ---- deployment-owned settings: who set the value (issue 12) --------------------------
def _plan(raw_spec, rendered_spec=None, raw_overrides=None, rendered_overrides=None, dag=None, **kw):
    """A plan operator built from DAG-file values, with its fields as Airflow's render leaves them."""
    from airflow_provider_vllm.operators import VllmPlanOperator

    n = next(_PLANS)
    op = VllmPlanOperator(task_id=f"plan{n}", spec=raw_spec, overrides=raw_overrides, dag=dag, **kw)
    op.spec = rendered_spec if rendered_spec is not None else raw_spec
    op.overrides = rendered_overrides if rendered_overrides is not None else raw_overrides
    if isinstance(op.spec, dict):  # each plan its own output prefix
        op.spec = _set(op.spec, "io.output_uri", op.spec["io"]["output_uri"] + f"-{n}")
    return op


_PLANS = itertools.count()


def _set(doc: dict, path: str, value) -> dict:
    doc = json.loads(json.dumps(doc))
    *parents, leaf = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return doc


OWNED_VALUES = {
    "model.trust_remote_code": True,
    "engine.engine_kwargs": {"compilation_config": {"backend": "evil.module.compile"}},
    "kubernetes.image": "evil.example/miner:latest",
    "kubernetes.service_account": "cluster-admin",
    "kubernetes.env": {"LD_PRELOAD": "/tmp/x.so"},
    "kubernetes.env_from_secrets": ["prod-db"],
    "kubernetes.secret_env": {"AWS_SECRET_ACCESS_KEY": {"name": "other-team", "key": "k"}},
    "kubernetes.pod_template_file": "/etc/kubernetes/privileged.yaml",
    "kubernetes.namespace": "kube-system",
    "kubernetes.annotations": {"iam.amazonaws.com/role": "admin"},
}


@pytest.mark.parametrize("via", ["param template", "dag_run conf", "xcom", "Variable overrides"])
def test_deployment_owned_settings_from_a_trigger_or_a_variable_are_refused(allowed, monkeypatch, via):
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_REMOTE_CODE", "True")  # the gate is open: provenance decides
    tried = rejected = 0
    for path, value in OWNED_VALUES.items():
        tried += 1
        template = {
            "param template": "{{ params.x }}",
            "dag_run conf": "{{ dag_run.conf['x'] }}",
            "xcom": "{{ ti.xcom_pull('t') }}",
        }.get(via)
        if template is not None:
            raw = _set(base_doc(allowed), path, template)
            op = _plan(raw, _set(base_doc(allowed), path, value))
        else:
            op = _plan(
                base_doc(allowed),
                raw_overrides="{{ var.value.get('vllm_batch_spec_overrides', '{}') }}",
                rendered_overrides=json.dumps({path: value}),
            )
        ti = _ti()
        with pytest.raises(AirflowFailException) as e:
            op.execute({"ti": ti, "params": {"x": "y"}})
        msg = str(e.value)
        named = path if path != "engine.engine_kwargs" else "engine.engine_kwargs.compilation_config.backend"
        if named in msg and "deployment-owned" in msg and ti.xcoms == {}:
            rejected += 1
        else:
            print(f"NOT REFUSED AS EXPECTED {path} via {via}: {msg}")
        if via == "Variable overrides":
            assert "deployment_settings_from_variables" in msg
    assert not list(allowed.glob("out*"))
    record_malicious(f"deployment_owned_via_{via.replace(' ', '_')}", tried, rejected)
    assert rejected == tried


def test_deployment_owned_settings_from_the_dag_file_or_an_opted_in_variable_pass(allowed, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    literal = _set(
        _set(base_doc(allowed), "kubernetes.image", "registry.example.com/w:1"),
        "kubernetes.service_account",
        "vllm-batch",
    )
    assert _plan(literal).execute({"ti": _ti(), "params": {}})  # a DAG-file literal
    dated = _set(base_doc(allowed), "kubernetes.labels", {"day": "{{ ds_nodash }}"})
    assert _plan(dated, _set(base_doc(allowed), "kubernetes.labels", {"day": "20261130"})).execute(
        {"ti": _ti(), "params": {}}
    )  # a template over the logical date only
    # trust_remote_code as a DAG-file literal: still needs the deployment's allow_remote_code
    trc = _set(_set(base_doc(allowed), "model.trust_remote_code", True), "model.revision", "0" * 40)
    with pytest.raises(AirflowFailException, match=r"\[vllm_batch\] allow_remote_code"):
        _plan(trc).execute({"ti": _ti(), "params": {}})
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_REMOTE_CODE", "True")
    assert _plan(trc).execute({"ti": _ti(), "params": {}})
    # a Variable may set them once the deployment opts in
    var = "{{ var.value.get('vllm_batch_spec_overrides', '{}') }}"
    op = _plan(base_doc(allowed), raw_overrides=var, rendered_overrides='{"kubernetes.image": "r.example.com/w:2"}')
    with pytest.raises(AirflowFailException, match="deployment_settings_from_variables"):
        op.execute({"ti": _ti(), "params": {}})
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__DEPLOYMENT_SETTINGS_FROM_VARIABLES", "True")
    op = _plan(base_doc(allowed), raw_overrides=var, rendered_overrides='{"kubernetes.image": "r.example.com/w:2"}')
    assert op.execute({"ti": _ti(), "params": {}})
    # ... but a trigger never may, opt-in or not
    op = _plan(
        _set(base_doc(allowed), "kubernetes.image", "{{ params.image }}"),
        _set(base_doc(allowed), "kubernetes.image", "evil/x"),
    )
    with pytest.raises(AirflowFailException, match="trigger params"):
        op.execute({"ti": _ti(), "params": {"image": "evil/x"}})
    # the other settings stay free for Variables (engine sizes, sampling, ...)
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__DEPLOYMENT_SETTINGS_FROM_VARIABLES")
    op = _plan(
        base_doc(allowed),
        raw_overrides=var,
        rendered_overrides='{"engine.max_num_seqs": 256, "engine.engine_kwargs": {"block_size": 32}}',
    )
    assert op.execute({"ti": _ti(), "params": {}})


def test_an_included_spec_file_is_the_dag_files_unless_it_reads_params(allowed, tmp_path, monkeypatch):
    """``{% include 'job.yaml' %}``: the included file is read (not rendered) to see which names it uses."""
    import yaml
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    doc = _set(base_doc(allowed), "kubernetes.image", "registry.example.com/w:1")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    hostile = _set(doc, "kubernetes.service_account", "{{ params.sa }}")
    (tmp_path / "hostile.yaml").write_text(yaml.safe_dump(hostile))
    with DAG("d", template_searchpath=[str(tmp_path)], schedule=None) as dag:
        pass
    assert _plan("{% include 'job.yaml' %}", yaml.safe_dump(doc), dag=dag).execute({"ti": _ti(), "params": {}})
    op = _plan(
        "{% include 'hostile.yaml' %}", yaml.safe_dump(_set(doc, "kubernetes.service_account", "admin")), dag=dag
    )
    with pytest.raises(AirflowFailException, match=r"kubernetes.image is deployment-owned and came from trigger"):
        op.execute({"ti": _ti(), "params": {"sa": "admin"}})
    op = _plan("{% include params.f %}", yaml.safe_dump(doc), dag=dag)
    with pytest.raises(AirflowFailException, match="deployment-owned"):
        op.execute({"ti": _ti(), "params": {"f": "job.yaml"}})
    record_malicious("deployment_owned_via_include", 2, 2)
