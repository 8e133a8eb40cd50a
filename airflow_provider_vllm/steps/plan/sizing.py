"""Shard sizing from evidence: throughput recorded by earlier runs.

Where the history lives: ``sharding.history_uri`` (a folder, local or s3://, gs://). After a
run is merged, ``merge`` writes one small JSON-lines file there,
``<UTC time>-<spec hash>-<plan fingerprint>.jsonl``, holding one record per hardware the
run's shards reported (``record_run``). One file per run, named by the run: no appends, so
concurrent runs never race and re-merging a run rewrites the same file. The planner reads the
newest records (``read_history``: each file through the pipeline's bounded reads that follow no link, its lines
parsed one by one) and sizes shards to a number of minutes
(``size_shards``); with no history_uri, or no matching record, it falls back to
``target_rows`` / ``target_tokens``.

Which records count (``find_evidence``): same model name, task and tensor_parallel_size,
and the hardware named in ``sharding.hardware`` (default: the hardware of the newest
matching record, so that different GPUs are never averaged). Records of the same job
configuration (``config_hash``: model, engine, prompt, sampling) are preferred; their
rows/s carries over as is. Otherwise the model's tokens/s (prompt + completion tokens per
second of inference) is applied to this job's estimated tokens. The newest
``HISTORY_RECORDS`` matching records are pooled (sum of rows / sum of inference seconds).

Shard time = engine start + inference. With ``target_minutes`` unset, a shard lasts at least
``10 x`` the expected engine start (so start-up is <= 10% of it) and at least
``MIN_SHARD_MINUTES``. The expected start (``start_estimate``) depends on whether the shards
will find compiled artefacts: with the Kubernetes runner's shared compile cache
(``[vllm_batch] kubernetes_compile_cache_pvc``; ``warm_starts=True``) the recorded median of the
starts that restored one (``engine_start_warm_s``), without it (``False``) the median of the
starts that compiled, and for want of those the median of all starts, else a measured figure
(``ASSUMED_WARM_START_S`` / ``ASSUMED_COLD_START_S``: the 8B shape on an H200). A start counts
the worker's restore and publish of the compile cache (``compile_cache_s``) as well.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.commit import CommitMarker
from airflow_provider_vllm.core.errors import CommitError, LinkRefused, ListingTooLarge, SealError
from airflow_provider_vllm.core.plan import Evidence, Sizing
from airflow_provider_vllm.core.records import ThroughputRecord
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage, hash_pool

log = logging.getLogger(__name__)

HISTORY_VERSION = 1
HISTORY_RECORDS = 20  # newest matching records pooled
HISTORY_FILES = 500  # newest files read
# A merge writes one record (~1 KB with its seal) per hardware: a bigger file is not one of its files, and is not
# read (a planted file of millions of lines would hold the plan's memory and time): left out of the listing on its
# stated size, and never read past this + 1 bytes (a file swapped in after the listing).
HISTORY_FILE_BYTES = 64 * 1024
HISTORY_LISTED = 10_000
"""The most entries of a history folder listed: merge writes one file per run (a nightly job: 365 a year). A
folder holding more is not read (a warning names it and the bound; the plan sizes shards without history) and
merge writes its file without removing the run's earlier one: whoever else can write the folder cannot make
each plan and merge list millions of objects."""
FUTURE_SLACK_S = 24 * 3600.0  # a file named more than this after now is not a merge's (clock skew allowed)
_FILE_TIME = re.compile(r"^(\d{8}T\d{6}Z)-")
MIN_SHARD_MINUTES = 5.0
START_SHARE = 0.10  # engine start's largest share of a shard's time
# Engine start of a shard pod when the history has no figure: measured with the worker on one H200, Llama-3-8B
# shape, vLLM 0.25.0 (docs/BENCHMARKS.md, warm starts): 105-115 s compiling, 41 s from a restored compile cache.
ASSUMED_COLD_START_S = 110.0
ASSUMED_WARM_START_S = 41.0


# ---- writing --------------------------------------------------------------------------
def run_records(spec: JobSpec, plan: Any, markers: list[CommitMarker]) -> list[ThroughputRecord]:
    """Throughput records of one merged run, one per hardware; shards that inferred nothing are left out."""
    by_hw: dict[str, list] = {}
    for m in markers:
        st = m.stats
        rows = st.infer_rows
        if rows is None and st.rows_per_s and st.infer_s:  # markers before infer_rows existed
            rows = round(st.rows_per_s * st.infer_s)
        if not rows or not st.infer_s:
            continue
        by_hw.setdefault(st.hardware or "unknown", []).append(st.model_copy(update={"infer_rows": int(rows)}))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    est_per_row = plan.est_tokens / plan.total_rows if plan.total_rows else None
    out = []
    for hw, stats in sorted(by_hw.items()):
        rows = sum(s.infer_rows for s in stats)
        infer_s = sum(float(s.infer_s) for s in stats)
        ptok = sum(int(s.prompt_tokens or 0) for s in stats)
        ctok = sum(int(s.completion_tokens or 0) for s in stats)
        starts = [_start(s) for s in stats if s.engine_start_s]
        warm = [_start(s) for s in stats if s.engine_start_s and s.compile_cache == "warm"]
        cold = [_start(s) for s in stats if s.engine_start_s and s.compile_cache == "cold"]
        out.append(
            ThroughputRecord(
                version=HISTORY_VERSION,
                recorded_at=now,
                job=spec.name,
                task=spec.task,
                model=spec.model.name,
                model_revision=spec.model.revision,
                hardware=hw,
                tensor_parallel_size=spec.engine.tensor_parallel_size,
                max_num_seqs=spec.engine.max_num_seqs,
                config_hash=plan.config_hash,
                spec_hash=plan.spec_hash,
                shards=len(stats),
                rows=rows,
                infer_s=round(infer_s, 3),
                prompt_tokens=ptok,
                completion_tokens=ctok,
                engine_start_s=round(statistics.median(starts), 3) if starts else None,
                **({"engine_start_warm_s": round(statistics.median(warm), 3)} if warm else {}),
                **({"engine_start_cold_s": round(statistics.median(cold), 3)} if cold else {}),
                rows_per_s=round(rows / infer_s, 4),
                tokens_per_s=round((ptok + ctok) / infer_s, 2),
                prompt_tokens_per_row=round(ptok / rows, 2),
                completion_tokens_per_row=round(ctok / rows, 2),
                est_prompt_tokens_per_row=round(est_per_row, 2) if est_per_row is not None else None,
            )
        )
    return out


def _start(st: Any) -> float:
    """A shard's start-up: the engine's start plus restoring / publishing the shared compile cache."""
    return float(st.engine_start_s) + float(st.compile_cache_s or 0.0)


def record_run(
    spec: JobSpec,
    plan: Any,
    markers: list[CommitMarker],
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
) -> str | None:
    """Write the run's records under ``sharding.history_uri``, each sealed for that folder (``keyring``: default
    ``VLLM_BATCH_SIGNING_KEY``); returns the file's URI (None: nothing to record)."""
    uri = spec.sharding.history_uri
    if not uri:
        return None
    records = run_records(spec, plan, markers)
    if not records:
        return None
    store = Storage(uri, spec.io.storage_options, filesystems)
    keyring, scope = keyring or Keyring.from_env(), seals.scope_of(store.uri())
    sealed = [seals.seal_record(keyring, seals.HISTORY, scope, r) for r in records]
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{plan.spec_hash[:16]}-{plan.fingerprint[:16]}.jsonl"
    # a re-merge of the same run replaces its earlier file (same spec and input): one record set per run
    stale = [n for n in _names(store) if n.endswith(f"-{plan.spec_hash[:16]}-{plan.fingerprint[:16]}.jsonl")]
    store.write_atomic(name, "".join(json.dumps(r.dump(), sort_keys=True) + "\n" for r in sealed).encode())
    for n in stale:
        if n != name:
            store.remove(n)
    return store.uri(name)


