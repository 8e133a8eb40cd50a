"""The real worker process on real vLLM (CPU build) with real small models.

Each worker process starts its own engine (~25 s here), so the tests share runs where they can:
the session fixtures ``tiny_run`` and ``raw_smollm2`` (tests/vllm/conftest.py); tests about what the worker
computes, not about its process, run their shards in the test process's ``shard_server``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.commit import MARKER
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.task import worker_command
from tests.conftest import worker_environ
from tests.support.data import merge, shard_task, write_parquet
from tests.support.reconcile import check

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LABELS = ["billing", "bug", "other"]
SYSTEM = (
    "You classify support tickets. billing = money, charges, refunds, invoices. "
    "bug = the software crashes or is broken. other = anything else. Answer with one word."
)
TICKETS = [
    "I was charged twice for my subscription this month, please refund one payment.",
    "The app crashes every time I open the settings page on Android.",
    "Can you tell me where your office is located?",
    "My invoice shows the wrong VAT number.",
    "After the last update the export button does nothing and the page freezes.",
    "Do you have a student discount?",
    "The refund you promised two weeks ago has not arrived on my card.",
    "Login fails with error 500 since yesterday.",
]
ENV = {
    **os.environ,
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
}


def planted_rows(n: int) -> tuple[list[str], list[str | None], dict[str, str]]:
    """ids, texts (three of them bad) and the bad rows' expected error codes."""
    ids = [f"t{i:04d}" for i in range(n)]
    texts: list[str | None] = [TICKETS[i % len(TICKETS)] + f" (ref {i})" for i in range(n)]
    texts[2] = None
    texts[5] = "  "
    texts[11] = "please help " * 600  # far beyond max_model_len 512
    return ids, texts, {"t0002": "EMPTY_INPUT", "t0005": "EMPTY_INPUT", "t0011": "PROMPT_TOO_LONG"}


