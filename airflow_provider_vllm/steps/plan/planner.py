"""The planner: validate the input once, group its rows into shards, write the plan manifest.

Deterministic: the same input files (same sizes and versions) and the same spec give the
same shards with the same ids. The input is read only through its format
(``core.formats.input_format``: ``scan`` checks the ids and sizes the rows); the planner
cuts the sized rows into shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from airflow_provider_vllm import __version__
from airflow_provider_vllm.core import faults
from airflow_provider_vllm.core.adapters import describe_adapters
from airflow_provider_vllm.core.allow_list import canonical_uri, enclosing_folders
from airflow_provider_vllm.core.commit import PROBE_DIR, probe_create_only
from airflow_provider_vllm.core.errors import DatasetError, ListingTooLarge, SpecError
from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.formats.base import array_groups
from airflow_provider_vllm.core.formats.files import Input, find_input
from airflow_provider_vllm.core.plan import (
    PLAN_FILE,
    LastPublished,
    Plan,
    Segment,
    ShardPlan,
    estimate_tokens,
    parse_plan,
)
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import (
    GLOB_CHARS,
    LISTING_MAX,
    FileSystems,
    Storage,
    copies_folder,
    has_glob,
    is_temp_copy,
)
from airflow_provider_vllm.core.weights import WeightsPin
from airflow_provider_vllm.steps.golden import GOLDEN_IN, with_golden
from airflow_provider_vllm.steps.plan.groups import ALL, LONG, SHORT, GroupTokens
from airflow_provider_vllm.steps.plan.passthrough import resolve_passthrough
from airflow_provider_vllm.steps.plan.sizing import History, job_history, size_shards
from airflow_provider_vllm.steps.publish import SUCCESS, pin_last_published
from airflow_provider_vllm.steps.qa.reference import with_golden_set
from airflow_provider_vllm.steps.tables.access import Tables
from airflow_provider_vllm.steps.tables.commit import check_output_table
from airflow_provider_vllm.steps.tables.snapshot import (
    TABLE_DIR,
    materialized_root,
    resolve_table_input,
    split_materialized,
)

RUN_MARKERS = (PLAN_FILE, SUCCESS)
"""Files that make a folder a run's: its sealed plan, and once published its ``_SUCCESS.json``."""

DEFAULT_TARGET_ROWS = 10_000
OUTPUT_LISTED_PER_SHARD = 4
"""With ``storage.LISTING_MAX``, the most entries of a new run's output prefix listed per ``sharding.max_shards``
(what a plan killed before its ``_plan.json`` leaves: a few files per shard): a prefix holding more is not empty,
and is refused as such without being listed further."""
PLAN_VERSION = 2  # 2: sealed (core/seal.py); with the result cache, one input file per shard

log = logging.getLogger(__name__)


