"""The DAG run a sealed record must be of: the task's own run, as its task instance names it; the operators' use of
it over real runs is in tests/unit/operators/test_review.py and test_publish.py."""

from __future__ import annotations

import re

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.records import DagRunRef
from airflow_provider_vllm.utils.run_binding import check_made_here, this_dag_run
from tests.support.task_context import context


def test_this_dag_run_is_the_task_instances():
    assert this_dag_run(context(dag_id="nightly", run_id="scheduled__1")) == DagRunRef(
        dag_id="nightly", run_id="scheduled__1"
    )


def test_a_record_of_another_run_or_of_none_is_refused_naming_both():
    here = context(dag_id="nightly", run_id="scheduled__2")
    check_made_here(DagRunRef(dag_id="nightly", run_id="scheduled__2"), here, "publish", "the verdict", "rerun")
    for other in (DagRunRef(dag_id="nightly", run_id="scheduled__1"), DagRunRef(dag_id="rerun", run_id="scheduled__2")):
        with pytest.raises(AirflowFailException) as e:
            check_made_here(other, here, "publish", "the verdict", "run QA again")
        assert other.describe() in str(e.value) and "DAG run 'nightly' / 'scheduled__2'" in str(e.value)
        assert str(e.value).startswith("publish: the verdict was made by") and str(e.value).endswith("run QA again")
    with pytest.raises(AirflowFailException, match=r"^review: the verdict names no DAG run .*; run QA again$"):
        check_made_here(None, here, "review", "the verdict", "run QA again")


def test_read_sealed_names_a_missing_forged_or_foreign_record_and_what_to_run_again(tmp_path):
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.qa.store import REVIEW_RECORD, read_review
    from airflow_provider_vllm.utils.run_binding import read_sealed

    out, keyring = Storage(str(tmp_path)), Keyring.from_env()
    where = out.uri(REVIEW_RECORD)

    def read():
        return read_sealed("publish", lambda: read_review(out, keyring), "review decision", where, "why", "clear it")

    with pytest.raises(AirflowFailException, match=r"^publish: no sealed review decision \S+ \(why\); clear it$"):
        read()
    (tmp_path / "qa").mkdir()
    (tmp_path / REVIEW_RECORD).write_text('{"approved": true}')
    with pytest.raises(AirflowFailException, match=r"(?s)is not a review decision record: .*dag_run"):
        read()
    unsealed = (
        '{"dag_run": {"dag_id": "d", "run_id": "r1"}, "qa_record_mac": "' + "a" * 64 + '", "qa_status": "pass", '
        '"asked": false, "approved": true, "decided_at": "2026-12-06T12:00:00Z"}'
    )
    (tmp_path / REVIEW_RECORD).write_text(unsealed)
    with pytest.raises(AirflowFailException, match=r"carries no seal.*; clear it$"):
        read()


def test_the_job_is_the_operators_task_group_and_map_index():
    """Two jobs of one DAG run (two groups, or one group mapped): a record of the other is refused naming both."""
    from airflow.sdk import DAG, BaseOperator, TaskGroup

    from airflow_provider_vllm.core.records import TaskGroupRef
    from airflow_provider_vllm.utils.run_binding import check_same_job, this_task_group

    with DAG("d", schedule=None):
        top = BaseOperator(task_id="publish")
        with TaskGroup("outer"), TaskGroup("job"):
            inner = BaseOperator(task_id="publish")
    assert this_task_group(top, context()) == TaskGroupRef(group_id=None, map_index=-1)
    mine = this_task_group(inner, context(map_index=2))
    assert mine == TaskGroupRef(group_id="outer.job", map_index=2)
    check_same_job(mine, inner, context(map_index=2), "publish", "the verdict", "rerun")
    for other, shown in (
        (TaskGroupRef(group_id="outer.other", map_index=2), "task group 'outer.other' (map index 2)"),
        (TaskGroupRef(group_id="outer.job", map_index=1), "task group 'outer.job' (map index 1)"),
        (TaskGroupRef(group_id=None, map_index=-1), "the top level"),
    ):
        with pytest.raises(AirflowFailException, match=rf"made by the job in {re.escape(shown)}, not by this one"):
            check_same_job(other, inner, context(map_index=2), "publish", "the verdict", "run QA again")
    with pytest.raises(AirflowFailException, match=r"^publish: the verdict names no task group .*; run QA again$"):
        check_same_job(None, inner, context(map_index=2), "publish", "the verdict", "run QA again")