def planted(tmp_path: Path, n: int) -> dict[str, str]:
    ids, texts, codes = planted_rows(n)
    write_parquet(tmp_path / "in" / "part-0.parquet", ids[: n // 2], texts[: n // 2], row_group_size=16)
    write_parquet(tmp_path / "in" / "part-1.parquet", ids[n // 2 :], texts[n // 2 :], row_group_size=16)
    return codes


def spec_for(model: str, tmp_path: Path, **sharding) -> JobSpec:
    return JobSpec.load(
        {
            "model": {"name": model, "max_model_len": 512},
            "engine": {"enforce_eager": True, "max_num_seqs": 32},
            "io": {"input_uri": str(tmp_path / "in"), "output_uri": str(tmp_path / "out")},
            "prompt": {"system_prompt": SYSTEM, "template": "Ticket: {text}"},
            "sampling": {"temperature": 0, "max_tokens": 8, "structured": {"choice": LABELS}},
            "sharding": {"target_rows": 10_000, "chunk_rows": 16, **sharding},
        }
    )


def run_worker(spec: JobSpec, shard_id: str, **popen) -> subprocess.CompletedProcess:
    cmd = worker_command(shard_task(spec=spec, shard_id=shard_id, progress_interval_s=1))
    return subprocess.run(cmd, env=worker_environ(ENV), capture_output=True, text=True, timeout=600, **popen)


def manifest(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])


def check_exactly_once(out: Path, n: int, planted_codes: dict[str, str]):
    res = pq.read_table(out / "results").to_pylist()
    err = pq.read_table(out / "errors").to_pylist()
    ids = [r["id"] for r in res] + [e["id"] for e in err]
    assert sorted(ids) == [f"t{i:04d}" for i in range(n)]
    assert {e["id"]: e["error_code"] for e in err} == planted_codes
    return res, err


def test_tiny_model_worker_cli_planted_rows_and_rerun(tiny_run):
    spec, proc = tiny_run.spec, tiny_run.proc
    m = manifest(proc)
    assert m["status"] == "committed" and m["rows"] == 80 and m["error_rows"] == 3
    assert "progress shard-" in proc.stderr and "rows=80/80" in proc.stderr
    merge(spec)
    res, _ = check_exactly_once(tiny_run.root / "out", 80, tiny_run.codes)
    assert all(r["label"] in LABELS and r["valid"] for r in res)  # structured choice holds on random weights
    assert res[0]["engine_version"] and res[0]["model"] == tiny_run.model
    again = manifest(run_worker(spec, tiny_run.shard_id))
    assert again["status"] == "already_committed"


@pytest.mark.reliability
def test_kill9_mid_shard_then_rerun_reuses_chunks(tmp_path, tiny_model):
    n = 240  # 12 chunks: the kill after the 2nd lands well before the last (the rerun does the rest)
    ids = [f"t{i:04d}" for i in range(n)]
    # distinct texts: each row goes to the engine (identical prompts would be inferred once, docs/cache.md)
    write_parquet(tmp_path / "in" / "a.parquet", ids, [TICKETS[i % 8] + f" (ref {i})" for i in range(n)])
    spec = spec_for(tiny_model, tmp_path, chunk_rows=20)
    spec = JobSpec.load({**spec.model_dump(mode="json"), "sampling": {"temperature": 0, "max_tokens": 24}})
    (shard,) = plan_job(spec).shards
    cmd = worker_command(shard_task(spec=spec, shard_id=shard.shard_id))
    proc = subprocess.Popen(
        cmd, env=worker_environ(ENV), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    shard_dir = tmp_path / "out" / "shards" / shard.shard_id
    deadline = time.time() + 300
    while time.time() < deadline and len(list(shard_dir.glob("attempts/*/chunk-?????.seal.json"))) < 2:
        assert proc.poll() is None, "worker ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the worker and its engine processes, no clean-up
    proc.wait()
    # a chunk is complete once its seal is written: a chunk killed between its files and its seal is redone
    done = list(shard_dir.glob("attempts/*/chunk-?????.seal.json"))
    assert 2 <= len(done) < n // 20 and not (shard_dir / MARKER).exists()
    m = manifest(run_worker(spec, shard.shard_id))
    assert m["status"] == "committed" and m["stats"]["reused_chunks"] == len(done)
    summary = merge(spec).dump()
    assert summary["ok_rows"] == n and summary["duplicates_dropped"] == 0
    check_exactly_once(tmp_path / "out", n, {})
    check(tmp_path / "out", ids, kind="kill9_process_group_mid_shard", level="process")


# Raw vLLM scripts end like the worker (exits.exit_hard): the answer is printed, then the engine
# processes are killed and the script leaves with os._exit. Python's own teardown of vLLM can abort
# (SIGABRT); and os._exit alone would orphan the engine core, which keeps our stdout pipe open.
LEAVE = "from airflow_provider_vllm.worker.exits import exit_hard as leave\n"

# Raw vLLM on SmolLM2 for two tests, one engine (the ``raw_smollm2`` fixture, tests/vllm/conftest.py):
# "llm_chat": LLM.chat over the planted rows that succeed; "tokens": for the generate and the chat task, the
# worker's single tokenisation (PromptBuilder over the engine's tokenizer) as TokensPrompt next to the
# same rows as text (LLM.generate) or as conversations (LLM.chat). Each call computes from scratch: a
# prefix-cache hit (the same prompts a moment ago) changes the arithmetic enough to flip a near-tie of
# greedy decoding now and then.
RAW_SMOLLM2 = (
    LEAVE
    + r"""
import json, math, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    from airflow_provider_vllm.core.spec import JobSpec
    from airflow_provider_vllm.worker.prompts import PromptBuilder
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], max_model_len=512, enforce_eager=True, max_num_seqs=32, dtype=a["dtype"])
    c = a["chat"]
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=0,
                        structured_outputs=StructuredOutputsParams(choice=c["labels"]))
    convs = [[{"role": "system", "content": c["system"]}, {"role": "user", "content": "Ticket: " + t}]
             for t in c["texts"]]
    llm.reset_prefix_cache()
    outs = [o.outputs[0] for o in llm.chat(convs, sp, use_tqdm=False)]
    # the chosen tokens' logprobs (logprobs=0: the sampled token's own), as vLLM computed them
    chosen = [[step[tid].logprob for tid, step in zip(o.token_ids, o.logprobs)] for o in outs]
    res = {"llm_chat": [o.text for o in outs], "confidence": [[math.exp(sum(c)), len(c)] for c in chosen],
           "tokens": {}}
    t = a["tokens"]
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=t["max_tokens"])
    for task, doc in t["specs"].items():
        spec = JobSpec.load(doc)
        builder = PromptBuilder(spec, tok, 512)
        preps = [builder.prepare({"text": x}) for x in t["texts"]]
        llm.reset_prefix_cache()
        as_tokens = llm.generate([TokensPrompt(prompt_token_ids=p.token_ids) for p in preps], sp, use_tqdm=False)
        users = [spec.prompt.template.format(text=x) for x in t["texts"]]
        llm.reset_prefix_cache()
        if task == "generate":
            as_text = llm.generate(users, sp, use_tqdm=False)
        else:
            as_text = llm.chat([[{"role": "system", "content": spec.prompt.system_prompt},
                                 {"role": "user", "content": u}] for u in users], sp, use_tqdm=False)
        res["tokens"][task] = {"tokens": [[list(o.prompt_token_ids), o.outputs[0].text] for o in as_tokens],
                               "text": [[list(o.prompt_token_ids), o.outputs[0].text] for o in as_text]}
    print("RAW " + json.dumps(res), flush=True)
    leave(0)
"""
)


def test_smollm2_labels_and_confidence_equal_raw_llm_chat(tmp_path, smollm2, raw_smollm2, shard_server):
    n = 48
    codes = planted(tmp_path, n)
    # float32: in bf16 the worker's batches (a deep queue) and LLM.chat's differ enough to flip a
    # greedy near-tie now and then (seen once in CI: 'billing' vs 'bug'); the claim is about prompts
    spec = spec_for(smollm2, tmp_path)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"dtype": "float32"})})
    (shard,) = plan_job(spec).shards
    m = shard_server.run(spec, shard.shard_id)
    assert m["status"] == "committed" and m["ok_rows"] == n - 3
    merge(spec)
    res, _ = check_exactly_once(tmp_path / "out", n, codes)
    assert all(r["label"] in LABELS for r in res)
    # a real model classifies: the crash and charge tickets get their labels
    by_id = {r["id"]: r for r in res}
    assert by_id["t0000"]["label"] == "billing" and by_id["t0001"]["label"] == "bug"

    # raw LLM.chat got the texts of the rows that succeed, in input order (planted_rows: the fixture's input)
    table = pq.read_table(tmp_path / "in").to_pylist()
    rows = [t for t in table if t["id"] in by_id]
    ids, texts, _ = planted_rows(n)
    assert [(t["id"], t["text"]) for t in rows] == [(i, x) for i, x in zip(ids, texts) if i in by_id]
    ours = [by_id[t["id"]]["output"] for t in rows]
    assert ours == raw_smollm2["llm_chat"]

    # a structured-choice answer's confidence is exp(sum of the chosen tokens' logprobs) of vLLM's own
    # output (LLM.chat with logprobs=0 over the same prompts), within 1e-5 (float32: in bf16 the batches of
    # the two differ enough to move low bits of a logit)
    assert spec.confidence_from_logprobs  # structured choice: on by default
    for t, (prob, n_tokens) in zip(rows, raw_smollm2["confidence"]):
        row = by_id[t["id"]]
        assert row["completion_tokens"] == n_tokens and abs(row["confidence"] - prob) <= 1e-5, (t["id"], prob)
    confs = [r["confidence"] for r in res]
    assert all(0 < c <= 1 for c in confs) and max(confs) - min(confs) > 0.05  # a real spread, not a constant