def plan_job(
    spec: JobSpec,
    filesystems: FileSystems | None = None,
    max_shards: int | None = None,
    engine_identity: str | None = None,
    keyring: Keyring | None = None,
    warm_starts: bool | None = None,
    tables: Tables | None = None,
    allowed_prefixes: Sequence[str] | None = None,
    last_published: LastPublished | Callable[[], LastPublished] | None = None,
) -> Plan:
    """Plan the job and write ``_plan.json`` under the output prefix, sealed; idempotent.

    Raises DatasetError for dataset faults and SpecError when the output prefix already
    holds the plan of a different input or spec, or files but no plan (another run's), or
    when the plan would have more than ``max_shards`` shards (the orchestrator's limit on
    mapped tasks, e.g. Airflow's ``[core] max_map_length``; None: no limit).
    ``filesystems``: how object stores are reached (``storage.FileSystems``; default fsspec).
    With ``cache.uri`` (steps/cache/result_cache.py) the plan also writes ``_cache/`` hits and misses files
    before the plan (``engine_identity``: the engine the shards run, part of the cache key;
    default the vLLM installed here); an existing plan is returned as it is, however the cache
    grew since (the create-only plan file wins).

    ``keyring``: the deployment's signing keys (default ``VLLM_BATCH_SIGNING_KEY``): the plan is sealed
    with it for this output prefix (``core/seal.py``), and a plan already there is accepted only with
    this deployment's seal (SealError otherwise). ``warm_starts``: whether the shards reuse a shared compile
    cache, for the engine start that sizing counts (``sizing.start_estimate``; None: unknown).

    ``tables``: the deployment's catalog and table rules, for ``io.input_table`` (``steps/tables/``): the plan
    pins the snapshot and hands the shards its files; a plan already there keeps the snapshot it pinned,
    however the table moved since.

    A new run's output prefix must not lie inside another run's folder: SpecError when a folder above it, up to
    the longest of ``allowed_prefixes`` it lies under (the deployment's allow-list), holds a ``_plan.json`` or a
    ``_SUCCESS.json`` (its parts would land among that run's files, which readers list recursively).

    ``last_published``: with ``changes.previous_published``, the job's newest Asset event of its publish task, as
    the plan task read it from Airflow (``steps/publish.pin_last_published`` pins that run; SpecError without it);
    or a callable that reads it, called only when a new plan is made (a plan already written keeps its pin).
    """
    keyring = keyring or Keyring.from_env()
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    pins = _Pins(last_published, filesystems, keyring, allowed_prefixes)
    if has_glob(out.path()):  # the merge and QA read the output's parts with DuckDB, which would expand it
        raise SpecError(
            f"io.output_uri {spec.io.output_uri}: holds a glob character ({' '.join(GLOB_CHARS)}); use another prefix"
        )
    if not out.exists(PLAN_FILE):
        _check_not_inside_a_run(spec, out, allowed_prefixes)
    if spec.io.input_table is not None:
        with _readable_input():
            return _plan_table(spec, out, filesystems, max_shards, engine_identity, keyring, warm_starts, tables, pins)
    if spec.cache.uri is not None or _may_dedupe(spec):
        with _readable_input():
            plan = _plan_cached(spec, out, filesystems, max_shards, engine_identity, keyring, warm_starts, tables, pins)
    else:
        plan = build_plan(spec, filesystems, max_shards=max_shards, warm_starts=warm_starts)
        if not out.exists(PLAN_FILE):
            _check_empty(spec, out)
            plan = with_golden(plan, spec, out, filesystems, max_shards)  # qa.reference: ride-along rows
            plan = with_golden_set(plan, spec, filesystems)  # qa.reference.golden_uri: its files' sha256
            plan = _with_changes_from(plan, spec, tables, pins)
            # create-only: of two runs racing for one prefix, the loser meets the winner's plan below
            _write_plan(out, plan, spec, keyring, tables)
    existing = _existing(spec, out, keyring)
    if existing.fingerprint != plan.fingerprint or existing.spec_hash != plan.spec_hash:
        raise SpecError(
            f"output {spec.io.output_uri} already holds a run of another input or spec "
            f"(plan fingerprint {existing.fingerprint[:12]}, spec {existing.spec_hash[:12]}); "
            "use a new output prefix"
        )
    return existing


def _check_not_inside_a_run(spec: JobSpec, out: Storage, allowed_prefixes: Sequence[str] | None) -> None:
    """SpecError when a folder above the output prefix holds a run (two existence checks per folder level)."""
    canon = canonical_uri(spec.io.output_uri, "io.output_uri")
    for folder in enclosing_folders(canon, allowed_prefixes):
        above = out.at(folder)
        for marker in RUN_MARKERS:
            if above.exists(marker):
                raise SpecError(
                    f"io.output_uri={spec.io.output_uri} lies inside the run at {folder} (it holds {marker}); "
                    "its files would land among that run's. Use a prefix outside every other run's folder"
                )


def _plan_table(
    spec: JobSpec,
    out: Storage,
    filesystems: FileSystems | None,
    max_shards: int | None,
    engine_identity: str | None,
    keyring: Keyring,
    warm_starts: bool | None,
    tables: Tables | None,
    pins: _Pins,
) -> Plan:
    """``io.input_table``: an existing plan wins as it is (its pinned snapshot; only the spec is compared), else
    pin the snapshot now and plan over its files."""
    t = spec.io.input_table
    assert t is not None
    if tables is None:
        raise SpecError(f"io.input_table={t.identifier!r}: this plan has no Iceberg catalog (the deployment's)")
    tables.check(t.identifier, "io.input_table.identifier")
    if out.exists(PLAN_FILE):
        existing = _existing(spec, out, keyring)
        if existing.spec_hash != spec.content_hash() or existing.table is None:
            raise SpecError(
                f"output {spec.io.output_uri} already holds a run of another input or spec "
                f"(spec {existing.spec_hash[:12]}); use a new output prefix"
            )
        return existing
    _check_empty(spec, out)
    # a private folder that a plan killed with SIGKILL leaves to the next plan's sweep (it holds a whole snapshot)
    with copies_folder("table") as workdir:
        # a materialized snapshot is read from the plan's local copy (found.root), never again from the prefix
        found, pin = resolve_table_input(spec, tables, out, filesystems, workdir)
        plan = build_plan(
            spec,
            filesystems,
            max_shards=max_shards,
            cache_out=out if spec.cache.uri is not None or _may_dedupe(spec) else None,
            engine_identity=engine_identity,
            keyring=keyring,
            warm_starts=warm_starts,
            found=found,
        )
        update: dict[str, Any] = {"table": pin, "input_uri": f"iceberg:{pin.identifier}@{pin.snapshot_id}"}
        if pin.read == "materialized":  # the file under the output prefix; each shard reads its own rows' file
            update |= {"input_root": materialized_root(out), "shards": split_materialized(out, found, plan.shards)}
        plan = plan.model_copy(update=update)
        plan = with_golden(plan, spec, out, filesystems, max_shards, found=found)
    plan = with_golden_set(plan, spec, filesystems)
    plan = _with_changes_from(plan, spec, tables, pins)
    _write_plan(out, plan, spec, keyring, tables)
    return _existing(spec, out, keyring)  # of two plans racing, the winner's


