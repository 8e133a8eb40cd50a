"""Run one shard: read its rows, validate, infer, write chunks, commit.

Every row of the shard leaves exactly once, in a chunk file, as 'ok' or 'error'. Chunks
are written as soon as all their rows are done; the deep engine queue spans chunk
boundaries so the engine never drains between chunks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pyarrow as pa

from airflow_provider_vllm import __version__
from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.adapters import check_refs
from airflow_provider_vllm.core.commit import ChunkMeta, CommitMarker, FileEntry, RunSeal, ShardStore, new_attempt_id
from airflow_provider_vllm.core.engine_identity import local_engine_identity
from airflow_provider_vllm.core.errors import CommitError, InputChangedError, SpecError, TransientError
from airflow_provider_vllm.core.formats import RowBatch, input_format
from airflow_provider_vllm.core.formats.files import REPLAN, check_unchanged
from airflow_provider_vllm.core.formats.openai_batch import REQUEST
from airflow_provider_vllm.core.plan import Plan, ShardPlan, estimate_tokens, is_pinned, load_pinned_plan, read_plan
from airflow_provider_vllm.core.records import ShardStats, WorkerManifest
from airflow_provider_vllm.core.rows import ENGINE_ERROR, INVALID_ROW, prompt_hash, rows_table, samples_at_random
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import Storage, copies_folder
from airflow_provider_vllm.worker import compile_cache
from airflow_provider_vllm.worker.adapters import local_adapters
from airflow_provider_vllm.worker.engine import sampling_kwargs
from airflow_provider_vllm.worker.guard import GuardedEngine, RowFailure
from airflow_provider_vllm.worker.hardware import hardware_id
from airflow_provider_vllm.worker.isolation import describe, row_caused
from airflow_provider_vllm.worker.outputs import answer_extras, check_structured
from airflow_provider_vllm.worker.progress import Progress
from airflow_provider_vllm.worker.prompts import Prepared, PromptBuilder
from airflow_provider_vllm.worker.redact import redactor
from airflow_provider_vllm.worker.task import ShardTask
from airflow_provider_vllm.worker.telemetry import ShardTelemetry
from airflow_provider_vllm.worker.watchdog import Watchdog
from airflow_provider_vllm.worker.weights import WeightsCheck, check_pins

log = logging.getLogger("airflow_provider_vllm.worker")

# Requests kept in the engine at once: deep enough for continuous batching to stay full.
MIN_QUEUE = 1024


def start_limits(spec: JobSpec, carried: dict[str, int] | None) -> JobSpec:
    """The spec the engine starts from: lowered to the limits an earlier attempt's OOM reached.

    Only lowers (never raises what the spec asks for); engine limits are not part of the
    run's config hash, so chunks of earlier attempts stay reusable.
    """
    if not carried:
        return spec
    eng = spec.engine
    lim = {k: v if getattr(eng, k) is None else min(v, getattr(eng, k)) for k, v in carried.items()}
    if all(getattr(eng, k) == v for k, v in lim.items()):
        return spec
    log.warning(
        "starting at %s: an earlier attempt of this shard ran out of memory above that",
        ", ".join(f"{k}={v}" for k, v in sorted(lim.items())),
    )
    return spec.model_copy(update={"engine": eng.model_copy(update=lim)})


def run_shard(
    task: ShardTask,
    engine_factory: Callable[[JobSpec], Any] | None = None,
    on_stall: Callable[[float], None] | None = None,
    keyring: Keyring | None = None,
) -> dict[str, Any]:
    """Process one shard; returns the manifest as JSON data (``WorkerManifest.dump()``, the XCom value).

    Idempotent.

    The engine runs behind ``GuardedEngine`` (OOM back-off, engine death -> EngineError). A
    progress ``Watchdog`` (``spec.worker.watchdog_s``; ``on_stall`` default: exit 75) covers every
    phase that can hang: plan load, row reads, the reuse scan, inference, chunk writes and the
    commit; each completed step of them is progress (engine start and warm-up are not counted).

    ``keyring``: the worker's keys (default ``VLLM_BATCH_WORKER_KEY``): chunks of earlier attempts are reused only
    under their seal, and the chunks, the commit marker and compile cache snapshots are sealed with it
    (``core/seal.py``). The plan is the one the task names (``plan_mac``, ``plan_sha256``), which the Airflow side
    checked: the worker holds no key that checks a plan.
    """
    with Watchdog(task.spec.worker.watchdog_s, on_stall) as watchdog:
        return _run_shard(task, engine_factory, watchdog, keyring or Keyring.worker_from_env())


def _run_shard(
    task: ShardTask, engine_factory: Callable[[JobSpec], Any] | None, watchdog: Watchdog, keyring: Keyring
) -> dict[str, Any]:
    spec = task.spec
    # the engine this worker runs, as the cache key names it: read before vLLM starts (it sets VLLM_*
    # variables in this process's environment for its own workers)
    identity = local_engine_identity()
    out = Storage(spec.io.output_uri, spec.io.storage_options)
    faults.hit("plan.load")
    plan = load_pinned_plan(spec, task.plan_mac, task.plan_sha256)
    plan_mac = task.plan_mac
    plan = plan.for_shard(task.shard_id)  # a golden shard reads the golden rows' view
    watchdog.beat()
    if plan.spec_hash != spec.content_hash():
        raise SpecError(
            f"the plan at {spec.io.output_uri} was made for another spec "
            f"({plan.spec_hash[:12]} != {spec.content_hash()[:12]})"
        )
    shard = plan.shard(task.shard_id)
    store = ShardStore(out, shard.shard_id, RunSeal(keyring, plan_mac))
    committed = store.marker()
    watchdog.beat()
    if committed is not None:
        log.info("shard %s already committed by attempt %s: nothing to do", shard.shard_id, committed.attempt_id)
        return _manifest(committed, status="already_committed")
    factory = engine_factory or _default_engine
    if getattr(factory, "needs_vllm", False):  # before reading a row: without vLLM no attempt can succeed
        from airflow_provider_vllm.worker.engine import require_vllm

        require_vllm()

    check_refs(spec, plan.adapters)  # the plan's adapters are the spec's (before reading a row)
    weights = WeightsCheck(check_pins(spec, plan))  # the local model / tokenizer folders the plan pinned
    attempt = task.attempt_id or new_attempt_id()
    t_start = time.monotonic()
    with shard_input(spec, plan, shard) as in_root:
        watchdog.beat()
        batch = read_shard_rows(spec, plan, shard, in_root, beat=watchdog.beat)
    if len(batch) != shard.rows:
        raise InputChangedError(
            f"shard {shard.shard_id}: read {len(batch)} rows, the plan says {shard.rows}: the input's content "
            f"changed since the plan though its files' sizes and versions did not; {REPLAN}"
        )
    carried = passthrough_table(plan, batch)
    read_s = time.monotonic() - t_start

    chunk_rows = spec.sharding.chunk_rows
    n_chunks = max(1, -(-shard.rows // chunk_rows)) if shard.rows else 0
    metas = {
        k: ChunkMeta(
            shard_id=shard.shard_id,
            chunk=k,
            first_row=k * chunk_rows,
            rows=min(chunk_rows, shard.rows - k * chunk_rows),
            config_hash=plan.config_hash,
        )
        for k in range(n_chunks)
    }
    sealed = store.reusable_seals(metas, beat=watchdog.beat)
    reused = {k: s.entry for k, s in sealed.items()}
    todo = [k for k in range(n_chunks) if k not in reused]
    log.info(
        "shard %s attempt %s: %d rows in %d chunks, %d reused from earlier attempts",
        shard.shard_id,
        attempt,
        shard.rows,
        n_chunks,
        len(reused),
    )

    stats: dict[str, Any] = {
        "rows": shard.rows,
        "read_s": round(read_s, 3),
        "reused_chunks": len(reused),
        "engine_start_s": 0.0,
        "infer_s": 0.0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
    }
    files = dict(reused)
    engine_version = None
    reads_clock = None  # probed by the prompt builder when an engine starts
    done_rows = sum(metas[k].rows for k in todo)
    engine_rows = 0
    telemetry = ShardTelemetry(spec, shard.shard_id, attempt, done_rows, task.progress_interval_s)
    if todo:
        started = start_limits(spec, store.engine_limits())
        shared = compile_cache.from_env(started, keyring)  # the shared compile cache, when the pod mounts one
        with _beating(watchdog), local_adapters(spec, plan) as adapter_paths, contextlib.closing(weights):
            if factory is _default_engine and adapter_paths:  # without adapters: the factory as it was
                factory = functools.partial(_default_engine, adapters=adapter_paths)
            factory = weights.bracket(factory)  # hashes the pinned folders while each engine loads and runs
            if shared is not None:
                shared.restore()  # before vLLM starts: it reads the private folders once, at start
            engine = GuardedEngine(
                started,
                factory,
                watchdog,
                label=lambda key: batch.ids[cast(tuple, key)[1]],
                on_lowered=lambda lim: store.save_engine_limits(lim, attempt),
            )
            engine_version = engine.version
            stats["engine_start_s"] = round(engine.start_seconds, 3)
            telemetry.engine_started(engine.start_seconds)
            with watchdog.paused():
                engine.warm_up()
            if shared is not None:
                shared.publish(f"{shard.shard_id}/{attempt}")  # after a cold start: what it compiled
                stats.update(shared.stats())
            try:
                runner = _ChunkRunner(
                    spec=spec,
                    plan=plan,
                    shard=shard,
                    batch=batch,
                    engine=engine,
                    store=store,
                    attempt=attempt,
                    metas=metas,
                    progress=telemetry.progress,
                    carried=carried,
                    engine_identity=identity,
                    weights=weights,
                )
                reads_clock = runner.builder.reads_clock
                t0 = time.monotonic()
                files.update(runner.run(todo))
                runner.seal_checked(
                    wait=True, beat=watchdog.beat
                )  # InputChangedError when a pinned folder changed: nothing sealed
                stats["infer_s"] = round(time.monotonic() - t0, 3)
                stats.update(engine.stats())
            finally:
                engine.close()
        stats["prompt_tokens"] = runner.prompt_tokens
        stats["completion_tokens"] = runner.completion_tokens
        # rows refused before the engine took no inference time: counted, they would make the throughput history's
        # rows/s that of a night of empty rows, and the next plan cut a normal night into a few shards of hours
        engine_rows = done_rows - runner.rejected
    infer = stats["infer_s"] or 1e-9
    stats.update(
        infer_rows=engine_rows,  # rows this attempt sent to the engine (reused chunks excluded): the throughput basis
        hardware=hardware_id(spec.engine.tensor_parallel_size),
        rows_per_s=round(done_rows / infer, 3) if todo else None,
        tokens_per_s=round((stats["prompt_tokens"] + stats["completion_tokens"]) / infer, 1) if todo else None,
        wall_s=round(time.monotonic() - t_start, 3),
        **telemetry.finish(),
    )
    entries = [files[k] for k in range(n_chunks)]
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
        stats=ShardStats.model_validate(stats),
        engine_identity=_made_by(identity, [s.engine_identity for s in sealed.values()], bool(todo)),
        prompt_reads_clock=reads_clock,
        versions={
            "airflow-provider-vllm": __version__,
            "vllm": engine_version,
            "python": platform.python_version(),
            "model": spec.model.name,
            "model_revision": spec.model.revision,
        },
        committed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    if marker.rows != shard.rows:
        raise InputChangedError(f"shard {shard.shard_id}: chunks hold {marker.rows} rows, plan {shard.rows}")
    _check_plan_unchanged(spec, task, shard.shard_id)
    watchdog.beat()
    if store.commit(marker):
        log.info(
            "shard %s committed by attempt %s: %d ok, %d errors",
            shard.shard_id,
            attempt,
            marker.ok_rows,
            marker.error_rows,
        )
        return _manifest(marker, status="committed")
    winner = store.marker()  # sealed by the attempt that won (checked), or a SealError
    if winner is None:  # create_only refused but no marker: storage lost it; a retry commits again
        raise TransientError(f"shard {shard.shard_id}: the commit marker was refused but cannot be read back")
    log.info(
        "shard %s was committed first by attempt %s; this attempt's files are ignored",
        shard.shard_id,
        winner.attempt_id,
    )
    return _manifest(winner, status="already_committed")


def _check_plan_unchanged(spec: JobSpec, task: ShardTask, shard_id: str) -> None:
    """CommitError (terminal) unless the output prefix still holds the plan this attempt ran under (the one its task
    names), read again right before the commit: an attempt that outlived its run (a zombie pod, a task process gone)
    while the prefix was emptied and planned again must not take the shard's one create-only marker in the new run's
    folder (its workers would refuse that marker, sealed for another plan, and the shard could never commit); nor
    must an attempt commit after ``_plan.json`` was replaced by another record. SpecError when there is no plan any
    more."""
    now, _ = read_plan(spec)
    if not is_pinned(now, task.plan_mac, task.plan_sha256):
        raise CommitError(
            f"shard {shard_id}: the plan at {spec.io.output_uri} is not the one this attempt started under (the "
            "output prefix was emptied and planned again while it ran, or its plan was replaced); not committing its "
            "rows, which answer the earlier plan"
        )


def _made_by(identity: str, reused: list[str | None], inferred: bool) -> str | None:
    """The engine the marker names: the one that made every row of the shard (this worker's when it ran them all);
    None when the reused chunks of earlier attempts were made by another engine than the rest, or by a worker
    that did not record its own: the result cache files no row of such a shard (``engines_differ``)."""
    made = set(reused) | ({identity} if inferred or not reused else set())
    if len(made) == 1:
        return made.pop()
    log.warning(
        "the shard's rows were made by more than one engine (chunks reused from earlier attempts: %s; this "
        "attempt: %s): its commit marker names none of them, and the result cache files none of its rows",
        sorted(str(x) for x in set(reused)),
        identity,
    )
    return None


@contextlib.contextmanager
def _beating(watchdog: Watchdog):
    """A phase of the shard: progress when it starts and when it ends."""
    watchdog.beat()
    try:
        yield
    finally:
        watchdog.beat()


def _default_engine(spec: JobSpec, adapters: dict[str, str] | None = None):
    from airflow_provider_vllm.worker.engine import Engine

    return Engine(spec, adapters)


_default_engine.needs_vllm = True  # type: ignore[attr-defined]  # an injected engine (tests) needs none


def _manifest(marker: CommitMarker, status: str) -> dict[str, Any]:
    return WorkerManifest(
        status=status,
        shard_id=marker.shard_id,
        attempt_id=marker.attempt_id,
        rows=marker.rows,
        ok_rows=marker.ok_rows,
        error_rows=marker.error_rows,
        stats=marker.stats,
    ).dump()


# ---- reading ------------------------------------------------------------------------
@contextlib.contextmanager
def shard_input(spec: JobSpec, plan: Plan, shard: ShardPlan) -> Iterator[Storage]:
    """The folder the shard's segments are read from.

    The input itself, checked unchanged since the plan; or, with the result cache, repeated prompts (the
    dedupe) or a materialized table (``TablePin.read``), the shard's own input file, fetched whole into a
    private temp folder and read only when it has the size and sha256 of the sealed plan: the rows the engine
    answers are the rows the plan keyed (or wrote under the output prefix, which has other writers).
    """
    root, files = plan.shard_input(shard)
    # a materialized table's file lies under the output prefix (other writers): a shard reads only its own rows'
    # file, checked; an old plan that pins no bytes (InputChangedError) or a shard without one is refused
    pin = plan.table.checked_materialized() if plan.table is not None else None
    if pin is not None and shard.input_file is None:
        raise InputChangedError(
            f"shard {shard.shard_id} would read {plan.input_root}/{files[0].path if files else ''}, the file the plan "
            "wrote under the output prefix, without its own checked input file; plan the run again into a new "
            "output prefix"
        )
    # the input: the user's links are followed; the plan's own misses file (under the output prefix) is not
    src = Storage(root, spec.io.storage_options, follow_links=shard.input_file is None)
    if shard.input_file is None:
        check_unchanged(src, files)
        yield src
        return
    with copies_folder("shard") as tmp:  # swept by the next one when a worker killed with SIGKILL leaves it
        f = shard.input_file
        src.fetch_verified(files[0].path, f.bytes, f.sha256, os.path.join(tmp, files[0].path))
        yield Storage(tmp)


def read_shard_rows(
    spec: JobSpec, plan: Plan, shard: ShardPlan, root: Storage, beat: Callable[[], None] = lambda: None
) -> RowBatch:
    """The shard's rows in plan order (bucket filter applied); ``beat()`` after each segment read."""
    fmt = input_format(plan.format)
    batch = RowBatch(ids=[], values={}, faults=[], lines=[])
    carried = plan.passthrough.columns if plan.passthrough is not None else None
    for seg in shard.segments:
        faults.hit("read.segment")
        part = fmt.read_rows(root, plan.shard_input(shard)[1][seg.file].path, seg, spec, carried)
        if shard.bucket != "all":
            assert plan.long_row_tokens is not None  # the planner buckets only with a threshold
            tokens = np.asarray(estimate_tokens(np.asarray(part.chars, dtype=np.int64), plan.chars_per_token))
            long = tokens > plan.long_row_tokens
            part = part.select(long if shard.bucket == "long" else ~long)
        batch.extend(part)
        beat()
    return batch


def passthrough_table(plan: Plan, batch: RowBatch) -> pa.Table | None:
    """The rows' passthrough columns as the parts publish them: renamed and typed as the plan says (a shard's
    input file written by DuckDB may carry a wider or tz-normalised type of the same values)."""
    p = plan.passthrough
    if p is None:
        return None
    t = batch.passthrough
    if t is None or t.num_rows != len(batch):
        raise InputChangedError(f"read {0 if t is None else t.num_rows} rows of passthrough columns for {len(batch)}")
    schema = p.arrow_schema()
    cols = []
    for c, f in zip(p.columns, schema):
        col = t.column(c)
        cols.append(col if col.type == f.type else col.cast(f.type))
    return pa.Table.from_arrays(cols, schema=schema)


# ---- inference ----------------------------------------------------------------------
@dataclass
class _ChunkRunner:
    """Feeds rows of the chunks to do through the engine and writes each chunk when complete.

    ``metas``: chunk number -> what the chunk holds (every chunk of the shard); ``batch``: the shard's rows
    in plan order; ``progress``: counts rows as they finish (the shard's progress lines and metrics);
    ``carried``: the shard's passthrough columns (``passthrough_table``), a row per row of ``batch``;
    ``engine_identity``: the engine this worker runs, sealed with each chunk it writes.
    """

    spec: JobSpec
    plan: Plan
    shard: ShardPlan
    batch: RowBatch
    engine: GuardedEngine
    store: ShardStore
    attempt: str
    metas: dict[int, ChunkMeta]
    progress: Progress
    carried: pa.Table | None = None
    engine_identity: str | None = None
    weights: WeightsCheck | None = None
    prompt_tokens: int = field(default=0, init=False)
    completion_tokens: int = field(default=0, init=False)
    rejected: int = field(default=0, init=False)  # rows refused before the engine (EMPTY_INPUT, PROMPT_TOO_LONG, ...)
    unsealed: list[tuple[ChunkMeta, FileEntry]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        spec, plan = self.spec, self.plan
        self.builder = PromptBuilder(spec, self.engine.tokenizer, self.engine.max_model_len, plan.format)
        self.requests = input_format(plan.format).carries_requests
        self.prov = {
            "model": spec.model.name,
            "model_revision": spec.model.revision,
            "engine_version": self.engine.version,
            "config_hash": plan.config_hash,
            "shard_id": self.shard.shard_id,
            "attempt_id": self.attempt,
        }
        self.depth = max(MIN_QUEUE, 4 * (spec.engine.max_num_seqs or 256))

    def run(self, todo: list[int]) -> dict[int, FileEntry]:
        self.progress.total = sum(self.metas[k].rows for k in todo)
        self.progress.restart()
        if self.spec.task in ("embed", "classify"):
            return {k: self._pool_chunk(k) for k in todo}
        return self._generate(todo)

    def _prepare(self, i: int) -> Prepared:
        """The row's prompt, or its fault: nothing one row holds can fail the shard from here."""
        fault = self.batch.faults[i]
        if fault is not None:
            return Prepared(fault=fault)
        try:
            if self.requests:
                return self.builder.prepare_openai(self.batch.values[REQUEST][i])
            return self.builder.prepare({c: v[i] for c, v in self.batch.values.items()})
        except Exception as e:
            if not row_caused(e):
                raise
            log.warning("row %s could not be prepared: %s", self.batch.ids[i], describe(e, 200))
            return Prepared(fault=(INVALID_ROW, f"the row could not be prepared: {describe(e)}"))

    def _samples(self, overrides: dict[str, Any] | None) -> bool:
        """Whether the row's request samples at random (``rows.samples_at_random``), by the settings the engine gets:
        the spec's with the row's own (an OpenAI batch body's), ``engine.sampling_kwargs``."""
        kw = sampling_kwargs(self.spec, overrides)
        return samples_at_random(kw.get("temperature"), kw.get("seed"))

    def _error(self, i: int, code: str, message: str, adapter: str | None = None) -> dict[str, Any]:
        return {
            "id": self.batch.ids[i],
            "status": "error",
            "error_code": code,
            "error_message": message,
            **self.prov,
            "adapter": adapter,
        }

    def _write(self, meta: ChunkMeta, rows: list[dict]) -> FileEntry:
        part = None if self.carried is None else self.carried.slice(meta.first_row, meta.rows)
        # an error message may quote an engine's or a tokenizer's exception, which may echo a secret or a URL's
        # credentials: masked as in the log, before it reaches errors/ (and an OpenAI batch's errors.jsonl)
        masker = redactor() if any(r.get("error_message") for r in rows) else None
        for r in rows:
            if masker is not None and r.get("error_message"):
                r["error_message"] = masker.redact(r["error_message"])
        if self.weights is None or not self.weights.pins:
            return self.store.write_chunk(self.attempt, meta, rows_table(rows), part, self.engine_identity)
        # pinned weights: a chunk is sealed (reusable by a retry) only once the folders its engine loaded are
        # checked; a chunk of an attempt killed or refused before then is redone by the next one
        entry = self.store.write_chunk(self.attempt, meta, rows_table(rows), part, self.engine_identity, seal=False)
        self.unsealed.append((meta, entry))
        self.seal_checked()
        return entry

    def seal_checked(self, wait: bool = False, beat: Callable[[], None] = lambda: None) -> None:
        """Seal the chunks written so far once the weights check has settled (``wait``: wait for it, ``beat()`` while
        it hashes); InputChangedError (nothing sealed) when a pinned folder changed."""
        if self.weights is None:
            return
        if wait:
            self.weights.wait(beat)
        elif not self.unsealed or not self.weights.settled():
            return
        for meta, entry in self.unsealed:
            self.store.seal_chunk(meta, entry, self.engine_identity)
        self.unsealed = []

    def _generate(self, todo: list[int]) -> dict[int, FileEntry]:
        records: dict[int, dict[int, dict]] = {k: {} for k in todo}
        submitted: dict[int, tuple[float, bool, int | None, str | None]] = {}
        files: dict[int, FileEntry] = {}
        queue = [
            (k, i) for k in todo for i in range(self.metas[k].first_row, self.metas[k].first_row + self.metas[k].rows)
        ]
        pos = 0
        while pos < len(queue) or self.engine.pending():
            while pos < len(queue) and self.engine.pending() < self.depth:
                k, i = queue[pos]
                pos += 1
                prep = self._prepare(i)
                if prep.fault is not None:
                    self.rejected += 1
                    records[k][i] = self._error(i, *prep.fault, prep.adapter)
                    self._row_done(k, i, records, files)
                    continue
                # no hash for a request that samples at random: its answers differ by design (nothing compares them)
                phash = (
                    None
                    if self._samples(prep.overrides)
                    else prompt_hash(prep.token_ids or [], prep.overrides, prep.adapter)
                )
                submitted[i] = (time.monotonic(), prep.truncated, phash, prep.adapter)
                # a request the engine refuses comes back from step() as a RowFailure
                if prep.adapter is None:
                    self.engine.submit((k, i), _tokens(prep), prep.overrides or None)
                else:
                    self.engine.submit((k, i), _tokens(prep), prep.overrides or None, adapter=prep.adapter)
            if not self.engine.pending():
                continue
            for key, g in self.engine.step():
                k, i = cast(tuple[int, int], key)
                t_sub, truncated, phash, adapter = submitted.pop(i)
                if isinstance(g, RowFailure):
                    records[k][i] = self._error(i, g.code, g.message, adapter)
                    self._row_done(k, i, records, files)
                    continue
                label, parsed, valid = self._structured(i, g.text)
                records[k][i] = {
                    "id": self.batch.ids[i],
                    "status": "ok",
                    "output": g.text,
                    "label": label,
                    "parsed_json": parsed,
                    "valid": valid,
                    "finish_reason": g.finish_reason,
                    "prompt_tokens": g.prompt_tokens,
                    "completion_tokens": g.completion_tokens,
                    "truncated": truncated,
                    "latency_ms": (time.monotonic() - t_sub) * 1000.0,
                    **self.prov,
                    **answer_extras(g, phash),
                    "adapter": adapter,
                }
                self.prompt_tokens += g.prompt_tokens
                self.completion_tokens += g.completion_tokens
                self._row_done(k, i, records, files)
        return files

    def _structured(self, i: int, text: str) -> tuple[str | None, str | None, bool | None]:
        try:
            return check_structured(self.spec, text)
        except Exception as e:  # e.g. JSON nested too deep to parse: the output is not valid
            if not row_caused(e):
                raise
            log.warning("row %s: structured output check failed: %s", self.batch.ids[i], describe(e, 200))
            return None, None, False

    def _row_done(self, k: int, i: int, records: dict, files: dict) -> None:
        self.progress.add_row(records[k][i])
        self._maybe_flush(k, records, files)

    def _maybe_flush(self, k: int, records: dict, files: dict) -> None:
        meta = self.metas[k]
        got = records[k]
        if len(got) < meta.rows:
            return
        rows = [got[i] for i in range(meta.first_row, meta.first_row + meta.rows)]
        files[k] = self._write(meta, rows)
        del records[k]

    def _pool_chunk(self, k: int) -> FileEntry:
        meta = self.metas[k]
        rows: dict[int, dict] = {}
        ok: list[tuple[int, Prepared]] = []
        for i in range(meta.first_row, meta.first_row + meta.rows):
            prep = self._prepare(i)
            if prep.fault is not None:
                self.rejected += 1
                rows[i] = self._error(i, *prep.fault)
            else:
                ok.append((i, prep))
        if ok:
            t0 = time.monotonic()
            vectors = self.engine.pool([_tokens(p) for _, p in ok], keys=[(k, i) for i, _ in ok])
            per_row_ms = (time.monotonic() - t0) * 1000.0 / len(ok)
            col = "embedding" if self.spec.task == "embed" else "scores"
            names = getattr(self.engine, "class_labels", None) or []
            for (i, p), vec in zip(ok, vectors):
                if isinstance(vec, RowFailure):
                    rows[i] = self._error(i, vec.code, vec.message)
                    continue
                bad = _unusable_vector(vec, col)
                if bad is not None:  # no answer: NaN is not JSON (OpenAI lines) and spoils every distance/argmax
                    log.warning("row %s: %s", self.batch.ids[i], bad)
                    rows[i] = self._error(i, ENGINE_ERROR, bad)
                    continue
                label = None
                if col == "scores" and len(vec):
                    best = max(range(len(vec)), key=lambda j: vec[j])
                    label = names[best] if best < len(names) else str(best)
                n_tokens = len(p.token_ids or ())
                rows[i] = {
                    "id": self.batch.ids[i],
                    "status": "ok",
                    col: [float(x) for x in vec],
                    "label": label,
                    "prompt_tokens": n_tokens,
                    "completion_tokens": 0,
                    "truncated": p.truncated,
                    "latency_ms": per_row_ms,
                    **self.prov,
                    "confidence": max(vec) if col == "scores" and len(vec) else None,
                    "prompt_hash": prompt_hash(p.token_ids or []),
                }
                self.prompt_tokens += n_tokens
        ordered = [rows[i] for i in range(meta.first_row, meta.first_row + meta.rows)]
        entry = self._write(meta, ordered)
        self.progress.add_rows(ordered)
        return entry


def _unusable_vector(vec: Any, col: str) -> str | None:
    """Why a pooling output is no answer (empty, or NaN / infinity once stored as float32), or None."""
    what = "embedding" if col == "embedding" else "class probabilities"
    with np.errstate(over="ignore"):  # a value beyond float32's range is stored as infinity: counted below
        arr = np.asarray(vec, dtype=np.float64).astype(np.float32)
    if arr.ndim != 1 or not arr.size:
        return f"the engine returned no {what} for this row"
    finite = np.isfinite(arr)
    if not finite.all():
        return (
            f"{int((~finite).sum())} of the {arr.size} values of the engine's {what} for this row are NaN or "
            f"infinite as float32 (first at index {int(np.argmin(finite))})"
        )
    return None


def _tokens(prep: Prepared) -> list[int]:
    """The prompt of a row that was prepared without a fault (``PromptBuilder`` sets one or the other)."""
    assert prep.token_ids is not None, "a prepared row without a fault has its tokens"
    return prep.token_ids
