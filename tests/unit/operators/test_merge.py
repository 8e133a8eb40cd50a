"""The merge task: ``execute()`` over committed shards (the worker ran in this process with the fake engine),
a minimal context, no Airflow process and no metadata DB. The merge itself: tests/unit/steps/merge/."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_vllm.core.errors import TransientError
from airflow_provider_vllm.core.records import WorkerManifest
from airflow_provider_vllm.operators import merge as merge_operator
from airflow_provider_vllm.operators.merge import VllmMergeOperator
from tests.support.data import plan_xcom, shard_task
from tests.support.task_context import committed_job, context


def test_construction_reads_nothing_and_templates_only_the_spec(tmp_path):
    op = VllmMergeOperator(task_id="merge", spec={"io": {"output_uri": str(tmp_path / "nowhere")}}, memory_limit="2GB")
    assert tuple(op.template_fields) == ("spec", "shard_results", "plan") and op.memory_limit == "2GB"
    assert not (tmp_path / "nowhere").exists()


def test_execute_returns_the_summary_without_per_shard_stats(tmp_path, fake_engine_factory):
    spec, plan = committed_job(tmp_path, fake_engine_factory, n=60, empty=(5,))
    op = VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec))
    result = op.execute(context())
    assert (result["rows"], result["ok_rows"], result["error_rows"], result["shards"]) == (60, 59, 1, 3)
    assert "shard_stats" not in result  # the XCom stays small; _MERGED.json keeps them
    merged = json.loads((tmp_path / "out" / "_MERGED.json").read_text())
    assert len(merged["shard_stats"]) == len(plan.shards) == 3 and merged["checksums"] == result["checksums"]
    assert op._lineage is not None  # recorded for get_openlineage_facets_on_complete


def test_a_shard_that_is_not_committed_fails_the_task_without_retry(tmp_path, fake_engine_factory):
    spec, plan = committed_job(tmp_path, fake_engine_factory, n=60, run=[0, 2])
    with pytest.raises(AirflowFailException, match=plan.shards[1].shard_id):
        VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    assert not (tmp_path / "out" / "_MERGED.json").exists()


def test_a_transient_storage_failure_is_retried_not_failed(tmp_path, fake_engine_factory, monkeypatch):
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=20)

    def throttled(*a, **kw):
        raise TransientError("SlowDown from the store")

    monkeypatch.setattr(merge_operator, "merge", throttled)
    with pytest.raises(AirflowException, match="transient, retried") as e:
        VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    assert not isinstance(e.value, AirflowFailException)


def test_merge_runs_only_under_the_plan_the_plan_task_named(tmp_path, fake_engine_factory):
    """An earlier genuine sealed plan of the output prefix put back at ``_plan.json`` (the folder emptied and planned
    again): the merge task takes only the plan the plan task's value names, and fails without retry naming it."""
    import shutil

    out = tmp_path / "out"
    committed_job(tmp_path, fake_engine_factory, n=40, run=[])  # an earlier plan of this output prefix
    earlier = (out / "_plan.json").read_bytes()
    shutil.rmtree(out)
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=60)
    named = plan_xcom(spec)  # what the plan task pushed under the key "plan"
    now = (out / "_plan.json").read_bytes()
    (out / "_plan.json").write_bytes(earlier)
    with pytest.raises(
        AirflowFailException, match=r"merge: CommitError: \S+/_plan.json is not the plan this run's plan"
    ):
        VllmMergeOperator(task_id="merge", spec=spec, plan=named).execute(context())
    assert not (out / "_MERGED.json").exists() and not (out / "results").exists()
    (out / "_plan.json").write_bytes(now)
    assert VllmMergeOperator(task_id="merge", spec=spec, plan=named).execute(context())["rows"] == 60


