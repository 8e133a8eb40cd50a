"""A finished worker -> the shard task's result or Airflow exception; shared by both runners.

The exit code decides through the one table in ``core/exit_codes.py``: success returns the
validated ``WorkerManifest``; ``FAIL`` raises ``AirflowFailException`` (no retry); ``RETRY``
(and anything unexpected) an ``AirflowException`` that Airflow retries.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from pydantic import ValidationError

from airflow_provider_vllm.core.exit_codes import Outcome, failure_text, outcome
from airflow_provider_vllm.core.records import FailureManifest, WorkerManifest, read_manifest


def parse(doc: Any) -> WorkerManifest | FailureManifest | None:
    """The worker's manifest, validated; None when absent or not a manifest (a crash, foreign output)."""
    if doc is None:
        return None
    try:
        return read_manifest(doc)
    except ValidationError:
        return None


def failure_detail(manifest: WorkerManifest | FailureManifest | None) -> str:
    """``error: message`` of a failure manifest, for the task's exception."""
    if isinstance(manifest, FailureManifest):
        return f"{manifest.error}: {manifest.message}".rstrip(": ")
    return "no manifest"


def worker_failure(code: int | None, shard_id: str, manifest: Any = None) -> AirflowException:
    """The exception for a worker that did not succeed; exit 2 -> no retry, anything else -> retried."""
    text = failure_text(code, shard_id, failure_detail(parse(manifest)))
    if outcome(code) is Outcome.FAIL:
        return AirflowFailException(text)
    return AirflowException(text)


def worker_result(code: int, shard_id: str, manifest: Any, stdout_tail: Any = None) -> WorkerManifest:
    """The shard's manifest when the worker succeeded; raises ``worker_failure`` otherwise.

    Exit 0 without a manifest of this shard is retried (the worker was replaced or its stdout lost).
    """
    if outcome(code) is not Outcome.SUCCESS:
        raise worker_failure(code, shard_id, manifest)
    m = None
    if manifest is not None:
        try:
            m = read_manifest(manifest)
        except ValidationError as e:  # e.g. a worker image of another provider version
            raise AirflowException(
                f"shard {shard_id}: worker exited 0 but its manifest is not one this provider reads "
                f"({e.error_count()} error(s): {first_error(e)}); run the worker image built from the same "
                "airflow-provider-vllm version as the Airflow side"
            ) from None
    if not isinstance(m, WorkerManifest) or m.shard_id != shard_id:
        raise AirflowException(f"shard {shard_id}: worker exited 0 without its manifest (stdout tail: {stdout_tail})")
    return m


def first_error(e: ValidationError) -> str:
    """Where and what the first of a validation's errors is, e.g. ``attempt_id: Field required``."""
    err = e.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
