"""Prompts are data: shell text in a row, the template or the system prompt reaches the engine
verbatim, and the worker's command line is an argv list (no shell).
"""

from __future__ import annotations

import json

import pytest

from airflow_provider_vllm.core.spec import JobSpec
from tests.support.data import shard_task, write_parquet
from tests.support.security import base_doc

pytestmark = pytest.mark.reliability


# ---- verbatim to the engine, never a shell --------------------------------------------
def test_shell_text_reaches_the_engine_verbatim(allowed, tmp_path, fake_engine_factory):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from airflow_provider_vllm.worker.task import worker_command
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

    task = shard_task(spec=spec, shard_id=plan.shards[0].shard_id)
    assert run_shard(task, engine_factory=recording)["ok_rows"] == 1
    assert seen == [f"<system>System {payload}\n<user>Ticket: row text {payload} {payload}\n<assistant>"]
    argv = worker_command(task)
    assert argv[1:3] == ["-m", "airflow_provider_vllm.worker"] and len(argv) == 4
    assert json.loads(argv[3])["spec"]["prompt"]["system_prompt"] == f"System {payload}"
    assert not canary.exists()


# ---- a chat template that reads the clock --------------------------------------------------
# The date logic of Llama 3.1/3.2/3.3 Instruct's chat template (tokenizer_config.json), around a minimal conversation
LLAMA31_LIKE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    '{%- set date_string = strftime_now("%d %b %Y") %}'
    '{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}{%- endif %}'
    '{{- "Today Date: " + date_string + "\\n\\n" }}'
    "{%- for message in messages %}{{- message['role'] + ': ' + message['content'] + '\\n' }}{%- endfor %}"
)


def _hf_tokenizer(template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="!", chat_template=template)


def test_the_builder_finds_a_chat_template_that_reads_the_clock(tmp_path):
    """transformers gives chat templates strftime_now (Llama 3.x: "Today Date: ..."): one row, another prompt every
    day. The builder renders its probe at two dates and says so (the worker seals it; the result cache then files
    nothing); a template without the clock, or a job without a chat template, does not. The real clock is put back."""
    import datetime as dt

    import transformers.utils.chat_template_utils as ctu

    from airflow_provider_vllm.worker.prompts import PromptBuilder
    from tests.support.data import make_spec

    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", model={"name": "m", "max_model_len": 4096})
    assert PromptBuilder(spec, _hf_tokenizer(LLAMA31_LIKE_TEMPLATE), 4096).reads_clock is True
    assert ctu.datetime is dt.datetime
    dateless = LLAMA31_LIKE_TEMPLATE.replace('strftime_now("%d %b %Y")', '"26 Jul 2024"')
    assert PromptBuilder(spec, _hf_tokenizer(dateless), 4096).reads_clock is False
    generate = make_spec(
        tmp_path / "in.parquet", tmp_path / "out", task="generate", model={"name": "m"}, prompt={"system_prompt": None}
    )
    assert PromptBuilder(generate, _hf_tokenizer(LLAMA31_LIKE_TEMPLATE), 1024).reads_clock is False