def test_a_plan_put_back_after_the_merge_wrote_does_not_fail_the_merge_task(tmp_path, fake_engine_factory, monkeypatch):
    """The lineage's plan (a job with passthrough columns) is the plan merge ran under, read before the merge writes:
    an earlier sealed plan of the folder put back at ``_plan.json`` right after the merge sealed ``_MERGED.json`` does
    not fail the task after the fact with "not merging" (QA, which follows the sealed merge, then refuses it)."""
    import shutil

    out = tmp_path / "out"
    over = {"io": {"passthrough": ["text"]}}
    committed_job(tmp_path, fake_engine_factory, n=40, run=[], **over)  # an earlier plan of this output prefix
    earlier = (out / "_plan.json").read_bytes()
    shutil.rmtree(out)
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=60, **over)
    named = plan_xcom(spec)
    real = merge_operator.merge

    def merge_then_put_back(*args, **kwargs):
        summary = real(*args, **kwargs)
        (out / "_plan.json").write_bytes(earlier)
        return summary

    monkeypatch.setattr(merge_operator, "merge", merge_then_put_back)
    op = VllmMergeOperator(task_id="merge", spec=spec, plan=named)
    assert op.execute(context())["rows"] == 60 and (out / "_MERGED.json").exists()
    assert ("text", "string") in op._lineage.outputs[0].fields  # the passthrough column, from the merge's plan


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "merge: no plan identity given"),
        ({"plan_mac": "a" * 64}, "merge: plan .*: not a plan identity: plan_sha256: Field required"),
        ("a" * 64, "merge: plan .*: not a plan identity"),
        # the plan task's return value (its shards) where its value under the key "plan" belongs: the message says so
        (
            [{"shard_id": "shard-00000-b96aaac1"}],
            r"not a plan identity: the value: .*plan_task.output\['plan'\].*not its return value \(the shards\)",
        ),
    ],
)
def test_a_merge_task_given_no_plan_identity_fails_without_retry(tmp_path, fake_engine_factory, value, message):
    """Fail closed: without the plan task's value (a merge task built without it, or a value that names no plan)
    merge refuses to run rather than take whatever sealed plan the folder holds."""
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=20)
    with pytest.raises(AirflowFailException, match=message):
        VllmMergeOperator(task_id="merge", spec=spec, plan=value).execute(context())
    assert not (tmp_path / "out" / "_MERGED.json").exists()


def test_a_run_planned_before_merge_took_the_plan_fails_without_retry(tmp_path, fake_engine_factory):
    """A run whose plan task (an earlier version) pushed no value under the key ``plan``: Airflow's ``XComNotFound``
    while rendering would fail the merge task and retry it, to no avail; the task fails without retry, naming the
    key and what to do, before it reads or writes anything. Another missing value (the spec) is Airflow's as before."""
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import XComNotFound

    from airflow_provider_vllm.operators.plan import VllmPlanOperator
    from tests.support.task_context import FakeTI

    spec, _ = committed_job(tmp_path, fake_engine_factory, n=20)
    with DAG("d", schedule=None):
        plan = VllmPlanOperator(task_id="plan", spec=spec)
        op = VllmMergeOperator(task_id="merge", spec=plan.output["spec"], plan=plan.output["plan"])

    class PlannedBefore(FakeTI):
        pushed = {"spec": spec}  # what the plan task of an earlier version pushed: no "plan"

        def xcom_pull(self, task_ids=None, key="return_value", default=None, map_indexes=None, **_):
            return self.pushed.get(key, default)

    ctx = context()
    ctx["ti"] = PlannedBefore()
    op.render_template_fields(ctx)
    with pytest.raises(
        AirflowFailException, match=r"merge: the plan task \(plan\) pushed no value under XCom key 'plan'"
    ):
        op.execute(ctx)
    assert not (tmp_path / "out" / "_MERGED.json").exists()
    PlannedBefore.pushed = {}
    with DAG("d2", schedule=None):
        plan = VllmPlanOperator(task_id="plan", spec=spec)
        op = VllmMergeOperator(task_id="merge", spec=plan.output["spec"], plan=plan.output["plan"])
    with pytest.raises(XComNotFound, match='key="spec"'):
        op.render_template_fields(ctx)


def test_a_spec_that_is_not_a_job_spec_fails_without_retry():
    with pytest.raises(AirflowFailException, match="merge: invalid job spec"):
        VllmMergeOperator(task_id="merge", spec={"model": {"name": "m"}}).execute(context())


