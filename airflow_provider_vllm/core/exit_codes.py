"""The worker's exit codes and what each means to the task that ran it: one table for both runners.

The worker (``python -m airflow_provider_vllm.worker``) ends with an ``ExitCode``; the local
runner (``operators/shard.py``) and the Kubernetes runner (``operators/kubernetes.py``) turn
the code into the task's outcome through ``outcome`` and ``failure_text`` (the Airflow
exception type is chosen in ``utils/worker_outcome.worker_failure``, the one place that knows
Airflow). Decision record: ``docs/adr/0003-exit-codes.md``.

=========  ====  ==============================================================================
ExitCode   code  Outcome
=========  ====  ==============================================================================
OK         0     SUCCESS: the shard is committed (by this attempt or an earlier one)
TERMINAL   2     FAIL: retrying cannot help (bad spec, bad dataset, changed input, refused
                 location); ``AirflowFailException``, no retry
TRANSIENT  75    RETRY (``EX_TEMPFAIL``): preemption, engine death or hang, storage retries
                 exhausted; Airflow retries and the retry resumes from committed chunks
other      any   RETRY: a crash, a signal (negative code), a pod that ended before the worker
=========  ====  ==============================================================================
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class ExitCode(IntEnum):
    """How the worker process ends."""

    OK = 0
    TERMINAL = 2
    TRANSIENT = 75


class Outcome(StrEnum):
    """What a worker's end means to its Airflow task."""

    SUCCESS = "success"  # return the manifest as the XCom value
    FAIL = "fail"  # fail the task without retry
    RETRY = "retry"  # fail the task; Airflow retries it


OUTCOMES: dict[ExitCode, Outcome] = {
    ExitCode.OK: Outcome.SUCCESS,
    ExitCode.TERMINAL: Outcome.FAIL,
    ExitCode.TRANSIENT: Outcome.RETRY,
}
"""The outcome of each exit code; any code not listed (a crash, a signal) is ``Outcome.RETRY``."""


def outcome(code: int | None) -> Outcome:
    """The task outcome of a worker exit code; None (no code: the pod ended first) -> RETRY."""
    if code is None:
        return Outcome.RETRY
    try:
        return OUTCOMES[ExitCode(code)]
    except ValueError:
        return Outcome.RETRY


def failure_text(code: int | None, shard_id: str, detail: str) -> str:
    """The failed task's message for exit ``code``; ``detail`` is the failure manifest's error and message."""
    if code == ExitCode.TERMINAL:
        return f"shard {shard_id}: terminal worker error (exit 2, not retried): {detail}"
    if code == ExitCode.TRANSIENT:
        return f"shard {shard_id}: transient worker failure (exit 75, retried): {detail}"
    if code is None:
        return f"shard {shard_id}: pod failed before the worker exited (retried)"
    if code < 0:
        return f"shard {shard_id}: worker killed by signal {-code} (retried)"
    return f"shard {shard_id}: worker exited {code} (retried): {detail}"
