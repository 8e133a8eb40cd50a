#!/usr/bin/env python
"""Data-plane benchmark: plan, merge and QA over a 10M-row (or 100M-row) Parquet dataset (no vLLM).

    .venv/bin/python benchmarks/bench_dataplane.py [--rows 10000000] [--workdir DIR]
                                                   [--repeat N] [--chunk-rows 50000]
                                                   [--stages plan,merge,qa,publish]
                                                   [--profile [missed|all]] [--passthrough] [--token-sizing]

Sizes: 10M (default; goals GOALS) and 100M (``--rows 100000000``; goals GOALS_100M, each run within
the goal, not only the median:
about 0.3 GB of input and 1.5 GB of run output on disk, ~2 min to generate and set up; the merged
folders are hard links to the committed parts, so merge adds no data on a local disk).

1. Generates the input once (vectorised, one row group at a time; reused while rows/files
   match): ``id`` like ``row-000000001`` and short ticket-like ``text`` picked from a few
   hundred templates, in several files with several row groups each.
2. plan: ``plan_job(spec)`` (target_rows 100000, max_shards 256, 8-label structured choice).
3. Setup (not timed): committed shard outputs synthesised with the real commit protocol
   (``ShardStore.write_chunk`` + ``ShardStore.commit`` with a marker shaped like the one
   ``worker/shard.py::run_shard`` writes); ~99% 'ok' rows, ~1% 'error' rows.
4. merge: ``merge(spec, plan=current_plan_ref(spec)).dump()`` (run by hand: the folder's sealed plan, taken
   explicitly; checksums, verification against the input ids, the parts published by reference into
   results/ and errors/, manifests, ``_MERGED.json``); each timed merge starts with those folders removed, as
   a first merge does.
5. QA: ``qa_run(spec)``. With ``--golden-rows N`` (the quality measures): a golden set of N known
   labels for ids spread over the input (``qa.reference.golden_uri``), and the synthesised result
   rows carry a confidence (Beta(5, 2)) and the prompt hash of their text, so QA also scores the
   labelled rows, reports the confidence and checks the consistency of repeated prompts.
1B rows (``--rows 1000000000``; goals GOALS_1B): ids get 10 digits (fixed width, so in order); about 2.6 GB
of input and 9.5 GB of commits; the setup can run in several processes (``BENCH_SETUP_PART=i/n`` with
``--child setup``) and resumes after an interruption. ``--token-sizing``: the plan only, sized by tokens with a
long-row bucket (``TOKEN_SIZING``), into ``runs-tokens/``.
``--passthrough``: the input has four more typed columns (``queue`` string with 5% nulls, ``opened`` a
timestamp with a time zone, ``amount`` a decimal, ``tags`` a list of strings; its own folder,
``input-<rows>-passthrough``), the spec passes them through (``io.passthrough``), and the synthesised
chunks carry them as the workers write them (``ShardStore.write_chunk(..., passthrough=...)``).

6. publish: the publish task's check before ``_SUCCESS.json``: the sealed ``_MERGED.json``, each
   manifest against it, every part's size and sha256 (a streaming read of all of results/ and errors/).

``--stages`` times only the named stages; without ``plan`` the previous run under
``--workdir`` (plan, commits, merged output) is reused. Every stage runs in its own subprocess, so peak RSS
(``ru_maxrss`` of that child) is the
stage's own. The "baseline" of this benchmark is the goal: each stage prints its seconds,
the goal and the ratio (seconds / goal; <= 1 meets it). ``--profile`` re-runs stages that
miss a goal under cProfile (and, for merge, with per-SQL timers) and prints where the time
goes. One JSON line per run is appended to ``benchmarks/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_FILE = HERE / "results.jsonl"

GOALS = {
    "plan": {"seconds": 3.0},
    "merge": {"seconds": 10.0, "rss_mib": 1536.0},
    "qa": {"seconds": 5.0},
    "publish": {"seconds": 5.0},  # the publish task's check of every part's bytes (docs/adr/0007)
}
# the goals at 100M rows (this 2-core machine), for every run: at that size they replace GOALS
GOALS_100M = {
    "plan": {"seconds": 5.0, "rss_mib": 2048.0},
    "merge": {"seconds": 15.0, "rss_mib": 2048.0},
    "qa": {"seconds": 10.0, "rss_mib": 2048.0},
    "publish": {"seconds": 30.0, "rss_mib": 2048.0},
}
# at 1B rows: each stage within 4 GiB and 12x its 100M goal
GOALS_1B = {
    "plan": {"seconds": 60.0, "rss_mib": 4096.0},
    "merge": {"seconds": 180.0, "rss_mib": 4096.0},
    "qa": {"seconds": 120.0, "rss_mib": 4096.0},
    "publish": {"seconds": 360.0, "rss_mib": 4096.0},
}
LABELS = ["billing", "bug", "account", "shipping", "refund", "feature_request", "security", "other"]
N_FILES = 10
ROW_GROUP = 250_000


# ---- input generation ----------------------------------------------------------------
# A benchmark's own signing key (docs/adr/0007-sealed-records.md): the stages it runs, in this process
# and in the children it starts, seal and check what they write with it. Never a deployment's key.
os.environ.setdefault("VLLM_BATCH_SIGNING_KEY", "benchmark-signing-key-not-for-deployments-0123456789")


def _templates() -> tuple[list[str], list[str]]:
    openers = [
        "I was charged twice for my {p} subscription",
        "The {p} app crashes when I open the settings page",
        "I cannot log in to my {p} account after the update",
        "My {p} order has not arrived yet",
        "Please refund the {p} purchase I made last week",
        "It would be great if {p} supported dark mode",
        "Someone else seems to have access to my {p} account",
        "How do I change the email address on my {p} profile",
        "The invoice for {p} shows the wrong VAT number",
        "Export to CSV in {p} produces an empty file",
        "The {p} delivery was left at the wrong address",
        "I got a suspicious password reset email from {p}",
        "Can {p} add an option to schedule reports",
        "The {p} checkout page keeps timing out",
        "I want to cancel my {p} plan and get my money back",
    ]
    products = [
        "Acme Cloud",
        "PhotoBox",
        "TaskFlow",
        "ShopNow",
        "MailDash",
        "FitTrack",
        "CodeHub",
        "PayLite",
        "StreamIt",
        "HomeHub",
        "NoteWise",
        "TravelGo",
        "BankEasy",
        "GameZone",
        "LearnPro",
        "DriveShare",
        "SafeVault",
        "MusicMix",
        "DocuSign-ish",
        "CartPal",
    ]
    templates = [o.format(p=p) + "." for o in openers for p in products]  # 300 templates
    details = [
        "This is the second time it happened.",
        "Please help as soon as possible.",
        "I already tried restarting.",
        "Order number is in my account.",
        "Thanks in advance!",
        "It started yesterday evening.",
        "My colleague has the same problem.",
        "I am on the latest version.",
        "This is really frustrating.",
        "No rush, just curious.",
        "I attached a screenshot earlier.",
        "The support chat did not answer.",
        "It works on my phone but not on the laptop.",
        "I have been a customer for years.",
        "Can someone call me back?",
        "The error code was E42.",
    ]
    return templates, details


PASSTHROUGH = ["queue", "opened", "amount", "tags"]  # --passthrough: the input's extra columns, passed through
QUEUES = ["billing", "tech", "accounts", "logistics", "refunds", "product", "trust", "general", "vip", "partners"]
TAGS = ["urgent", "vip", "repeat", "mobile", "web", "eu", "us", "apac", "chargeback", "beta", "legacy", "api"]


def passthrough_columns(first_row: int, n: int, rng) -> dict:
    """The --passthrough input's extra columns for rows ``first_row`` .. ``first_row + n`` (vectorised)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    queue = pa.array(QUEUES).take(pa.array(rng.integers(0, len(QUEUES), n)))
    queue = pc.if_else(pa.array(rng.random(n) < 0.05), pa.scalar(None, pa.string()), queue)
    ms = 1_767_225_600_000 + (np.arange(first_row, first_row + n, dtype=np.int64) * 7_919) % 31_536_000_000
    opened = pa.array(ms, pa.int64()).cast(pa.timestamp("ms", tz="America/New_York"))
    cents = rng.integers(0, 10_000_000, n)
    amount = pc.cast(pa.array(cents / 100.0), pa.decimal128(12, 2), safe=False)
    lengths = rng.integers(0, 4, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    words = pa.array(TAGS).take(pa.array(rng.integers(0, len(TAGS), int(offsets[-1]))))
    tags = pa.ListArray.from_arrays(pa.array(offsets), words)
    return {"queue": queue, "opened": opened, "amount": amount, "tags": tags}


def id_digits(rows: int) -> int:
    """Digits of the ids' number: 9 (``row-000000001``), more when the rows need them (1B: ``row-0000000001``)."""
    return max(9, len(str(rows)))


def generate_dataset(folder: Path, rows: int, seed: int = 7, passthrough: bool = False) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    marker = folder / "_DATASET.json"  # '_' prefix: the planner ignores it
    want = {"rows": rows, "files": N_FILES, "row_group": ROW_GROUP, "seed": seed, "recipe": 1}
    digits = id_digits(rows)
    if digits != 9:  # 1B rows: 10 digits (ids stay fixed-width, so in order); smaller inputs keep their marker
        want["id_digits"] = digits
    if passthrough:
        want["passthrough"] = PASSTHROUGH
    if marker.exists() and json.loads(marker.read_text()) == want:
        return want
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    templates, details = _templates()
    t_arr, d_arr = pa.array(templates), pa.array(details)
    rng = np.random.default_rng(seed)
    extra_rng = np.random.default_rng(seed + 1)  # the extra columns' own draws: id and text stay as without them
    per_file = -(-rows // N_FILES)
    t0 = time.monotonic()
    for f in range(N_FILES):
        lo, hi = f * per_file, min(rows, (f + 1) * per_file)
        if lo >= hi:
            break
        n = hi - lo
        # the same draws as one whole-file table (same bytes as before), written one row group
        # at a time so that 100M rows fit: only the small index arrays span the file
        t_idx, d_idx = rng.integers(0, len(templates), n), rng.integers(0, len(details), n)
        schema = pa.schema({"id": pa.string(), "text": pa.string()})
        if passthrough:
            schema = pa.schema(list(schema) + list(pa.table(passthrough_columns(0, 1, extra_rng)).schema))
        with pq.ParquetWriter(folder / f"part-{f:03d}.parquet", schema, compression="zstd") as w:
            for a in range(0, n, ROW_GROUP):
                b = min(n, a + ROW_GROUP)
                ids = pc.binary_join_element_wise(
                    "row-",
                    pc.utf8_lpad(
                        pa.array(np.arange(lo + a + 1, lo + b + 1, dtype=np.int64)).cast(pa.string()), digits, "0"
                    ),
                    "",
                )
                text = pc.binary_join_element_wise(
                    t_arr.take(pa.array(t_idx[a:b])), d_arr.take(pa.array(d_idx[a:b])), " "
                )
                cols = {"id": ids, "text": text}
                if passthrough:
                    cols.update(passthrough_columns(lo + a, b - a, extra_rng))
                w.write_table(pa.table(cols, schema=schema), row_group_size=ROW_GROUP)
    marker.write_text(json.dumps(want))
    print(f"generated {rows} rows in {N_FILES} files under {folder} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return want


# ---- spec -----------------------------------------------------------------------------
def golden_set(input_dir: Path, rows: int, n: int) -> Path:
    """A golden set of ``n`` known labels (id, label) for ids spread over the input (``qa.reference.golden_uri``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = input_dir.parent / f"golden-{rows}-{n}.parquet"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(5)
        picks = np.unique(np.linspace(1, rows, n).astype(np.int64))
        ids = pa.array([f"row-{i:0{id_digits(rows)}d}" for i in picks.tolist()])
        labels = pa.array(LABELS).take(pa.array(rng.integers(0, len(LABELS), len(picks))))
        pq.write_table(pa.table({"id": ids, "label": labels}), path)
    return path


# --token-sizing: shards sized by estimated tokens, with long rows in their own bucket (the plan then reads the
# text column: ~21 estimated tokens a row, 16-28; about a fifth of the rows are over LONG_ROW_TOKENS)
TOKEN_SIZING = {"target_tokens": 2_000_000, "long_row_tokens": 24}


def bench_spec(
    input_dir: Path,
    run_dir: Path,
    chunk_rows: int,
    golden: Path | None = None,
    passthrough=False,
    token_sizing: bool = False,
):
    from airflow_provider_vllm.core.spec import JobSpec

    qa = {"reference": {"golden_uri": str(golden)}} if golden is not None else {}
    io = {"input_uri": str(input_dir), "output_uri": str(run_dir)}
    if passthrough:
        io["passthrough"] = PASSTHROUGH
    return JobSpec.load(
        {
            "qa": qa,
            "name": "bench-dataplane",
            "task": "chat",
            "model": {"name": "bench"},
            "prompt": {
                "template": "Ticket: {text}",
                "system_prompt": "Classify the support ticket. Labels: " + ", ".join(LABELS) + ".",
            },
            "sampling": {"temperature": 0, "max_tokens": 8, "structured": {"choice": LABELS}},
            "io": io,
            # every row to a shard: the data plane is measured over all rows (its texts repeat a few templates)
            "sharding": {
                **(TOKEN_SIZING if token_sizing else {"target_rows": 100_000}),
                "max_shards": 256,
                "chunk_rows": chunk_rows,
                "dedupe": False,
            },
        }
    )


# ---- synthesised committed shards (setup, not timed) --------------------------------
def _synth_chunk(ids, rng, labels_arr, prov: dict, prompt_hashes=None):
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from airflow_provider_vllm.core.rows import ROW_SCHEMA

    n = len(ids)
    err_np = rng.random(n) < 0.01
    err = pa.array(err_np)
    null_s = pa.scalar(None, pa.string())
    label = pc.if_else(err, null_s, labels_arr.take(pa.array(rng.integers(0, len(LABELS), n))))
    codes = pa.array(["EMPTY_INPUT", "PROMPT_TOO_LONG", "INVALID_ROW"]).take(pa.array(rng.integers(0, 3, n)))
    msgs = pa.array(
        ["column 'text' is empty", "prompt has 9000 tokens; budget is 8184", "column 'text' contains a NUL character"]
    )
    ptok = pa.array(rng.integers(60, 140, n).astype(np.int32))
    ctok = pa.array(rng.integers(1, 4, n).astype(np.int32))
    lat = pa.array(rng.gamma(2.0, 900.0, n).astype(np.float32))
    null_i = pa.scalar(None, pa.int32())
    cols = {
        "id": ids,
        "status": pc.if_else(err, "error", "ok"),
        "output": label,
        "label": label,
        "parsed_json": pa.nulls(n, pa.string()),
        "valid": pc.if_else(err, pa.scalar(None, pa.bool_()), True),
        "embedding": pa.nulls(n, pa.list_(pa.float32())),
        "scores": pa.nulls(n, pa.list_(pa.float32())),
        "finish_reason": pc.if_else(err, null_s, "stop"),
        "prompt_tokens": pc.if_else(err, null_i, ptok),
        "completion_tokens": pc.if_else(err, null_i, ctok),
        "truncated": pc.if_else(err, pa.scalar(None, pa.bool_()), False),
        "latency_ms": pc.if_else(err, pa.scalar(None, pa.float32()), lat),
        "error_code": pc.if_else(err, codes, null_s),
        "error_message": pc.if_else(err, msgs.take(pa.array(rng.integers(0, 3, n))), null_s),
    }
    for k, v in prov.items():
        cols[k] = pa.nulls(n, pa.string()) if v is None else pa.repeat(pa.scalar(v, pa.string()), n)
    if "confidence" in ROW_SCHEMA.names:  # the answer columns added with the quality measures
        conf = pa.array(rng.beta(5.0, 2.0, n).astype(np.float32))
        cols["confidence"] = pc.if_else(err, pa.scalar(None, pa.float32()), conf)
        cols["prompt_hash"] = (
            pa.array(prompt_hashes, pa.int64()) if prompt_hashes is not None else pa.nulls(n, pa.int64())
        )
        cols["logprobs"] = pa.nulls(n, pa.string())
    for f in ROW_SCHEMA:  # any other column (e.g. ``adapter``: the base model answered) is null
        cols.setdefault(f.name, pa.nulls(n, f.type))
    return pa.Table.from_arrays([cols[f.name] for f in ROW_SCHEMA], schema=ROW_SCHEMA)


def synthesise_commits(spec, engine_identity: str | None = None, part: tuple[int, int] | None = None) -> dict:
    """The shards' commits as workers make them (sealed); ``engine_identity``: the engine they say they saw.

    ``part`` (i, n): only the shards whose index is i modulo n, each with its own random draws (seeded by its
    index), so that n processes can set up a large run (1B rows) at once, and a shard already committed is left
    as it is (an interrupted setup resumes); None: every shard, one stream of draws."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    from airflow_provider_vllm import __version__
    from airflow_provider_vllm.core.commit import ChunkMeta, CommitMarker, RunSeal, ShardStore
    from airflow_provider_vllm.core.formats.parquet import read_parquet_range
    from airflow_provider_vllm.core.plan import load_plan
    from airflow_provider_vllm.core.seal import Keyring
    from airflow_provider_vllm.core.storage import Storage

    keyring = Keyring.from_env()
    plan = load_plan(spec, keyring=keyring)
    run = RunSeal(keyring, plan.seal.mac)
    out = Storage(spec.io.output_uri, spec.io.storage_options)
    rng = np.random.default_rng(11)
    labels_arr = pa.array(LABELS)
    carried = plan.passthrough.columns if plan.passthrough is not None else []
    chunk_rows = spec.sharding.chunk_rows
    n_files = 0
    for shard in plan.shards:
        assert shard.bucket == "all"
        if part is not None:
            if shard.index % part[1] != part[0]:
                continue
            rng = np.random.default_rng([11, shard.index])
            if ShardStore(out, shard.shard_id, run).marker() is not None:
                continue  # committed by an earlier, interrupted setup: the parts resume
        root, files = plan.shard_input(shard)  # the input, or with the result cache the shard's own file
        in_root = Storage(root, spec.io.storage_options)
        parts, hash_parts, pt_parts = [], [], []
        for seg in shard.segments:
            # only the row groups that hold the segment (as a worker reads): memory stays one shard's rows at 1B
            t = read_parquet_range(
                in_root, files[seg.file].path, seg.start, seg.count, [spec.prompt.id_column, "text", *carried]
            )
            parts.append(t.column(0).combine_chunks())
            # the rows' request hashes: equal texts, equal hashes (as the worker's prompt_hash)
            hash_parts.append(pd.util.hash_array(t.column(1).to_numpy(zero_copy_only=False)).view(np.int64))
            pt_parts.append(t.select(carried))
        ids = pa.concat_arrays(parts)
        # the shard's passthrough columns, named and typed as the plan says (worker/shard.py passthrough_table)
        pt = (
            pa.concat_tables(pt_parts).rename_columns(plan.passthrough.names).cast(plan.passthrough_schema())
            if plan.passthrough is not None
            else None
        )
        hashes = np.concatenate(hash_parts)
        assert len(ids) == shard.rows
        attempt = f"abench-{shard.index:05d}"
        prov = {
            "model": spec.model.name,
            "model_revision": spec.model.revision,
            "engine_version": "0.32.0",
            "config_hash": plan.config_hash,
            "shard_id": shard.shard_id,
            "attempt_id": attempt,
        }
        store = ShardStore(out, shard.shard_id, run)
        entries = []
        for k in range(max(1, -(-shard.rows // chunk_rows))):
            first = k * chunk_rows
            n = min(chunk_rows, shard.rows - first)
            table = _synth_chunk(ids.slice(first, n), rng, labels_arr, prov, hashes[first : first + n])
            meta = ChunkMeta(shard_id=shard.shard_id, chunk=k, first_row=first, rows=n, config_hash=plan.config_hash)
            chunk_pt = pt.slice(first, n).combine_chunks() if pt is not None else None
            entries.append(store.write_chunk(attempt, meta, table, **({"passthrough": chunk_pt} if pt else {})))
            n_files += 1  # one chunk: its ok part and its errors part
        ptoks = shard.rows * 100
        infer_s = shard.rows / 14.0
        stats = {
            "rows": shard.rows,
            "read_s": 0.4,
            "reused_chunks": 0,
            "engine_start_s": 25.0,
            "infer_s": round(infer_s, 3),
            "prompt_tokens": ptoks,
            "completion_tokens": shard.rows * 2,
            "progress_lines": 10,
            "rows_per_s": 14.0,
            "tokens_per_s": round(ptoks * 1.02 / infer_s, 1),
            "wall_s": round(infer_s + 27, 3),
            "peak_rss_mb": 1100.0,
        }
        marker = CommitMarker(
            shard_id=shard.shard_id,
            attempt_id=attempt,
            config_hash=plan.config_hash,
            spec_hash=plan.spec_hash,
            plan_fingerprint=plan.fingerprint,
            files=entries,
            rows=sum(e.rows for e in entries),
            ok_rows=sum(e.ok_rows for e in entries),
            error_rows=sum(e.error_rows for e in entries),
            stats=stats,
            **({"engine_identity": engine_identity} if engine_identity else {}),
            # what a worker's probe of a chat template without a clock records; without it merge appends nothing
            # to the result cache (bench_cache.py's warm cache would be empty)
            prompt_reads_clock=False if spec.task == "chat" else None,
            versions={
                "airflow-provider-vllm": __version__,
                "vllm": "0.32.0",
                "python": platform.python_version(),
                "model": spec.model.name,
                "model_revision": spec.model.revision,
            },
            committed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        assert marker.rows == shard.rows
        assert store.commit(marker), f"{shard.shard_id} was already committed"
    return {"shards": len(plan.shards), "chunk_files": n_files}


# ---- profiling helpers ----------------------------------------------------------------
class _TimedCon:
    """Wraps a DuckDB connection: seconds per SQL statement, fetches included (profile mode only)."""

    def __init__(self, con, log):
        self._con, self._log = con, log

    def _run(self, method, sql, *a, **kw):
        label = " ".join(str(sql).split())[:150]
        t0 = time.monotonic()
        res = getattr(self._con, method)(sql, *a, **kw)
        self._log.append([time.monotonic() - t0, label])
        return _TimedResult(res, self._log, label)

    def execute(self, sql, *a, **kw):
        return self._run("execute", sql, *a, **kw)

    def sql(self, sql, *a, **kw):
        return self._run("sql", sql, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._con, name)


class _TimedResult:
    def __init__(self, res, log, label):
        self._res, self._log, self._label = res, log, label

    def __getattr__(self, name):
        attr = getattr(self._res, name)
        if not callable(attr):
            return attr

        def timed(*a, **kw):
            t0 = time.monotonic()
            try:
                return attr(*a, **kw)
            finally:
                self._log.append([time.monotonic() - t0, f"[{name}] {self._label}"])

        return timed


def _install_sql_timers(log: list) -> None:
    """Route the package's DuckDB connections through _TimedCon (bench process only)."""
    import importlib
    import types

    import duckdb

    def shim_module():
        shim = types.SimpleNamespace(**{k: getattr(duckdb, k) for k in dir(duckdb) if not k.startswith("__")})
        shim.connect = lambda *a, **kw: _TimedCon(duckdb.connect(*a, **kw), log)
        shim.__version__ = duckdb.__version__
        return shim

    try:
        duck = importlib.import_module("airflow_provider_vllm.core.duck")
        orig = duck.connect
        duck.connect = lambda *a, **kw: _TimedCon(orig(*a, **kw), log)
    except ImportError:
        pass
    for mod in (
        "airflow_provider_vllm.steps.merge.merger",
        "airflow_provider_vllm.steps.qa.evaluate",
        "airflow_provider_vllm.steps.plan.planner",
    ):
        m = importlib.import_module(mod)
        if getattr(m, "duckdb", None) is duckdb:
            m.duckdb = shim_module()


# ---- child: one stage -------------------------------------------------------------------
def child(
    stage: str,
    input_dir: Path,
    run_dir: Path,
    chunk_rows: int,
    profile: str | None,
    golden_rows: int = 0,
    passthrough: bool = False,
    token_sizing: bool = False,
) -> None:
    from airflow_provider_vllm.core.plan import current_plan_ref
    from airflow_provider_vllm.steps.merge.merger import merge
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa.stage import qa_run

    golden = (
        golden_set(input_dir, int(os.environ["BENCH_ROWS"]), golden_rows) if golden_rows and stage != "gen" else None
    )
    spec = bench_spec(input_dir, run_dir, chunk_rows, golden, passthrough, token_sizing)
    rss_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sql_log: list = []
    if profile:
        _install_sql_timers(sql_log)
    extra: dict = {}
    # run by hand, no plan task names the plan: take the folder's sealed plan, explicitly (outside the timed work)
    pinned = current_plan_ref(spec) if stage == "merge" else None

    def work():
        if stage == "plan":
            plan = plan_job(spec)
            extra.update(shards=len(plan.shards), total_rows=plan.total_rows)
        elif stage == "gen":
            extra.update(generate_dataset(input_dir, int(os.environ["BENCH_ROWS"]), passthrough=passthrough))
        elif stage == "setup":
            part = os.environ.get("BENCH_SETUP_PART")  # "i/n": this child sets up every n-th shard (1B rows)
            extra.update(synthesise_commits(spec, part=tuple(map(int, part.split("/"))) if part else None))
        elif stage == "merge":
            assert pinned is not None
            s = merge(spec, plan=pinned).dump()
            extra.update(ok_rows=s["ok_rows"], error_rows=s["error_rows"], merge_s=s["merge_s"])
        elif stage == "qa":
            report, _ = qa_run(spec)
            extra.update(qa_status=report.status)
            q = report.metrics.get("quality")
            if q is not None:
                extra.update(
                    labelled=q["labelled"], confidence_rows=(report.metrics.get("confidence") or {}).get("rows")
                )
        elif stage == "publish":  # what the publish task checks before _SUCCESS.json: every part's bytes
            from airflow_provider_vllm.core.storage import Storage
            from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS, read_merged, verified_parts

            out = Storage(spec.io.output_uri, spec.io.storage_options)
            merged = read_merged(out)
            extra.update(parts=sum(len(verified_parts(out, kind, merged)) for kind in (RESULTS, ERRORS)))
        else:
            raise SystemExit(f"unknown stage {stage}")

    if stage == "merge":  # every timed merge publishes from nothing (a rerun would find its parts in place)
        for name in ("results", "errors", "openai"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
        (run_dir / "_MERGED.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(work)
        seconds = time.perf_counter() - t0
        prof.dump_stats(profile)
        st = pstats.Stats(prof, stream=sys.stderr)
        st.sort_stats("cumulative").print_stats(35)
        st.sort_stats("tottime").print_stats(20)
        if sql_log:
            print("DuckDB statements (and their fetches), slowest first:", file=sys.stderr)
            for s, q in sorted(sql_log, reverse=True)[:15]:
                print(f"  {s:7.3f}s  {q}", file=sys.stderr)
            extra["sql"] = [[round(s, 3), q] for s, q in sql_log]
    else:
        work()
        seconds = time.perf_counter() - t0
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)  # every thread of this process
    peak = u1.ru_maxrss / 1024
    print(
        json.dumps(
            {
                "stage": stage,
                "seconds": round(seconds, 3),
                "cpu_s": round(cpu_s, 3),
                "peak_rss_mib": round(peak, 1),
                "rss_after_imports_mib": round(rss_imports, 1),
                **extra,
            }
        )
    )


def run_child(stage: str, args, input_dir: Path, run_dir: Path, profile: str | None = None, quiet: bool = True) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        stage,
        "--input-dir",
        str(input_dir),
        "--run-dir",
        str(run_dir),
        "--chunk-rows",
        str(args.chunk_rows),
    ]
    if profile:
        cmd += ["--profile-out", profile]
    if args.golden_rows:
        cmd += ["--golden-rows", str(args.golden_rows)]
    if args.passthrough:
        cmd += ["--passthrough"]
    if args.token_sizing:
        cmd += ["--token-sizing"]
    load = os.getloadavg()[0]
    stderr = None if profile or not quiet else subprocess.PIPE
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr or "")
        raise SystemExit(f"stage {stage} failed (exit {proc.returncode})")
    line = [x for x in proc.stdout.splitlines() if x.startswith("{")][-1]
    r = json.loads(line)
    r["load1_before"] = round(load, 2)
    return r


# ---- main ---------------------------------------------------------------------------------
def environment() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    import duckdb
    import pyarrow

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
        ).stdout.strip()
        # cwd: the repository root (a pathspec is relative to cwd; from benchmarks/ it matched nothing)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "airflow_provider_vllm"],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
        ).stdout.strip()
        commit += " (package modified)" if dirty else ""
    except OSError:
        commit = None
    return {
        "machine": platform.machine(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "git": commit,
        # the package under test, which PYTHONPATH may take from another checkout (an A/B against an older commit)
        "package": _package_commit(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "pyarrow": pyarrow.__version__,
        "duckdb": duckdb.__version__,
    }


def _package_commit() -> str:
    """The commit of the checkout the imported package lies in (a path would name this machine's folders)."""
    import airflow_provider_vllm

    where = Path(airflow_provider_vllm.__file__).resolve().parent
    try:
        p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True)
    except OSError:
        return "unknown (no git)"
    return p.stdout.strip() if p.returncode == 0 else "not in a git checkout"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--workdir", type=Path, default=Path(".cache/bench/dataplane"))
    ap.add_argument("--chunk-rows", type=int, default=50_000, help="sharding.chunk_rows of the bench spec")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per stage (median seconds, max RSS)")
    ap.add_argument(
        "--profile",
        nargs="?",
        const="missed",
        choices=["missed", "all"],
        help="afterwards, profile the stages that missed a goal (or all) under cProfile + SQL timers",
    )
    ap.add_argument(
        "--stages",
        default="plan,merge,qa",
        help="comma-separated stages to time (default all); without plan, the previous run's "
        "plan, commits and merged output under --workdir are reused",
    )
    ap.add_argument(
        "--golden-rows",
        type=int,
        default=0,
        help="QA with known labels: a golden set of this many ids joined by id (qa.reference.golden_uri); "
        "the results then carry confidence and prompt hashes too (0: no labels)",
    )
    ap.add_argument(
        "--passthrough",
        action="store_true",
        help=f"the input has typed columns {PASSTHROUGH} more, passed through into results/ and errors/ "
        "(io.passthrough; its own input folder)",
    )
    ap.add_argument(
        "--token-sizing",
        action="store_true",
        help=f"shards sized by estimated tokens ({TOKEN_SIZING}; the plan reads the text column): only the plan "
        "stage, into its own folder (runs-tokens/)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--input-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(
            args.child,
            args.input_dir,
            args.run_dir,
            args.chunk_rows,
            args.profile_out,
            args.golden_rows,
            args.passthrough,
            args.token_sizing,
        )
        return 0

    work = args.workdir.resolve()
    input_dir = work / f"input-{args.rows}{'-passthrough' if args.passthrough else ''}"
    # in a child: the parent stays small, since a child's ru_maxrss starts from its parent's RSS
    os.environ["BENCH_ROWS"] = str(args.rows)
    gen = run_child("gen", args, input_dir, work / "unused", quiet=False)
    runs = work / ("runs-tokens" if args.token_sizing else "runs")  # a token-sized plan never replaces the run
    run_dir = runs / "run"
    wanted = [x for x in args.stages.split(",") if x]
    if unknown := set(wanted) - set(GOALS):
        raise SystemExit(f"--stages: unknown {sorted(unknown)}; choose from {sorted(GOALS)}")
    if args.token_sizing and wanted != ["plan"]:
        raise SystemExit("--token-sizing times the plan only: --stages plan")
    if "plan" not in wanted and not (run_dir / "_plan.json").exists():
        raise SystemExit(f"--stages without plan reuses {run_dir}, which has no plan: include plan once")
    t_start = time.time()
    env = environment()  # at the start: the package commit under test

    measured: dict[str, list[dict]] = {s: [] for s in GOALS if s in wanted}
    setup = None
    if "plan" in wanted:
        if runs.exists():
            shutil.rmtree(runs)
        runs.mkdir(parents=True)
        for rep in range(args.repeat):  # plans into fresh folders; rep 0's folder is the run
            measured["plan"].append(run_child("plan", args, input_dir, run_dir if rep == 0 else runs / f"plan-{rep}"))
    if ("merge" in wanted or "qa" in wanted or "publish" in wanted) and not (run_dir / "shards").exists():
        setup = run_child("setup", args, input_dir, run_dir)
        print(
            f"setup (not timed as a stage): {setup['shards']} shards, {setup['chunk_files']} chunk files "
            f"committed in {setup['seconds']:.1f}s",
            file=sys.stderr,
        )
    for _ in range(args.repeat if "merge" in wanted else 0):
        measured["merge"].append(run_child("merge", args, input_dir, run_dir))
    if ("qa" in wanted or "publish" in wanted) and not (run_dir / "_MERGED.json").exists():
        untimed = run_child("merge", args, input_dir, run_dir)
        print(f"merge (not timed: QA needs its output) in {untimed['seconds']:.1f}s", file=sys.stderr)
    for _ in range(args.repeat if "qa" in wanted else 0):
        measured["qa"].append(run_child("qa", args, input_dir, run_dir))
    for _ in range(args.repeat if "publish" in wanted else 0):
        measured["publish"].append(run_child("publish", args, input_dir, run_dir))
    n_shards = setup["shards"] if setup else len(json.loads((run_dir / "_plan.json").read_text())["shards"])
    n_chunks = setup["chunk_files"] if setup else None

    stages = []
    for name, rs in measured.items():
        g = (GOALS_1B if args.rows >= 1_000_000_000 else GOALS_100M if args.rows >= 100_000_000 else GOALS)[name]
        secs = statistics.median(r["seconds"] for r in rs)
        rss = max(r["peak_rss_mib"] for r in rs)
        # from 100M rows on, every run must be within the goal (3 of 3), not only the median
        met_s = (max(r["seconds"] for r in rs) if args.rows >= 100_000_000 else secs) <= g["seconds"]
        met_m = rss <= g.get("rss_mib", float("inf"))
        stages.append(
            {
                "stage": name,
                "seconds": round(secs, 3),
                "runs_s": [r["seconds"] for r in rs],
                "runs_cpu_s": [r.get("cpu_s") for r in rs],
                "peak_rss_mib": rss,
                "rss_after_imports_mib": rs[0]["rss_after_imports_mib"],
                "goal_s": g["seconds"],
                "goal_rss_mib": g.get("rss_mib"),
                "ratio_s_to_goal": round(secs / g["seconds"], 3),
                "ratio_rss_to_goal": round(rss / g["rss_mib"], 3) if "rss_mib" in g else None,
                "met": met_s and met_m,
                "load1_before": [r["load1_before"] for r in rs],
                **{
                    k: v
                    for k, v in rs[0].items()
                    if k not in ("stage", "seconds", "cpu_s", "peak_rss_mib", "rss_after_imports_mib", "load1_before")
                },
            }
        )

    print(
        f"\nbench_dataplane: {args.rows:,} rows{' with passthrough columns' if args.passthrough else ''}, "
        f"{n_shards} shards, chunk_rows {args.chunk_rows}, "
        f"{n_chunks if n_chunks is not None else 'reused'} chunk files, repeat {args.repeat}, "
        f"stages {','.join(measured)}"
    )
    print(
        f"{'stage':<6} {'seconds':>8} {'goal s':>7} {'s/goal':>7} {'peak RSS MiB':>13} {'goal MiB':>9} "
        f"{'RSS/goal':>9} {'met?':>5}"
    )
    for s in stages:
        print(
            f"{s['stage']:<6} {s['seconds']:>8.2f} {s['goal_s']:>7.1f} {s['ratio_s_to_goal']:>7.2f} "
            f"{s['peak_rss_mib']:>13.0f} {s['goal_rss_mib'] or '-':>9} {s['ratio_rss_to_goal'] or '-':>9} "
            f"{'yes' if s['met'] else 'NO':>5}"
        )

    record = {
        "bench": "dataplane",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "rows": args.rows,
        "chunk_rows": args.chunk_rows,
        "golden_rows": args.golden_rows,
        "passthrough": PASSTHROUGH if args.passthrough else None,
        "token_sizing": TOKEN_SIZING if args.token_sizing else None,
        "repeat": args.repeat,
        "shards": n_shards,
        "chunk_files": n_chunks,
        "setup_s": setup["seconds"] if setup else None,
        "stages_run": list(measured),
        "gen_s": gen.get("seconds"),
        "env": env,
        "stages": stages,
    }
    with open(RESULTS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    print(f"appended to {RESULTS_FILE}")

    if args.profile:
        for s in stages:
            if not s["met"] or args.profile == "all":
                prof = str(work / f"{s['stage']}.prof")
                why = "missed its goal" if not s["met"] else "--profile all"
                print(f"\n==== profile of {s['stage']} ({why}) -> {prof}", flush=True)
                r = run_child(
                    s["stage"], args, input_dir, run_dir if s["stage"] != "plan" else runs / "plan-prof", profile=prof
                )
                print(f"profiled run: {r['seconds']:.2f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
