"""The deployment's rules read from [vllm_batch] (utils/deployment.py): the signing key, the Secret the pods
get it from, where result caches may live, and which runners a run may choose."""

from __future__ import annotations

import json
import re

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.seal import Keyring, kid_of
from airflow_provider_vllm.utils.deployment import (
    KUBERNETES_RUNNER_OPTIONS,
    allowed_runners,
    cache_prefixes,
    check_run_may_write,
    check_runner_choice,
    check_spec_allowed,
    kubernetes_signing_secret,
    signing_keyring,
)
from tests.support.data import PLAN_REF, make_spec
from tests.support.ledger import record_malicious
from tests.support.security import _ti, base_doc


def test_no_signing_key_fails_closed_naming_the_option(monkeypatch):
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", raising=False)
    with pytest.raises(AirflowFailException, match=r"\[vllm_batch\] signing_key .*AIRFLOW__VLLM_BATCH__SIGNING_KEY"):
        signing_keyring()
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", "too-short")
    with pytest.raises(AirflowFailException, match="shorter than 32"):
        signing_keyring()
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", "n" * 40 + ",o" + "o" * 40)
    ring = signing_keyring()
    assert isinstance(ring, Keyring) and not ring.worker and ring.kid == kid_of(b"n" * 40)
    # the worker key of a deployment key is refused as the deployment's key (a Secret's value pasted back)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", ring.worker_text())
    with pytest.raises(AirflowFailException, match="is a worker key"):
        signing_keyring()


@pytest.mark.parametrize("value", ["", "only-a-name", ":key", "name:"])
def test_the_pods_signing_secret_must_be_named(monkeypatch, value):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", value)
    with pytest.raises(AirflowFailException, match="kubernetes_signing_secret"):
        kubernetes_signing_secret()


def test_the_pods_signing_secret_is_name_and_key(monkeypatch):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", "vllm-signing:key")
    assert kubernetes_signing_secret() == ("vllm-signing", "key")


@pytest.mark.reliability
def test_a_job_cannot_point_its_cache_at_another_teams(monkeypatch, tmp_path):
    """Where caches live is the deployment's choice: none configured, nowhere; else only under its prefixes
    (a job of team b naming team a's cache, inside the allow-list, is refused)."""
    spec = make_spec(tmp_path / "in", tmp_path / "out", cache={"uri": str(tmp_path / "team-a" / "cache")})
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", raising=False)
    assert cache_prefixes() == []
    with pytest.raises(AirflowFailException, match=r"cache_uri_prefixes .*is empty"):
        check_spec_allowed(spec, "plan")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", str(tmp_path / "team-b"))
    with pytest.raises(AirflowFailException, match="outside the deployment's cache locations"):
        check_spec_allowed(spec, "plan")
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", f"{tmp_path / 'team-b'},{tmp_path / 'team-a'}")
    check_spec_allowed(spec, "plan")
    no_cache = make_spec(tmp_path / "in", tmp_path / "out")
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES")
    check_spec_allowed(no_cache, "plan")  # a job without a cache needs no cache location


@pytest.mark.reliability
def test_allow_list_is_deployment_config_only(monkeypatch, tmp_path, fail_closed):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.utils.deployment import allowed_prefixes

    monkeypatch.setenv("AIRFLOW_VAR_VLLM_BATCH_ALLOWED_PREFIXES", '["/"]')  # a Variable is not the deployment
    assert allowed_prefixes() == []
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", f"s3://from-config/, {tmp_path}")
    assert allowed_prefixes() == ["s3://from-config", str(tmp_path)]
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", "s3://ok/,ftp://bad/")
    with pytest.raises(AirflowFailException, match="malformed"):
        allowed_prefixes()