@dataclass(frozen=True)
class _Pins:
    """What ``_with_changes_from`` needs for ``changes.previous_published``."""

    last: LastPublished | Callable[[], LastPublished] | None
    filesystems: FileSystems | None
    keyring: Keyring
    allowed_prefixes: Sequence[str] | None


def _with_changes_from(plan: Plan, spec: JobSpec, tables: Tables | None, pins: _Pins) -> Plan:
    """``changes.previous_table`` / ``changes.previous_published``: the plan pins the run the change set compares
    with (``Plan.changes_from``)."""
    if spec.changes.previous_published:
        if pins.last is None:
            raise SpecError(
                "changes.previous_published: this plan was not given the job's Asset events (the plan task of "
                "vllm_batch_job reads them, with the setting in the DAG file's spec)"
            )
        pinned = pin_last_published(
            pins.last() if callable(pins.last) else pins.last,
            spec.io.output_uri,
            keyring=pins.keyring,
            storage_options=spec.io.storage_options,
            filesystems=pins.filesystems,
            allowed_prefixes=pins.allowed_prefixes,
        )
        return plan.model_copy(update={"changes_from": pinned})
    if not spec.changes.previous_table:
        return plan
    if tables is None:
        raise SpecError("changes.previous_table: this plan has no Iceberg catalog (the deployment's)")
    from airflow_provider_vllm.steps.tables.commit import resolve_changes_from

    pinned = resolve_changes_from(spec, tables, keyring=pins.keyring, filesystems=pins.filesystems)
    return plan.model_copy(update={"changes_from": pinned})


def _may_dedupe(spec: JobSpec) -> bool:
    """Whether the plan may write files besides ``_plan.json`` for the dedupe (the input's format decides later)."""
    from airflow_provider_vllm.steps.cache.dedupe import deterministic

    return spec.sharding.dedupe and deterministic(spec) is None


def _write_plan(out: Storage, plan: Plan, spec: JobSpec, keyring: Keyring, tables: Tables | None) -> None:
    """``_plan.json``, sealed, create-only: of two plans racing for one prefix the first wins. Before it, with
    ``io.output_table``, what publish would refuse about the table's schema (``check_output_table``: a passthrough
    column the table cannot hold), so that nothing is written and no shard runs for a run that cannot publish."""
    if spec.io.output_table is not None and tables is not None:
        check_output_table(spec.io.output_table, tables, plan.result_schema())
    with faults.writing("plan.mid_marker"):
        out.create_only(PLAN_FILE, plan.sealed(keyring, spec.io.output_uri).dump_json())


def _existing(spec: JobSpec, out: Storage, keyring: Keyring) -> Plan:
    """The plan already under the output prefix, its seal checked (SealError: not this deployment's plan task's;
    CommitError: no plan at all)."""
    existing = parse_plan(out.read_bytes(PLAN_FILE), out.uri(PLAN_FILE))  # CommitError: bytes that are no plan
    existing.verify(keyring, spec.io.output_uri)
    return existing


