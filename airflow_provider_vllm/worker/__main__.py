"""``python -m airflow_provider_vllm.worker '<shard task json>'`` (or ``@file.json``).

Exit codes: 0 done (or already committed), 2 terminal (retrying cannot help: bad spec,
changed input), 75 transient (retry: engine failure, storage error, preemption).
The last stdout line is the JSON manifest; it is also written to
``/airflow/xcom/return.json`` when that folder exists (KubernetesPodOperator XCom sidecar).
A hung engine, read or write is stopped by the progress watchdog (``spec.worker.watchdog_s``): exit 75.
SIGTERM stops it at any phase (``Preempted`` is a ``BaseException``: no ``except Exception``
swallows it): exit 75. Started by the local runner (``VLLM_BATCH_PARENT_PID``), it ends with
the task process that started it and holds a host-local lock of its shard (``lifecycle``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.errors import VllmBatchError
from airflow_provider_vllm.core.exit_codes import ExitCode
from airflow_provider_vllm.core.records import FailureManifest
from airflow_provider_vllm.worker.exits import emit as _emit
from airflow_provider_vllm.worker.exits import exit_hard
from airflow_provider_vllm.worker.imports import carry_to_spawned, skip_unused_imports
from airflow_provider_vllm.worker.lifecycle import bind_to_parent, hold_shard_lock
from airflow_provider_vllm.worker.redact import guard_streams
from airflow_provider_vllm.worker.redact import install as install_redaction

if TYPE_CHECKING:
    from airflow_provider_vllm.core.seal import Keyring


class Preempted(BaseException):
    """SIGTERM received (node drain, spot preemption, task killed, the task process died).

    A ``BaseException`` like ``KeyboardInterrupt``: the ``except Exception`` blocks that keep a
    shard going past a failed observer, shutdown or read never swallow a stop request.
    """


def _on_sigterm(signum, frame):  # noqa: ARG001
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the stop path
    raise Preempted(f"signal {signum}")


def worker_keyring() -> Keyring:
    """The worker's keys from ``VLLM_BATCH_WORKER_KEY``, both key variables then out of the environment. SealError
    (terminal) when the deployment's own key is here (``VLLM_BATCH_SIGNING_KEY``, or a key without the worker prefix
    in ``VLLM_BATCH_WORKER_KEY``: an old Secret): code in the worker could seal any record with it. So is a variable
    that names the Airflow option (``AIRFLOW__VLLM_BATCH__SIGNING_KEY`` and its ``_CMD`` / ``_SECRET`` forms, in any
    case) or whose value holds the deployment key of this worker key, whatever its name (a pod's ``secret_env`` or
    ``env_from_secrets``); every such variable leaves the environment too."""
    from airflow_provider_vllm.core.errors import SealError
    from airflow_provider_vllm.core.seal import HOW_TO_PRINT_WORKER_KEY, Keyring

    env = envs.environ()
    named = sorted(n for n in env if envs.names_a_key(n, envs.DEPLOYMENT_KEY_NAMES))
    held: list[str] = []
    try:
        if envs.SIGNING_KEY.get() is not None:
            raise SealError(
                f"the worker's environment holds {envs.SIGNING_KEY.name}, the deployment's signing key: a shard worker "
                f"must never hold it (code in the worker could seal any record with it); give it only its worker key "
                f"in {envs.WORKER_KEY.name}: {HOW_TO_PRINT_WORKER_KEY}"
            )
        keyring = Keyring.worker_from_env()
        held = sorted(n for n, v in env.items() if n != envs.WORKER_KEY.name and keyring.derives_from(v))
        if named or held:
            raise SealError(
                f"the worker's environment holds the deployment's signing key or its setting in "
                f"{', '.join(sorted({*named, *held}))}: a shard worker must never hold it (code in the worker could "
                f"seal any record with it); take it out of the pod's or runner's settings and give the worker only "
                f"its worker key in {envs.WORKER_KEY.name}: {HOW_TO_PRINT_WORKER_KEY}"
            )
        return keyring
    finally:
        envs.WORKER_KEY.drop()
        envs.SIGNING_KEY.drop()
        envs.remove({*named, *held})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # first: the SIGTERM handler, then the parent-death signal (SIGTERM) asked for by the local runner
    signal.signal(signal.SIGTERM, _on_sigterm)
    bound = bind_to_parent()
    logging.basicConfig(
        level=envs.LOG_LEVEL.get(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    redact = install_redaction()
    log = logging.getLogger("airflow_provider_vllm.worker")
    if not bound:
        log.error("the task process that started this worker is already gone: not starting")
        return ExitCode.TRANSIENT
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return ExitCode.TERMINAL
    # vLLM logs to stdout by default; stdout carries only the manifest
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        skip_unused_imports()  # before anything imports vLLM (worker/imports.py)
        from airflow_provider_vllm.core.allow_list import (
            ALLOW_ANY_LOCATION_ENV,
            ALLOW_REMOTE_CODE_ENV,
            ALLOWED_PREFIXES_ENV,
            flag_from_env,
            prefixes_from_env,
        )
        from airflow_provider_vllm.core.param_schemas import check_spec_params
        from airflow_provider_vllm.core.spec_guard import check_deployment, check_remote_code
        from airflow_provider_vllm.worker.shard import run_shard
        from airflow_provider_vllm.worker.task import ShardTask

        raw = argv[0]
        if raw.startswith("@"):
            with open(raw[1:], encoding="utf-8") as f:
                raw = f.read()
        task = ShardTask.load(raw)
        # the allow-list comes from the deployment (environment), never from the task itself; none: refuse
        check_deployment(
            task.spec,
            prefixes_from_env(),
            allow_any=flag_from_env(ALLOW_ANY_LOCATION_ENV),
            no_allow_list=f"the worker got no allow-list from the Airflow side ({ALLOWED_PREFIXES_ENV} "
            f"is unset and {ALLOW_ANY_LOCATION_ENV} is not 1): it reads and writes nothing",
        )
        check_remote_code(
            task.spec,
            flag_from_env(ALLOW_REMOTE_CODE_ENV),
            f"{ALLOW_REMOTE_CODE_ENV}=1 from the Airflow side's [vllm_batch] allow_remote_code",
        )
        check_spec_params(task.spec.model_dump(mode="json"))
        # the worker key: read once, then out of the environment (vLLM's processes and the model's code never
        # inherit it). It seals and checks only the worker's own records; the deployment's key never comes here
        keyring = worker_keyring()
        hold_shard_lock(task.spec.io.output_uri, task.shard_id)  # local runner only; held until exit
        manifest = run_shard(task, keyring=keyring)
    except VllmBatchError as e:
        log.error("%s: %s", type(e).__name__, e)
        _emit(
            FailureManifest(status="failed", error=type(e).__name__, message=redact.redact(str(e)), terminal=e.terminal)
        )
        return e.exit_code
    except (Preempted, KeyboardInterrupt) as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.error("stopped (%s): committed chunks are kept; a retry resumes from them", e)
        _emit(FailureManifest(status="failed", error="Preempted", message=str(e), terminal=False))
        return ExitCode.TRANSIENT
    except Exception as e:  # engine crash, storage failure, OOM...: a retry may succeed
        log.error("unexpected failure: %s\n%s", e, traceback.format_exc())
        _emit(
            FailureManifest(
                status="failed", error=type(e).__name__, message=redact.redact(str(e))[:2000], terminal=False
            )
        )
        return ExitCode.TRANSIENT
    _emit(manifest)
    return ExitCode.OK


def entrypoint(argv: list[str] | None = None) -> None:
    """The process's entry: redacted streams, ``main``, then ``exit_hard`` with its code (never returns)."""
    code: int = ExitCode.TRANSIENT
    try:
        guard_streams()
        code = main(argv)
    except BaseException as e:  # a stop request outside main's own handlers (e.g. before its try): exit 75
        print(f"worker stopped: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        exit_hard(code)


if __name__ == "__main__":
    carry_to_spawned()  # the same imports skipped in vLLM's engine core, which the CPU build spawns (imports.py)
    entrypoint()
