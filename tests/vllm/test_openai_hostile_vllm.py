"""Hostile OpenAI batch requests among good ones, through the real worker CLI on real vLLM (CPU).

One worker run over a batch file where most rows are hostile in a different way each (sampling
values outside vLLM's ranges, refused and unknown fields, messages the model's chat template
refuses, a 1 MB message): it exits 0, every hostile row is an error record with its code, and
every good row is identical to a run over the good rows alone. Before per-row isolation one
`"temperature": 3` made vLLM raise `VLLMValidationError` at submit and the worker exit 75 on
every retry.

The model is SmolLM2-135M-Instruct with its own ChatML template, behind a check of the kind many
real templates carry (Llama 2, Mistral: `raise_exception('Conversation roles must alternate
...')`); the check renders nothing, so good rows render exactly as with SmolLM2's template
(asserted below). float32, greedy (one row samples with a seed): the two runs must agree token
for token, but for two rows that sample at random, which must have no prompt hash.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.support.bad_inputs.corpus import good_chat_requests, hostile_chat_requests
from tests.support.data import merge
from tests.support.ledger import record_bad_rows
from tests.support.shard_server import ShardServer
from tests.vllm.test_worker_vllm import ENV, LEAVE

pytestmark = [pytest.mark.vllm, pytest.mark.reliability, pytest.mark.timeout(1500)]

# Renders nothing; raises (jinja2 TemplateError via HF's raise_exception) for roles that do not
# alternate user/assistant after leading system messages, as Llama 2's and Mistral's templates do.
ALTERNATION_CHECK = (
    "{%- set ns = namespace(turn=0) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ['user', 'assistant'] -%}"
    "{%- if (message['role'] == 'user') != (ns.turn % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set ns.turn = ns.turn + 1 -%}"
    "{%- elif ns.turn > 0 -%}"
    "{{ raise_exception('System messages are only allowed at the start') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def strict_template_model(model: str, dest: Path) -> Path:
    """The model's folder (files linked) with ALTERNATION_CHECK in front of its chat template."""
    dest.mkdir()
    for f in Path(model).iterdir():
        if f.name != "chat_template.jinja":
            os.symlink(f, dest / f.name)
    original = (Path(model) / "chat_template.jinja").read_text()
    (dest / "chat_template.jinja").write_text(ALTERNATION_CHECK + original)
    return dest


def write_batch(path: Path, rows: list[tuple[str, dict]]) -> None:
    path.parent.mkdir(parents=True)
    with path.open("w") as f:
        for cid, body in rows:
            f.write(
                json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
            )


def run_batch(model: Path, inp: Path, out: Path, server: ShardServer) -> tuple[dict, JobSpec]:
    spec = JobSpec.load(
        {
            "task": "chat",
            "model": {"name": str(model), "max_model_len": 1024, "dtype": "float32", "served_model_names": ["m"]},
            "engine": {"enforce_eager": True, "max_num_seqs": 16},
            "io": {"input_uri": str(inp), "output_uri": str(out), "output_format": "openai_batch"},
            "prompt": {"system_prompt": None, "template": "{text}"},
            "sampling": {"temperature": 0, "max_tokens": 12},
            "sharding": {"target_rows": 10_000, "chunk_rows": 8},
        }
    )
    (shard,) = plan_job(spec).shards
    m = server.run(spec, shard.shard_id)  # the worker's run_shard in the test process's shard server
    assert m["status"] == "committed"
    merge(spec)
    return m, spec