def _check_empty(spec: JobSpec, out: Storage) -> None:
    """SpecError unless the prefix is empty (create-only probes and orphaned ``_cache/`` files aside), then probe."""
    from airflow_provider_vllm.steps.cache.result_cache import CACHE_DIR

    mine = (
        PROBE_DIR + "/",
        CACHE_DIR + "/",
        GOLDEN_IN + "/",
        TABLE_DIR + "/",
    )  # files a plan killed before its _plan.json leaves
    # a plan killed while writing _plan.json leaves its temp copy beside it
    bound = OUTPUT_LISTED_PER_SHARD * spec.sharding.max_shards + LISTING_MAX
    try:
        files = out.walk_files(limit=bound)
        foreign = next((f for f in files if not f.startswith(mine) and not is_temp_copy(f, PLAN_FILE)), None)
    except ListingTooLarge:
        foreign = f"more than {bound} entries"
    if foreign is not None:
        raise SpecError(
            f"output {spec.io.output_uri} is not empty (e.g. {foreign}) and holds no plan of "
            "this job; use a new, empty output prefix"
        )
    probe_create_only(out, _store_name(spec))


def _plan_cached(
    spec: JobSpec,
    out: Storage,
    filesystems: FileSystems | None,
    max_shards: int | None,
    engine_identity: str | None,
    keyring: Keyring,
    warm_starts: bool | None,
    tables: Tables | None,
    pins: _Pins,
) -> Plan:
    """With the result cache or the dedupe (plans that write files besides ``_plan.json``): an existing plan wins
    (only its input and spec are compared); else a new one."""
    if out.exists(PLAN_FILE):
        assert spec.io.input_uri is not None  # tables: _plan_table
        found = find_input(spec.io.input_uri, spec.io.storage_options, spec.io.input_format, filesystems)
        existing = _existing(spec, out, keyring)
        # what plan_job compares with the stored plan: this input's fingerprint and this spec's hash
        return existing.model_copy(update={"fingerprint": found.fingerprint, "spec_hash": spec.content_hash()})
    _check_empty(spec, out)
    plan = build_plan(
        spec,
        filesystems,
        max_shards=max_shards,
        cache_out=out,
        engine_identity=engine_identity,
        keyring=keyring,
        warm_starts=warm_starts,
    )
    plan = with_golden(plan, spec, out, filesystems, max_shards)  # qa.reference: ride-along rows
    plan = with_golden_set(plan, spec, filesystems)  # qa.reference.golden_uri: its files' sha256
    plan = _with_changes_from(plan, spec, tables, pins)
    _write_plan(out, plan, spec, keyring, tables)
    return plan


def _store_name(spec: JobSpec) -> str:
    ep = (spec.io.storage_options or {}).get("endpoint_url")
    return f"{spec.io.output_uri} (endpoint_url {ep})" if ep else spec.io.output_uri


@dataclass(frozen=True)
class PlanInputs:
    """What building a plan read, for a caller that reports on the same input (the dry run) without reading it
    again: the input as found (files, sizes, versions, format) and the throughput history (None: not read, as
    without ``sharding.history_uri`` or without rows to size)."""

    found: Input
    history: History | None


@contextlib.contextmanager
def _readable_input() -> Iterator[None]:
    """DatasetError (not retried) for input data that DuckDB refuses to read: the result cache and the dedupe read
    every row's text, and a Parquet string that is not valid UTF-8 fails the whole read (DuckDB names the file
    and the value). Without them the plan reads no text, and such a row is an INVALID_ROW error of its shard."""
    import duckdb

    try:
        yield
    except duckdb.InvalidInputException as e:  # the data itself; I/O errors are other exceptions and stay transient
        raise DatasetError(
            f"the input cannot be read (the result cache and the dedupe read every row's text): {e}. Fix the value "
            "it names, or set sharding.dedupe: false and no cache.uri: the shards then read the rows, and a text "
            "that is not valid UTF-8 is that row's INVALID_ROW error"
        ) from None


def build_plan(
    spec: JobSpec,
    filesystems: FileSystems | None = None,
    max_shards: int | None = None,
    cache_out: Storage | None = None,
    engine_identity: str | None = None,
    keyring: Keyring | None = None,
    warm_starts: bool | None = None,
    found: Input | None = None,
) -> Plan:
    """Validate the input and compute shards, without writing anything but the cache's files (see ``plan_job``).

    ``cache_out``: the output prefix, with ``cache.uri`` set: the hits file and one input file per shard
    are written there (``steps.cache.result_cache.plan_cache``, ``write_shard_inputs``); the shards are cut
    over the misses only. ``found``: the input already found (a table's pinned files); default: find
    ``io.input_uri``. The plan is returned unsealed.
    """
    return build_plan_with_inputs(
        spec, filesystems, max_shards, cache_out, engine_identity, keyring, warm_starts, found
    )[0]


