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


# ---- what decides publication: a Variable or the trigger only tightens it (core/qa_gates.py) -------------------
VAR = "{{ var.value.get('vllm_batch_spec_overrides', '{}') }}"


def _gated(allowed, **qa) -> dict:
    """The spec a DAG file writes, with QA settings of its own."""
    return _set(base_doc(allowed), "qa", qa)


def _outcome(op, params=None) -> str:
    """'ok' when the plan task planned, else its refusal (nothing pushed for any shard)."""
    from airflow.sdk.exceptions import AirflowFailException

    ti = _ti()
    try:
        op.execute({"ti": ti, "params": params or {}})
    except AirflowFailException as e:
        assert ti.xcoms == {}
        return str(e)
    return "ok"


def _golden(allowed, name: str) -> str:
    from tests.support.data import write_parquet

    return str(write_parquet(allowed / "golden" / f"{name}.parquet", ["a", "b"], ["one", "two"], label=["a", "b"]))


def test_a_trigger_param_lowering_fail_accuracy_below_is_refused_naming_it(allowed, monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES", "True")  # no opt-in for a trigger
    spec = _gated(allowed, fail_accuracy_below=0.6)
    tried = rejected = 0
    for via, raw, params in [
        ("param_overrides", spec, {"qa.fail_accuracy_below": 0.1}),
        ("param template", _set(spec, "qa.fail_accuracy_below", "{{ params.floor }}"), {"floor": 0.1}),
        ("dag_run conf", _set(spec, "qa.fail_accuracy_below", "{{ dag_run.conf['floor'] }}"), {}),
    ]:
        tried += 1
        names = ["qa.fail_accuracy_below"] if via == "param_overrides" else []
        rendered = spec if via == "param_overrides" else _set(spec, "qa.fail_accuracy_below", 0.1)
        op = _plan(raw, rendered, param_overrides=names)
        msg = _outcome(op, params)
        who = "trigger params" if via != "dag_run conf" else "the trigger (dag_run)"
        floor = "the DAG file's 0.6" if via == "param_overrides" else "the spec default 0.5 (the DAG file sets none)"
        if f"qa.fail_accuracy_below=0.1 from {who} loosens {floor}" in msg and "a trigger may only" in msg:
            rejected += 1
        else:
            print(f"NOT REFUSED AS EXPECTED via {via}: {msg}")
    assert not list(allowed.glob("out*/_plan.json"))
    record_malicious("qa_gate_loosened_by_a_trigger", tried, rejected)
    assert rejected == tried
    # tightening from the trigger plans
    op = _plan(spec, param_overrides=["qa.fail_accuracy_below"])
    assert _outcome(op, {"qa.fail_accuracy_below": 0.7}) == "ok"


def test_a_variable_raising_fail_churn_rate_is_refused_unless_the_deployment_opts_in(allowed, monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    spec = _gated(allowed, warn_churn_rate=0.05, fail_churn_rate=0.5)  # the nightly's
    looser = '{"qa.fail_churn_rate": 0.9}'
    msg = _outcome(_plan(spec, raw_overrides=VAR, rendered_overrides=looser))
    assert "qa.fail_churn_rate=0.9 from Variables loosens the DAG file's 0.5" in msg
    assert "[vllm_batch] qa_settings_from_variables = True" in msg
    # tightening from a Variable plans, opt-in or not
    assert _outcome(_plan(spec, raw_overrides=VAR, rendered_overrides='{"qa.fail_churn_rate": 0.3}')) == "ok"
    # ... as does loosening once the deployment says Variables may
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES", "True")
    assert _outcome(_plan(spec, raw_overrides=VAR, rendered_overrides=looser)) == "ok"
    record_malicious("qa_gate_loosened_by_a_variable", 1, 1)


def test_a_dag_file_template_reading_a_variable_counts_as_the_variables(allowed, monkeypatch):
    """The floor of a value the DAG file takes from a Variable is the spec default, not the Variable's value."""
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    raw = _gated(allowed, fail_error_rate="{{ var.value.get('fail_error_rate', '0.05') }}")
    msg = _outcome(_plan(raw, _gated(allowed, fail_error_rate="0.5")))
    assert "qa.fail_error_rate=0.5 from Variables loosens the spec default 0.05 (the DAG file sets none)" in msg
    assert _outcome(_plan(raw, _gated(allowed, fail_error_rate="0.04"))) == "ok"
    # a template over the deployment's configuration is the DAG file's (the deployment's): no floor to keep
    conf = _gated(allowed, fail_error_rate="{{ conf.get('vllm_batch', 'fail_error_rate', fallback='0.05') }}")
    assert _outcome(_plan(conf, _gated(allowed, fail_error_rate="0.5"))) == "ok"


HOSTILE_OVERRIDES = {
    # nested and dotted paths to the same threshold
    "nested section": {"qa": {"fail_accuracy_below": 0}},
    "dotted path": {"qa.fail_accuracy_below": 0},
    "string for a number": {"qa.fail_accuracy_below": "0"},
    "padded string": {"qa.fail_accuracy_below": " 0.0 "},
    "bool": {"qa.fail_accuracy_below": False},
    "string for a rate": {"qa.fail_churn_rate": "1"},
    # a section replaced whole: every DAG-file threshold it omits falls back to the (looser) default
    "section reset": {"qa": {"sample_size": 200}},
    "reference reset": {"qa.reference": {}},
    "golden removed": {"qa.reference.golden_uri": None},
    "golden emptied": {"qa.reference.golden_uri": "  "},
    "swapped for the run's input column": {"qa.reference.golden_uri": None, "qa.reference.input_column": "text"},
    "label column": {"qa.reference.label_column": "text"},
    "min_labelled up": {"qa.min_labelled": 1000},
    "sample off": {"qa.sample_size": 0},
    "review sample off": {"qa.least_confident": 0},
    "baseline dropped": {"changes.previous_uri": None},
    "baseline moved": {"changes": {"previous_uri": "@ALLOWED@/out-elsewhere"}},
}


@pytest.mark.parametrize("via", ["Variable overrides", "param_overrides"])
def test_hostile_ways_to_loosen_a_gate_are_all_refused(allowed, monkeypatch, via):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    spec = _set(
        _gated(allowed, fail_accuracy_below=0.6, warn_churn_rate=0.05, fail_churn_rate=0.5, least_confident=30),
        "qa.reference.golden_uri",
        _golden(allowed, "dag"),
    )
    spec = _set(spec, "changes.previous_uri", str(allowed / "out-previous"))
    tried = rejected = 0
    for name, over in HOSTILE_OVERRIDES.items():
        over = json.loads(json.dumps(over).replace("@ALLOWED@", str(allowed)))
        tried += 1
        if via == "Variable overrides":
            op = _plan(spec, raw_overrides=VAR, rendered_overrides=json.dumps(over))
            msg = _outcome(op)
        elif None in over.values():
            tried -= 1  # an empty form field (None) keeps the DAG file's value: no change to refuse
            continue
        else:
            op = _plan(spec, param_overrides=list(over))
            msg = _outcome(op, over)
        # refused as a loosening, or (a string the spec cannot read as a number, ...) as an invalid spec
        if ("loosens" in msg or "invalid job spec" in msg) and msg != "ok":
            rejected += 1
        else:
            print(f"NOT REFUSED AS EXPECTED {name} via {via}: {msg}")
    for bad in (".nan", "nan", "-.inf", "-0.1", "1e9", "[0]") if via == "Variable overrides" else ():
        tried += 1  # no threshold at all (the Variable is YAML): the spec refuses it
        msg = _outcome(_plan(spec, raw_overrides=VAR, rendered_overrides=f'{{"qa.fail_churn_rate": {bad}}}'))
        rejected += "invalid job spec: qa.fail_churn_rate" in msg
    assert not list(allowed.glob("out*/_plan.json"))
    record_malicious(f"qa_gate_hostile_{via.replace(' ', '_')}", tried, rejected)
    assert rejected == tried


def test_a_trigger_changing_the_golden_set_is_refused_adding_one_where_the_dag_file_names_none_is_not(
    allowed, monkeypatch
):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    dag, own = _golden(allowed, "dag"), _golden(allowed, "the-runs-own-answers")
    spec = _set(base_doc(allowed), "qa.reference.golden_uri", dag)
    op = _plan(spec, param_overrides=["qa.reference.golden_uri"])
    msg = _outcome(op, {"qa.reference.golden_uri": own})
    assert f"qa.reference.golden_uri='{own}' from trigger params loosens the DAG file's '{dag}'" in msg
    # the DAG file's own value, given again, is no change
    assert _outcome(_plan(spec, param_overrides=["qa.reference.golden_uri"]), {"qa.reference.golden_uri": dag}) == "ok"
    # a DAG file that names none: a source added adds a check (the accuracy is the worst source's)
    op = _plan(base_doc(allowed), param_overrides=["qa.reference.golden_uri"])
    assert _outcome(op, {"qa.reference.golden_uri": own}) == "ok"
    # ... unless the DAG file asks for an accuracy gate and names no labels: QA would warn, not pass
    asks = _gated(allowed, warn_accuracy_below=0.9)
    msg = _outcome(_plan(asks, param_overrides=["qa.reference.golden_uri"]), {"qa.reference.golden_uri": own})
    assert "qa.reference.golden_uri" in msg and "asks for an accuracy gate" in msg
    record_malicious("qa_reference_changed_by_a_trigger", 2, 2)


def test_the_nightlys_variables_keep_working_tightening_only(allowed, monkeypatch):
    """The nightly's shape: churn gates in the DAG file, golden rows from vllm_batch_golden_uri, overrides from
    vllm_batch_spec_overrides, review from vllm_batch_human_review."""
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    golden = "{{ var.value.get('vllm_batch_golden_uri', '') }}"
    review = "{{ var.value.get('vllm_batch_human_review', 'true') }}"
    raw = _gated(allowed, warn_churn_rate=0.05, fail_churn_rate=0.5, reference={"ride_along_uri": golden})
    for golden_value in ("", _golden(allowed, "ride")):
        rendered = _set(raw, "qa.reference.ride_along_uri", golden_value)
        op = _plan(
            raw, rendered, raw_overrides=VAR, rendered_overrides='{"qa.warn_churn_rate": 0.02}', review_ask=review
        )
        op.review_ask = "true"
        assert _outcome(op) == "ok"
    op = _plan(raw, _set(raw, "qa.reference.ride_along_uri", ""), review_ask=review)
    op.review_ask = "false"  # vllm_batch_human_review=false: a QA 'warn' published unasked
    msg = _outcome(op)
    assert "the review's ask" in msg and "is false from Variables" in msg and "qa_settings_from_variables" in msg
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES", "True")
    op = _plan(raw, _set(raw, "qa.reference.ride_along_uri", ""), review_ask=review)
    op.review_ask = "false"
    assert _outcome(op) == "ok"
    # the trigger never turns the review off; the DAG file's own literal may
    op = _plan(base_doc(allowed), review_ask="{{ params.review }}")
    op.review_ask = "False"
    assert "is false from trigger params" in _outcome(op, {"review": False})
    assert _outcome(_plan(base_doc(allowed), review_ask="false")) == "ok"
    record_malicious("review_turned_off_by_a_variable_or_trigger", 2, 2)


def test_the_re_run_forms_compare_with_adds_a_baseline_where_the_dag_file_sets_none(allowed, monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", json.dumps(prefixes(allowed)))
    prev = str(allowed / "out-previous")
    assert _outcome(_plan(base_doc(allowed), param_overrides=["compare_with"]), {"compare_with": prev}) == "ok"
    spec = _set(base_doc(allowed), "changes.previous_uri", prev)
    msg = _outcome(_plan(spec, param_overrides=["compare_with"]), {"compare_with": str(allowed / "out-other")})
    assert "changes.previous_uri=" in msg and "from trigger params loosens the DAG file's" in msg


def test_names_that_carry_the_runs_dates_count_as_reading_them():
    """``run_dates_read``: besides ``ds`` and ``dag_run``, the task instance (``ti``, ``task_instance``: its
    ``get_template_context()`` holds ``ds``, its run the dates) and ``task_instance_key_str``
    (``dag__task__<ds_nodash>``) carry the run's logical date into a template: an output named through them is a
    dated output too."""
    from jinja2.sandbox import SandboxedEnvironment

    from airflow_provider_vllm.utils.provenance import run_dates_read

    env = SandboxedEnvironment()
    dated = [
        "s3://b/out/dt={{ ti.get_template_context()['ds'] }}/",
        "s3://b/out/{{ task_instance.run_id }}/",
        "s3://b/out/{{ task_instance_key_str }}/",
        "s3://b/out/{{ macros.ds_add(ds, 1) }}/",
        "s3://b/out/{% set d = logical_date %}{{ d | string }}/",
    ]
    for template in dated:
        assert run_dates_read(template, env), template
    assert not run_dates_read("s3://b/reruns/{{ run_id }}/", env)
    record_malicious("a dated output named through the task instance", len(dated), len(dated))
