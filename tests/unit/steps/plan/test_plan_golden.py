"""Plans are stable: the ``_plan.json`` of fixed inputs matches a recorded golden file.

The golden files were recorded from the planner before the input-format interface
(``core/formats``) replaced its format branches; a refactoring that changes a shard id, a
segment, the fingerprint or a row count fails here. Only what legitimately varies is
normalised: the tmp folder in URIs, the versions in ``created_with``, and the spec hashes
(the spec holds the tmp paths; they are checked against the spec instead).

Re-record (only for an intended change of the plan): ``UPDATE_GOLDEN=1 pytest <this file>``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from airflow_provider_vllm.core.plan import PLAN_FILE, load_plan
from airflow_provider_vllm.steps.plan.planner import plan_job
from tests.support.data import LABELS, make_spec, write_parquet

GOLDEN = Path(__file__).parent / "golden"
MTIME = 1_700_000_000  # fixed file versions (local files: mtime), so the fingerprint is stable


def _texts(n: int, long_every: int) -> list[str]:
    return [
        ("long ticket text " * 60 if i % long_every == 3 else f"{LABELS[i % len(LABELS)]} ticket {i}") for i in range(n)
    ]


def _parquet(d: Path) -> dict:
    ids = [f"p{i:03d}" for i in range(90)]
    texts = _texts(90, 11)
    write_parquet(d / "in" / "a.parquet", ids[:50], texts[:50], row_group_size=16)
    write_parquet(d / "in" / "b.parquet", ids[50:], texts[50:], row_group_size=7)
    # the long texts repeat: dedupe off, so that the recorded plan (every row in a shard) still applies
    return {"sharding": {"target_rows": 20, "long_row_tokens": 60, "dedupe": False}}


def _parquet_footer(d: Path) -> dict:
    write_parquet(d / "in" / "a.parquet", list(range(1000, 1070)), _texts(70, 9), row_group_size=16)
    return {"sharding": {"target_rows": 25, "dedupe": False}}  # repeated long texts, as above


def _jsonl_lines(d: Path) -> dict:
    (d / "in").mkdir(parents=True)
    rows = [json.dumps({"id": f"j{i}", "text": t}) for i, t in enumerate(_texts(40, 7))]
    first = "\ufeff" + rows[0] + "\n\n" + "\n".join(rows[1:20]) + "\nnot json at all\n[1, 2]\n"
    (d / "in" / "a.jsonl").write_text(first, encoding="utf-8")
    (d / "in" / "b.jsonl").write_text("\n".join(rows[20:]) + "\n   \n", encoding="utf-8")
    return {"sharding": {"target_rows": 8, "long_row_tokens": 60}}


def _openai_batch(d: Path) -> dict:
    (d / "in").mkdir(parents=True)
    lines = []
    for i, t in enumerate(_texts(30, 5)):
        body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": t}]}
        lines.append(
            json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    lines.insert(4, "{broken")
    lines.insert(9, json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {}}))
    lines.insert(
        12, json.dumps({"custom_id": "body-str", "method": "POST", "url": "/v1/chat/completions", "body": "text"})
    )
    (d / "in" / "batch.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {
        "sharding": {"target_tokens": 300, "target_rows": None, "long_row_tokens": 60},
        "sampling": {"max_tokens": 8, "structured": None},
        "prompt": {"system_prompt": None},  # each request carries its own messages
    }


CASES = {"parquet": _parquet, "parquet_footer": _parquet_footer, "jsonl": _jsonl_lines, "openai_batch": _openai_batch}


def _normalised(doc: dict, tmp: Path) -> dict:
    import re

    from airflow_provider_vllm.core.formats.files import InputFile, fingerprint

    # a local file's version carries its change time (not settable, unlike the mtime): the fingerprint
    # is checked as made, then both are compared as of the mtime alone
    assert doc["fingerprint"] == fingerprint([InputFile(**f) for f in doc["files"]])
    for f in doc["files"]:
        f["version"] = re.sub(r"\|ctime [0-9]+$", "", f["version"])
    doc["fingerprint"] = fingerprint([InputFile(**f) for f in doc["files"]])
    # shard ids end in a hash of the plan key (which the fingerprint enters): distinct, and shown by index only
    ids = [sh["shard_id"] for sh in doc["shards"]]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(rf"shard-{sh['index']:05d}-[0-9a-f]{{8}}", sh["shard_id"]) for sh in doc["shards"])
    text = json.dumps(doc, sort_keys=True).replace(str(tmp), "<tmp>")
    text = re.sub(r"(shard-[0-9]{5})-[0-9a-f]{8}", r"\1-<key>", text)
    doc = json.loads(text)
    doc["created_with"] = sorted(doc["created_with"])
    return doc


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_matches_the_golden_file(tmp_path, case):
    over = CASES[case](tmp_path)
    for f in sorted((tmp_path / "in").iterdir()):
        os.utime(f, (MTIME, MTIME))
    spec = make_spec(tmp_path / "in", tmp_path / "out", **over)
    plan_job(spec)
    doc = json.loads((tmp_path / "out" / PLAN_FILE).read_text())
    assert doc.pop("spec_hash") == spec.content_hash()
    assert doc.pop("config_hash") == spec.output_hash()
    seal = doc.pop("seal")  # depends on the folder's path; checked by loading the plan
    assert load_plan(spec).seal.mac == seal["mac"]
    got = _normalised(doc, tmp_path)
    path = GOLDEN / f"{case}_plan.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())