def build_plan_with_inputs(
    spec: JobSpec,
    filesystems: FileSystems | None = None,
    max_shards: int | None = None,
    cache_out: Storage | None = None,
    engine_identity: str | None = None,
    keyring: Keyring | None = None,
    warm_starts: bool | None = None,
    found: Input | None = None,
) -> tuple[Plan, PlanInputs]:
    """``build_plan``, and what it read (``PlanInputs``)."""
    if found is None:
        if spec.io.input_uri is None:
            raise SpecError("io.input_table: a table is read through the plan step (plan_job), not found as files")
        found = find_input(spec.io.input_uri, spec.io.storage_options, spec.io.input_format, filesystems)
    _check_detected_format(spec, found.format)
    passthrough = resolve_passthrough(_passthrough_spec(spec, found), found)
    adapters = describe_adapters(spec, filesystems=filesystems)
    sh = spec.sharding
    # Exact per-row lengths need the text columns; footers (dictionary-encoded pages make
    # them approximate) are enough when shards are sized by rows only.
    per_row = sh.long_row_tokens is not None or (sh.target_tokens is not None and sh.target_rows is None)
    scan = input_format(found.format).scan(found.root, found.names, spec, per_row)
    total_rows = int(sum(scan.file_rows))
    tokens = _row_tokens(scan, sh.chars_per_token, sh.long_row_tokens)
    est_tokens = tokens.total
    cache, dedupe, cut_scan, cut_tokens, cut_fp = None, None, scan, tokens, found.fingerprint
    weights: list[WeightsPin] = []
    # a private folder (the misses file: the whole input's rows) that a plan killed with SIGKILL leaves to the
    # next plan's sweep
    with copies_folder("plan") as workdir:
        misses = None
        if cache_out is not None and spec.cache.uri is not None:
            from airflow_provider_vllm.steps.cache.key import describe_weights
            from airflow_provider_vllm.steps.cache.result_cache import plan_cache

            # the local model / tokenizer folders, every file hashed (memoised): the key and the workers' check
            weights = describe_weights(spec)
            cache, misses = plan_cache(
                spec,
                found,
                cache_out,
                workdir,
                engine_identity,
                filesystems=filesystems,
                keyring=keyring,
                adapters=adapters,
                passthrough=passthrough,
                weights=weights,
            )
            cut_fp = f"{found.fingerprint}:{cache.hits_file.sha256}"
        if cache_out is not None:
            dedupe, leaders = _dedupe(spec, found, cache_out, workdir, passthrough, misses, cache)
            if dedupe is not None and dedupe.followers_file is not None:
                cut_fp = f"{cut_fp}:{dedupe.followers_file.sha256}"
                misses = leaders
        if misses is not None:
            from airflow_provider_vllm.steps.cache.result_cache import file_sha256

            cut_scan = input_format("parquet").scan(Storage(workdir), [os.path.basename(misses)], spec, per_row)
            cut_tokens = _row_tokens(cut_scan, sh.chars_per_token, sh.long_row_tokens)
            cut_fp = hashlib.sha256(f"{cut_fp}:{file_sha256(misses)}".encode()).hexdigest()
        # the history sizes shards only when there are rows to size (as size_shards decides)
        history = job_history(spec, filesystems, keyring) if len(cut_tokens) else None
        shards, sizing = _cut_all(spec, cut_scan, cut_tokens, cut_fp, history, max_shards, warm_starts)
        if cache_out is not None and misses is not None:
            from airflow_provider_vllm.steps.cache.result_cache import write_shard_inputs

            shards = write_shard_inputs(cache_out, misses, shards)
    plan = Plan(
        version=PLAN_VERSION,
        spec_hash=spec.content_hash(),
        config_hash=spec.output_hash(),
        input_uri=spec.io.input_name,
        input_root=found.root.root,
        format=found.format,
        files=list(found.files),
        fingerprint=found.fingerprint,
        total_rows=total_rows,
        invalid_lines=int(scan.invalid),
        est_tokens=est_tokens,
        long_row_tokens=sh.long_row_tokens,
        chars_per_token=sh.chars_per_token,
        shards=shards,
        created_with={"airflow-provider-vllm": __version__, "pyarrow": pa.__version__},
        sizing=sizing,
        **({"cache": cache} if cache is not None else {}),
        **({"dedupe": dedupe} if dedupe is not None else {}),
        **({"passthrough": passthrough} if passthrough is not None else {}),
        **({"weights": weights} if weights else {}),
        **({"adapters": adapters} if adapters else {}),
    )
    return plan, PlanInputs(found=found, history=history)