# ---- reading --------------------------------------------------------------------------
def _names(store: Storage) -> list[str]:
    try:
        listed = store.listdir("", limit=HISTORY_LISTED)
    except ListingTooLarge as e:
        log.warning("throughput history: %s; its earlier file of this run is left in place", e)
        return []
    return [n for n in listed if n.endswith(".jsonl") and not n.startswith((".", "_"))]


def read_history(
    uri: str,
    storage_options: dict[str, Any] | None = None,
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
) -> list[ThroughputRecord]:
    """Records under ``uri``, newest first; an absent folder is an empty history.

    Files are taken newest first by name (``_window``: files merge would not have written are left out, named in a
    warning), each read as the pipeline reads below its roots (``_read_file``: a link, a FIFO, a device or a file
    over ``HISTORY_FILE_BYTES`` found in place of a listed file is skipped, named in a warning), records newest
    first by their sealed ``recorded_at``, each sealed record once (a copy of one in another file is not more
    evidence). Lines that are not valid records of this version, or that hold no rows or
    no inference time, are skipped (a history is evidence, not input: one bad file must not stop a plan).
    So are records without this deployment's seal for this folder (``keyring``: default
    ``VLLM_BATCH_SIGNING_KEY``): a file in the folder proves nothing about who wrote it, and
    whoever else can write there would choose the shards' size (one shard of every row, or
    ``max_shards`` of them); they are counted in a warning.
    """
    store = Storage(uri, storage_options or {}, filesystems)
    names = _window(store, uri)
    if not names:
        return []
    keyring, scope = keyring or Keyring.from_env(), seals.scope_of(store.uri())
    with hash_pool(len(names)) as pool:
        read = list(pool.map(lambda n: _read_file(store, n), reversed(names)))  # newest file first
    _warn_unread(uri, [f"{n} ({why})" for n, (_, why) in zip(reversed(names), read) if why])
    rows = [line for data, _ in read for line in data.splitlines() if line.strip()]
    out: list[ThroughputRecord] = []
    unsealed, copies, macs = 0, 0, set[str]()
    for raw in rows:
        try:
            r = ThroughputRecord.model_validate_json(raw)
        except (TypeError, ValidationError):
            continue
        if r.version != HISTORY_VERSION or not r.rows or not r.infer_s:
            continue
        try:
            seals.verify_record(keyring, seals.HISTORY, scope, r, f"a throughput record under {uri}")
        except SealError:
            unsealed += 1
            continue
        if r.seal is not None and r.seal.mac in macs:  # the same sealed record copied into another file
            copies += 1
            continue
        if r.seal is not None:
            macs.add(r.seal.mac)
        out.append(r)
    # newest first by the sealed time: a file's name is anyone's to choose, and would make a copied old record "newest"
    out.sort(key=lambda r: r.recorded_at, reverse=True)
    if copies:
        log.warning(
            "%d throughput record(s) under %s are copies of a record already read (the same sealed record in another "
            "file): each is used once",
            copies,
            uri,
        )
    if unsealed:
        log.warning(
            "%d throughput record(s) under %s are not sealed by this deployment's merge for that folder (written by "
            "another writer, copied from another folder, or before records were sealed): not used for sizing",
            unsealed,
            uri,
        )
    return out


