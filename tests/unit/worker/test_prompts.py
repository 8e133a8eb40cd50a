"""Prompts are data: shell text in a row, the template or the system prompt reaches the engine
verbatim, and the worker's command line is an argv list (no shell).
"""

from __future__ import annotations

import json

import pytest

from airflow_provider_vllm.core.spec import JobSpec
from tests.support.data import write_parquet
from tests.support.security import base_doc

pytestmark = pytest.mark.reliability


# ---- verbatim to the engine, never a shell --------------------------------------------
def test_shell_text_reaches_the_engine_verbatim(allowed, tmp_path, fake_engine_factory):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from airflow_provider_vllm.worker.task import ShardTask, worker_command
    from tests.support.fakes import FakeTokenizer

    canary = tmp_path / "pwned"
    payload = f"; touch {canary} $(touch {canary}) `touch {canary}` | sh && echo 'x' \"y\""
    write_parquet(allowed / "in2" / "p.parquet", ["r1"], [f"row text {payload}"])
    doc = base_doc(allowed)
    doc["io"] = {"input_uri": str(allowed / "in2"), "output_uri": str(allowed / "out2")}
    doc["prompt"]["system_prompt"] = f"System {payload}"
    doc["prompt"]["template"] = "Ticket: {text} " + payload
    doc["model"]["max_model_len"] = 4096
    spec = JobSpec.load(doc)
    plan = plan_job(spec)
    seen = []
    factory_engine = fake_engine_factory

    def recording(s):
        e = factory_engine(s)
        orig = e.submit

        def submit(key, ids, overrides=None):
            seen.append(FakeTokenizer().decode(ids))
            return orig(key, ids, overrides)

        e.submit = submit
        return e

    task = ShardTask(spec=spec, shard_id=plan.shards[0].shard_id)
    assert run_shard(task, engine_factory=recording)["ok_rows"] == 1
    assert seen == [f"<system>System {payload}\n<user>Ticket: row text {payload} {payload}\n<assistant>"]
    argv = worker_command(task)
    assert argv[1:3] == ["-m", "airflow_provider_vllm.worker"] and len(argv) == 4
    assert json.loads(argv[3])["spec"]["prompt"]["system_prompt"] == f"System {payload}"
    assert not canary.exists()