def test_merge_takes_only_the_attempts_the_shard_tasks_reported(tmp_path, fake_engine_factory):
    """A shard's marker deleted and the shard rerun leaves two genuine commit markers: the earlier one, kept and
    put back, passed every check. The shard tasks' XComs (the worker manifests) name the attempt each committed."""
    import shutil

    from airflow_provider_vllm.core.commit import MARKER
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.worker.shard import run_shard

    spec, plan = committed_job(tmp_path, fake_engine_factory, n=60)
    out = tmp_path / "out"
    marker = out / "shards" / plan.shards[0].shard_id / MARKER
    shutil.copy2(marker, tmp_path / "earlier.json")
    marker.unlink()  # the shard run again: another genuine attempt
    run_shard(shard_task(spec=JobSpec.load(spec), shard_id=plan.shards[0].shard_id), engine_factory=fake_engine_factory)
    reported = [  # what each shard task pushed: its worker's manifest
        {
            "status": "committed",
            **{k: json.loads(m.read_text())[k] for k in WorkerManifest.model_fields if k != "status"},
        }
        for m in sorted(out.glob(f"shards/*/{MARKER}"))
    ]
    assert json.loads((tmp_path / "earlier.json").read_text())["attempt_id"] not in {r["attempt_id"] for r in reported}
    by_runner = [reported, []]  # the local runner's mapped task and the skipped Kubernetes one

    def merge_with(results):
        op = VllmMergeOperator(
            task_id="merge", spec=spec, plan=plan_xcom(spec), shard_results=results, require_shard_results=True
        )
        return op.execute(context())

    shutil.copy2(marker, tmp_path / "now.json")
    shutil.copy2(tmp_path / "earlier.json", marker)  # the earlier genuine marker put back
    with pytest.raises(AirflowFailException, match=rf"{MARKER} is attempt \S+, not \S+, the one this run's shard"):
        merge_with(by_runner)
    shutil.copy2(tmp_path / "now.json", marker)
    with pytest.raises(AirflowFailException, match="not one a shard task of this run reported"):
        merge_with([[r for r in reported if r["shard_id"] != plan.shards[0].shard_id], None])
    with pytest.raises(AirflowFailException, match="not one a shard task of this run reported"):
        merge_with(None)  # required, and no XCom at all (a shard task marked success by hand)
    summary = merge_with(by_runner)
    assert summary["rows"] == 60 and summary["merged_mac"]


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"shard_id": "s", "attempt_id": "a"},
            r"shard result 1 .* is not a worker manifest \(1 error\(s\): \(root\): Unable",
        ),
        ("shard-00000", "shard result 1 .* is not a worker manifest"),
        (7, "shard result 1 .* is not a worker manifest"),
        ({"status": "failed", "error": "Stalled", "message": "m", "terminal": False}, "a failed worker's manifest"),
    ],
)
def test_a_shard_result_that_is_not_a_worker_manifest_fails_the_merge(tmp_path, entry, message):
    """The shard tasks' XComs are read as the records their tasks pushed: one of another shape is refused, named,
    before anything is merged (before, an entry without the two fields was skipped)."""
    good = {
        "status": "committed",
        "shard_id": "shard-00000",
        "attempt_id": "a1",
        "rows": 1,
        "ok_rows": 1,
        "error_rows": 0,
    }
    op = VllmMergeOperator(task_id="merge", spec={}, shard_results=[[good, entry]], require_shard_results=True)
    with pytest.raises(AirflowFailException, match=message):
        op._reported_attempts()


def test_two_attempts_reported_for_one_shard_fail_the_merge():
    def manifest(attempt):
        return {
            "status": "committed",
            "shard_id": "shard-00000",
            "attempt_id": attempt,
            "rows": 1,
            "ok_rows": 1,
            "error_rows": 0,
        }

    same = VllmMergeOperator(task_id="merge", spec={}, shard_results=[[manifest("a1")], [manifest("a1")]])
    assert same._reported_attempts() == {"shard-00000": "a1"}  # a commit race's loser reports the winner's
    two = VllmMergeOperator(task_id="merge", spec={}, shard_results=[[manifest("a1")], [manifest("a2")]])
    with pytest.raises(AirflowFailException, match="two attempts of shard 'shard-00000' \\(a1 and a2\\)"):
        two._reported_attempts()
