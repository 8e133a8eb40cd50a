"""No single row can fail a shard: per-row isolation with the fake engine (fast).

The fake engine builds real ``vllm.SamplingParams`` for per-row settings (vLLM's own checks),
repeats vLLM's prompt checks, and honours max_tokens / stop / temperature / seed, so these tests
see the class of bug where one OpenAI batch row's ``"temperature": 3`` reached vLLM, raised its
``VLLMValidationError`` (not a ``ValueError``) and failed the shard with exit 75 on every retry.
The same rows on real vLLM: tests/vllm/test_openai_hostile_vllm.py.
"""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import EngineError, SpecError
from airflow_provider_vllm.core.formats.openai_requests import RequestFault, parse_chat_body
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.engine import sampling_params
from airflow_provider_vllm.worker.guard import GuardedEngine, RowFailure
from airflow_provider_vllm.worker.isolation import RequestRejected, refusal, row_caused
from airflow_provider_vllm.worker.prompts import PromptBuilder
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.bad_inputs.corpus import good_chat_requests, hostile_chat_requests
from tests.support.data import make_spec, merge, shard_task, write_parquet
from tests.support.fakes import FakeEngine, FakeTokenizer, vllm_importable
from tests.support.reconcile import check

pytestmark = pytest.mark.reliability
needs_vllm = pytest.mark.skipif(not vllm_importable(), reason="vLLM is not importable here")


def openai_job(tmp_path, rows, task="chat", **over):
    p = tmp_path / "in" / "batch.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for cid, body, *url in rows:
            f.write(
                json.dumps(
                    {"custom_id": cid, "method": "POST", "url": url[0] if url else "/v1/chat/completions", "body": body}
                )
                + "\n"
            )
    doc = {
        "io": {"output_format": "openai_batch"},
        "prompt": {"system_prompt": None, "template": "{text}"},
        "sampling": {"max_tokens": 8, "structured": None},
        "sharding": {"target_rows": 1000, "chunk_rows": 5},
        **over,
    }
    if task != "chat":
        doc["task"] = task
    spec = make_spec(p, tmp_path / "out", **doc)
    (shard,) = plan_job(spec).shards
    return spec, shard


def run(spec, shard, factory):
    m = run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=factory)
    assert m["status"] == "committed"
    merge(spec)
    out = spec.io.output_uri
    res = {r["id"]: r for r in pq.read_table(f"{out}/results").to_pylist()}
    err = {r["id"]: r for r in pq.read_table(f"{out}/errors").to_pylist()}
    return m, res, err


def user(text="hello"):
    return [{"role": "user", "content": text}]


# ---- the fake engine refuses what vLLM refuses, with vLLM's own checks ------------------
@needs_vllm
def test_the_fake_engine_validates_per_row_settings_with_vllms_own_sampling_params(tmp_path):
    from vllm.exceptions import VLLMValidationError

    spec = make_spec(tmp_path / "in", tmp_path / "out", sampling={"max_tokens": 8, "structured": None})
    fake = FakeEngine(spec)
    assert fake.real_vllm
    with pytest.raises(RequestRejected) as e:
        fake.submit("k", [5, 6, 7], {"temperature": 3})
    assert e.value.code == "INVALID_REQUEST" and "temperature must be in [0, 2], got 3" in e.value.message
    cause = e.value.__cause__
    # the bug's class: vLLM 0.32 raises its own class, not a ValueError, so `except ValueError` missed it
    assert isinstance(cause, VLLMValidationError) and not isinstance(cause, ValueError)
    for bad, fragment in [
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"max_tokens": -5}, "max_tokens must be at least 1"),
        ({"stop": [""]}, "stop cannot contain an empty string"),
        ({"presence_penalty": 5}, "presence_penalty must be in [-2, 2]"),
        ({"min_tokens": 9, "max_tokens": 2}, "min_tokens must be less than or equal"),
    ]:
        with pytest.raises(RequestRejected, match=fragment.replace("(", r"\(").replace("[", r"\[")):
            fake.submit("k", [5, 6, 7], bad)
    with pytest.raises(RequestRejected, match="cannot be empty"):  # vLLM's input processor
        fake.submit("k", [], None)
    with pytest.raises(RequestRejected, match="maximum context length is"):
        fake.submit("k", [5] * 5000, None)
    assert fake.submitted == 0 and fake.refused == 8


