"""How the worker process reports its end: the manifest line, and the hard exit of a stall.

The last stdout line is the JSON manifest; it is also written to ``$VLLM_BATCH_XCOM_DIR/return.json``
(default ``/airflow/xcom``, the KubernetesPodOperator XCom sidecar's file) when that folder exists.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.exit_codes import ExitCode
from airflow_provider_vllm.core.records import FailureManifest, WorkerManifest, read_manifest

log = logging.getLogger("airflow_provider_vllm.worker")


def emit(manifest: WorkerManifest | FailureManifest | dict) -> None:
    """Print the manifest as the last stdout line (and write the XCom file); a dict is validated first."""
    if isinstance(manifest, dict):
        manifest = read_manifest(manifest)
    xcom_dir = envs.XCOM_DIR.value()
    from airflow_provider_vllm.worker.redact import redact

    # the XCom file does not pass through the redacted stdout: a failure's free text is masked here. Only that: the
    # ids are matched by merge against the commit marker (the attempt id carries the host, the pod's name, in which a
    # value set from a Secret may occur), and the rest is numbers and the hardware's name
    if isinstance(manifest, FailureManifest):
        manifest = manifest.model_copy(update={"message": redact(manifest.message)})
    line = json.dumps(manifest.dump(), sort_keys=True)
    if os.path.isdir(xcom_dir):
        with open(os.path.join(xcom_dir, "return.json"), "w", encoding="utf-8") as f:
            f.write(line)
    print(line, flush=True)


def stalled(idle_s: float) -> None:
    """End the process from the watchdog thread: failure manifest, children killed, exit 75.

    ``os._exit`` skips clean-up on purpose: the main thread is stuck and may hold locks.
    Nothing partial is visible (every write is atomic) and committed chunks stay for the retry.
    """
    msg = f"no progress for {idle_s:.0f} s: the engine or storage hangs; a retry resumes from committed chunks"
    try:
        emit(FailureManifest(status="failed", error="Stalled", message=msg, terminal=False))
    finally:
        exit_hard(ExitCode.TRANSIENT)


def exit_hard(code: int) -> None:
    """Leave without interpreter teardown once the outcome is durable and reported.

    Every result is committed (or the failure manifest emitted) before this is called; what is
    left is teardown of native threads in vLLM/torch, which can abort the process (seen with
    vLLM 0.32 CPU: ``terminate called without an active exception`` -> SIGABRT after a committed
    classify shard) and would turn a success into a failed, retried task. Streams are flushed,
    leftover engine processes killed (they would hold our stdout pipe open), then ``os._exit``.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe must not change the exit code
            pass
    logging.shutdown()
    kill_children()
    from airflow_provider_vllm.worker.redact import drain

    drain()
    os._exit(code)


def orphaned() -> None:
    """The task process that started this worker is gone (local runner): end everything now, exit 75.

    Called from the parent-watch thread when the main thread did not act on the parent-death
    SIGTERM (stuck in native code). The log line is written from a helper thread with a
    bound: the stuck main thread may hold the logging lock. Committed chunks stay for the retry.
    """
    t = threading.Thread(
        target=log.error,
        daemon=True,
        args=(
            "the task process that started this worker is gone: stopping it and its engine processes; "
            "a retry resumes from committed chunks",
        ),
    )
    t.start()
    t.join(1.0)
    kill_children()
    from airflow_provider_vllm.worker.redact import drain

    drain(1.0)
    os._exit(ExitCode.TRANSIENT)


def kill_children() -> None:
    """SIGKILL every descendant process (vLLM's engine core and its workers), and, when this
    process leads its own session (the local runner starts it so), every other member of its
    process group: an engine process whose own parent died is no longer a descendant but is
    still in the group. (A process that only leads a group, like the first command of a shell
    pipeline, leaves the group alone: ``tee`` in ``worker ... | tee log`` is not ours to kill.)"""
    try:
        import psutil
    except ImportError:  # psutil comes with vLLM; without it the group members are still found below
        psutil = None
    if psutil is not None:
        for child in psutil.Process().children(recursive=True):
            try:
                child.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
    me = os.getpid()
    if os.getpgrp() != me or os.getsid(0) != me:
        return
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            if pid != me and os.getpgid(pid) == me:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
