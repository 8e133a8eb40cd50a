"""One worker process that runs many shards, its real vLLM engines shared between them (tests only).

A worker process pays ``import vllm`` and an engine start (~15-20 s here) before its first row. Tests that
need several shards of jobs with the same engine settings (two nights of one job, a run and its full
recompute) send them to one ``ShardServer`` instead: ``python -m tests.support.shard_server`` reads one
``ShardTask`` per line on stdin, runs it with the worker's own ``run_shard`` (the deployment checks, the
plan's seal, the chunk and commit protocol, the result cache: all as in ``python -m
airflow_provider_vllm.worker``) and answers one line with the manifest.

What differs from one worker process per shard, and is tested elsewhere (tests/vllm/test_worker_vllm.py, the
reliability tests): the process's life (signals, the parent's death, the host-local shard lock, exit codes),
and the engine, which is built once per engine configuration (model, engine settings, task, sampling) and
kept for the next shard, as a warm pod would keep it (its prefix cache reset, so that each shard computes as on a
fresh engine; ``keep`` engines at most, the least recently used shut down). Before each shard the environment is
reset to the server's at start: vLLM sets variables of its own in the process that starts it, and the engine identity
the cache keys on is read from them.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from tests.support import ROOT
from tests.support.data import shard_task, worker_env

KEEP_ENGINES = 2  # engines kept at once by default (each holds its KV cache, VLLM_CPU_KVCACHE_SPACE GiB)
KEEP_ENV = "SHARD_SERVER_KEEP_ENGINES"


class _Kept:
    """A shared engine as the worker sees it: everything but ``shutdown``, which the server does."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def shutdown(self) -> None:
        pass


class SharedEngines:
    """The engine factory of the server: one real ``Engine`` per configuration, the least recent shut down."""

    needs_vllm = True  # as the worker's default factory: refuse early without vLLM

    def __init__(self, keep: int = KEEP_ENGINES) -> None:
        self.engines: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.keep = keep
        self.started = 0

    @staticmethod
    def key(spec: Any) -> str:
        # what worker/engine.py's Engine reads of the spec
        return json.dumps(
            [
                spec.task,
                spec.model.model_dump(mode="json"),
                spec.engine.model_dump(mode="json"),
                spec.sampling.model_dump(mode="json"),
                spec.confidence_from_logprobs,
            ],
            sort_keys=True,
        )

    def __call__(self, spec: Any) -> _Kept:
        from airflow_provider_vllm.worker.engine import Engine

        k = self.key(spec)
        if k not in self.engines:
            while len(self.engines) >= self.keep:
                self.engines.popitem(last=False)[1].shutdown()
            self.engines[k] = Engine(spec)
            self.started += 1
        else:
            # A kept engine computes each shard as a fresh one would: a prefix-cache hit from an earlier shard changes
            # the arithmetic enough to flip a near-tie of greedy decoding now and then (tests compare with raw vLLM).
            self.engines[k].llm.reset_prefix_cache()
        self.engines.move_to_end(k)
        return _Kept(self.engines[k])


def serve() -> None:
    """The server's loop (``python -m tests.support.shard_server``)."""
    import logging

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM and anything else that prints: to the log, not into the answers
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from airflow_provider_vllm.core import envs
    from airflow_provider_vllm.core.allow_list import ALLOW_ANY_LOCATION_ENV, flag_from_env, prefixes_from_env
    from airflow_provider_vllm.core.param_schemas import check_spec_params
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.spec_guard import check_deployment
    from airflow_provider_vllm.worker.shard import run_shard
    from airflow_provider_vllm.worker.task import ShardTask

    keep = int(os.environ.pop(KEEP_ENV, KEEP_ENGINES))
    keyring = Keyring.worker_from_env()  # as the worker: its worker key only, then out of the environment
    envs.WORKER_KEY.drop()
    base = dict(os.environ)
    engines = SharedEngines(keep)
    for line in sys.stdin:
        os.environ.clear()
        os.environ.update(base)
        try:
            task = ShardTask.load(line)
            check_deployment(task.spec, prefixes_from_env(), allow_any=flag_from_env(ALLOW_ANY_LOCATION_ENV))
            check_spec_params(task.spec.model_dump(mode="json"))
            answer = {"manifest": run_shard(task, engine_factory=engines, keyring=keyring)}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        answer["engines_started"] = engines.started
        proto.write(json.dumps(answer) + "\n")
        proto.flush()
    for engine in engines.engines.values():
        engine.shutdown()


class ShardServer:
    """The test side: ``run(spec, shard_id)`` -> the manifest, from one long-lived server process."""

    def __init__(self, log: Path, env: dict[str, str] | None = None, keep: int = KEEP_ENGINES):
        self.log = log
        env = worker_env(os.environ if env is None else env)  # as a worker's: its worker key, no deployment key
        env[KEEP_ENV] = str(keep)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.shard_server"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        self.engines_started = 0

    def run(self, spec: Any, shard_id: str, timeout: float = 600) -> dict:

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(shard_task(spec=spec, shard_id=shard_id).model_dump_json() + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout=timeout):
                raise AssertionError(f"shard server: no answer for {shard_id} in {timeout} s\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"shard server ended (rc {self.proc.poll()})\n{self.tail()}")
        answer = json.loads(line)
        self.engines_started = answer["engines_started"]
        if "error" in answer:
            raise AssertionError(f"shard {shard_id}: {answer['error']}\n{answer['traceback']}\n{self.tail()}")
        return answer["manifest"]

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


if __name__ == "__main__":
    from airflow_provider_vllm.worker.exits import exit_hard
    from airflow_provider_vllm.worker.imports import skip_unused_imports

    code = 0
    try:
        skip_unused_imports()  # as the worker's __main__
        serve()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        exit_hard(code)  # as the worker: Python's own teardown of vLLM can abort