@needs_vllm
@pytest.mark.parametrize(
    "cid",
    [
        "temperature-3",
        "temperature-nan",
        "top-p-0",
        "max-tokens-negative",
        "stop-empty-string",
        "presence-penalty-5",
        "min-tokens-over-max",
    ],
)
def test_our_ranges_are_vllms(cid):
    """Every sampling value the body model refuses, vLLM's SamplingParams refuses too..."""
    from vllm import SamplingParams

    body = next(b for c, b, _ in hostile_chat_requests() if c == cid)
    with pytest.raises(RequestFault) as e:
        parse_chat_body(body)
    assert e.value.code == "INVALID_REQUEST"
    raw = {k: v for k, v in body.items() if k not in ("model", "messages")}
    with pytest.raises(Exception) as v:
        SamplingParams(**raw)
    assert type(v.value).__name__ == "VLLMValidationError"


@needs_vllm
@pytest.mark.parametrize(
    "body",
    [b for _, b in good_chat_requests()]
    + [
        {"messages": user(), "temperature": 2, "top_p": 1e-9, "max_tokens": 1},
        {"messages": user(), "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 1, "seed": -(2**63)},
        {
            "messages": user(),
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "repetition_penalty": 0.01,
            "seed": 2**63 - 1,
        },
    ],
)
def test_what_the_body_model_accepts_vllm_accepts(body, tmp_path):
    """... and every body it accepts becomes SamplingParams vLLM takes (the edges included)."""
    spec = make_spec(tmp_path / "in", tmp_path / "out", sampling={"max_tokens": 8, "structured": None})
    params = sampling_params(spec, parse_chat_body(body).sampling())
    assert params.n == 1


# ---- the body model: each hostile case, its code and a message that says why -----------
@pytest.mark.parametrize("cid,body,code", hostile_chat_requests(), ids=[c for c, _, _ in hostile_chat_requests()])
def test_each_hostile_body_is_its_rows_error_with_a_reason(cid, body, code):
    spec = make_spec(
        "/tmp/in", "/tmp/out", io={"output_format": "openai_batch"}, sampling={"max_tokens": 8, "structured": None}
    )
    builder = PromptBuilder(spec, FakeTokenizer(), max_model_len=4096, input_format="openai_batch")
    prep = builder.prepare_openai({"url": "/v1/chat/completions", "body": body})
    assert prep.fault is not None and prep.token_ids is None
    got, message = prep.fault
    assert got == code, message
    assert message and len(message) <= 1000
    if code == "UNSUPPORTED_PARAMETER":
        assert "not supported" in message or "unknown field" in message


# ---- through run_shard ----------------------------------------------------------------
def test_hostile_rows_among_good_ones_leave_the_good_rows_as_without_them(tmp_path, fake_engine_factory):
    hostile = [(c, b) for c, b, _ in hostile_chat_requests()]
    good = good_chat_requests()
    # every hostile row, each after a good one (zip stops at the shorter list: enough good rows for all)
    mixed = [x for pair in zip(good * (len(hostile) // len(good) + 1), hostile) for x in pair]
    assert len(mixed) == len(hostile) * 2
    mixed = [(f"{c}#{n}" if c.startswith("good") else c, b) for n, (c, b) in enumerate(mixed)]
    spec, shard = openai_job(tmp_path / "a", mixed)
    m, res, err = run(spec, shard, fake_engine_factory)
    expected = {c: code for c, _, code in hostile_chat_requests()}
    assert {i: e["error_code"] for i, e in err.items()} == expected
    assert m["error_rows"] == len(hostile) and m["stats"]["step_failures"] == 0
    engine = fake_engine_factory.made[-1]
    assert engine.refused == 0  # every hostile row was refused before it reached the engine
    check(spec.io.output_uri, [c for c, _ in mixed], kind=None)
    clean = [(c, b) for c, b in mixed if c.startswith("good")]
    spec2, shard2 = openai_job(tmp_path / "b", clean)
    _, res2, err2 = run(spec2, shard2, fake_engine_factory)
    cols = ("output", "finish_reason", "prompt_tokens", "completion_tokens")
    assert not err2 and {i: [r[c] for c in cols] for i, r in res.items()} == {
        i: [r[c] for c in cols] for i, r in res2.items()
    }


def test_per_row_settings_reach_the_engine_and_are_honoured(tmp_path, fake_engine_factory):
    rows = [
        ("greedy", {"messages": user("same prompt")}),
        ("greedy-seed", {"messages": user("same prompt"), "seed": 99}),  # greedy ignores the seed
        ("sampled-a", {"messages": user("same prompt"), "temperature": 1, "seed": 1}),
        ("sampled-a2", {"messages": user("same prompt"), "temperature": 1, "seed": 1}),
        ("one-token", {"messages": user("same prompt"), "max_tokens": 1}),
        ("stopped", {"messages": user("same prompt"), "stop": ["-"]}),
    ]
    spec, shard = openai_job(tmp_path, rows)
    _, res, err = run(spec, shard, fake_engine_factory)
    assert not err
    assert res["greedy"]["output"] == res["greedy-seed"]["output"]
    assert res["sampled-a"]["output"] == res["sampled-a2"]["output"]  # a seed makes sampling reproducible
    assert res["one-token"]["finish_reason"] == "length" and res["one-token"]["completion_tokens"] == 1
    assert res["greedy"]["finish_reason"] == "stop" and res["greedy"]["completion_tokens"] == 2
    assert res["stopped"]["output"] == "out" and res["stopped"]["finish_reason"] == "stop"
    seen = {k[1]: p for k, p in fake_engine_factory.made[-1].params_seen}
    assert type(seen[4]).__name__ == ("SamplingParams" if vllm_importable() else "MirrorParams")
    assert seen[4].max_tokens == 1 and seen[2].temperature == 1 and seen[2].seed == 1


def test_a_refusal_that_slips_past_the_body_model_is_still_only_that_rows_error(
    tmp_path, fake_engine_factory, monkeypatch
):
    """Defence in depth: with the body model bypassed, vLLM's own refusal (at submit) is the row's
    INVALID_REQUEST; before isolation it was an uncaught VLLMValidationError (exit 75)."""
    rows = [("ok", {"messages": user()}), ("t3", {"messages": user("x")}), ("ok2", {"messages": user("y")})]
    spec, shard = openai_job(tmp_path, rows)

    original = PromptBuilder._prepare_openai

    def leaky(self, request):  # as if the body model let temperature 3 through
        prep = original(self, request)
        if request["body"]["messages"][0]["content"] == "x":
            prep.overrides = {"temperature": 3}
        return prep

    monkeypatch.setattr(PromptBuilder, "_prepare_openai", leaky)
    m, res, err = run(spec, shard, fake_engine_factory)
    assert set(res) == {"ok", "ok2"} and err["t3"]["error_code"] == "INVALID_REQUEST"
    assert "temperature" in err["t3"]["error_message"] and m["error_rows"] == 1
    assert fake_engine_factory.made[-1].refused == 1


def test_a_row_that_breaks_an_engine_step_is_bisected_out_and_batching_stays(tmp_path, fake_engine_factory):
    """A step fails whenever one row is in it (as a detokenizer failure would): the rows in flight
    run again in halves until that row fails alone, a probe passes, the row is ENGINE_ERROR."""
    ids = [f"r{i:04d}" for i in range(200)]
    texts = [f"ticket {i}" for i in range(200)]
    texts[137] = "ticket POISON"
    write_parquet(tmp_path / "in.parquet", ids, texts)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 1000, "chunk_rows": 20})
    (shard,) = plan_job(spec).shards
    poison = FakeTokenizer().encode("POISON", add_special_tokens=False)

    def contains(ids_):
        return any(ids_[j : j + len(poison)] == poison for j in range(len(ids_) - len(poison) + 1))

    m, res, err = run(spec, shard, lambda s: fake_engine_factory(s, fail_on=contains, per_step=16))
    assert set(err) == {"r0137"} and err["r0137"]["error_code"] == "ENGINE_ERROR"
    assert "alone" in err["r0137"]["error_message"] and "probe" in err["r0137"]["error_message"]
    s = m["stats"]
    assert s["engine_error_rows"] == 1 and 1 <= s["step_failures"] <= math.ceil(math.log2(200)) + 1
    engine = fake_engine_factory.made[-1]
    assert engine.probes == 1
    # batching: far fewer steps than rows (one request per step would be >= 200)
    assert engine.steps < 60
    rec = check(tmp_path / "out", ids, kind="row_breaks_engine_step", faults=s["step_failures"])
    assert rec.error_codes == {"r0137": "ENGINE_ERROR"}


def test_a_step_failure_that_does_not_come_back_costs_only_the_rerun(tmp_path, fake_engine_factory, set_faults):
    ids = [f"r{i:04d}" for i in range(120)]
    write_parquet(tmp_path / "in.parquet", ids, [f"ticket {i}" for i in range(120)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 1000, "chunk_rows": 20})
    (shard,) = plan_job(spec).shards
    set_faults("engine.step#3=raise")
    m, res, err = run(spec, shard, fake_engine_factory)
    assert len(res) == 120 and not err and m["stats"]["step_failures"] == 1
    assert fake_engine_factory.made[-1].probes == 0
    check(tmp_path / "out", ids, kind="transient_step_failure")


def test_a_step_that_fails_with_a_broken_engine_is_the_engines_failure(tmp_path, fake_engine_factory, set_faults):
    """Every step fails: bisected to one request, the probe fails too: EngineError (exit 75), no
    row is blamed."""
    ids = [f"r{i:04d}" for i in range(40)]
    write_parquet(tmp_path / "in.parquet", ids, [f"ticket {i}" for i in range(40)])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out", sharding={"target_rows": 1000, "chunk_rows": 50})
    (shard,) = plan_job(spec).shards
    with pytest.raises(EngineError, match="probe request failed") as e:
        run_shard(
            shard_task(spec=spec, shard_id=shard.shard_id),
            engine_factory=lambda s: fake_engine_factory(s, fail_on=lambda ids_: True),
        )
    assert e.value.exit_code == 75
    assert not list((tmp_path / "out" / "shards").glob("*/attempts/*/chunk-*.parquet"))  # no row blamed


def test_pooling_bisects_a_prompt_that_breaks_the_call(tmp_path, fake_engine_factory):
    ids = [f"k{i:03d}" for i in range(40)]
    texts = [f"kb article {i}" for i in range(40)]
    texts[11] = "POISON article"
    write_parquet(tmp_path / "in.parquet", ids, texts)
    spec = make_spec(
        tmp_path / "in.parquet",
        tmp_path / "out",
        task="embed",
        prompt={"system_prompt": None, "template": "{text}"},
        sampling={"structured": None},
        sharding={"target_rows": 1000, "chunk_rows": 16},
    )
    (shard,) = plan_job(spec).shards
    poison = ord("P") + 3
    m, res, err = run(spec, shard, lambda s: fake_engine_factory(s, fail_on=lambda p: poison in p))
    assert set(err) == {"k011"} and err["k011"]["error_code"] == "ENGINE_ERROR" and len(res) == 39
    assert m["stats"]["engine_error_rows"] == 1


def test_template_and_tokenizer_failures_of_one_row(tmp_path, fake_engine_factory):
    class Picky(FakeTokenizer):
        def apply_chat_template(self, messages, **kw):
            if any("{{bad}}" in m["content"] for m in messages):
                from jinja2.exceptions import TemplateError

                raise TemplateError("this template does not like the row")
            return super().apply_chat_template(messages, **kw)

        def encode(self, text, add_special_tokens=True):
            if "\ufdd0" in text:  # a noncharacter this tokenizer chokes on
                raise TypeError("cannot encode")
            return super().encode(text, add_special_tokens)

    def factory(s):
        e = fake_engine_factory(s)
        e.tokenizer = Picky()
        return e

    ids = [f"r{i}" for i in range(10)]
    texts = [f"ticket {i}" for i in range(10)]
    texts[3] = "a {{bad}} row"
    texts[6] = "odd \ufdd0 char"
    write_parquet(tmp_path / "in.parquet", ids, texts)
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    (shard,) = plan_job(spec).shards
    _, res, err = run(spec, shard, factory)
    assert {i: e["error_code"] for i, e in err.items()} == {"r3": "TEMPLATE_ERROR", "r6": "INVALID_ROW"}
    assert "does not like the row" in err["r3"]["error_message"] and len(res) == 8


def test_a_template_that_refuses_the_jobs_own_prompt_is_the_jobs_error(tmp_path, fake_engine_factory):
    """Not a row's fault: every row would fail. Terminal (exit 2), before any row is done."""

    class NoSystem(FakeTokenizer):
        def apply_chat_template(self, messages, **kw):
            if messages[0]["role"] == "system":
                from jinja2.exceptions import TemplateError

                raise TemplateError("System role not supported")
            return super().apply_chat_template(messages, **kw)

    def factory(s):
        e = fake_engine_factory(s)
        e.tokenizer = NoSystem()
        return e

    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["x", "y"])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    (shard,) = plan_job(spec).shards
    with pytest.raises(SpecError, match="System role not supported") as e:
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=factory)
    assert e.value.exit_code == 2


