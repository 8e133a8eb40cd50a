"""The run's sealed records as the review and publish tasks read them: sealed for the run's folder (``read_sealed``)
and made in the task's own DAG run (QA's verdict and the review's decision name the run that made them).

A seal's scope is the run's folder, so a genuine verdict of another run of this deployment verifies where it lies.
Whoever can write the plan task's ``spec`` XCom and the QA task's can point review and publish at such a folder (an
older run a person rejected, answers of another model). Review and publish therefore take only a record made in
their own DAG run: ``this_dag_run`` is the task's ``dag_id`` / ``run_id`` as Airflow gives them to the task (never
an XCom), ``check_made_here`` compares a record's ``dag_run`` with it.

One DAG run may hold several jobs (two ``vllm_batch_job`` groups, or one group mapped over jobs), each with its own
folder and its own review settings: pointed through XCom at another job's folder of the same run, a review whose
'warn' needs nobody's answer would seal an approval there. The records also name the task group and map index of the
task that made them (``this_task_group``: the operator's own group in the parsed DAG file and the task instance's
map index, never an XCom), and ``check_same_job`` takes only the records of the task's own job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.records import DagRunRef, TaskGroupRef

R = TypeVar("R")


def this_dag_run(context: Mapping[str, Any]) -> DagRunRef:
    """The DAG run of the task ``context`` is of (its task instance's ``dag_id`` and ``run_id``)."""
    ti = context["ti"]
    return DagRunRef(dag_id=ti.dag_id, run_id=ti.run_id)


def this_task_group(task: Any, context: Mapping[str, Any]) -> TaskGroupRef:
    """The task group of the operator ``task`` (as the DAG file builds it; None at the DAG's top level) and the map
    index of its task instance in ``context``."""
    group = getattr(task, "task_group", None)
    map_index = getattr(context["ti"], "map_index", -1)
    return TaskGroupRef(
        group_id=getattr(group, "group_id", None), map_index=-1 if map_index is None else int(map_index)
    )


def check_same_job(
    made: TaskGroupRef | None, task: Any, context: Mapping[str, Any], name: str, what: str, rerun: str
) -> None:
    """AirflowFailException (no retry) unless ``made`` (a sealed record's ``task_group``; None: a record of an earlier
    version, which names none) is the task group and map index of the operator ``task`` (named ``name`` in the
    message) in ``context``: another job of the same DAG run made it otherwise."""
    here = this_task_group(task, context)
    if made is None:
        raise AirflowFailException(
            f"{name}: {what} names no task group (written by an earlier version), so nothing ties it to this job "
            f"({here.describe()}); {rerun}"
        )
    if made != here:
        raise AirflowFailException(
            f"{name}: {what} was made by the job in {made.describe()}, not by this one in {here.describe()} (the "
            f"folder of another job of this DAG run, named through XCom); {rerun}"
        )


def check_made_here(made: DagRunRef | None, context: Mapping[str, Any], task: str, what: str, rerun: str) -> None:
    """AirflowFailException (no retry) unless ``made`` (a sealed record's ``dag_run``; None: a record of an earlier
    version, which names none) is the DAG run of ``context``'s task; ``what`` names the record, ``rerun`` says what
    to run again."""
    here = this_dag_run(context)
    if made is None:
        raise AirflowFailException(
            f"{task}: {what} names no DAG run (written by an earlier version), so nothing ties it to this run "
            f"({here.describe()}); {rerun}"
        )
    if made != here:
        raise AirflowFailException(
            f"{task}: {what} was made by {made.describe()}, not by this {here.describe()} (the folder of another run, "
            f"named through XCom); {rerun}"
        )


def check_this_job(record: Any, task: Any, context: Mapping[str, Any], name: str, what: str, rerun: str) -> None:
    """``check_made_here`` and ``check_same_job`` of a sealed ``record`` (one with ``dag_run`` and ``task_group``: QA's
    verdict, the review's decision) for the operator ``task`` in ``context``: made by this job in this DAG run."""
    check_made_here(record.dag_run, context, name, what, rerun)
    check_same_job(record.task_group, task, context, name, what, rerun)


def read_sealed(task: str, read: Callable[[], R], what: str, where: str, why_missing: str, rerun: str) -> R:
    """``read()`` of the sealed ``what`` (e.g. 'QA verdict') at ``where``; AirflowFailException (no retry) when it is
    missing (saying ``why_missing``, when given), not sealed by this deployment for this run's folder (SealError, a
    CommitError), or not such a record; each message says what to run again (``rerun``)."""
    try:
        return read()
    except FileNotFoundError:
        why = f" ({why_missing})" if why_missing else ""
        raise AirflowFailException(f"{task}: no sealed {what} {where}{why}; {rerun}") from None
    except CommitError as e:  # SealError included: not this deployment's record, or not for this run's folder
        raise AirflowFailException(f"{task}: {e}; {rerun}") from None
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise AirflowFailException(f"{task}: {where} is not a {what} record: {e}") from None
