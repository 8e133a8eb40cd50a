"""LoRA adapters through plan, worker, merge and the result cache, with the strict fake engine.

The fake engine's answer depends on the adapter a request ran with and on that adapter's files
(tests/support/fakes.py), so a row's answer shows which adapter the worker asked for; the real engine:
tests/vllm/test_lora_vllm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import InputChangedError
from airflow_provider_vllm.core.rows import INVALID_REQUEST, INVALID_ROW
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import PINNED_REVISION, make_spec, merge, shard_task, vouch_cache
from tests.support.fakes import FakeTokenizer, adapter_weights, answer
from tests.support.lora import write_adapter
from tests.unit.core.test_adapters import LLAMA

ENGINE = None  # the plan's default: the local engine identity (the fake engine runs in this Python)


@pytest.fixture
def adapters(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    return {n: write_adapter(tmp_path / "adapters" / n, model, seed=i) for i, n in enumerate(["billing", "refunds"])}


def adapter_spec(tmp_path, adapters, run="a", **model):
    return make_spec(
        tmp_path / f"in-{run}.parquet",
        tmp_path / f"out-{run}",
        model={
            "adapters": [{"name": n, "source": str(p)} for n, p in adapters.items()],
            "adapter_column": "which",
            **model,
        },
        sampling={"max_tokens": 8, "structured": None},
        prompt={"system_prompt": None, "template": "{text}"},
        sharding={"target_rows": 4, "chunk_rows": 2},
    )


def write_rows(path: Path, rows: list[tuple[str, str, object]]) -> None:
    pq.write_table(
        pa.table(
            {
                "id": [r[0] for r in rows],
                "text": [r[1] for r in rows],
                "which": pa.array(
                    [r[2] for r in rows],
                    pa.string() if all(isinstance(r[2], (str, type(None))) for r in rows) else pa.int64(),
                ),
            }
        ),
        path,
    )


def run(spec, factory):
    plan = plan_job(spec)
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    merge(spec)
    vouch_cache(spec)  # publish's step for the cache (none without cache.uri)
    out = Path(spec.io.output_uri)
    res = {r["id"]: r for r in pq.read_table(out / RESULTS).to_pylist()}
    err = {r["id"]: r for r in pq.read_table(out / ERRORS).to_pylist()}
    return plan, res, err


def expected(spec, text, adapter):
    tok = FakeTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return answer(spec, tok.encode(ids, add_special_tokens=False), None, adapter, adapter_weights(spec).get(adapter))


def test_each_row_runs_with_the_adapter_its_column_names(tmp_path, adapters, fake_engine_factory):
    rows = [
        ("b", "the same ticket", "billing"),
        ("r", "the same ticket", "refunds"),
        ("d", "the same ticket", None),  # model.default_adapter: none, the base model
        ("e", "the same ticket", ""),
        ("x", "the same ticket", "marketing"),
    ]
    write_rows(tmp_path / "in-a.parquet", rows)
    spec = adapter_spec(tmp_path, adapters)
    plan, res, err = run(spec, fake_engine_factory)
    assert [a.name for a in plan.adapters] == ["billing", "refunds"] and all(a.sha256 for a in plan.adapters)
    assert {i: r["adapter"] for i, r in res.items()} == {"b": "billing", "r": "refunds", "d": None, "e": None}
    answers = {i: r["output"] for i, r in res.items()}
    assert answers["b"] == expected(spec, "the same ticket", "billing")
    assert answers["r"] == expected(spec, "the same ticket", "refunds")
    assert answers["d"] == answers["e"] == expected(spec, "the same ticket", None)
    assert len({answers["b"], answers["r"], answers["d"]}) == 3
    assert (
        err["x"]["error_code"] == INVALID_ROW
        and "'marketing', not one of the job's adapters" in err["x"]["error_message"]
    )
    seen = {a for e in fake_engine_factory.made for _, a in e.adapters_seen}
    assert seen == {"billing", "refunds", None}


def test_a_default_adapter_answers_rows_that_pick_none(tmp_path, adapters, fake_engine_factory):
    write_rows(tmp_path / "in-a.parquet", [("n", "t", None), ("r", "t", "refunds")])
    spec = adapter_spec(tmp_path, adapters, default_adapter="billing")
    _, res, _ = run(spec, fake_engine_factory)
    assert {i: r["adapter"] for i, r in res.items()} == {"n": "billing", "r": "refunds"}


def test_a_non_text_adapter_value_is_the_rows_error(tmp_path, adapters, fake_engine_factory):
    write_rows(tmp_path / "in-a.parquet", [("n", "t", 3), ("m", "t", None)])
    _, res, err = run(adapter_spec(tmp_path, adapters), fake_engine_factory)
    assert set(res) == {"m"} and err["n"]["error_code"] == INVALID_ROW and "holds int" in err["n"]["error_message"]


def test_an_adapter_changed_after_the_plan_fails_the_shard(tmp_path, adapters, fake_engine_factory):
    write_rows(tmp_path / "in-a.parquet", [("b", "t", "billing")])
    spec = adapter_spec(tmp_path, adapters)
    plan = plan_job(spec)
    (adapters["refunds"] / "adapter_model.safetensors").write_bytes(b"other weights")
    with pytest.raises(InputChangedError, match=r"adapters\[refunds\].*changed since the plan"):
        run_shard(shard_task(spec=spec, shard_id=plan.shards[0].shard_id), engine_factory=fake_engine_factory)
    assert not fake_engine_factory.made  # refused before the engine started


def test_openai_requests_pick_adapters_by_body_model(tmp_path, adapters, fake_engine_factory):
    def req(cid, model):
        body = {"messages": [{"role": "user", "content": "refund please"}], "max_tokens": 4}
        if model is not None:
            body["model"] = model
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}

    lines = [req("base", "m"), req("billing", "billing"), req("none", None), req("other", "NonExistModel")]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    doc = {
        "io": {
            "input_uri": str(tmp_path / "batch.jsonl"),
            "output_uri": str(tmp_path / "out"),
            "output_format": "openai_batch",
        },
        "model": {
            "adapters": [{"name": n, "source": str(p)} for n, p in adapters.items()],
            "default_adapter": "refunds",
        },
        "prompt": {"system_prompt": None, "template": "{text}"},
        "sampling": {"max_tokens": 8, "structured": None},
    }
    spec = make_spec(tmp_path / "batch.jsonl", tmp_path / "out", **doc)
    _, res, err = run(spec, fake_engine_factory)
    assert {i: r["adapter"] for i, r in res.items()} == {"base": None, "billing": "billing", "none": "refunds"}
    assert err["other"]["error_code"] == INVALID_REQUEST
    assert "'NonExistModel' does not exist in this job" in err["other"]["error_message"]
    out = [json.loads(x) for x in (tmp_path / "out" / "openai" / "output.jsonl").read_text().splitlines()]
    assert {o["custom_id"]: o["response"]["body"]["model"] for o in out} == {
        "base": "m",
        "billing": "billing",
        "none": "refunds",
    }

    ignoring = make_spec(
        tmp_path / "batch.jsonl",
        tmp_path / "out-ignore",
        **{**doc, "io": {**doc["io"], "output_uri": str(tmp_path / "out-ignore"), "ignore_request_model": True}},
    )
    _, res, err = run(ignoring, fake_engine_factory)
    assert not err and {r["adapter"] for r in res.values()} == {"refunds"}


def test_the_cache_keys_each_rows_adapter_and_each_adapters_bytes(tmp_path, adapters, fake_engine_factory):
    rows = [(f"r{i}", f"ticket {i}", ["billing", "refunds", None][i % 3]) for i in range(12)]
    for run_name in ("a", "b", "c", "d"):
        write_rows(tmp_path / f"in-{run_name}.parquet", rows)

    def spec(run_name):
        return adapter_spec(
            tmp_path,
            adapters,
            run=run_name,
            revision=PINNED_REVISION,
        ).model_copy(update={"cache": make_spec("/i", "/o", cache={"uri": str(tmp_path / "cache")}).cache})

    a, b = spec("a"), spec("b")
    run(a, fake_engine_factory)
    plan_b, res_b, _ = run(b, fake_engine_factory)
    assert plan_b.cache.hits == 12 and {r["adapter"] for r in res_b.values()} == {"billing", "refunds", None}
    assert all(r["cached_from"] for r in res_b.values())

    # the same rows picking other adapters: those rows miss, the others hit
    moved = [(i, t, "refunds" if w == "billing" else w) for i, t, w in rows]
    write_rows(tmp_path / "in-c.parquet", moved)
    plan_c, res_c, _ = run(spec("c"), fake_engine_factory)
    assert plan_c.cache.hits == 8 and plan_c.cache.misses == 4
    assert {i: r["adapter"] for i, r in res_c.items()} == {i: w for i, _, w in moved}

    # one adapter's weights change: the key config changes, no row is served from the cache
    write_adapter(adapters["billing"], Path(tmp_path / "model"), seed=99)
    plan_d, _, _ = run(spec("d"), fake_engine_factory)
    assert plan_d.cache.hits == 0 and plan_d.cache.key_hash != plan_b.cache.key_hash


def test_new_weights_for_an_adapter_miss_the_cache_and_move_its_rows_for_the_settings(
    tmp_path, adapters, fake_engine_factory
):
    """The same job the next night, after the billing adapter was retrained in place (same folder, same name):
    no row is served from the cache, and the change set says the billing rows moved for the settings, as it
    says for another model revision; the other rows are unchanged."""
    from airflow_provider_vllm.steps.merge.changes import CHANGES, compute_changes

    rows = [(f"r{i}", f"ticket {i}", ["billing", "refunds", None][i % 3]) for i in range(12)]
    for run_name in ("a", "b"):
        write_rows(tmp_path / f"in-{run_name}.parquet", rows)

    def spec(run_name, previous=None):
        s = adapter_spec(tmp_path, adapters, run=run_name, revision=PINNED_REVISION)
        return s.model_copy(
            update={
                "cache": make_spec("/i", "/o", cache={"uri": str(tmp_path / "cache")}).cache,
                "changes": make_spec("/i", "/o", changes={"previous_uri": previous}).changes,
            }
        )

    _, res_a, _ = run(spec("a"), fake_engine_factory)
    write_adapter(adapters["billing"], Path(tmp_path / "model"), seed=99)
    b = spec("b", previous=str(tmp_path / "out-a"))
    plan_b, res_b, _ = run(b, fake_engine_factory)
    assert plan_b.cache.hits == 0 and plan_b.cache.misses == 12
    assert plan_b.config_hash == json.loads((tmp_path / "out-a" / "_plan.json").read_text())["config_hash"]
    billing = {i for i, _, w in rows if w == "billing"}
    assert {i for i in res_b if res_b[i]["output"] != res_a[i]["output"]} == billing  # its new weights answer

    summary = compute_changes(b)
    got = {r["id"]: (r["change"], r["reason"]) for r in pq.read_table(tmp_path / "out-b" / CHANGES).to_pylist()}
    assert got == {i: ("changed", "settings") if i in billing else ("unchanged", None) for i, _, _ in rows}
    assert summary.reasons["settings"] == len(billing) and any("billing (sha256:" in n for n in summary.notes)


def test_adapter_copies_go_where_the_deployment_says_and_are_removed_after(
    tmp_path, adapters, monkeypatch, fake_engine_factory
):
    """VLLM_BATCH_ADAPTER_DIR (a pod: /cache/adapters, the large emptyDir, not the 4Gi /tmp) holds the copies
    vLLM loads, each in a private folder removed when the shard ends."""
    import contextlib

    import airflow_provider_vllm.worker.shard as shard_module

    root = tmp_path / "copies"
    monkeypatch.setenv("VLLM_BATCH_ADAPTER_DIR", str(root))
    given = {}
    real = shard_module.local_adapters

    @contextlib.contextmanager
    def watched(spec, plan):
        with real(spec, plan) as paths:
            given.update(paths)
            assert all((Path(p) / "adapter_config.json").is_file() for p in paths.values())  # there while it runs
            yield paths

    monkeypatch.setattr(shard_module, "local_adapters", watched)
    write_rows(tmp_path / "in-a.parquet", [("b", "t", "billing"), ("r", "t", "refunds")])
    _, res, _ = run(adapter_spec(tmp_path, adapters), fake_engine_factory)
    assert set(res) == {"b", "r"} and set(given) == {"billing", "refunds"}
    assert all(Path(p).resolve().is_relative_to(root.resolve()) for p in given.values())
    assert (root.stat().st_mode & 0o777) == 0o700 and list(root.iterdir()) == []


def test_the_pod_puts_adapter_copies_on_the_cache_volume():
    from airflow_provider_vllm.utils.pod_spec import BASE_ENV, CACHE_DIR

    assert BASE_ENV["VLLM_BATCH_ADAPTER_DIR"].startswith(CACHE_DIR + "/")


ADAPTER_HOLDER = """
import json, sys
from airflow_provider_vllm.core.plan import load_plan
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.worker.adapters import local_adapters
with open(sys.argv[1]) as f:
    spec = JobSpec.model_validate_json(f.read())
