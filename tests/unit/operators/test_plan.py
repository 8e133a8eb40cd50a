"""The plan operator's spec layering: spec < deployment overrides < trigger params (no Airflow run needed)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from airflow_provider_vllm.operators.plan import VllmPlanOperator
from tests.support.ledger import record_malicious
from tests.support.security import base_doc, prefixes

pytestmark = pytest.mark.unit

SPEC = {
    "model": {"name": "m", "revision": "r"},
    "io": {"input_uri": "/in", "output_uri": "/out"},
    "cache": {"uri": "/cache"},
    "sharding": {"target_rows": 100},
}


def op(overrides, param_overrides=()):
    return VllmPlanOperator(task_id="plan", spec=SPEC, overrides=overrides, param_overrides=param_overrides)


def test_a_null_override_turns_a_field_off():
    assert op({"cache.uri": None}).build_spec({}).cache.uri is None
    assert op({"cache": {"uri": None}}).build_spec({}).cache.uri is None
    assert op({}).build_spec({}).cache.uri == "/cache"


def test_malformed_overrides_fail_the_plan_without_retry_naming_them():
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="plan: spec overrides .*vllm_batch_spec_overrides"):
        op("{cache.uri: null").build_spec({})


def test_an_empty_form_field_keeps_the_override():
    o = op({"sharding.target_rows": 7}, param_overrides=["shard_rows"])
    assert o.build_spec({"shard_rows": None}).sharding.target_rows == 7
    assert o.build_spec({"shard_rows": 9}).sharding.target_rows == 9


# ---- the plan operator: refused before any shard spec exists ---------------------------
@pytest.mark.reliability
def test_plan_operator_refuses_before_planning(allowed, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import VllmPlanOperator

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    cases = {
        "input_uri": ["s3://other/in", str(allowed / "in") + "/../../x", "file:///etc"],
        "output_uri": ["s3://data-other/out", "/tmp/elsewhere", "http://x/y"],
        "model": ["$(id)", "{{ 7*7 }}"],
        "labels": [["ok", "x`id`"], [f"l{i}" for i in range(300)]],
        "system_prompt": ["{# x #} hi"],
    }
    n = tried = 0
    for param, values in cases.items():
        for value in values:
            tried += 1
            ti = type(
                "TI",
                (),
                {
                    "xcoms": {},
                    "xcom_push": lambda self, key, value: self.xcoms.update({key: value}),
                    "map_index": -1,
                    "try_number": 1,
                },
            )()
            op = VllmPlanOperator(task_id="plan", spec=base_doc(allowed), param_overrides=[param])
            with pytest.raises(AirflowFailException):
                op.execute({"ti": ti, "params": {param: value}})
            assert ti.xcoms == {}  # no spec for any shard task
            assert not (allowed / "out" / "_plan.json").exists()
            n += 1
    record_malicious("plan_operator", tried, n)
    # and the valid spec plans under the same deployment setting
    ti = type("TI", (), {"xcoms": {}, "xcom_push": lambda self, key, value: self.xcoms.update({key: value})})()
    assert VllmPlanOperator(task_id="plan", spec=base_doc(allowed)).execute({"ti": ti, "params": {}})


@pytest.mark.reliability
def test_param_overrides_cannot_name_deployment_owned_settings():
    from airflow_provider_vllm.operators import VllmPlanOperator

    names = [
        "model.trust_remote_code",
        "kubernetes",
        "kubernetes.image",
        "kubernetes.env.X",
        "kubernetes.service_account",
        "kubernetes.secret_env",
    ]
    n = 0
    for name in names:
        with pytest.raises(ValueError, match="deployment-owned"):
            VllmPlanOperator(task_id="plan", spec={}, param_overrides=["model", name])
        n += 1
    record_malicious("param_overrides_deployment_owned", len(names), n)
    VllmPlanOperator(task_id="plan", spec={}, param_overrides=["model", "labels", "kubernetes.gpus"])


@pytest.mark.parametrize("declared", [False, True])
def test_a_dry_run_conf_key_skips_only_on_a_dag_that_declares_the_param(allowed, monkeypatch, declared):
    """Airflow merges any conf key into params: ``-c '{"dry_run": true}'`` on a nightly DAG without the
    param must not skip the run while it shows success."""
    from airflow.sdk import DAG, Param
    from airflow.sdk.exceptions import AirflowSkipException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))

    def dry_run(self, spec, context):
        raise AirflowSkipException("dry run")

    monkeypatch.setattr(VllmPlanOperator, "_dry_run", dry_run)
    with DAG("nightly", schedule=None, params={"dry_run": Param(False, type="boolean")} if declared else {}):
        plan = VllmPlanOperator(task_id="plan", spec=base_doc(allowed))
    ti = type("TI", (), {"xcoms": {}, "xcom_push": lambda self, key, value: self.xcoms.update({key: value})})()
    context = {"ti": ti, "params": {"dry_run": True}, "dag": plan.dag}
    if declared:
        with pytest.raises(AirflowSkipException, match="dry run"):
            plan.execute(context)
        assert not (allowed / "out" / "_plan.json").exists()
    else:
        assert plan.execute(context) and (allowed / "out" / "_plan.json").exists()


def _plan_ti():
    return type(
        "TI",
        (),
        {
            "xcoms": {},
            "xcom_push": lambda self, key, value: self.xcoms.update({key: value}),
            "map_index": -1,
            "try_number": 1,
        },
    )()


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("model", "attacker/remote-code-model"),
        ("model_revision", "refs/pr/1"),
        ("model_revision", "b" * 40),
    ],
)
def test_with_remote_code_on_a_trigger_cannot_choose_the_model_repo_or_revision(allowed, monkeypatch, param, value):
    """The deployment allows remote code and the DAG file turns it on: the model repo and revision are then the
    code that runs, deployment-owned like trust_remote_code itself; the form's model / revision is refused,
    even a commit sha. The same DAG-file model still plans, and without remote code the form may choose."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_REMOTE_CODE", "True")
    doc = base_doc(allowed)
    doc["model"] = {"name": "trusted-org/reviewed-model", "revision": "a" * 40, "max_model_len": 256}
    remote = {**doc, "model": {**doc["model"], "trust_remote_code": True}}
    ti = _plan_ti()
    with pytest.raises(AirflowFailException, match=rf"{PARAM_TARGET[param]} is deployment-owned and came from trigger"):
        VllmPlanOperator(task_id="plan", spec=remote, param_overrides=[param]).execute(
            {"ti": ti, "params": {param: value}}
        )
    assert "spec" not in ti.xcoms
    ti = _plan_ti()  # an empty form field keeps the DAG file's model: plans
    assert VllmPlanOperator(task_id="plan", spec=remote, param_overrides=[param]).execute(
        {"ti": ti, "params": {param: None}}
    )
    assert ti.xcoms["spec"]["model"]["name"] == "trusted-org/reviewed-model"
    if param != "model":  # without remote code the form chooses (a hub id needs no local folder)
        ti = _plan_ti()
        doc["io"]["output_uri"] = str(allowed / "out2")
        VllmPlanOperator(task_id="plan", spec=doc, param_overrides=[param]).execute(
            {"ti": ti, "params": {param: value}}
        )
        assert value in json.dumps(ti.xcoms["spec"]["model"])


