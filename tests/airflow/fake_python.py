"""Stands in for ``python`` in ``worker_command(task, python=...)``: runs the real worker CLI
(``-m airflow_provider_vllm.worker '<json>'``) with the fake engine, so the shard operator's
process handling is tested without vLLM."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from airflow_provider_vllm.worker import __main__ as worker_main  # noqa: E402
from airflow_provider_vllm.worker import shard  # noqa: E402
from tests.support.fakes import FakeEngine  # noqa: E402

if __name__ == "__main__":
    assert sys.argv[1:3] == ["-m", "airflow_provider_vllm.worker"], sys.argv
    shard._default_engine = lambda spec: FakeEngine(spec)
    worker_main.entrypoint(sys.argv[3:])