def _read_file(store: Storage, name: str) -> tuple[bytes, str]:
    """``(bytes, "")`` of the history file ``name``, or ``(b"", why it is not read)``. Read as the pipeline reads
    below its roots (``Storage.read_bytes``): a link (local: each component opened with O_NOFOLLOW), a FIFO or a
    device is refused unopened, and no more than ``HISTORY_FILE_BYTES`` + 1 bytes are read (remote: none when the
    store states a bigger size). The listing checked the same, but the name may be another file by now."""
    try:
        return store.read_bytes(name, HISTORY_FILE_BYTES), ""
    except LinkRefused:
        return b"", "a symbolic link, refused unopened"
    except CommitError as e:  # no regular file, or over HISTORY_FILE_BYTES: refused unread
        return b"", str(e).removeprefix(store.uri(name)).strip(" :")
    except OSError as e:  # gone since the listing, or unreadable
        return b"", f"unreadable: {type(e).__name__}: {e}"


def _window(store: Storage, uri: str) -> list[str]:
    """The newest ``HISTORY_FILES`` history files by name, oldest first. Names not of merge's form
    (``<UTC time>-...jsonl``), named after now (+ ``FUTURE_SLACK_S``), not plain files, or over ``HISTORY_FILE_BYTES``
    are left out, each named in a warning: such a file would hold the window, or the plan's memory or time."""
    latest = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() + FUTURE_SLACK_S))
    keep: list[str] = []
    skipped: list[str] = []
    try:
        listed = store.listdir_sizes("", limit=HISTORY_LISTED)
    except ListingTooLarge as e:
        log.warning("throughput history: %s; shards are sized without it", e)
        return []
    for name, size in listed.items():
        if not name.endswith(".jsonl") or name.startswith((".", "_")):
            continue
        m = _FILE_TIME.match(name)
        if m is None:
            skipped.append(f"{name} (not named <UTC time>-...jsonl as merge names its files)")
        elif m.group(1) > latest:
            skipped.append(f"{name} (named after now: a merge names its file by the time it writes it)")
        elif size is None:
            skipped.append(f"{name} (not a plain file: a folder, a link, a FIFO or a device)")
        elif size > HISTORY_FILE_BYTES:
            skipped.append(
                f"{name} ({size} bytes; a merge writes about 1 KB per hardware, {HISTORY_FILE_BYTES} at most)"
            )
        else:
            keep.append(name)
    _warn_unread(uri, skipped)
    return keep[-HISTORY_FILES:]