PARAM_TARGET = {
    "model": "model.name",
    "model_revision": "model.revision",
}


def test_the_re_run_forms_output_cannot_nest_inside_another_runs_folder(allowed, monkeypatch):
    """The form's output prefix pointed at a sub-folder of the nightly's run (.../dt=X/results/x): the plan task
    fails, writing nothing; a prefix of its own plans."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    nightly = base_doc(allowed)
    nightly["io"]["output_uri"] = str(allowed / "nightly" / "dt=2026-12-05")
    VllmPlanOperator(task_id="plan", spec=nightly).execute({"ti": _plan_ti(), "params": {}})
    rerun = base_doc(allowed)
    op = VllmPlanOperator(task_id="plan", spec=rerun, param_overrides=["output_uri"])
    target = allowed / "nightly" / "dt=2026-12-05" / "results" / "x"
    with pytest.raises(AirflowFailException, match="lies inside the run at"):
        op.execute({"ti": _plan_ti(), "params": {"output_uri": str(target)}})
    assert not target.exists()
    assert op.execute({"ti": _plan_ti(), "params": {"output_uri": str(allowed / "reruns" / "r1")}})


@pytest.mark.reliability
def test_a_trigger_cannot_move_the_shards_onto_the_airflow_worker(allowed, monkeypatch):
    """A Kubernetes deployment ([vllm_batch] allowed_runners unset): the form's runner=local fails the plan task
    without retry, naming the param, the value and the setting, before it writes or pushes anything; kubernetes
    plans, and so does local once the deployment lists it. The DAG file's literal runner is not restricted."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", raising=False)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", "vllm-batch-signing:key")

    def plan(runner, params, ti=None):
        op = VllmPlanOperator(task_id="plan", spec=base_doc(allowed), runner=runner)
        context = {"ti": ti or _plan_ti(), "params": params}
        op.render_template_fields(context)
        return op.execute(context), context["ti"].xcoms

    ti = _plan_ti()
    with pytest.raises(AirflowFailException) as e:
        plan("{{ params.runner }}", {"runner": "local"}, ti)
    msg = str(e.value)
    assert msg.startswith("plan: runner='local' (from '{{ params.runner }}': trigger params)"), msg
    assert "[vllm_batch] allowed_runners (AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS)" in msg, msg
    assert ti.xcoms == {} and not (allowed / "out").exists()
    record_malicious("trigger_runner_local", 1, 1)
    shards, xcoms = plan("{{ params.runner }}", {"runner": "kubernetes"})
    assert shards and "spec" in xcoms
    shutil.rmtree(allowed / "out")
    assert plan("local", {"runner": "local"})[0]  # the DAG file's literal: its author's choice
    shutil.rmtree(allowed / "out")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", "kubernetes,local")
    assert plan("{{ params.runner }}", {"runner": "local"})[0]