def test_failures_that_are_not_a_rows_are_not_swallowed(tmp_path, fake_engine_factory):
    class Preempted(Exception):
        """Named like worker.__main__.Preempted (SIGTERM)."""

    for exc in (MemoryError("host memory"), Preempted("signal 15"), RuntimeError("CUDA out of memory")):
        assert not row_caused(exc) and refusal(exc) is None

    class Exploding(FakeTokenizer):
        def encode(self, text, add_special_tokens=True):
            if "boom" in text:
                raise MemoryError("no memory left")
            return super().encode(text, add_special_tokens)

    def factory(s):
        e = fake_engine_factory(s)
        e.tokenizer = Exploding()
        return e

    write_parquet(tmp_path / "in.parquet", ["a", "b"], ["fine", "boom"])
    spec = make_spec(tmp_path / "in.parquet", tmp_path / "out")
    (shard,) = plan_job(spec).shards
    with pytest.raises(MemoryError):
        run_shard(shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=factory)


def test_the_guard_hands_a_refused_request_back_as_a_row_failure(tmp_path):
    spec = make_spec(tmp_path / "in", tmp_path / "out", sampling={"max_tokens": 8, "structured": None})
    g = GuardedEngine(spec, lambda s: FakeEngine(s))
    g.submit("good", [5, 6, 7])
    g.submit("empty", [])
    g.submit("hot", [5, 6, 7], {"temperature": 3})
    done = {}
    while g.pending():
        done.update(dict(g.step()))
    assert isinstance(done["empty"], RowFailure) and done["empty"].code == "INVALID_REQUEST"
    assert isinstance(done["hot"], RowFailure) and "temperature" in done["hot"].message
    assert not isinstance(done["good"], RowFailure)