def test_hostile_openai_rows_do_not_fail_the_shard_and_good_rows_are_unchanged(tmp_path, smollm2, shard_server):
    model = strict_template_model(smollm2, tmp_path / "smollm2-strict")
    hostile = hostile_chat_requests()
    # two identical requests that sample at random (temperature, no seed): answered, compared by nobody
    sampled_body = {"messages": [{"role": "user", "content": "Write a word."}], "temperature": 0.9, "max_tokens": 4}
    sampled = [("sampled-a", sampled_body), ("sampled-b", sampled_body)]
    good = good_chat_requests() + sampled
    assert len(hostile) >= 12
    # good rows first, between and after the hostile ones
    mixed: list[tuple[str, dict]] = []
    goods = iter(good)
    for n, (cid, body, _) in enumerate(hostile):
        if n % 3 == 0:
            mixed += itertools.islice(goods, 1)
        mixed.append((cid, body))
    mixed += goods
    assert len(mixed) == len(hostile) + len(good)
    write_batch(tmp_path / "mixed" / "batch.jsonl", mixed)
    write_batch(tmp_path / "clean" / "batch.jsonl", good)

    m, _ = run_batch(model, tmp_path / "mixed", tmp_path / "out-mixed", shard_server)
    assert m["rows"] == len(mixed) and m["error_rows"] == len(hostile) and m["ok_rows"] == len(good)
    assert m["stats"]["engine_error_rows"] == 0 and m["stats"]["step_failures"] == 0  # all refused before vLLM

    errors = [json.loads(x) for x in (tmp_path / "out-mixed" / "openai" / "errors.jsonl").read_text().splitlines()]
    got = {e["custom_id"]: e["error"]["code"] for e in errors}
    expected = {cid: code for cid, _, code in hostile}
    record_bad_rows("openai_hostile_rows_real_vllm", len(expected), sum(got.get(c) == e for c, e in expected.items()))
    assert got == expected
    msg = {e["custom_id"]: e["error"]["message"] for e in errors}
    assert "temperature" in msg["temperature-3"] and "[0, 2]" in msg["temperature-3"]
    assert "top_p" in msg["top-p-0"] and "(0, 1]" in msg["top-p-0"]
    assert "max_tokens" in msg["max-tokens-huge"] and "10000000" in msg["max-tokens-huge"]
    assert "max_model_len 1024" in msg["max-tokens-over-context"]
    assert "body.temprature" in msg["unknown-fields"] and "body.foo" in msg["unknown-fields"]
    assert "n must be 1" in msg["n-3"] and "tool" in msg["tool-message"] and "stream" in msg["stream"]
    assert "must alternate" in msg["roles-not-alternating"] and "chat template" in msg["roles-not-alternating"]
    assert "wizard" in msg["unknown-role"] and "budget" in msg["one-mb-message"]
    assert "10000 stop strings; at most 16" in msg["stop-ten-thousand"] and len(msg["stop-ten-thousand"]) < 200
    assert "'NonExistModel' does not exist" in msg["another-model"]

    m_clean, _ = run_batch(model, tmp_path / "clean", tmp_path / "out-clean", shard_server)
    assert m_clean["ok_rows"] == len(good) and m_clean["error_rows"] == 0
    cols = ["id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "prompt_hash"]
    mixed_ok = {r["id"]: r for r in pq.read_table(tmp_path / "out-mixed" / "results", columns=cols).to_pylist()}
    clean_ok = {r["id"]: r for r in pq.read_table(tmp_path / "out-clean" / "results", columns=cols).to_pylist()}
    assert set(mixed_ok) == set(clean_ok) == {cid for cid, _ in good}
    # the requests that sample have no prompt hash (their answers differ by design); greedy and seeded ones do
    assert all(r["prompt_hash"] is None for cid, r in clean_ok.items() if cid.startswith("sampled-"))
    assert all(r["prompt_hash"] is not None for cid, r in clean_ok.items() if not cid.startswith("sampled-"))
    for cid, _ in sampled:  # each run drew its own answers: not compared
        del mixed_ok[cid], clean_ok[cid]
    assert mixed_ok == clean_ok
    assert all(r["output"] for r in clean_ok.values())  # a real model answers
    # per-row settings reached vLLM: the row's max_tokens and stop string bound its answer
    assert clean_ok["good-max-completion-tokens"]["completion_tokens"] <= 5
    assert "." not in clean_ok["good-stop-string"]["output"]


def test_the_strict_template_renders_good_rows_like_smollm2s_own(tmp_path, smollm2):
    """The alternation check renders nothing: the good rows' prompts are SmolLM2's own."""
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    strict = AutoTokenizer.from_pretrained(str(strict_template_model(smollm2, tmp_path / "strict")))
    stock = AutoTokenizer.from_pretrained(smollm2)
    from airflow_provider_vllm.core.formats.openai_requests import parse_chat_body

    for _, body in good_chat_requests():
        conv = parse_chat_body(body).conversation()
        assert strict.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=True
        ) == stock.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    with pytest.raises(TemplateError, match="alternate"):
        strict.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            tokenize=False,
            add_generation_prompt=True,
        )


ENGINE_REFUSALS = (
    LEAVE
    + r"""
import json, sys
if __name__ == "__main__":
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.worker.engine import Engine
    from airflow_provider_vllm.worker.isolation import RequestRejected
    e = Engine(JobSpec.load(json.loads(sys.argv[1])))
    ids = e.tokenizer.encode("hello there, a ticket about my invoice")
    out = {}
    for name, overrides, prompt in [("temperature", {"temperature": 3}, ids), ("top_p", {"top_p": 0}, ids),
                                    ("stop", {"stop": [""]}, ids), ("logprobs", {"logprobs": 50}, ids),
                                    ("empty", None, []), ("too_long", None, ids * 200)]:
        try:
            e.submit(name, prompt, overrides)
            out[name] = "accepted"
        except RequestRejected as r:
            out[name] = [r.code, r.message, type(r.__cause__).__name__]
    e.submit("good", ids, {"max_tokens": 3})
    done = {}
    while e.pending():
        done.update({k: [g.completion_tokens, g.finish_reason] for k, g in e.step()})
    e.probe()
    out["good"], out["pending_after_probe"] = done, e.pending()
    print("RAW " + json.dumps(out), flush=True)
    e.shutdown()
    leave(0)
"""
)


def test_the_real_engine_refuses_one_request_without_failing(tmp_path, tiny_model):
    """Engine.submit on real vLLM: vLLM's VLLMValidationError, raised when the request's
    SamplingParams are built or by its input processor at add_request, is that request's
    RequestRejected; the engine goes on and the probe request runs."""
    doc = {
        "task": "generate",
        "model": {"name": tiny_model, "max_model_len": 256},
        "engine": {"enforce_eager": True, "max_num_seqs": 8},
        "io": {"input_uri": str(tmp_path / "in"), "output_uri": str(tmp_path / "out")},
        "prompt": {"template": "{text}"},
        "sampling": {"temperature": 0, "max_tokens": 4},
    }
    raw = subprocess.run(
        [sys.executable, "-c", ENGINE_REFUSALS, json.dumps(doc)], env=ENV, capture_output=True, text=True, timeout=600
    )
    assert raw.returncode == 0, raw.stderr[-3000:]
    out = json.loads(next(x for x in raw.stdout.splitlines() if x.startswith("RAW "))[4:])
    for name, fragment in [
        ("temperature", "temperature must be in [0, 2], got 3"),
        ("top_p", "top_p must be in (0, 1]"),
        ("stop", "stop cannot contain an empty string"),
        ("logprobs", "greater than max allowed: 20"),
        ("empty", "prompt cannot be empty"),
        ("too_long", "maximum context length is 256 tokens"),
    ]:
        code, message, cause = out[name]
        assert code == "INVALID_REQUEST" and fragment in message and cause == "VLLMValidationError", (name, out[name])
    assert out["good"] == {"good": [3, "length"]} and out["pending_after_probe"] == 0