def test_a_passthrough_column_the_output_table_cannot_hold_fails_the_plan_task(allowed, monkeypatch, tmp_path):
    """A column the output table cannot take failed publish, after every shard had run; the plan task fails,
    naming it, without retry."""
    import datetime as dt

    import pyarrow as pa
    import pyarrow.parquet as pq
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import plan as plan_module
    from airflow_provider_vllm.steps.tables.access import Tables
    from tests.support.iceberg import sql_catalog

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    catalog = sql_catalog(tmp_path)
    monkeypatch.setattr(plan_module, "iceberg_tables", lambda p: Tables(catalog=catalog, allowed=["lake.*"]))
    when = pa.array([dt.datetime(2026, 1, 1)] * 3, pa.timestamp("ns"))
    path = allowed / "in" / "part-0.parquet"
    pq.write_table(pq.read_table(path).append_column("when", when), path)
    doc = base_doc(allowed)
    doc["io"] |= {"passthrough": ["when"], "output_table": {"identifier": "lake.triage", "create": True}}
    with pytest.raises(AirflowFailException, match="results column 'when' is timestamp\\[ns\\], which an Iceberg"):
        VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _plan_ti(), "params": {}})
    doc["io"]["passthrough"] = []
    assert VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _plan_ti(), "params": {}})


@pytest.mark.parametrize("rows", [3, 0])
def test_the_plan_task_names_the_sealed_plan_it_wrote_for_merge(allowed, monkeypatch, rows):
    """Under the XCom key ``plan``: the seal and sha256 of the ``_plan.json`` it wrote, which merge takes and no other
    sealed plan of the folder; also when the input plans no shard (no shard value then names the plan)."""
    import pyarrow as pa

    from airflow_provider_vllm.core.plan import Plan, plan_sha256
    from tests.support.data import write_parquet

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    if not rows:
        write_parquet(allowed / "in" / "part-0.parquet", pa.array([], pa.string()), pa.array([], pa.string()))
    ti = _plan_ti()
    shards = VllmPlanOperator(task_id="plan", spec=base_doc(allowed)).execute({"ti": ti, "params": {}})
    plan = Plan.model_validate_json((allowed / "out" / "_plan.json").read_bytes())
    assert ti.xcoms["plan"] == {"plan_mac": plan.seal.mac, "plan_sha256": plan_sha256(plan)}
    assert len(shards) == (1 if rows else 0)
    assert all({s["plan_mac"], s["plan_sha256"]} == set(ti.xcoms["plan"].values()) for s in shards)


