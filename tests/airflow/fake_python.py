"""Stands in for ``python`` in ``worker_command(task, python=...)``: runs the real worker CLI
(``-m airflow_provider_vllm.worker '<json>'``) with the fake engine, so the shard operator's
process handling is tested without vLLM.

With ``FAKE_ENGINE_REQUESTS`` set, every request the fake engine accepts (a generation request, or
one prompt of a pooling call) is appended to that file as one line, at once (the worker may leave
with ``os._exit``): what the engine received, counted across processes."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from airflow_provider_vllm.worker import __main__ as worker_main  # noqa: E402
from airflow_provider_vllm.worker import shard  # noqa: E402
from tests.support.fakes import FakeEngine  # noqa: E402


class CountingEngine(FakeEngine):
    """The fake engine, appending each accepted request to ``FAKE_ENGINE_REQUESTS``."""

    def _record(self, kind: str, n: int) -> None:
        with open(os.environ["FAKE_ENGINE_REQUESTS"], "a") as f:
            f.write(f"{kind}\n" * n)

    def submit(self, key, token_ids, overrides=None, adapter=None):
        out = super().submit(key, token_ids, overrides, adapter)
        self._record("submit", 1)
        return out

    def pool(self, prompts):
        out = super().pool(prompts)
        self._record("pool", len(prompts))
        return out


if __name__ == "__main__":
    assert sys.argv[1:3] == ["-m", "airflow_provider_vllm.worker"], sys.argv
    engine = CountingEngine if os.environ.get("FAKE_ENGINE_REQUESTS") else FakeEngine
    # vLLM's own SamplingParams only check per-row options (OpenAI batch rows), which no job run through this file
    # sets; without them the fake imports no vLLM (seconds per worker process)
    shard._default_engine = lambda spec: engine(spec, real_vllm=False)
    worker_main.entrypoint(sys.argv[3:])