def _check_detected_format(spec: JobSpec, fmt: str) -> None:
    """SpecError when the spec's rules for the input format refuse ``fmt``, the format ``io.input_format: auto``
    found: an OpenAI batch file found so takes the refusals of one declared (task, prompt.system_prompt,
    model.adapter_column, ...), which would otherwise be dropped without a word."""
    if spec.io.input_format != "auto" or fmt == "auto":
        return
    doc = spec.model_dump(mode="json")
    doc["io"]["input_format"] = fmt
    try:
        JobSpec.load(doc)
    except SpecError as e:
        raise SpecError(f"the input is {fmt} (found by io.input_format auto): {e}") from None


def _passthrough_spec(spec: JobSpec, found: Input) -> JobSpec:
    """The spec passthrough is resolved by: for a table, ``io.passthrough`` 'all' means the table's columns the job
    may read (``found.columns``: the column selection, else the snapshot's schema), not what a data file read by
    reference stores: a file written before a column was dropped from the table still holds that column."""
    if spec.io.input_table is None or spec.io.passthrough != "all" or found.columns is None:
        return spec
    cols = [c for c in found.columns if c != spec.prompt.id_column]
    return spec.model_copy(update={"io": spec.io.model_copy(update={"passthrough": cols})})


def _dedupe(spec: JobSpec, found: Input, out: Storage, workdir: str, passthrough, misses: str | None, cache):
    """Each distinct prompt once (``steps/cache/dedupe.py``): (the DedupePlan, the local leaders file), or
    (None, None) when the job is not deduplicated (the reason is logged). ``misses``: with the result cache, its
    local misses file (keyed under its key hash); else every input row is keyed here. Only with followers is a
    leaders file returned, and the followers file written under ``_cache/``."""
    from airflow_provider_vllm.steps.cache import dedupe as dd
    from airflow_provider_vllm.steps.cache.matching import needed_columns
    from airflow_provider_vllm.steps.cache.result_cache import (
        CACHE_DIR,
        PLAN_MEMORY_LIMIT,
        SHARD_INPUTS,
        put_by_content,
    )

    reason, khash = dd.why_not(spec, found.format), cache.key_hash if cache is not None else ""
    if reason is None and misses is None:
        keyed = dd.keyed_rows(spec, found, workdir, needed_columns(spec, passthrough), PLAN_MEMORY_LIMIT)
        if isinstance(keyed, str):
            reason = keyed
        elif not keyed[0]:  # no prompt repeats: the shards read the input itself
            log.info("dedupe: no row of %d repeats an earlier row's prompt", keyed[2])
            return dd.plan_record(dd.Split("", "", keyed[2], keyed[2], 0, 0), keyed[1], None, None), None
        else:
            misses, khash = keyed[0], keyed[1]
    if reason is not None or misses is None:
        log.info("dedupe: every row is inferred: %s", reason)
        return None, None
    sp = dd.split(spec, misses, workdir, passthrough, PLAN_MEMORY_LIMIT)
    log.info(
        "dedupe: %d of %d rows share a prompt with an earlier row; %d distinct prompts to infer",
        sp.followers,
        sp.rows,
        sp.leaders,
    )
    if not sp.followers:
        return dd.plan_record(sp, khash, None, None), None
    followers = put_by_content(out, sp.followers_file, f"{CACHE_DIR}/{dd.FOLLOWERS}", sp.followers)
    faults.hit("dedupe.after_followers")
    return dd.plan_record(sp, khash, followers, out.uri(SHARD_INPUTS)), sp.leaders_file


def _cut_all(
    spec: JobSpec,
    cut_scan,
    cut_tokens,
    cut_fp: str,
    history: History | None,
    max_shards: int | None,
    warm_starts: bool | None = None,
):
    """The shards over the scanned rows (sized from the throughput history when it has a record), and that sizing."""
    sizing = (
        None
        if history is None or history.error is not None
        else size_shards(spec, len(cut_tokens), cut_tokens.total, records=history.records, warm_starts=warm_starts)
    )
    cut_spec = (
        spec
        if sizing is None
        else spec.model_copy(update={"sharding": spec.sharding.model_copy(update=sizing.sharding_update())})
    )
    shards = _cut(
        cut_spec, cut_fp, cut_tokens, np.asarray(cut_scan.file_rows, dtype=np.int64), cut_scan.offsets, cut_scan.lines
    )
    if max_shards is not None and len(shards) > max_shards:
        _refuse_shard_count(
            cut_spec, len(shards), max_shards, len(cut_tokens), cut_tokens.total, from_history=sizing is not None
        )
    return shards, sizing