@dataclass(frozen=True)
class History:
    """A job's throughput history as one read saw it: its records, or the error that kept them unread."""

    records: list[ThroughputRecord]
    error: Exception | None = None


def job_history(
    spec: JobSpec, filesystems: FileSystems | None = None, keyring: Keyring | None = None
) -> History | None:
    """The sealed records under ``sharding.history_uri`` (None: no history_uri; ``read_history``). An unreadable
    history is evidence missing, not a failed plan: an empty History carrying the error, with a warning logged."""
    uri = spec.sharding.history_uri
    if not uri:
        return None
    try:
        return History(read_history(uri, spec.io.storage_options, filesystems, keyring))
    except Exception as e:  # unreadable evidence: plan as if there were none, and say so
        log.warning("cannot read the throughput history under %s (%s): using target_rows/tokens", uri, e)
        return History([], e)


# ---- deciding ---------------------------------------------------------------------------
def find_evidence(spec: JobSpec, records: list[ThroughputRecord]) -> Evidence | None:
    """The evidence for ``spec`` among ``records`` (newest first), or None."""
    cand = [
        r
        for r in records
        if r.model == spec.model.name
        and r.task == spec.task
        and (r.tensor_parallel_size or 1) == spec.engine.tensor_parallel_size
    ]
    if not cand:
        return None
    hw = spec.sharding.hardware or cand[0].hardware
    cand = [r for r in cand if r.hardware == hw]
    if not cand:
        return None
    same = [r for r in cand if r.config_hash == spec.output_hash()]
    use = (same or cand)[:HISTORY_RECORDS]
    rows = sum(r.rows for r in use)
    infer_s = sum(r.infer_s for r in use)
    ptok = sum(float(r.prompt_tokens) for r in use)
    ctok = sum(float(r.completion_tokens) for r in use)
    starts = [float(r.engine_start_s) for r in use if r.engine_start_s]
    warm = [float(r.engine_start_warm_s) for r in use if r.engine_start_warm_s]
    cold = [float(r.engine_start_cold_s) for r in use if r.engine_start_cold_s]
    return Evidence(
        basis="config" if same else "model",
        hardware=hw,
        records=len(use),
        rows=rows,
        infer_s=infer_s,
        rows_per_s=rows / infer_s,
        tokens_per_s=(ptok + ctok) / infer_s,
        prompt_tokens_per_row=ptok / rows,
        completion_tokens_per_row=ctok / rows,
        engine_start_s=statistics.median(starts) if starts else None,
        **({"engine_start_warm_s": statistics.median(warm)} if warm else {}),
        **({"engine_start_cold_s": statistics.median(cold)} if cold else {}),
    )