with local_adapters(spec, load_plan(spec)) as paths:
    print(json.dumps(paths), flush=True)
    sys.stdin.readline()  # serves them until killed
"""


def test_adapter_copies_left_by_a_worker_killed_with_sigkill_are_removed_by_the_next_worker(
    tmp_path, adapters, monkeypatch
):
    """A worker killed with SIGKILL (the OOM killer) cannot remove its adapter copies (each as large as an
    adapter): the next worker's removes them before making its own."""
    import os
    import subprocess
    import sys

    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.worker.adapters import local_adapters
    from tests.support import ROOT

    root = tmp_path / "copies"
    monkeypatch.setenv("VLLM_BATCH_ADAPTER_DIR", str(root))
    write_rows(tmp_path / "in-a.parquet", [("b", "t", "billing"), ("r", "t", "refunds")])
    spec = adapter_spec(tmp_path, adapters)
    plan_job(spec)
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", ADAPTER_HOLDER, str(tmp_path / "spec.json")]
    killed = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    left = json.loads(killed.stdout.readline())
    killed.kill()
    killed.wait()
    assert set(left) == {"billing", "refunds"} and all(Path(p).is_dir() for p in left.values())
    with local_adapters(spec, load_plan(spec)) as paths:
        assert not any(Path(p).exists() for p in left.values())
        assert [p.name for p in root.iterdir() if p.is_dir()] == [Path(paths["billing"]).parent.name]
    assert list(root.iterdir()) == []