def test_url_and_task_must_match(tmp_path, fake_engine_factory):
    rows = [("chat-ok", {"messages": user()}), ("emb", {"input": "x"}, "/v1/embeddings")]
    spec, shard = openai_job(tmp_path / "chat", rows)
    _, res, err = run(spec, shard, fake_engine_factory)
    assert set(res) == {"chat-ok"} and err["emb"]["error_code"] == "INVALID_ROW"
    assert "does not match this job's task 'chat'" in err["emb"]["error_message"]
    rows = [
        ("emb-ok", {"input": "x"}, "/v1/embeddings"),
        ("chat", {"messages": user()}),
        ("emb-empty", {"input": ""}, "/v1/embeddings"),
        ("emb-list", {"input": ["a"]}, "/v1/embeddings"),
    ]
    spec, shard = openai_job(tmp_path / "emb", rows, task="embed")
    _, res, err = run(spec, shard, fake_engine_factory)
    assert set(res) == {"emb-ok"}
    assert {i: e["error_code"] for i, e in err.items()} == {
        "chat": "INVALID_ROW",
        "emb-empty": "EMPTY_INPUT",
        "emb-list": "UNSUPPORTED_PARAMETER",
    }


def test_the_spec_refuses_what_vllm_would_refuse_for_every_row():
    for bad in ({"temperature": 3}, {"stop": [""]}, {"seed": 2**64}):
        with pytest.raises(SpecError):
            make_spec("/tmp/in", "/tmp/out", sampling=bad)