@dataclass(frozen=True)
class StartEstimate:
    """The engine start a shard is expected to pay, and where the figure comes from."""

    seconds: float
    basis: str  # history:warm, history:cold, history, assumed:warm, assumed:cold, assumed


def start_estimate(
    evidence: Evidence | None, warm_starts: bool | None, assumed_s: float | None = None
) -> StartEstimate:
    """The expected engine start per shard.

    ``warm_starts``: True when the shards reuse a shared compile cache (only the first pods of a new
    model, engine or vLLM compile: the figure is the warm one), False when every shard compiles, None
    when unknown (the local runner: the machine's own caches). ``assumed_s``: the figure for want of
    history (None: the measured warm / cold figure, or nothing when ``warm_starts`` is None).
    """
    ev = evidence
    known = ev.engine_start_s if ev is not None and ev.engine_start_s else None
    if warm_starts is True:
        if ev is not None and ev.engine_start_warm_s:
            return StartEstimate(ev.engine_start_warm_s, "history:warm")
        guess = assumed_s if assumed_s is not None else ASSUMED_WARM_START_S
        return StartEstimate(min(guess, known) if known else guess, "assumed:warm")  # never above the recorded
    if warm_starts is False:
        if ev is not None and ev.engine_start_cold_s:
            return StartEstimate(ev.engine_start_cold_s, "history:cold")
        if known:
            return StartEstimate(known, "history")
        return StartEstimate(assumed_s if assumed_s is not None else ASSUMED_COLD_START_S, "assumed:cold")
    if known:
        return StartEstimate(known, "history")
    return StartEstimate(assumed_s or 0.0, "assumed")


def prompt_overhead_tokens(spec: JobSpec) -> int:
    """Estimated prompt tokens per row beyond the row's text: system prompt and template literal text."""
    literal = len(spec.prompt.template)
    for c in spec.prompt.columns:
        literal -= len(c) + 2 * spec.prompt.template.count("{" + c + "}")
    chars = max(0, literal) + len(spec.prompt.system_prompt or "")
    return math.ceil(chars / spec.sharding.chars_per_token)


@dataclass(frozen=True)
class Workload:
    """What a job will cost: tokens and inference seconds (the latter from evidence or an assumption)."""

    rows: int
    prompt_tokens: int
    completion_tokens: int
    completion_basis: str  # "history" or "max_tokens (upper bound)"
    infer_s: float
    engine_start_s: float
    throughput_basis: str  # "history:config", "history:model" or "assumed"


def estimate_workload(
    spec: JobSpec,
    rows: int,
    est_text_tokens: int,
    evidence: Evidence | None,
    assumed_tokens_per_s: float,
    assumed_engine_start_s: float,
    engine_start_s: float | None = None,
) -> Workload:
    """Tokens and inference seconds of ``rows`` rows whose text columns hold ``est_text_tokens`` (planner estimate).

    ``engine_start_s``: the start per shard already estimated (``start_estimate``); None: the history's median,
    else ``assumed_engine_start_s``."""
    generates = spec.task in ("chat", "generate")
    prompt = est_text_tokens + rows * prompt_overhead_tokens(spec)
    if generates and evidence is not None:
        per_row = min(float(spec.sampling.max_tokens), evidence.completion_tokens_per_row)
        completion, c_basis = round(rows * per_row), "history"
    elif generates:
        completion, c_basis = rows * spec.sampling.max_tokens, "max_tokens (upper bound)"
    else:
        completion, c_basis = 0, "none (pooling task)"
    if evidence is not None and evidence.basis == "config":
        infer_s, basis = rows / evidence.rows_per_s, "history:config"
    elif evidence is not None:
        infer_s, basis = (prompt + completion) / evidence.tokens_per_s, "history:model"
    else:
        infer_s, basis = (prompt + completion) / assumed_tokens_per_s, "assumed"
    start = engine_start_s
    if start is None:
        start = evidence.engine_start_s if evidence is not None and evidence.engine_start_s else assumed_engine_start_s
    return Workload(
        rows=rows,
        prompt_tokens=int(prompt),
        completion_tokens=int(completion),
        completion_basis=c_basis,
        infer_s=float(infer_s),
        engine_start_s=float(start),
        throughput_basis=basis,
    )