@pytest.mark.reliability
def test_two_real_attempts_at_once_commit_exactly_once(tmp_path, tiny_model):
    n = 120
    texts = [TICKETS[i % 8] + f" (ref {i})" for i in range(n)]  # distinct: every row goes to the engine
    write_parquet(tmp_path / "in" / "a.parquet", [f"t{i:04d}" for i in range(n)], texts)
    spec = spec_for(tiny_model, tmp_path)
    (shard,) = plan_job(spec).shards
    xcom = [tmp_path / "xcom-a", tmp_path / "xcom-b"]
    procs = []
    for name, d in zip(("attempt-a", "attempt-b"), xcom):
        d.mkdir()
        cmd = worker_command(shard_task(spec=spec, shard_id=shard.shard_id, attempt_id=name))
        procs.append(
            subprocess.Popen(
                cmd,
                env={**worker_environ(ENV), "VLLM_BATCH_XCOM_DIR": str(d)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    manifests = [json.loads((d / "return.json").read_text()) for d in xcom]  # the KPO XCom file
    statuses = sorted(m["status"] for m in manifests)
    marker = json.loads((tmp_path / "out" / "shards" / shard.shard_id / MARKER).read_text())
    # one commits; the other saw the marker at start or lost the create-only race at the end
    assert statuses == ["already_committed", "committed"]
    assert all(m["attempt_id"] == marker["attempt_id"] for m in manifests)
    summary = merge(spec).dump()
    assert summary["ok_rows"] == n and summary["duplicates_dropped"] == 0
    res = pq.read_table(tmp_path / "out" / "results")
    assert set(res.column("attempt_id").to_pylist()) == {marker["attempt_id"]}
    check(tmp_path / "out", [f"t{i:04d}" for i in range(n)], kind="concurrent_attempts_real", level="process")


def test_embed_task_with_minilm(tmp_path, shard_server):
    from airflow_provider_vllm.testing.local_models import minilm_path

    ids = [f"k{i}" for i in range(30)]
    texts = [f"How do I reset my password? variant {i}" for i in range(30)]
    texts[4] = ""
    write_parquet(tmp_path / "in" / "kb.parquet", ids, texts)
    spec = JobSpec.load(
        {
            "task": "embed",
            "model": {"name": str(minilm_path())},
            "engine": {"enforce_eager": True},
            "io": {"input_uri": str(tmp_path / "in"), "output_uri": str(tmp_path / "out")},
            "prompt": {"template": "{text}"},
            "sharding": {"chunk_rows": 8},
        }
    )
    (shard,) = plan_job(spec).shards
    m = shard_server.run(spec, shard.shard_id)
    assert m["ok_rows"] == 29 and m["error_rows"] == 1
    merge(spec)
    res = pq.read_table(tmp_path / "out" / "results").to_pylist()
    assert len(res) == 29 and all(len(r["embedding"]) == 384 for r in res)
    import numpy as np

    a, b = np.array(res[0]["embedding"]), np.array(res[1]["embedding"])
    assert 0.8 < float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) <= 1.0001  # near-duplicate texts


def test_classify_task_with_a_sequence_classification_model(tmp_path, tiny_model, shard_server):
    """A tiny random LlamaForSequenceClassification (3 labels) made from the tiny model."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "tiny-cls"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(
        architectures=["LlamaForSequenceClassification"],
        num_labels=3,
        id2label={"0": "billing", "1": "bug", "2": "other"},
        label2id={"billing": 0, "bug": 1, "other": 2},
    )
    (model / "config.json").write_text(json.dumps(cfg))
    w = load_file(model / "model.safetensors")
    w.pop("lm_head.weight")
    w["score.weight"] = (torch.randn(3, cfg["hidden_size"], generator=torch.Generator().manual_seed(0)) * 0.02).to(
        torch.bfloat16
    )
    save_file(w, model / "model.safetensors", metadata={"format": "pt"})

    write_parquet(
        tmp_path / "in" / "a.parquet",
        [f"c{i}" for i in range(20)],
        [TICKETS[i % 8] + f" (ref {i})" if i != 3 else None for i in range(20)],  # distinct: all 20 inferred
    )
    spec = JobSpec.load(
        {
            "task": "classify",
            "model": {"name": str(model), "max_model_len": 512},
            "engine": {"enforce_eager": True},
            "io": {"input_uri": str(tmp_path / "in"), "output_uri": str(tmp_path / "out")},
            "sharding": {"chunk_rows": 8},
        }
    )
    (shard,) = plan_job(spec).shards
    m = shard_server.run(spec, shard.shard_id)
    assert m["ok_rows"] == 19 and m["error_rows"] == 1
    merge(spec)
    res = pq.read_table(tmp_path / "out" / "results").to_pylist()
    assert all(len(r["scores"]) == 3 and abs(sum(r["scores"]) - 1) < 1e-3 for r in res)
    assert all(r["label"] in LABELS for r in res)


TOKEN_TEXTS = [
    TICKETS[i % len(TICKETS)] + (" Übergröße, naïve café — 😀" if i % 5 == 0 else f" (ref {i})") for i in range(12)
]


def token_specs(model: str, tmp_path: Path) -> tuple[JobSpec, dict]:
    """The generate job the worker runs, and the chat job's document (raw vLLM only)."""
    gen = JobSpec.load(
        {
            "task": "generate",
            # float32: bf16 rounding leaves near-ties that greedy decoding may break either way
            # when anything about the batch differs; the claim tested here is about the prompt
            "model": {"name": model, "max_model_len": 512, "dtype": "float32"},
            "engine": {"enforce_eager": True, "max_num_seqs": 32},
            "io": {"input_uri": str(tmp_path / "in"), "output_uri": str(tmp_path / "out")},
            "prompt": {"template": "Support ticket: {text}\nShort reply:"},
            "sampling": {"temperature": 0, "max_tokens": 24},
            "sharding": {"chunk_rows": 5},
        }
    )
    chat = {
        **gen.model_dump(mode="json"),
        "task": "chat",
        "prompt": {"system_prompt": SYSTEM, "template": "Ticket: {text}"},
    }
    return gen, chat


def test_token_prompts_give_the_same_outputs_as_text_prompts(tmp_path, smollm2, raw_smollm2, shard_server):
    """The worker tokenises once and hands vLLM token ids (TokensPrompt). Raw vLLM given the
    same rows as text (LLM.generate) or as conversations (LLM.chat) sees the same prompt tokens
    and produces the same outputs, for the generate and the chat task; and the worker's
    generate-task outputs equal raw LLM.generate over text prompts. (Worker vs LLM.chat runs
    through the worker in test_smollm2_labels_and_confidence_equal_raw_llm_chat.)"""
    n = len(TOKEN_TEXTS)
    write_parquet(tmp_path / "in" / "a.parquet", [f"g{i:03d}" for i in range(n)], TOKEN_TEXTS)
    gen, _ = token_specs(smollm2, tmp_path)
    (shard,) = plan_job(gen).shards
    m = shard_server.run(gen, shard.shard_id)
    assert m["status"] == "committed" and m["ok_rows"] == n
    merge(gen)
    ours = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results").to_pylist()}

    res = raw_smollm2["tokens"]
    for task in ("generate", "chat"):
        assert [ids for ids, _ in res[task]["tokens"]] == [ids for ids, _ in res[task]["text"]], task
        assert [out for _, out in res[task]["tokens"]] == [out for _, out in res[task]["text"]], task
        assert all(out for _, out in res[task]["text"])  # a real model answers something
    raw_gen = res["generate"]["text"]
    assert [ours[f"g{i:03d}"]["output"] for i in range(n)] == [out for _, out in raw_gen]
    assert [ours[f"g{i:03d}"]["prompt_tokens"] for i in range(n)] == [len(ids) for ids, _ in raw_gen]


def test_date_and_decimal_template_columns_are_answered_by_real_vllm(tmp_path, tiny_model, shard_server):
    """A template with a date and a decimal column (every row an INVALID_ROW error before: "holds date, expected a
    scalar"): on real vLLM every row is answered, and the prompt the engine saw holds the values as the worker renders
    them (ISO date, the decimal's scale): its token count is the model's own chat template over that text."""
    import datetime as dt
    import decimal

    import pyarrow as pa
    from transformers import AutoTokenizer

    n = 6
    write_parquet(
        tmp_path / "in" / "a.parquet",
        [f"t{i:04d}" for i in range(n)],
        TICKETS[:n],
        due=pa.array([dt.date(2024, 3, 1 + i) for i in range(n)], pa.date32()),
        amount=pa.array([decimal.Decimal(f"{i + 1}2.50") for i in range(n)], pa.decimal128(10, 2)),
    )
    spec = JobSpec.load(
        {
            "model": {"name": tiny_model, "max_model_len": 512},
            "engine": {"enforce_eager": True, "max_num_seqs": 32},
            "io": {"input_uri": str(tmp_path / "in"), "output_uri": str(tmp_path / "out")},
            "prompt": {
                "system_prompt": SYSTEM,
                "template": "Ticket: {text} (due {due}, amount {amount})",
                "text_columns": ["text"],
            },
            "sampling": {"temperature": 0, "max_tokens": 8, "structured": {"choice": LABELS}},
            "sharding": {"target_rows": 10_000, "chunk_rows": 16},
        }
    )
    (shard,) = plan_job(spec).shards
    m = shard_server.run(spec, shard.shard_id)
    assert m["status"] == "committed" and (m["ok_rows"], m["error_rows"]) == (n, 0)
    merge(spec)
    res = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results").to_pylist()}
    assert len(res) == n and all(r["label"] in LABELS for r in res.values())
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for i in range(n):
        text = f"Ticket: {TICKETS[i]} (due 2024-03-0{1 + i}, amount {i + 1}2.50)"
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert res[f"t{i:04d}"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False)), i