def test_a_one_off_failure_with_one_request_alone_does_not_blame_it(tmp_path):
    """Alone by chance (the last request) and failing once: it runs alone once more before a probe
    could blame it; here it then succeeds."""
    spec = make_spec(tmp_path / "in", tmp_path / "out", sampling={"max_tokens": 8, "structured": None})
    calls = []

    def once(ids_):
        calls.append(1)
        return len(calls) == 1

    g = GuardedEngine(spec, lambda s: FakeEngine(s, fail_on=once))
    g.submit("last", [5, 6, 7])
    done = {}
    while g.pending():
        done.update(dict(g.step()))
    assert not isinstance(done["last"], RowFailure) and g.step_failures == 1 and g.failed_rows == 0
    assert g.engine.probes == 0


def test_a_secret_cut_by_an_error_messages_length_limit_is_masked_before_the_cut(monkeypatch):
    """Error messages are cut (500, 300 characters): until 2026-12 the cut came first, so a secret or a URL's
    credentials straddling it left their first half in the row's ``error_message``, where no later masking of the
    whole value could find it."""
    from airflow_provider_vllm.worker.isolation import describe

    secret = "db-SENTINEL-pass-77"
    monkeypatch.setenv("DB_PASS", secret)
    monkeypatch.setenv("VLLM_BATCH_MASKED_ENV", "DB_PASS")
    for limit, exc in (
        (500, ValueError("x" * 440 + secret)),
        (500, TypeError("y" * 433 + "https://user:URLSENTINEL@host/x")),
    ):
        rejected = refusal(exc)
        assert rejected is not None and len(rejected.message) <= limit
        assert "SENTINEL" not in rejected.message and "db-SEN" not in rejected.message, rejected.message
    text = describe(ValueError("z" * 275 + secret), 300)
    assert "db-SEN" not in text and text.endswith("***")