def shard_seconds(spec: JobSpec, engine_start_s: float) -> float:
    """Target seconds per shard (engine start + inference)."""
    if spec.sharding.target_minutes is not None:
        return spec.sharding.target_minutes * 60.0
    return max(MIN_SHARD_MINUTES * 60.0, engine_start_s / START_SHARE)


def shard_count(work: Workload, target_s: float, max_shards: int, at_least: bool) -> int:
    """Shards of about ``target_s`` each (engine start included), within [1, min(rows, max_shards)].

    ``at_least``: shards last no less than ``target_s`` (the default target, a floor that keeps
    engine start <= 10%); otherwise no more than ``target_s`` (an explicit target_minutes).
    """
    if work.rows == 0:
        return 0
    per_shard_infer = target_s - work.engine_start_s
    if per_shard_infer <= 0:
        k = 1  # the engine start alone exceeds the target: as few shards as possible
    else:
        ratio = work.infer_s / per_shard_infer
        k = math.floor(ratio) if at_least else math.ceil(ratio)
    return max(1, min(k, work.rows, max_shards))


def size_shards(
    spec: JobSpec,
    rows: int,
    est_text_tokens: int,
    records: list[ThroughputRecord] | None = None,
    filesystems: FileSystems | None = None,
    warm_starts: bool | None = None,
    keyring: Keyring | None = None,
) -> Sizing | None:
    """Shard targets from history, or None (no history_uri, no matching record, no rows, an unreadable history).

    ``records``: the history already read (``job_history``); None reads it here. ``warm_starts``: whether the
    shards reuse a shared compile cache (``start_estimate``).
    """
    sh = spec.sharding
    if not sh.history_uri or rows == 0:
        return None
    if records is None:
        history = job_history(spec, filesystems, keyring)
        if history is None or history.error is not None:
            return None
        records = history.records
    ev = find_evidence(spec, records)
    if ev is None:
        log.info(
            "no throughput history for model %s (task %s, hardware %s) under %s: using target_rows/tokens",
            spec.model.name,
            spec.task,
            sh.hardware or "any",
            sh.history_uri,
        )
        return None
    start = start_estimate(ev, warm_starts)
    work = estimate_workload(spec, rows, est_text_tokens, ev, 1.0, 0.0, engine_start_s=start.seconds)
    target_s = shard_seconds(spec, work.engine_start_s)
    k = shard_count(work, target_s, sh.max_shards, at_least=sh.target_minutes is None)
    by_tokens = sh.target_tokens is not None and sh.target_rows is None
    sizing = Sizing(
        shards=k,
        target_rows=None if by_tokens else math.ceil(rows / k),
        target_tokens=max(1, math.ceil(est_text_tokens / k)) if by_tokens else None,
        target_s=round(target_s, 1),
        est_infer_s=round(work.infer_s, 1),
        engine_start_s=round(work.engine_start_s, 1),
        engine_start_basis=start.basis,
        evidence=ev.rounded(),
    )
    log.info(
        "sized %d rows into %d shard(s) of ~%.0f s (engine start %.0f s, %s) from %d history record(s) (%s, %s)",
        rows,
        k,
        target_s,
        start.seconds,
        start.basis,
        ev.records,
        ev.basis,
        ev.hardware,
    )
    return sizing


def _warn_unread(uri: str, unread: list[str]) -> None:
    """One warning naming the files under ``uri`` not read as throughput history (the first five), and why."""
    if unread:
        log.warning(
            "%d file(s) under %s are not read as throughput history: %s%s",
            len(unread),
            uri,
            "; ".join(unread[:5]),
            f"; and {len(unread) - 5} more" if len(unread) > 5 else "",
        )
