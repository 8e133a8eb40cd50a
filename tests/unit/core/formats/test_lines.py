"""JSONL and OpenAI batch lines over the line limit or nested too deep: one ``INVALID_JSON`` row each, decided
from the line's bytes, alike in the plan's scan, the worker's read and format detection, at any stack depth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.formats import input_format, lines
from airflow_provider_vllm.core.formats.files import detect_format
from airflow_provider_vllm.core.formats.lines import JSON_MAX_DEPTH, JSONL_LINE_MAX_BYTES
from airflow_provider_vllm.core.plan import Segment
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, merge, openai_batch_spec, shard_task

ROOT = Path(__file__).resolve().parents[4]
JSONL = input_format("jsonl")
LIMIT = 1000  # the line limit these tests set (the real one, 64 MiB, in the memory test)


def _rows(out: Path) -> dict[str, tuple[str, str]]:
    """id -> ("ok", "") or (error code, reason), from the merged files; no id twice."""
    got = {i: ("ok", "") for i in pq.read_table(out / RESULTS, columns=["id"]).column("id").to_pylist()}
    err = pq.read_table(out / ERRORS, columns=["id", "error_code", "error_message"]).to_pylist()
    for r in err:
        assert r["id"] not in got
        got[r["id"]] = (r["error_code"], r["error_message"])
    return got


def _read_all(root: Storage, name: str, spec, n: int):
    return JSONL.read_rows(root, name, Segment(file=0, start=0, count=n, offset=0, line=1), spec)


def _deeper(frames: int, fn):
    """``fn()`` called ``frames`` Python frames deeper than here (as inside an Airflow task's stack)."""
    return fn() if frames == 0 else _deeper(frames - 1, fn)


def _stack_depth() -> int:
    depth, f = 0, sys._getframe()
    while f is not None:
        depth, f = depth + 1, f.f_back
    return depth


def test_a_line_over_the_limit_is_one_error_row_naming_the_limit(tmp_path, monkeypatch):
    """Scan and read give the long line (valid JSON with an id of its own) its synthetic id and a reason naming the
    limit; the lines around it, and a line of exactly the limit, are rows as before. The code before parsed it."""
    monkeypatch.setattr(lines, "JSONL_LINE_MAX_BYTES", LIMIT)
    at_limit = b'{"id": "b", "text": "' + b"y" * (LIMIT - 24) + b'"}\n'
    assert len(at_limit) == LIMIT
    long = b'{"id": "big", "text": "' + b"x" * 5000 + b'"}\n'
    body = b'{"id": "a", "text": "hi"}\n' + long + at_limit + long.rstrip(b"\n") + b"\n" + b'{"id": "c", "text": "yo"}'
    (tmp_path / "in.jsonl").write_bytes(body)
    root, spec = Storage(str(tmp_path)), make_spec(tmp_path / "in.jsonl", tmp_path / "out")
    scan = JSONL.scan(root, ["in.jsonl"], spec, per_row=False)
    ids = JSONL.file_ids(root, "in.jsonl", spec)
    assert ids == ["a", "__line__:in.jsonl:2", "b", "__line__:in.jsonl:4", "c"]
    assert scan.invalid == 2 and scan.lines.tolist() == [1, 2, 3, 4, 5]
    assert scan.offsets.tolist() == [0, 26, 26 + len(long), 26 + len(long) + LIMIT, 26 + 2 * len(long) + LIMIT]
    batch = _read_all(root, "in.jsonl", spec, 5)
    assert batch.ids == ids and batch.values["text"] == ["hi", None, "y" * (LIMIT - 24), None, "yo"]
    why = f"line is {len(long):,} bytes long, over the line limit of {LIMIT:,} bytes (JSONL_LINE_MAX_BYTES)"
    assert batch.faults == [None, ("INVALID_JSON", why), None, ("INVALID_JSON", why), None]
    # the worker from the planned offset of the line after the long one reads the same rows
    after = JSONL.read_rows(
        root, "in.jsonl", Segment(file=0, start=2, count=3, offset=int(scan.offsets[2]), line=3), spec
    )
    assert after.ids == ids[2:] and after.lines == [3, 4, 5]


MEMORY = """
import json, sys
from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.plan import Segment
from airflow_provider_vllm.core.storage import Storage
from tests.support.data import make_spec
jsonl, root = input_format("jsonl"), Storage(sys.argv[1])
spec = make_spec(sys.argv[1] + "/in.jsonl", sys.argv[1] + "/out")
scan = jsonl.scan(root, ["in.jsonl"], spec, per_row=False)
batch = jsonl.read_rows(root, "in.jsonl", Segment(file=0, start=0, count=3, offset=0, line=1), spec)
# VmHWM: this process image's peak (ru_maxrss would count the forked parent's memory too)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"ids": batch.ids, "faults": batch.faults, "invalid": scan.invalid, "peak_mib": hwm // 1024}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak memory from /proc (Linux)")
def test_a_line_of_a_gigabyte_is_skipped_holding_at_most_the_limit(tmp_path):
    """A 1 GiB line (a sparse hole of NUL bytes: no disk used) between two rows, at the real limit: plan's scan and
    the worker's read give it one error row, keep the rows around it, and the process's peak stays far below the
    line (the code before held it whole, as bytes and as text: over 2 GiB)."""
    size = 1 << 30
    with open(tmp_path / "in.jsonl", "wb") as f:
        f.write(b'{"id": "a", "text": "hi"}\n')
        f.seek(26 + size - 1)
        f.write(b'\n{"id": "c", "text": "yo"}\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run([sys.executable, "-c", MEMORY, str(tmp_path)], capture_output=True, text=True, env=env)
    assert got.returncode == 0, got.stderr[-2000:]
    doc = json.loads(got.stdout.strip().splitlines()[-1])
    assert doc["ids"] == ["a", "__line__:in.jsonl:2", "c"] and doc["invalid"] == 1
    assert doc["faults"][1] == [
        "INVALID_JSON",
        f"line is {size:,} bytes long, over the line limit of {JSONL_LINE_MAX_BYTES:,} bytes (JSONL_LINE_MAX_BYTES)",
    ]
    # holds at most the limit (64 MiB) of the line, and its first block past it
    assert doc["peak_mib"] < 400, doc


def test_format_detection_reads_no_more_of_a_long_first_line_than_the_limit(tmp_path, monkeypatch):
    """A first line over the limit is no request line (``jsonl``), decided after reading at most the limit and one
    block of it; the code before read the whole line."""
    monkeypatch.setattr(lines, "JSONL_LINE_MAX_BYTES", LIMIT)
    request = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {"pad": "x" * (8 << 20)}}
    (tmp_path / "b.jsonl").write_text(json.dumps(request) + "\n")
    root = Storage(str(tmp_path))
    read: list[int] = []
    real_open = Storage.open

    class Counted:
        def __init__(self, f):
            self._f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def read(self, n=-1):
            out = self._f.read(n)
            read.append(len(out))
            return out

        def readline(self, *a):
            out = self._f.readline(*a)
            read.append(len(out))
            return out

        def __iter__(self):
            for raw in self._f:
                read.append(len(raw))
                yield raw

    monkeypatch.setattr(Storage, "open", lambda self, rel, mode="rb": Counted(real_open(self, rel, mode)))
    assert detect_format(root, ["b.jsonl"], "auto") == "jsonl"
    assert 0 < sum(read) <= LIMIT + lines.READ_BLOCK


def _deep_request(cid: str, depth: int) -> str:
    nested = "[" * depth + "]" * depth
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    return (
        json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})[:-2]
        + f', "metadata": {nested}}}}}\n'
    )


def test_a_deep_first_line_is_detected_as_a_request_or_not_without_a_recursion_error(tmp_path):
    """Format detection parses the first line as plan and worker do: too deep is no request (``jsonl``, where the
    plan then names it); the code before raised RecursionError out of detection."""
    (tmp_path / "deep.jsonl").write_text(_deep_request("r", 100_000))
    (tmp_path / "ok.jsonl").write_text(_deep_request("r", JSON_MAX_DEPTH - 2))
    root = Storage(str(tmp_path))
    assert detect_format(root, ["deep.jsonl"], "auto") == "jsonl"
    assert detect_format(root, ["ok.jsonl"], "auto") == "openai_batch"


def test_nesting_depth_is_counted_outside_strings(tmp_path):
    """Brackets inside strings (escaped quotes included) do not nest; one level past the limit is too deep, and the
    worker's reason names the limit (the code before: "not valid UTF-8 JSON" for valid JSON)."""
    inside = json.dumps({"id": "s", "text": 'a \\" ["' + "[{" * 2000})
    at_limit = '{"id": "d", "text": "t", "x": ' + "[" * (JSON_MAX_DEPTH - 1) + "]" * (JSON_MAX_DEPTH - 1) + "}"
    over = '{"id": "e", "text": "t", "x": ' + "[" * JSON_MAX_DEPTH + "]" * JSON_MAX_DEPTH + "}"
    (tmp_path / "in.jsonl").write_text("\n".join([inside, at_limit, over]) + "\n")
    root, spec = Storage(str(tmp_path)), make_spec(tmp_path / "in.jsonl", tmp_path / "out")
    batch = _read_all(root, "in.jsonl", spec, 3)
    assert batch.ids == ["s", "d", "__line__:in.jsonl:3"]
    assert batch.faults[2] == (
        "INVALID_JSON",
        f"line is JSON nested deeper than {JSON_MAX_DEPTH} levels (the reader's limit, JSON_MAX_DEPTH)",
    )
    assert lines.deeper_than(b'"\\\\"' + b"[" * 5, 4) and not lines.deeper_than(b'"\\"' + b"[" * 5, 4)


@pytest.mark.parametrize("fmt", ["jsonl", "openai_batch"])
def test_a_line_decides_its_id_alike_at_a_deep_and_a_shallow_stack(tmp_path, fmt):
    """A line as deep as ``json.loads`` can parse only on a shallow stack (the worker's process) gets the same id
    and outcome when the scan runs on a deep one (the plan, inside an Airflow task). The code before gave it its
    real id at the shallow stack and a synthetic one at the deep stack."""
    room = sys.getrecursionlimit() - _stack_depth()
    depths = [JSON_MAX_DEPTH, JSON_MAX_DEPTH + 1, room - 40]
    if fmt == "jsonl":
        text = "".join(f'{{"id": "d{d}", "text": "t", "x": ' + "[" * (d - 1) + "]" * (d - 1) + "}\n" for d in depths)
    else:  # d levels in all: the line's object, its body and d - 2 arrays
        text = "".join(_deep_request(f"d{d}", d - 2) for d in depths)
    (tmp_path / "in.jsonl").write_text(text)
    root, spec = Storage(str(tmp_path)), make_spec(tmp_path / "in.jsonl", tmp_path / "out")
    form = input_format(fmt)
    shallow = form.file_ids(root, "in.jsonl", spec)
    deep = _deeper(room - JSON_MAX_DEPTH - 60, lambda: form.file_ids(root, "in.jsonl", spec))
    assert shallow == deep == [f"d{JSON_MAX_DEPTH}", "__line__:in.jsonl:2", "__line__:in.jsonl:3"]


@pytest.mark.parametrize("fmt", ["jsonl", "openai_batch"])
def test_plan_shard_and_merge_account_for_long_and_deep_lines_exactly_once(
    tmp_path, fake_engine_factory, monkeypatch, fmt
):
    """A long line and a line of 920 levels, planned on a deep stack (an Airflow task) and read by the shards on a
    shallow one: each is one ``INVALID_JSON`` row under its synthetic id, merge accounts for every line. The code
    before failed the merge, after the shards ran ("1 missing ... 1 not in the input")."""
    monkeypatch.setattr(lines, "JSONL_LINE_MAX_BYTES", 4 * LIMIT)
    over = {"sharding": {"target_rows": 2, "chunk_rows": 2}}
    if fmt == "openai_batch":
        spec = openai_batch_spec(tmp_path, n=3, sampling={"max_tokens": 8, "structured": None}, **over)
        src, good = tmp_path / "batch.jsonl", ["req-0", "req-1", "req-2"]
        deep = _deep_request("deep", 920)
        long = _deep_request("long", 1).replace('"content": "x"', '"content": "' + "x" * 8 * LIMIT + '"')
    else:
        src, good = tmp_path / "in" / "d.jsonl", ["a", "b"]
        src.parent.mkdir()
        src.write_text('{"id": "a", "text": "t"}\n{"id": "b", "text": "u"}\n')
        spec = make_spec(src.parent, tmp_path / "out", **over)
        deep = '{"id": "deep", "text": "t", "extra": ' + "[" * 920 + "]" * 920 + "}\n"
        long = json.dumps({"id": "long", "text": "x" * 8 * LIMIT}) + "\n"
    first, *rest = src.read_text().splitlines(keepends=True)
    src.write_text("".join([first, deep, *rest, long]))
    n = len(good) + 2
    plan = _deeper(60, lambda: plan_job(spec))
    assert plan.invalid_lines == 2
    for s in plan.shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=fake_engine_factory)
    summary = _deeper(60, lambda: merge(spec)).dump()
    got = _rows(tmp_path / "out")
    name = src.name
    assert {i: c for i, (c, _) in got.items()} == {
        **dict.fromkeys(good, "ok"),
        f"__line__:{name}:2": "INVALID_JSON",
        f"__line__:{name}:{n}": "INVALID_JSON",
    }
    assert "JSON_MAX_DEPTH" in got[f"__line__:{name}:2"][1]
    assert "JSONL_LINE_MAX_BYTES" in got[f"__line__:{name}:{n}"][1]
    assert summary["rows"] == n