@pytest.mark.reliability
def test_a_conf_key_for_a_param_the_dag_does_not_declare_never_reaches_the_spec(allowed, monkeypatch):
    """Airflow merges every ``dag_run.conf`` key into the params (``process_params``), declared or not. A
    ``param_overrides`` name the DAG declares no Param for was then set from the conf, past any form and its JSON
    schema: the plan task fails without retry, naming it, before it writes or pushes anything; the declared param
    still takes the trigger's value, and a conf without the undeclared key plans."""
    from airflow.sdk import DAG, Param
    from airflow.sdk.definitions.param import process_params
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    with DAG("rerun_undeclared", schedule=None, params={"temperature": Param(0.0, type="number", maximum=2)}) as dag:
        plan = VllmPlanOperator(
            task_id="plan", spec=base_doc(allowed), param_overrides=["temperature", "sampling.seed", "task"]
        )

    def run(conf, ti):
        params = process_params(dag, plan, conf, suppress_exception=False)  # what Airflow hands the task
        return plan.execute({"ti": ti, "params": params, "dag": dag})

    for conf, named in [({"sampling.seed": 7}, "sampling.seed"), ({"temperature": 1.0, "task": "generate"}, "task")]:
        ti = _plan_ti()
        with pytest.raises(AirflowFailException, match=rf"plan: param_overrides \['{named}'\] have a value"):
            run(conf, ti)
        assert ti.xcoms == {} and not (allowed / "out").exists()
    record_malicious("conf_key_for_an_undeclared_param", 2, 2)
    ti = _plan_ti()
    assert run({"temperature": 1.0}, ti)
    assert ti.xcoms["spec"]["sampling"]["temperature"] == 1.0 and ti.xcoms["spec"]["sampling"]["seed"] is None


