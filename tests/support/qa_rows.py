"""Rows and tables for the QA tests (steps/qa): ok / error records, the merged tables QA reads."""

from __future__ import annotations

import random

import pyarrow as pa

from airflow_provider_vllm.core.rows import ERROR_COLUMNS, RESULT_COLUMNS, rows_table

LABELS = ["positive", "negative", "neutral"]


def ok_row(i, label=None, output=None, **kw):
    r = {
        "id": f"r{i}",
        "status": "ok",
        "output": output if output is not None else (label or f"text {i}"),
        "label": label,
        "valid": True,
        "finish_reason": "stop",
        "prompt_tokens": 10 + i % 7,
        "completion_tokens": 1 + i % 3,
        "truncated": False,
        "latency_ms": 50.0 + i % 11,
        "model": "m",
        "shard_id": f"s{i % 3}",
        "attempt_id": "a",
    }
    r.update(kw)
    return r


def err_row(i, code="ENGINE_ERROR", **kw):
    r = {"id": f"e{i}", "status": "error", "error_code": code, "error_message": f"bad {i}", "shard_id": "s0"}
    r.update(kw)
    return r


def split(records):
    t = rows_table(records)
    return (
        # the columns QA's view reads (steps/qa/stage.py): ``cached_from`` is not among them
        t.filter(pa.compute.equal(t["status"], "ok")).select([c for c in RESULT_COLUMNS if c != "cached_from"]),
        t.filter(pa.compute.equal(t["status"], "error")).select(ERROR_COLUMNS),
    )


def empty_tables():
    return split([])


def check(report, name):
    return next(c for c in report.checks if c["name"] == name)


def labelled_tables(n, n_err=0, labels=LABELS, seed=0):
    rnd = random.Random(seed)
    recs = [ok_row(i, label=rnd.choice(labels)) for i in range(n)]
    recs += [err_row(i, rnd.choice(["ENGINE_ERROR", "EMPTY_INPUT"])) for i in range(n_err)]
    return split(recs)


def sample_ids(rep):
    return rep.sample.column("id").to_pylist()