def _refuse_shard_count(spec: JobSpec, n: int, limit: int, rows: int, tokens: int, from_history: bool) -> None:
    """SpecError naming the sharding setting to raise (or lower) so that at most ``limit`` shards are cut."""
    sh = spec.sharding
    if sh.target_tokens is not None and sh.target_rows is None:
        need = math.ceil(tokens / limit)
        setting = f"sharding.target_tokens (now {sh.target_tokens}; at least {need} for {tokens} estimated tokens)"
    else:
        need = math.ceil(rows / limit)
        now = sh.target_rows or DEFAULT_TARGET_ROWS
        setting = f"sharding.target_rows (now {now}; at least {need} for {rows} rows)"
    how = " (sized from the throughput history: raise sharding.target_minutes instead)" if from_history else ""
    raise SpecError(
        f"the plan has {n} shards, more than the {limit} mapped tasks Airflow allows ([core] max_map_length); "
        f"raise {setting}{how}, or set sharding.max_shards to at most {limit}, or raise [core] max_map_length "
        "(AIRFLOW__CORE__MAX_MAP_LENGTH)"
    )


# ---- token estimates ----------------------------------------------------------------
class RunTokens:
    """Per-row token estimates as runs (one per Parquet row group): the sum over any row range
    from cumulative sums at run boundaries, in memory proportional to the runs, not the rows."""

    def __init__(self, values: np.ndarray, counts: np.ndarray) -> None:
        self.values = np.asarray(values, np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.cum = np.concatenate([[0], np.cumsum(self.values * np.asarray(counts, np.int64))])
        self.total = int(self.cum[-1])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _prefix(self, x: int) -> int:
        i = int(np.searchsorted(self.starts, x, side="right")) - 1
        if i >= len(self.values):
            return self.total
        return int(self.cum[i] + self.values[i] * (x - int(self.starts[i])))

    def range_sum(self, a: int, b: int) -> int:
        return self._prefix(b) - self._prefix(a)


class RowTokens:
    """Per-row token estimates as one array (exact sizes, or line-addressed formats)."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.total = int(values.sum()) if len(values) else 0

    def __len__(self) -> int:
        return len(self.values)

    def range_sum(self, a: int, b: int) -> int:
        return int(self.values[a:b].sum())


def _row_tokens(scan, chars_per_token: float, long_row_tokens: int | None) -> RunTokens | RowTokens | GroupTokens:
    if scan.groups is not None:  # exact sizes, read group by group: never one array over every row
        return GroupTokens(scan.groups, chars_per_token, long_row_tokens)
    if scan.runs is not None:
        return RunTokens(estimate_tokens(scan.runs.values, chars_per_token), scan.runs.counts)
    chars = scan.chars
    return RowTokens(estimate_tokens(chars, chars_per_token) if len(chars) else np.zeros(0, np.int64))


# ---- cutting ------------------------------------------------------------------------
def _cut(
    spec: JobSpec, fp: str, row_tokens: RunTokens | RowTokens | GroupTokens, file_rows: np.ndarray, offsets, lines
) -> list[ShardPlan]:
    sh = spec.sharding
    n = len(row_tokens)
    if n == 0:
        return []
    target_tokens = sh.target_tokens if sh.target_rows is None else None  # rows win when both are set
    by_tokens = target_tokens is not None
    target: int = target_tokens if target_tokens is not None else (sh.target_rows or DEFAULT_TARGET_ROWS)
    split = sh.long_row_tokens is not None and sh.max_shards >= 2
    plan_key = hashlib.sha256(
        json.dumps(
            # sharding.dedupe decides which rows are cut (fp), not how: shard ids stay what they were
            [fp, spec.prompt.id_column, spec.sharding.model_dump(mode="json", exclude={"dedupe"})],
            sort_keys=True,
        ).encode()
    ).hexdigest()
    file_starts = np.concatenate([[0], np.cumsum(file_rows)]).astype(np.int64)
    if not (split or by_tokens):  # equal row counts over all rows: no per-row values needed
        k = _cap([min(n, max(1, math.ceil(n / target)))], sh.max_shards)[0]
        cuts = np.rint(n * np.arange(1, k) / k).astype(np.int64)
        bounds = _bounds(cuts, n)
        return [
            _shard(
                plan_key, i, ALL, a, b, _range_segments(a, b, file_starts, offsets, lines), row_tokens.range_sum(a, b)
            )
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]
    # rows weighed one by one: per-group totals, a group's rows read again only where a boundary falls
    groups = row_tokens if isinstance(row_tokens, GroupTokens) else _as_groups(row_tokens, file_rows, sh)
    buckets = [groups.bucket(SHORT), groups.bucket(LONG)] if split else [groups.bucket(ALL)]
    buckets = [b for b in buckets if b.rows]
    if by_tokens:
        wanted = [min(b.rows, max(1, math.ceil(float(b.total) / target))) for b in buckets]
    else:
        wanted = [min(b.rows, max(1, math.ceil(b.rows / target))) for b in buckets]
    shards: list[ShardPlan] = []
    for bucket, k in zip(buckets, _cap(wanted, sh.max_shards)):
        m = bucket.rows
        cuts = bucket.token_cuts(k) if by_tokens else np.rint(m * np.arange(1, k) / k).astype(np.int64)
        bounds = _bounds(cuts, m)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if bucket.name == ALL:
                segs = _range_segments(a, b, file_starts, offsets, lines)
            else:
                segs = [
                    _segment(f, lo - int(file_starts[f]), hi - int(file_starts[f]), lo, offsets, lines)
                    for f, lo, hi in bucket.file_ranges(a, b)
                ]
            shards.append(_shard(plan_key, len(shards), bucket.name, a, b, segs, bucket.prefix(b) - bucket.prefix(a)))
    return shards


def _bounds(cuts: np.ndarray, m: int) -> list[int]:
    """Shard boundaries from cut positions: inside (0, m), distinct, with 0 and m."""
    inner = np.clip(cuts, 1, m - 1) if m > 1 else np.zeros(0, np.int64)
    return np.unique(np.concatenate([[0], inner, [m]]).astype(np.int64)).tolist()


def _shard(plan_key: str, index: int, bucket: str, a: int, b: int, segs: list[Segment], est: int) -> ShardPlan:
    key = hashlib.sha256(f"{plan_key}:{bucket}:{json.dumps([s.model_dump() for s in segs])}".encode()).hexdigest()
    return ShardPlan(
        shard_id=f"shard-{index:05d}-{key[:8]}",
        index=index,
        bucket=bucket,
        rows=int(b - a),
        est_tokens=int(est),
        segments=segs,
    )


def _as_groups(row_tokens: RunTokens | RowTokens, file_rows: np.ndarray, sh) -> GroupTokens:
    """Per-row estimates already in memory (or runs), as groups for the cut (tokens, not characters: cpt 1)."""
    if isinstance(row_tokens, RowTokens):
        values = row_tokens.values
    else:
        values = np.repeat(row_tokens.values, np.diff(row_tokens.starts))
    return GroupTokens(array_groups(values, [int(x) for x in file_rows]), 1.0, sh.long_row_tokens, threads=1)


def _cap(wanted: list[int], max_shards: int) -> list[int]:
    """Scale shard counts down so their sum fits max_shards, keeping >= 1 per bucket."""
    counts = list(wanted)
    while sum(counts) > max_shards:
        i = max(range(len(counts)), key=lambda j: counts[j])
        if counts[i] == 1:
            break
        counts[i] -= max(1, (sum(counts) - max_shards) // len(counts))
        counts[i] = max(1, counts[i])
    return counts


def _segment(fid: int, start: int, end: int, global_start: int, offsets, lines) -> Segment:
    seg = Segment(file=fid, start=start, count=end - start)
    if offsets is not None:  # JSONL: where the first row's line starts
        seg.offset, seg.line = int(offsets[global_start]), int(lines[global_start])
    return seg


def _range_segments(a: int, b: int, file_starts: np.ndarray, offsets, lines) -> list[Segment]:
    """Segments of the global row range [a, b)."""
    segs = []
    first = int(np.searchsorted(file_starts, a, side="right")) - 1
    for fid in range(first, len(file_starts) - 1):
        lo, hi = max(a, int(file_starts[fid])), min(b, int(file_starts[fid + 1]))
        if lo >= b:
            break
        if hi > lo:
            segs.append(_segment(fid, lo - int(file_starts[fid]), hi - int(file_starts[fid]), lo, offsets, lines))
    return segs