@pytest.mark.reliability
def test_the_re_run_forms_compare_with_cannot_name_the_runs_own_folder(allowed, monkeypatch):
    """*Compare with* set to the run's own output prefix (the default or the form's), a folder inside it or one
    holding it: the change set would read the run's own merge (every id unchanged, a churn check passed where it
    had been skipped). The plan task fails without retry naming both, before it writes anything; an earlier run's
    folder beside it plans."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    own = allowed / "out"
    for value in (own, f"{own}/", own / "changes", allowed):
        ti = _plan_ti()
        op = VllmPlanOperator(task_id="plan", spec=base_doc(allowed), param_overrides=["compare_with"])
        with pytest.raises(AirflowFailException, match=r"changes\.previous_uri=.* and io\.output_uri=.* overlap"):
            op.execute({"ti": ti, "params": {"compare_with": str(value)}})
        assert ti.xcoms == {} and not own.exists()
    record_malicious("compare_with_own_folder", 4, 4)
    ti = _plan_ti()
    op = VllmPlanOperator(task_id="plan", spec=base_doc(allowed), param_overrides=["compare_with"])
    assert op.execute({"ti": ti, "params": {"compare_with": str(allowed / "earlier")}})
    assert ti.xcoms["spec"]["changes"]["previous_uri"] == str(allowed / "earlier")


@pytest.mark.reliability
def test_a_form_output_outside_the_dag_files_output_under_is_refused_before_anything_is_written(allowed, monkeypatch):
    """A DAG whose form may set the output (the re-run template) bounds it with ``output_under``: a trigger naming
    a nightly's next date (inside the allow-list), the folder itself or a sibling whose name starts the same fails
    the plan without retry, naming the folder, and writes nothing; a folder inside plans. An ``output_under`` that
    the trigger chose bounds nothing and fails too."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    reruns = allowed / "reruns"
    doc = base_doc(allowed)
    doc["io"]["output_uri"] = str(reruns / "default")

    def plan(output_uri, under=str(reruns)):
        ti = _plan_ti()
        op = VllmPlanOperator(task_id="plan", spec=doc, param_overrides=["output_uri"], output_under=under)
        return ti, op.execute({"ti": ti, "params": {"output_uri": output_uri}})

    hostile = [
        allowed / "nightly" / "dt=2099-01-01",
        reruns,
        f"{reruns}/",
        allowed / "reruns-nightly",
    ]
    for value in hostile:
        with pytest.raises(AirflowFailException, match=r"is not a folder inside .*reruns.*output_under"):
            plan(str(value))
        assert not (allowed / "nightly").exists() and not (allowed / "reruns-nightly").exists()
    with pytest.raises(AirflowFailException, match=r"output_under came from trigger params"):
        plan(str(allowed / "nightly" / "dt=2099-01-03"), under="{{ params.output_uri }}")
    assert not (allowed / "nightly").exists()
    record_malicious("output_outside_output_under", len(hostile) + 1, len(hostile) + 1)
    # the folder itself swapped for a link into a nightly's root by whoever may write its parent: both sides would
    # resolve into the nightly's folder, and its next date be "inside" it
    (allowed / "nightly").mkdir()
    reruns.symlink_to(allowed / "nightly", target_is_directory=True)
    with pytest.raises(AirflowFailException, match=r"output_under=.*reruns is a symbolic link"):
        plan(str(reruns / "dt=2099-01-02"))
    assert not (allowed / "nightly" / "dt=2099-01-02").exists()
    reruns.unlink()
    (allowed / "nightly").rmdir()
    record_malicious("output_under_swapped_for_a_link", 1, 1)
    ti, shards = plan(None)  # the DAG file's own output, inside the folder
    assert shards and ti.xcoms["spec"]["io"]["output_uri"] == str(reruns / "default")
    ti, shards = plan(str(reruns / "mine"))
    assert shards and (reruns / "mine" / "_plan.json").exists()


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("io.output_table.identifier", "{{ var.value.get('vllm_batch_output_table', 'lake.triage') }}"),
        ("io.output_table.identifier", "{{ params.table }}"),
        ("io.output_table.identifier", "{{ dag_run.conf['table'] }}"),
        ("io.output_table.mode", "{{ params.mode }}"),
        ("io.input_table.identifier", "{{ var.value.get('vllm_batch_input_table', 'lake.tickets') }}"),
    ],
)
def test_which_table_a_run_reads_or_publishes_to_is_never_a_trigger_or_variables_choice(
    allowed, monkeypatch, tmp_path, path, raw
):
    """Publish commits to the output table with the deployment's catalog identity, and ``mode: overwrite``
    replaces a date's rows there: which table (and whether its rows are replaced) is the DAG file's or the
    deployment's, like the pod's identity. A trigger or a Variable pointing the nightly at another table the
    deployment allows (another team's, in an allowed namespace) is refused before any catalog is reached; the
    same value as a DAG-file literal plans, and a Variable does once the deployment opts in. The code before took
    the identifier from a Variable or a trigger."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import plan as plan_module
    from airflow_provider_vllm.steps.tables.access import Tables
    from tests.support.iceberg import source_table, sql_catalog

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    catalog = sql_catalog(tmp_path)
    source_table(catalog)
    reached = []

    def tables(p):
        reached.append(p)
        return Tables(catalog=catalog, allowed=["lake.*"], uri_prefixes=[])

    monkeypatch.setattr(plan_module, "iceberg_tables", tables)
    literal = {"io.output_table.identifier": "lake.triage", "io.output_table.mode": "append"}
    literal["io.input_table.identifier"] = "lake.tickets"
    doc = base_doc(allowed)
    doc["io"] |= {"output_table": {"identifier": "lake.triage", "mode": "append", "create": True}}
    if path.startswith("io.input_table"):
        doc["io"] |= {"input_uri": None, "input_table": {"identifier": "lake.tickets", "columns": ["id", "text"]}}
    section, key = path.rsplit(".", 1)
    raw_doc = json.loads(json.dumps(doc))
    raw_doc["io"][section.split(".")[1]][key] = raw
    ti = _plan_ti()
    op = VllmPlanOperator(task_id="plan", spec=raw_doc)
    op.spec = doc  # as Airflow renders it: the value the template gave
    with pytest.raises(AirflowFailException, match=rf"{re.escape(path)} is deployment-owned and came from"):
        op.execute({"ti": ti, "params": {"table": "lake.triage", "mode": "append"}})
    assert "spec" not in ti.xcoms and reached == []
    if raw.startswith("{{ var."):  # a Variable: only with the deployment's opt-in
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__DEPLOYMENT_SETTINGS_FROM_VARIABLES", "True")
        op = VllmPlanOperator(task_id="plan", spec=raw_doc)
        op.spec = doc
        assert op.execute({"ti": _plan_ti(), "params": {}})
        monkeypatch.delenv("AIRFLOW__VLLM_BATCH__DEPLOYMENT_SETTINGS_FROM_VARIABLES")
    doc["io"]["output_uri"] = str(allowed / "out-literal")
    assert VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _plan_ti(), "params": {}})  # a DAG-file literal
    assert literal[path] in json.dumps(doc)
    record_malicious("table_chosen_by_a_trigger_or_variable", 1, 1)


@pytest.mark.reliability
def test_a_triggered_run_cannot_claim_the_dated_folder_of_a_day_not_over(allowed, monkeypatch):
    """The nightly's output is ``dt={{ ds }}``, and a manual trigger chooses the run's dates (the REST API's
    ``logical_date`` and data interval, ``airflow dags trigger -l``; the form's logical date is *now*): a run Airflow
    did not schedule whose output its dates name fails without retry, before anything is written, while one of them
    lies in the current UTC day or later (tomorrow's folder, today's whose input is still coming) or it has none.
    Without ``[vllm_batch] scheduled_output_prefixes`` nothing stopped it before. Scheduled runs, backfills, a
    manual run of a past date, an output the re-run form names or that the run id names, still plan."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from airflow.sdk import DAG, Param
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    now = datetime.now(UTC)
    past, tomorrow = now - timedelta(days=3), now + timedelta(days=1)

    def run(run_type, logical, output="dt={{ ds }}", interval=None, params=None, param_overrides=()):
        raw = base_doc(allowed)
        raw["io"]["output_uri"] = str(allowed / "nightly") + "/" + output + "/"
        declared = {k: Param(None, type=["null", "string"]) for k in param_overrides}
        with DAG("nightly", schedule=None, params=declared):
            op = VllmPlanOperator(task_id="plan", spec=raw, param_overrides=param_overrides)
        start, end = interval or ((logical - timedelta(days=1), logical) if logical else (None, None))
        dag_run = SimpleNamespace(
            run_type=run_type,
            run_id="manual__x",
            logical_date=logical,
            data_interval_start=start,
            data_interval_end=end,
            partition_date=None,
            run_after=now,
            conf={},
        )
        context = {"ti": _plan_ti(), "params": dict(params or {}), "dag_run": dag_run, "run_id": "manual__x"}
        context["ds"] = logical.strftime("%Y-%m-%d") if logical else "none"
        op.render_template_fields(context)
        return context["ti"], op.execute(context)

    hostile = [
        ("manual", tomorrow, None),
        ("manual", now, None),  # the trigger form's default: today's folder, which tonight's run writes
        ("operator_triggered", tomorrow, None),
        (None, tomorrow, None),  # no run type known: fails closed
        ("manual", past, (past - timedelta(days=1), tomorrow)),  # a past date with a data interval into tomorrow
        ("manual", None, None),  # no date at all (a template reading ds that rendered anyway)
    ]
    for run_type, logical, interval in hostile:
        with pytest.raises(AirflowFailException, match=r"plan: the output of this run is named by its dates \(ds\)"):
            run(run_type, logical, interval=interval)
        assert not (allowed / "nightly").exists()
    with pytest.raises(AirflowFailException, match=r"named by its dates \(dag_run\)"):
        run("manual", tomorrow, output="{{ dag_run.logical_date.strftime('%Y') }}")
    assert not (allowed / "nightly").exists()
    record_malicious("triggered_run_claiming_a_dated_folder", len(hostile) + 1, len(hostile) + 1)
    for run_type in ("scheduled", "backfill", "asset_triggered"):  # what Airflow schedules (a cleared one keeps it)
        ti, shards = run(run_type, now)
        assert shards and ti.xcoms["spec"]["io"]["output_uri"].endswith(f"dt={now:%Y-%m-%d}/")
    ti, shards = run("manual", past)  # `airflow dags test DAG <past date>`, the demo
    assert shards and ti.xcoms["spec"]["io"]["output_uri"].endswith(f"dt={past:%Y-%m-%d}/")
    ti, shards = run("manual", tomorrow, output="reruns/{{ run_id }}")  # the re-run form's default: no date
    assert shards
    ti, shards = run(  # an output the trigger named itself (inside the allow-list; output_under bounds it)
        "manual",
        tomorrow,
        params={"output_uri": str(allowed / "adhoc")},
        param_overrides=["output_uri"],
    )
    assert shards and ti.xcoms["spec"]["io"]["output_uri"] == str(allowed / "adhoc")


@pytest.mark.reliability
def test_a_conf_key_that_matches_no_declared_param_fails_the_plan_naming_it(allowed, monkeypatch):
    """A typo in the REST API's conf (``Output_uri``) matched no Param and was silently ignored: the run wrote the
    default output. Every ``dag_run.conf`` key the DAG declares no Param for fails the plan without retry, naming it,
    before anything is written (also ``dry_run`` on a DAG without that param, which ran the whole job before).
    The trigger form's conf (every declared param), an empty conf (scheduled, asset-triggered, a backfill without
    one) and a conf of declared keys plan."""
    from types import SimpleNamespace

    from airflow.sdk import DAG, Param
    from airflow.sdk.definitions.param import process_params
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    declared = {"output_uri": Param(None, type=["null", "string"]), "shard_rows": Param(5, type="integer")}
    with DAG("rerun_typo", schedule=None, params=declared) as dag:
        plan = VllmPlanOperator(task_id="plan", spec=base_doc(allowed), param_overrides=["output_uri", "shard_rows"])

    def run(conf, run_type="manual"):
        ti = _plan_ti()
        params = process_params(dag, plan, conf, suppress_exception=False)  # what Airflow hands the task
        dag_run = SimpleNamespace(run_type=run_type, conf=conf, logical_date=None, run_after=None)
        return ti, plan.execute({"ti": ti, "params": params, "dag": dag, "dag_run": dag_run})

    elsewhere = str(allowed / "mine")
    hostile = [
        ({"Output_uri": elsewhere}, ["Output_uri"]),
        ({"output_uri ": elsewhere, "OUTPUT_URI": elsewhere}, ["OUTPUT_URI", "output_uri "]),
        ({"\u043eutput_uri": elsewhere}, ["\u043eutput_uri"]),  # a Cyrillic o
        ({"shard_rows": 2, "dry_run": True}, ["dry_run"]),
        ({"sharding.target_rows": 1}, ["sharding.target_rows"]),
    ]
    for conf, named in hostile:
        with pytest.raises(AirflowFailException, match=re.escape(f"plan: the run's conf (dag_run.conf) names {named}")):
            run(conf)
        assert not (allowed / "out").exists() and not (allowed / "mine").exists()
    with pytest.raises(AirflowFailException, match=r"names \['Output_uri'\]"):
        run({"Output_uri": elsewhere}, run_type="backfill")  # a backfill's conf is whoever asked for it
    flood = {f"k{i:05d}" + "x" * 500: 1 for i in range(10_000)}
    with pytest.raises(AirflowFailException, match=r"names \['k00000x{74}', .* and 9980 more, which") as e:
        run(flood)
    assert len(str(e.value)) < 3000
    record_malicious("conf_key_matching_no_param", len(hostile) + 1, len(hostile) + 1)
    ti, shards = run({})
    assert shards and ti.xcoms["spec"]["io"]["output_uri"] == str(allowed / "out")
    ti, shards = run({"output_uri": elsewhere, "shard_rows": 2})  # the trigger form: every declared param
    assert shards and ti.xcoms["spec"]["io"]["output_uri"] == elsewhere
    assert ti.xcoms["spec"]["sharding"]["target_rows"] == 2


def test_a_table_named_by_the_runs_date_is_a_dated_output_too(allowed, monkeypatch):
    """An Iceberg output a template names by date (``lake.triage_{{ ds_nodash }}``, a table per day) is the
    run's dated output as a ``dt={{ ds }}`` folder is: a manual run of tomorrow created and published tomorrow's
    table, since only ``io.output_uri`` and ``date_column`` were looked at. It fails as such a folder does; a past
    date, and a scheduled run, pass."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", ",".join(prefixes(allowed)))
    now = datetime.now(UTC)

    def check(run_type, logical):
        doc = base_doc(allowed)
        doc["io"]["output_table"] = {"identifier": "lake.triage_{{ ds_nodash }}", "create": True}
        with DAG("tables", schedule=None):
            op = VllmPlanOperator(task_id="plan", spec=doc)
        dates = dict.fromkeys(("logical_date", "data_interval_start", "data_interval_end"), logical)
        dag_run = SimpleNamespace(run_type=run_type, partition_date=None, run_after=now, **dates)
        context = {"ti": _plan_ti(), "params": {}, "dag_run": dag_run, "ds_nodash": f"{logical:%Y%m%d}"}
        op.render_template_fields(context)
        op.check_run_dates(op.build_spec({}), {}, context)

    with pytest.raises(AirflowFailException, match=r"named by its dates \(ds_nodash\).*logical_date"):
        check("manual", now + timedelta(days=1))
    record_malicious("a table per day claimed by a trigger", 1, 1)
    check("manual", now - timedelta(days=3))
    check("scheduled", now + timedelta(days=1))
