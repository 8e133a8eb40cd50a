"""OpenAI batch request lines: ids from custom_id, a whole request per row, and what is not a request."""

from __future__ import annotations

import json

from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.formats.files import detect_format
from airflow_provider_vllm.core.plan import Segment
from airflow_provider_vllm.core.storage import Storage
from tests.support.data import make_spec

OPENAI = input_format("openai_batch")
CHAT = "/v1/chat/completions"


def req(cid, body, url=CHAT, method="POST"):
    return {"custom_id": cid, "method": method, "url": url, "body": body}


def test_request_lines_are_rows_with_their_faults(tmp_path):
    msgs = {
        "messages": [
            {"role": "system", "content": "ab"},
            {"role": "user", "content": "cde"},
            {"role": "user", "content": [{"type": "text", "text": "not counted"}]},
        ]
    }
    reqs = [
        req("ok", msgs),
        req("get", msgs, method="GET"),
        req("url", msgs, url="/v1/completions"),
        req("str", "text"),
        req("emb", {"input": "four"}, url="/v1/embeddings"),
    ]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    root = Storage(str(tmp_path))
    assert detect_format(root, ["b.jsonl"], "auto") == "openai_batch" and OPENAI.carries_requests
    spec = make_spec(tmp_path / "b.jsonl", tmp_path / "out", sampling={"max_tokens": 8, "structured": None})
    scan = OPENAI.scan(root, ["b.jsonl"], spec, per_row=False)
    assert scan.chars.tolist() == [5, 5, 5, 0, 4] and scan.invalid == 0
    batch = OPENAI.read_rows(root, "b.jsonl", Segment(file=0, start=0, count=5), spec)
    assert batch.ids == ["ok", "get", "url", "str", "emb"]
    assert batch.values == {"_request": reqs} and batch.chars == scan.chars.tolist()
    assert batch.faults[0] is None and batch.faults[4] is None
    assert batch.faults[1] == ("INVALID_ROW", "method 'GET' is not POST")
    assert batch.faults[2][0] == "INVALID_ROW" and "url '/v1/completions' is not one of" in batch.faults[2][1]
    assert batch.faults[3] == ("INVALID_ROW", "body is not an object")


def test_ids_come_from_custom_id_not_the_id_column(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({**req("c1", {"input": "x"}), "id": "other"}) + "\n")
    spec = make_spec(tmp_path / "b.jsonl", tmp_path / "out", sampling={"max_tokens": 8, "structured": None})
    assert OPENAI.file_ids(Storage(str(tmp_path)), "b.jsonl", spec) == ["c1"]
    assert input_format("jsonl").file_ids(Storage(str(tmp_path)), "b.jsonl", spec) == ["other"]


def test_a_request_line_without_custom_id_is_refused_naming_custom_id(tmp_path):
    """vLLM's run-batch test input: a first line whose custom_id is missing is still a request line (a body and
    a url), so the input is the OpenAI batch format and the refusal names custom_id, not the id column."""
    import pytest

    from airflow_provider_vllm.core.errors import DatasetError
    from airflow_provider_vllm.steps.plan.planner import plan_job

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    lines = [
        {"invalid_field": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": body},
        {"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": body},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert detect_format(Storage(str(tmp_path)), ["in.jsonl"], "auto") == "openai_batch"
    with pytest.raises(DatasetError, match=r"in.jsonl line 1: no 'custom_id'") as e:
        plan_job(make_spec(tmp_path / "in.jsonl", tmp_path / "out", prompt={"system_prompt": None}))
    assert "'id'" not in str(e.value)
    lines[0] = {"custom_id": 17, **{k: v for k, v in lines[1].items() if k != "custom_id"}}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DatasetError, match=r"line 1: 'custom_id' is int '17'; the OpenAI batch format's custom_id is"):
        plan_job(make_spec(tmp_path / "in.jsonl", tmp_path / "out2", prompt={"system_prompt": None}))
    # a plain JSONL line is not a request: no body
    (tmp_path / "plain.jsonl").write_text(json.dumps({"id": "a", "text": "x", "url": "u"}) + "\n")
    assert detect_format(Storage(str(tmp_path)), ["plain.jsonl"], "auto") == "jsonl"