@pytest.mark.reliability
def test_no_allow_list_refuses_every_task_naming_the_setting(allowed, tmp_path, monkeypatch, fail_closed):
    """The default deployment (nothing configured): plan, shard, merge, QA and publish refuse; nothing is touched."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.operators import (
        VllmLocalShardOperator,
        VllmMergeOperator,
        VllmPlanOperator,
        VllmPublishOperator,
        VllmQAOperator,
    )

    launched = tmp_path / "launched"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {launched}\n")
    python.chmod(0o755)
    doc = base_doc(allowed)
    shard = {"shard_id": "shard-00000-0123abcd", "index": 0, "rows": 3, "est_tokens": 30, "bucket": "all", **PLAN_REF}
    ops = [
        VllmPlanOperator(task_id="plan", spec=doc),
        VllmLocalShardOperator(task_id="shard", spec=doc, shard=shard, python=str(python)),
        VllmMergeOperator(task_id="merge", spec=doc),
        VllmQAOperator(task_id="qa", spec=doc),
        VllmPublishOperator(task_id="publish", spec=doc),
    ]
    for op in ops:
        ti = _ti()
        with pytest.raises(AirflowFailException) as e:
            op.execute({"ti": ti, "params": {}})
        msg = str(e.value)
        assert "[vllm_batch] allowed_uri_prefixes" in msg and "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES" in msg, msg
        assert "allow_any_location" in msg and ti.xcoms == {}
    assert not launched.exists() and not (allowed / "out").exists()
    record_malicious("no_allow_list_every_task", len(ops), len(ops))
    # a Variable cannot open it (only the deployment config can) ...
    monkeypatch.setenv("AIRFLOW_VAR_VLLM_BATCH_ALLOWED_PREFIXES", json.dumps(["/"]))
    with pytest.raises(AirflowFailException, match="allowed_uri_prefixes"):
        VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _ti(), "params": {}})
    # ... an explicit allow_any_location = True does; so does an allow-list
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION", "True")
    assert VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _ti(), "params": {}})
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION", "sure")  # a typo is not a yes
    with pytest.raises(AirflowFailException, match="not a boolean"):
        VllmPlanOperator(task_id="plan", spec=doc).execute({"ti": _ti(), "params": {}})


def test_the_compile_cache_claim_is_off_unless_named_and_warm_starts_follow_it(monkeypatch):
    from airflow_provider_vllm.utils.deployment import compile_cache_pvc, warm_starts

    spec = make_spec("/in", "/out")
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", raising=False)
    assert compile_cache_pvc() is None
    assert (warm_starts(spec, "local"), warm_starts(spec, "kubernetes")) == (None, False)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", " vllm-compile-cache ")
    assert compile_cache_pvc() == "vllm-compile-cache"
    assert (warm_starts(spec, "local"), warm_starts(spec, "kubernetes")) == (None, True)
    remote = make_spec("/in", "/out", model={"trust_remote_code": True})
    assert warm_starts(remote, "kubernetes") is False  # read-only pods never publish: each one compiles
    for bad in ("hostpath:/var/lib", "/data", "UPPER", "-x", "x" * 254):
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_COMPILE_CACHE_PVC", bad)
        with pytest.raises(AirflowFailException, match="not a PersistentVolumeClaim name"):
            compile_cache_pvc()


@pytest.fixture
def no_runner_settings(monkeypatch):
    """A deployment that set neither ``allowed_runners`` nor any Kubernetes runner option (a laptop, CI)."""
    for option in ("allowed_runners", *KUBERNETES_RUNNER_OPTIONS):
        monkeypatch.delenv(f"AIRFLOW__VLLM_BATCH__{option.upper()}", raising=False)


@pytest.mark.parametrize("option", KUBERNETES_RUNNER_OPTIONS)
def test_unset_allowed_runners_allow_only_the_runner_the_deployment_configured(monkeypatch, no_runner_settings, option):
    """Fail closed: a deployment with a Kubernetes runner option lets a run choose only pods (the local runner would
    run vLLM on the Airflow worker, with its identity); one without lets it choose only local (a laptop, CI)."""
    assert allowed_runners()[0] == ["local"]
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", " , \n")  # only blanks: unset
    assert allowed_runners()[0] == ["local"]
    monkeypatch.setenv(f"AIRFLOW__VLLM_BATCH__{option.upper()}", "x")
    runners, why = allowed_runners()
    assert runners == ["kubernetes"] and "allowed_runners" in why and option in why


@pytest.mark.parametrize(
    ("value", "runners"),
    [
        ("kubernetes", ["kubernetes"]),
        (" Kubernetes ,, LOCAL ,", ["kubernetes", "local"]),  # trimmed, lower-cased, blanks dropped
        ("local\nlocal", ["local"]),
        ('["local", "kubernetes"]', ["local", "kubernetes"]),
    ],
)
def test_allowed_runners_read_a_list(monkeypatch, no_runner_settings, value, runners):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", "s:k")  # the list wins over the default
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", value)
    assert allowed_runners() == (runners, "[vllm_batch] allowed_runners (AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS)")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("local,k8s", r"names \['k8s'\], not runners"),
        ("docker", r"names \['docker'\], not runners"),
        ("local kubernetes", r"names \['local kubernetes'\], not runners"),  # spaces do not separate
        ('["local", 1]', "must be a list of strings"),
        ('["local"', "is not a JSON list"),
    ],
)
def test_a_malformed_allowed_runners_fails_naming_the_option(monkeypatch, no_runner_settings, value, message):
    """A typo in a setting that widens what a trigger may do is an error, not ignored."""
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", value)
    with pytest.raises(AirflowFailException, match=message) as e:
        allowed_runners()
    assert "allowed_runners" in str(e.value)
    with pytest.raises(AirflowFailException, match=message):  # a run-time choice is refused, even an allowed one
        check_runner_choice("{{ params.runner }}", "local", "plan")


@pytest.mark.reliability
def test_a_run_time_runner_outside_the_allowed_ones_is_refused_a_literal_never(monkeypatch, no_runner_settings):
    from jinja2 import Environment

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__KUBERNETES_SIGNING_SECRET", "s:k")
    with pytest.raises(AirflowFailException) as e:
        check_runner_choice("{{ params.runner }}", "local", "plan", Environment())
    msg = str(e.value)
    assert msg.startswith("plan: runner='local' (from '{{ params.runner }}': trigger params)"), msg
    assert "allowed: ['kubernetes']" in msg and "AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS" in msg, msg
    with pytest.raises(AirflowFailException, match="runner='local' .*Variables"):
        check_runner_choice("{{ var.value.get('vllm_batch_runner', 'local') }}", "local", "plan", Environment())
    check_runner_choice("{{ params.runner }}", "kubernetes", "plan")
    check_runner_choice(" local ", "local", "plan")  # the DAG file's literal: the DAG author's choice
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_RUNNERS", "kubernetes,local")
    check_runner_choice("{{ params.runner }}", "local", "plan")


def test_a_triggered_run_cannot_claim_a_prefix_only_scheduled_runs_write(monkeypatch, tmp_path):
    """[vllm_batch] scheduled_output_prefixes: a run a person or a program triggered (manual, operator_triggered,
    or of unknown type) may not write under one, nor above one (its _plan.json would put the scheduled dates
    inside its run); runs the scheduler makes may. Unset: no restriction."""
    from types import SimpleNamespace

    from airflow.utils.types import DagRunType

    nightly = tmp_path / "lake" / "reclassification"
    tomorrow = str(nightly / "dt=2099-01-01")
    check_run_may_write(tomorrow, DagRunType.MANUAL, "plan")  # unset: anything goes
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SCHEDULED_OUTPUT_PREFIXES", f"s3://lake/nightly/, {nightly}")
    claims = [
        (tomorrow, DagRunType.MANUAL, "under"),
        (tomorrow, DagRunType.OPERATOR_TRIGGERED, "under"),
        (tomorrow, None, "under"),  # no dag_run in the context: fails closed
        (tomorrow, SimpleNamespace(value="something_new"), "under"),
        (str(tmp_path / "lake"), DagRunType.MANUAL, "above"),
        ("s3://lake/nightly/dt=2099-01-01/", "manual", "under"),
        ("s3://lake/nightly/../elsewhere", "manual", "io.output_uri"),
    ]
    for uri, kind, why in claims:
        with pytest.raises(AirflowFailException, match=f"plan: .*{why}"):
            check_run_may_write(uri, kind, "plan")
    for kind in (DagRunType.SCHEDULED, DagRunType.BACKFILL_JOB, DagRunType.ASSET_TRIGGERED, "scheduled"):
        check_run_may_write(tomorrow, kind, "plan")
    for elsewhere in (
        str(tmp_path / "lake" / "reruns" / "r1"),
        str(tmp_path / "lake" / "reclassification2"),
        "s3://lake/nightly2/x",
    ):
        check_run_may_write(elsewhere, DagRunType.MANUAL, "plan")  # by whole path segments
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SCHEDULED_OUTPUT_PREFIXES", "s3://ok/,ftp://bad/")
    with pytest.raises(AirflowFailException, match="scheduled_output_prefixes .* is malformed"):
        check_run_may_write(tomorrow, DagRunType.SCHEDULED, "plan")
    record_malicious("triggered run claiming a scheduled prefix", len(claims), len(claims))


def test_a_second_store_name_does_not_dodge_a_scheduled_prefix(monkeypatch):
    """A scheduled prefix ``s3://lake/nightly`` and a triggered run writing ``s3a://lake/nightly/dt=2099-01-01``
    (``gcs://`` for ``gs://``): one location to fsspec, two to a comparison of canonical forms, so the claim passed
    on a deployment whose allow-list lists both names (or allows any location). Either name of either side fails."""
    from airflow.utils.types import DagRunType

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SCHEDULED_OUTPUT_PREFIXES", "s3://lake/nightly/, gcs://lake/nightly")
    claims = [
        ("s3a://lake/nightly/dt=2099-01-01/", "under"),
        ("S3A://lake/nightly/dt=2099-01-01", "under"),
        ("gs://lake/nightly/dt=2099-01-01/", "under"),
        ("s3a://lake", "above"),
        ("gs://lake/", "above"),
    ]
    for uri, where in claims:
        with pytest.raises(AirflowFailException, match=f"plan: io.output_uri={re.escape(uri)} lies {where}"):
            check_run_may_write(uri, DagRunType.MANUAL, "plan")
    for elsewhere in ("s3a://lake/nightly2/x", "gcs://lake/reruns/x", "gs://other/nightly/x"):
        check_run_may_write(elsewhere, DagRunType.MANUAL, "plan")
    check_run_may_write("s3a://lake/nightly/dt=2099-01-01/", DagRunType.SCHEDULED, "plan")
    record_malicious("store alias dodging a scheduled prefix", len(claims), len(claims))


def test_a_triggered_run_may_name_its_output_by_dates_only_of_a_day_that_has_ended():
    """``check_run_dates``: a run Airflow did not schedule, whose output its dates name, needs every date it carries
    to lie before the current UTC day; it takes run_after (the trigger's moment by default) only when there is no
    logical date, and fails with none at all. Scheduled runs and outputs no date names pass whatever the dates."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from airflow_provider_vllm.utils.deployment import check_run_dates

    now = datetime(2026, 12, 6, 15, 0, tzinfo=UTC)
    midnight = datetime(2026, 12, 6, tzinfo=UTC)

    def run(run_type="manual", logical=None, start=None, end=None, partition=None, run_after=now):
        return SimpleNamespace(
            run_type=run_type,
            logical_date=logical,
            data_interval_start=start,
            data_interval_end=end,
            partition_date=partition,
            run_after=run_after,
        )

    last_second = midnight - timedelta(microseconds=1)
    ok = [
        run(logical=last_second, start=last_second - timedelta(days=1), end=last_second),
        run(logical=datetime(2026, 11, 15), run_after=now + timedelta(days=9)),  # naive: UTC; run_after not read
        run("scheduled", logical=now + timedelta(days=1)),
        run("backfill", logical=now),
    ]
    for dag_run in ok:
        check_run_dates({"ds"}, dag_run, "plan", now=now)
    check_run_dates(set(), run(logical=now + timedelta(days=400)), "plan", now=now)  # no date names the output
    refused = [
        (run(logical=midnight), "logical_date 2026-12-06T00:00:00"),
        (run(logical=last_second, end=midnight + timedelta(hours=2)), "data_interval_end 2026-12-06T02:00:00"),
        (run(logical=last_second, partition=now + timedelta(days=1)), "partition_date 2026-12-07"),
        (run(run_after=now), "run_after 2026-12-06T15:00:00"),  # no logical date: run_after stands in
        (run(run_after=None), "no date"),
        (None, "of unknown type"),
        (SimpleNamespace(run_type=SimpleNamespace(value="something_new"), logical_date=now), "something_new"),
    ]
    for dag_run, why in refused:
        with pytest.raises(
            AirflowFailException, match=rf"plan: the output of this run is named by its dates \(ds\).*{why}"
        ):
            check_run_dates({"ds"}, dag_run, "plan", now=now)
    with pytest.raises(AirflowFailException, match=r"named by its dates \(partition_key\).*partition_key 'x'"):
        keyed = SimpleNamespace(**vars(run(logical=last_second)), partition_key="x")  # a key no date stands for
        check_run_dates({"partition_key"}, keyed, "plan", now=now)
    record_malicious("triggered run naming a dated output of a day not over", len(refused) + 1, len(refused) + 1)


def _dag_run(logical, now, run_type="manual", **more):
    """A DagRun as check_run_dates reads it: ``logical`` as its logical date and both ends of its interval."""
    from types import SimpleNamespace

    fields = {"logical_date": logical, "data_interval_start": logical, "data_interval_end": logical}
    return SimpleNamespace(run_type=run_type, **fields, partition_date=None, run_after=now, **more)


def test_an_asset_materialization_run_is_a_trigger_not_a_schedule(monkeypatch):
    """``POST /assets/{id}/materialize`` (the UI's Materialize button, ``airflow assets materialize``) makes a run of
    the DAG that produces the asset, with the REST body's ``logical_date``, data interval, partition key, run id and
    conf, as a manual trigger does: run_type ``asset_materialization``. Counted among the runs the scheduler makes,
    it wrote tomorrow's ``dt=`` folder and a scheduled prefix. It is a triggered run: both rules refuse it."""
    from datetime import UTC, datetime, timedelta

    from airflow.utils.types import DagRunType

    from airflow_provider_vllm.utils.deployment import check_run_dates

    now = datetime(2026, 12, 6, 15, 0, tzinfo=UTC)
    tomorrow = now + timedelta(days=1)
    materialized = _dag_run(tomorrow, now, DagRunType.ASSET_MATERIALIZATION)
    with pytest.raises(AirflowFailException, match=r"named by its dates \(ds\).* asset_materialization, not one"):
        check_run_dates({"ds"}, materialized, "plan", now=now)
    past = _dag_run(now - timedelta(days=2), now, DagRunType.ASSET_MATERIALIZATION)
    check_run_dates({"ds"}, past, "plan", now=now)  # a day that has ended: as a manual run of it
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SCHEDULED_OUTPUT_PREFIXES", "s3://lake/nightly/")
    with pytest.raises(AirflowFailException, match=r"lies under s3://lake/nightly.* asset_materialization"):
        check_run_may_write("s3://lake/nightly/dt=2026-12-07/", DagRunType.ASSET_MATERIALIZATION, "plan")
    record_malicious("asset materialization run passing as a scheduled one", 2, 2)


def test_a_partition_key_read_through_the_run_needs_a_date_too():
    """An output ``{{ dag_run.partition_key }}`` reads the key as ``{{ partition_key }}`` does: a manual run with a
    key no date stands for (a timetable that picks partitions at run time) and a past logical date passed, writing
    whatever folder the key names. A key without a partition date fails whichever name the template reads it by."""
    from datetime import UTC, datetime, timedelta

    from airflow_provider_vllm.utils.deployment import check_run_dates

    now = datetime(2026, 12, 6, 15, 0, tzinfo=UTC)
    past = now - timedelta(days=3)
    keyed = _dag_run(past, now, partition_key="2026-12-09")
    for reads in ({"dag_run"}, {"ti"}, {"the trigger (a template that could not be parsed)"}):
        with pytest.raises(AirflowFailException, match=r"partition_key '2026-12-09'"):
            check_run_dates(reads, keyed, "plan", now=now)
    check_run_dates({"dag_run"}, _dag_run(past, now, partition_key=None), "plan", now=now)
    check_run_dates({"ds"}, keyed, "plan", now=now)  # the key names nothing here
    record_malicious("a partition key read through dag_run", 3, 3)


def test_a_run_date_a_template_may_put_in_another_time_zone_needs_a_day_behind_it():
    """``ds`` is the logical date's UTC day, but a template that reads the date itself can name the day of another
    zone (``{{ data_interval_start.in_timezone('Asia/Tokyo') | ds }}``, a team's local folders). A manual run of
    yesterday (UTC) 20:00 passed the UTC rule and wrote Tokyo's today, 10 hours into it. Dates read as datetimes
    (the logical date, data interval, partition date, the run or task instance, a template not analysed) need 24
    hours behind them: then their day has ended in every zone. ``ds``-style strings keep the UTC rule."""
    from datetime import UTC, datetime, timedelta

    from airflow_provider_vllm.utils.deployment import check_run_dates

    now = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)

    def run(logical, **more):
        return _dag_run(logical, now, **more)

    evening = run(datetime(2026, 12, 5, 20, 0, tzinfo=UTC))  # Tokyo: 2026-12-06 05:00, a day not over there
    as_objects = [{"data_interval_start"}, {"logical_date"}, {"dag_run"}, {"ti"}, {"partition_date", "ds"}]
    # a partition key names a period of the timetable's zone: its date (New York's 2026-12-05 starts 05:00 UTC)
    keyed = run(now - timedelta(days=3), partition_key="2026-12-05")
    keyed.partition_date = datetime(2026, 12, 5, 5, 0, tzinfo=UTC)
    with pytest.raises(AirflowFailException, match=r"partition_date 2026-12-05T05:00:00\+00:00.*24 hours"):
        check_run_dates({"partition_key"}, keyed, "plan", now=datetime(2026, 12, 6, 3, 0, tzinfo=UTC))
    for reads in as_objects:
        with pytest.raises(AirflowFailException, match=r"logical_date 2026-12-05T20:00:00\+00:00.*24 hours"):
            check_run_dates(reads, evening, "plan", now=now)
    for reads in ({"ds"}, {"ds_nodash", "ts"}, {"io.output_table.date_column=dt"}):
        check_run_dates(reads, evening, "plan", now=now)  # strings of the UTC day, which has ended
    check_run_dates({"logical_date"}, run(now - timedelta(days=1)), "plan", now=now)
    record_malicious("a run date shifted into a time zone whose day is not over", len(as_objects), len(as_objects))
