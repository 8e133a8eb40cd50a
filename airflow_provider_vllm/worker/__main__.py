"""``python -m airflow_provider_vllm.worker '<shard task json>'`` (or ``@file.json``).

Exit codes: 0 done (or already committed), 2 terminal (retrying cannot help: bad spec,
changed input), 75 transient (retry: engine failure, storage error, preemption).
The last stdout line is the JSON manifest; it is also written to
``/airflow/xcom/return.json`` when that folder exists (KubernetesPodOperator XCom sidecar).
A hung engine is stopped by the progress watchdog (``spec.worker.watchdog_s``): exit 75.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

from airflow_provider_vllm.errors import EXIT_OK, EXIT_TERMINAL, EXIT_TRANSIENT, VllmBatchError
from airflow_provider_vllm.worker.exits import emit as _emit
from airflow_provider_vllm.worker.exits import exit_hard
from airflow_provider_vllm.worker.redact import install as install_redaction


class Preempted(Exception):
    """SIGTERM received (node drain, spot preemption, task killed)."""


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise Preempted(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=os.environ.get("VLLM_BATCH_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    redact = install_redaction()
    log = logging.getLogger("airflow_provider_vllm.worker")
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return EXIT_TERMINAL
    signal.signal(signal.SIGTERM, _on_sigterm)
    # vLLM logs to stdout by default; stdout carries only the manifest
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        from airflow_provider_vllm.param_schemas import check_spec_params
        from airflow_provider_vllm.paths import (
            ALLOW_ANY_LOCATION_ENV,
            ALLOW_REMOTE_CODE_ENV,
            ALLOWED_PREFIXES_ENV,
            flag_from_env,
            prefixes_from_env,
        )
        from airflow_provider_vllm.spec_guard import check_deployment, check_remote_code
        from airflow_provider_vllm.worker.shard import run_shard
        from airflow_provider_vllm.worker.task import ShardTask

        raw = argv[0]
        if raw.startswith("@"):
            with open(raw[1:], encoding="utf-8") as f:
                raw = f.read()
        task = ShardTask.load(raw)
        # the allow-list comes from the deployment (environment), never from the task itself; none: refuse
        check_deployment(task.spec, prefixes_from_env(), allow_any=flag_from_env(ALLOW_ANY_LOCATION_ENV),
                         no_allow_list=f"the worker got no allow-list from the Airflow side ({ALLOWED_PREFIXES_ENV} "
                         f"is unset and {ALLOW_ANY_LOCATION_ENV} is not 1): it reads and writes nothing")
        check_remote_code(task.spec, flag_from_env(ALLOW_REMOTE_CODE_ENV), f"{ALLOW_REMOTE_CODE_ENV}=1 from the "
                          "Airflow side's [vllm_batch] allow_remote_code")
        check_spec_params(task.spec.model_dump(mode="json"))
        manifest = run_shard(task)
    except VllmBatchError as e:
        log.error("%s: %s", type(e).__name__, e)
        _emit({"status": "failed", "error": type(e).__name__, "message": redact.redact(str(e)),
               "terminal": e.terminal})
        return e.exit_code
    except (Preempted, KeyboardInterrupt) as e:
        log.error("stopped (%s): committed chunks are kept; a retry resumes from them", e)
        _emit({"status": "failed", "error": "Preempted", "message": str(e), "terminal": False})
        return EXIT_TRANSIENT
    except Exception as e:  # engine crash, storage failure, OOM...: a retry may succeed
        log.error("unexpected failure: %s\n%s", e, traceback.format_exc())
        _emit({"status": "failed", "error": type(e).__name__, "message": redact.redact(str(e))[:2000],
               "terminal": False})
        return EXIT_TRANSIENT
    _emit(manifest)
    return EXIT_OK


if __name__ == "__main__":
    exit_hard(main())
