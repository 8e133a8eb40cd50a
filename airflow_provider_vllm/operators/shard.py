"""The shard task, local runner: the pod's worker command line as a child process."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.allow_list import ALLOWED_PREFIXES_ENV
from airflow_provider_vllm.core.compat import vllm_not_installed
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import ShardSummary
from airflow_provider_vllm.hooks.filesystems import CONNECTION_SECRET_ENV, child_env, conn_ids_from_config
from airflow_provider_vllm.hooks.filesystems import worker_env as connection_worker_env
from airflow_provider_vllm.utils import provenance
from airflow_provider_vllm.utils.deployment import (
    check_spec_allowed,
    signing_keyring,
    variables_may_set_deployment_settings,
    worker_env,
)
from airflow_provider_vllm.utils.job_spec import (
    data_plane_errors,
    load_shard_plan,
    load_spec,
    shard_id_of,
    shard_plan,
    shard_summary,
)
from airflow_provider_vllm.utils.worker_outcome import worker_result
from airflow_provider_vllm.utils.worker_process import (
    FAULT_ENV,
    LocalWorkerProcess,
    WorkerResult,
    fault_command,
    inherited_env,
    injected_exit,
)
from airflow_provider_vllm.worker.task import ShardTask, worker_command


def worker_key_env(env: dict[str, str]) -> dict[str, str]:
    """The worker's key for its environment: the worker key derived from ``[vllm_batch] signing_key``, never the
    deployment's key. Removes from ``env`` (in place) every variable that could carry the deployment's key (the
    Airflow option, ``VLLM_BATCH_SIGNING_KEY``, also when the DAG file's env names them) and any other worker key."""
    for name in [k for k in env if envs.names_a_key(k)]:
        del env[name]
    return {envs.WORKER_KEY.name: signing_keyring().worker_text()}


class VllmLocalShardOperator(BaseOperator):
    """Run one shard with the local runner and push the worker's manifest as the XCom value.

    Runs exactly ``worker_command(ShardTask(spec=..., shard_id=..., plan_mac=..., plan_sha256=...))`` (no shell)
    with this process's environment less Airflow's own variables (``AIRFLOW_CONN_*``, ``AIRFLOW_VAR_*``,
    ``AIRFLOW__*``: ``utils/worker_process.inherited_env``) plus ``env``. ``env`` is deployment-owned
    (``PYTHONPATH``, ``LD_PRELOAD``, ``HF_ENDPOINT`` decide which code runs and from where): the DAG
    file's, or a Variable's with ``[vllm_batch] deployment_settings_from_variables``; one rendered from
    the trigger (params, ``dag_run.conf``) fails the task before the worker starts. The worker's
    stderr (progress: rows, rows/s, tokens/s, ETA; vLLM's logs) streams into the task log. Exit 0:
    the manifest (last stdout line starting with ``{``) is returned. Exit 2 (terminal: bad spec,
    changed input, no vLLM): ``AirflowFailException``, no retry. Exit 75 (transient) or any other failure: an
    ``AirflowException``, so Airflow retries; the retry resumes from committed chunks and a
    shard that is already committed is a no-op. Without ``python`` the worker runs on this
    interpreter, which is checked first: without vLLM the task fails at once, before any process
    starts, naming how to install vLLM and the Kubernetes runner.

    ``spec`` is the validated spec from the plan task (its ``spec`` XCom), ``shard`` one item
    of the plan's return value (a ``ShardSummary``'s JSON form, which names the sealed plan the worker runs under). The
    worker gets the worker key (``VLLM_BATCH_WORKER_KEY``), never the deployment's signing key. See
    ``utils/worker_process.py`` for the ``VLLM_BATCH_INJECT_EXIT`` test hook.

    ``aws_conn_id`` / ``gcp_conn_id`` (DAG-file settings; None: ``[vllm_batch]`` config, else the
    providers' defaults): when the job reads or writes ``s3://`` / ``gs://``, the worker gets that
    Connection's identity through its environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION``;
    ``GOOGLE_APPLICATION_CREDENTIALS``), never its command line; see ``connections.worker_env``.
    """

    template_fields: Sequence[str] = ("spec", "shard", "env")
    template_fields_renderers = {"spec": "json", "shard": "json", "env": "json"}
    ui_color = "#fef7e0"

    def __init__(
        self,
        *,
        spec: Any,
        shard: dict[str, Any] | ShardSummary | str,
        env: dict[str, str] | None = None,
        python: str | None = None,
        progress_interval_s: float = 10.0,
        aws_conn_id: str | None = None,
        gcp_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self.spec = spec
        self.shard = shard
        self.env = env
        self._raw_env = env  # before rendering: who set it (provenance)
        self.python = python
        self.progress_interval_s = progress_interval_s
        self._process: LocalWorkerProcess | None = None

    @property
    def shard_id(self) -> str:
        return shard_id_of(self.shard)

    def execute(self, context: Any) -> dict[str, Any]:
        spec = load_spec(self.spec, "shard")
        shard_id = self.shard_id
        try:
            task = ShardTask(
                spec=spec, shard_id=shard_id, progress_interval_s=self.progress_interval_s, **shard_plan(self.shard)
            )
        except (SpecError, ValueError) as e:
            raise AirflowFailException(f"shard {shard_id!r}: {e}") from None
        prefixes = check_spec_allowed(spec, f"shard {shard_id}")
        self.check_provenance()
        argv = worker_command(task, python=self.python)
        ti = context["ti"]
        code = injected_exit(getattr(ti, "map_index", None), ti.try_number)
        if code is not None:
            self.log.warning(
                "%s: replacing the worker of map index %s, try %s, by a process that exits %d",
                FAULT_ENV,
                ti.map_index,
                ti.try_number,
                code,
            )
            argv = fault_command(code)
        elif self.python is None and importlib.util.find_spec("vllm") is None:
            raise AirflowFailException(f"shard {shard_id}: {vllm_not_installed(sys.executable)}")
        # the allow-list goes last: neither the task's env nor the shard spec can widen it
        env = {**inherited_env(envs.environ()), "PYTHONUNBUFFERED": "1"}
        env.update({k: str(v) for k, v in (self.env or {}).items()})
        conn_env = self._credentials_env(spec)
        credentials = [k for k in conn_env if k in CONNECTION_SECRET_ENV]
        env = child_env(env, conn_env)  # the Connection's identity, in the environment only
        env.pop(ALLOWED_PREFIXES_ENV, None)
        env.update(worker_env(prefixes))
        env.update(worker_key_env(env))
        # what the deployment handed over from its secrets (the Connection's keys, the worker key): the worker masks
        # these values whatever their names; set last, so the task's env cannot shorten the list
        env[envs.SECRET_ENV_NAMES.name] = ",".join(sorted({*credentials, envs.WORKER_KEY.name}))
        env.pop(envs.SECRET_ENV_DIRS.name, None)  # the pods' Secret folders; none here
        rows = None if isinstance(self.shard, str) else shard_summary(self.shard).rows
        self.log.info(
            "shard %s (%s rows), try %s: %s -m airflow_provider_vllm.worker '<shard task json, %d bytes>'",
            shard_id,
            rows,
            ti.try_number,
            argv[0],
            len(argv[-1]),
        )
        self._process = LocalWorkerProcess(argv, env, self._worker_line)
        result = self._process.run()
        return self._outcome(shard_id, result)

    def check_provenance(self) -> None:
        """``env`` came from the DAG file, or a Variable with ``[vllm_batch] deployment_settings_from_variables``;
        never from the trigger (as the Kubernetes runner's ``kubernetes.env``)."""
        if not self.env:
            return
        jinja = provenance.template_env(self)
        problems = provenance.violations(
            ["env"],
            [lambda p: provenance.template_sources(self._raw_env, jinja)],
            variables_may_set_deployment_settings(),
        )
        if problems:
            raise AirflowFailException(f"shard {self.shard_id}: " + "; ".join(problems))

    def _credentials_env(self, spec: Any) -> dict[str, str]:
        from airflow.sdk.configuration import conf

        aws, gcp = conn_ids_from_config(conf, self.aws_conn_id, self.gcp_conn_id)
        try:
            # a table job's data files: where only its sealed plan says (steps/tables/snapshot.py)
            extra = [self._table_input_root(spec, aws, gcp)] if spec.io.input_table is not None else []
            return connection_worker_env(spec, aws, gcp, extra)
        except SpecError as e:
            raise AirflowFailException(f"shard {self.shard_id}: {e}") from None

    def _table_input_root(self, spec: Any, aws: str | None, gcp: str | None) -> str:
        from airflow_provider_vllm.hooks.filesystems import task_filesystems

        # the plan the task names (the worker's), not another sealed plan of the folder put back since
        with data_plane_errors(f"shard {self.shard_id}"):
            return load_shard_plan(spec, self.shard, task_filesystems(aws, gcp)).input_root

    def _worker_line(self, line: str) -> None:
        self.log.info("worker | %s", line)

    def _outcome(self, shard_id: str, result: WorkerResult) -> dict[str, Any]:
        """The exit code decides (``core/exit_codes.py``, shared with the Kubernetes runner)."""
        m = worker_result(result.returncode, shard_id, result.manifest, result.stdout_tail)
        st = m.stats
        self.log.info(
            "shard %s %s by attempt %s: %s rows, %s ok, %s errors; rows/s=%s tokens/s=%s engine_start_s=%s wall_s=%s",
            shard_id,
            m.status,
            m.attempt_id,
            m.rows,
            m.ok_rows,
            m.error_rows,
            st.rows_per_s,
            st.tokens_per_s,
            st.engine_start_s,
            st.wall_s,
        )
        return m.dump()

    def on_kill(self) -> None:
        if self._process is not None:
            self._process.terminate()
