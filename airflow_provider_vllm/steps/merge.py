"""Merge: committed shards -> final results and errors, verified against the input ids.

Reads only files that commit markers name, and only when each lies under its own shard's
attempt folders (``shards/<shard_id>/attempts/<attempt>/chunk-NNNNN.parquet``; a marker naming
another shard's file, or any other path, is refused) and matches the size and sha256 the
marker records. Counts duplicate ids across the committed chunks *before* anything is
dropped: identical duplicates (same status and output; provenance columns such as the
attempt may differ) are dropped and reported (``duplicates`` in ``_MERGED.json`` and in QA);
two committed rows for one id whose content differs fail the merge, naming the ids. Then it
verifies that input ids == result ids + error ids with no id twice, and writes
``results/results.parquet`` and ``results/errors.parquet`` atomically, in plan order (input
order within each length bucket). DuckDB over Arrow; no pandas, no row loops.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm import __version__
from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core.commit import MARKER, CommitMarker, ShardStore
from airflow_provider_vllm.core.errors import CommitError, VerificationError
from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.formats.files import check_unchanged
from airflow_provider_vllm.core.plan import Plan, load_plan
from airflow_provider_vllm.core.records import Duplicates, MergeSummary, ShardStatsEntry
from airflow_provider_vllm.core.rows import ERROR_COLUMNS, RESULT_COLUMNS, ROW_SCHEMA
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage
from airflow_provider_vllm.steps import cache

log = logging.getLogger(__name__)

RESULTS = "results/results.parquet"
ERRORS = "results/errors.parquet"
MERGED = "_MERGED.json"
OPENAI_OUT = "results/output.jsonl"
OPENAI_ERR = "results/errors.jsonl"
# Columns that say where and how fast a row was made, not what it is: two committed rows of one
# id that differ only here are the same result (e.g. one chunk named twice), anything else differs.
PROVENANCE_COLUMNS = ("shard_id", "attempt_id", "latency_ms")
DUPLICATE_EXAMPLES = 10
_ATTEMPT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK_NAME = re.compile(r"^chunk-\d{5}\.parquet$")


def merge_run(spec: JobSpec, verify_checksums: bool = True, memory_limit: str = "1GB",
              filesystems: FileSystems | None = None) -> dict[str, Any]:
    """``merge`` as JSON data: the merge summary's ``dump()`` (what ``_MERGED.json`` holds, plus ``history_record``)."""
    return merge(spec, verify_checksums, memory_limit, filesystems).dump()


def merge(spec: JobSpec, verify_checksums: bool = True, memory_limit: str = "1GB",
          filesystems: FileSystems | None = None) -> MergeSummary:
    """Merge a run whose shards are all committed; returns the merge summary (also ``_MERGED.json``).

    ``filesystems``: how object stores are reached (``storage.FileSystems``; default fsspec).
    """
    t0 = time.monotonic()
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    plan = load_plan(spec, filesystems)
    files, markers = committed_files(out, plan, verify_checksums)
    in_root = out.at(plan.input_root)
    con = duck.connect(out, in_root, memory_limit=memory_limit)
    try:
        if files:
            con.execute(f"CREATE VIEW chunks AS SELECT * FROM read_parquet({duck.file_list(out, files)})").fetchall()
        else:
            empty = Storage(os.path.dirname(_empty_chunk()))
            con.execute(f"CREATE VIEW chunks AS SELECT * FROM read_parquet("
                        f"{duck.file_list(empty, [os.path.basename(_empty_chunk())])}) LIMIT 0").fetchall()
        # Distinct 64-bit hashes == rows proves distinct ids (equal ids hash equal) and is
        # cheaper than distinct strings; only a shortfall (a duplicate or a collision) pays for
        # the exact count.
        total, distinct, ok = con.execute(
            "SELECT count(*), count(DISTINCT hash(id)), count(*) FILTER (WHERE status = 'ok') FROM chunks"
        ).fetchall()[0]
        if distinct != total:
            distinct = con.execute("SELECT count(DISTINCT id) FROM chunks").fetchall()[0][0]
        source = "chunks"
        duplicates = Duplicates(ids=0, rows_dropped=0, examples=[])
        if total != distinct:
            # Only a bug or a hand-edited marker gets here. Counted before anything is dropped;
            # identical copies are dropped (one row per id), differing ones fail the merge.
            duplicates = check_duplicates(con, total, distinct)
            con.execute(
                "CREATE TEMP TABLE deduped AS SELECT * EXCLUDE (rn) FROM (SELECT *, row_number() OVER "
                "(PARTITION BY id ORDER BY (status = 'ok') DESC, shard_id, attempt_id) AS rn FROM chunks) "
                "WHERE rn = 1"
            ).fetchall()
            source = "deduped"
            log.warning("merge: %d id(s) were committed more than once with identical content; dropped %d "
                        "extra row(s), e.g. %s", duplicates.ids, duplicates.rows_dropped,
                        duplicates.examples[:5])
        check_unchanged(in_root, plan.input_files())
        register_input_ids(con, spec, plan, in_root)
        # ---- result cache (steps/cache.py; moves onto the results parts layout): hits join the results
        hits = cache.register_hits(con, out, plan) if plan.cache is not None else 0
        verify(con, cache.accounted_ids(con, source) if plan.cache is not None else source, plan.total_rows)
        # ---- end result cache
        if source != "chunks":
            ok = con.execute("SELECT count(*) FROM deduped WHERE status = 'ok'").fetchall()[0][0]
        with tempfile.TemporaryDirectory() as tmp:
            res_local, err_local = os.path.join(tmp, "r.parquet"), os.path.join(tmp, "e.parquet")
            cols_r = ", ".join(RESULT_COLUMNS)
            cols_e = ", ".join(ERROR_COLUMNS)
            ok_rows = f"SELECT {cols_r} FROM {source} WHERE status = 'ok'"
            if plan.cache is not None:  # result cache: computed rows, then the hits, with cached_from
                ok_rows = (f"SELECT {cols_r}, NULL::VARCHAR AS {cache.CACHED_FROM} FROM {source} WHERE status = 'ok' "
                           f"UNION ALL BY NAME SELECT {cols_r}, {cache.CACHED_FROM} FROM cache_hits")
            con.execute(f"COPY ({ok_rows}) TO '{res_local}' (FORMAT parquet, COMPRESSION zstd)").fetchall()
            con.execute(f"COPY (SELECT {cols_e} FROM {source} WHERE status = 'error') TO '{err_local}' "
                        "(FORMAT parquet, COMPRESSION zstd)").fetchall()
            faults.hit("merge.before_write")
            _publish_file(out, res_local, RESULTS)
            _publish_file(out, err_local, ERRORS)
        extra = {}
        if spec.io.output_format == "openai_batch":
            extra = write_openai_outputs(out, spec, plan)
        # result cache: this run's computed ok rows become its cache entry (committed create-only)
        cache_summary = cache.append_results(con, spec, plan, source, filesystems) if plan.cache else None
    finally:
        con.close()
    summary = MergeSummary(
        rows=plan.total_rows,
        ok_rows=int(ok) + hits,
        error_rows=int(distinct - ok),
        duplicates_dropped=int(total - distinct),
        # counted over the committed chunks before the dedupe: ids seen more than once, extra rows
        duplicates=duplicates,
        shards=len(plan.shards),
        files={"results": RESULTS, "errors": ERRORS, **extra},
        checksums={RESULTS: out.sha256(RESULTS), ERRORS: out.sha256(ERRORS)},
        shard_stats=[ShardStatsEntry(**m.stats.dump(), shard_id=m.shard_id, attempt_id=m.attempt_id)
                     for m in markers],
        config_hash=plan.config_hash,
        spec_hash=plan.spec_hash,
        merge_s=round(time.monotonic() - t0, 3),
        versions={"airflow-provider-vllm": __version__, "duckdb": duckdb.__version__},
        task=spec.task,
        id_column=spec.prompt.id_column,
        **({"cache": cache_summary} if cache_summary is not None else {}),
    )
    faults.hit("merge.after_data")
    with faults.writing("merge.mid_marker"):
        out.write_atomic(MERGED, json.dumps(summary.dump(), indent=1, sort_keys=True).encode())
    faults.hit("merge.after_marker")
    _record_throughput(spec, plan, markers, summary, filesystems)
    return summary


def read_merged(out: Storage) -> MergeSummary:
    """``_MERGED.json`` of the run under ``out``, validated."""
    return MergeSummary.model_validate_json(out.read_bytes(MERGED))


def _record_throughput(spec: JobSpec, plan: Plan, markers: list[CommitMarker], summary: MergeSummary,
                       filesystems: FileSystems | None = None) -> None:
    """Throughput history for shard sizing (sizing.py); a failure here must not fail a merged run."""
    if not spec.sharding.history_uri:
        return
    from airflow_provider_vllm.steps.sizing import record_run

    try:
        summary.history_record = record_run(spec, plan, markers, filesystems)
    except Exception as e:  # evidence for later plans, not part of this run's results
        log.warning("could not write the throughput record to %s: %s", spec.sharding.history_uri, e)


def committed_files(out: Storage, plan: Plan, verify_checksums: bool) -> tuple[list[str], list[CommitMarker]]:
    """Files named by the markers of every planned shard, in plan order; raises if any is missing.

    A marker must be this shard's (its ``shard_id``) and every path it names must be a chunk
    file under this shard's own attempt folders, named once: a forged or corrupt marker that
    names another shard's file, the merged outputs, the plan or anything outside the shard is
    refused (``CommitError``, terminal) before any file is opened.
    """
    files, markers, missing = [], [], []
    for shard in plan.shards:
        store = ShardStore(out, shard.shard_id)
        m = store.marker()
        if m is None:
            missing.append(shard.shard_id)
            continue
        where = out.uri(f"{store.dir}/{MARKER}")
        if m.shard_id != shard.shard_id:
            raise CommitError(f"commit marker {where} is not shard {shard.shard_id}'s (it names shard {m.shard_id!r})")
        if m.rows != shard.rows:
            raise CommitError(f"shard {shard.shard_id}: marker says {m.rows} rows, plan {shard.rows}")
        seen: set[str] = set()
        for f in m.files:
            path = f.path
            check_marker_path(path, shard.shard_id, where)
            if path in seen:
                raise CommitError(f"commit marker {where} names {path} twice")
            seen.add(path)
            if out.size(path) != f.bytes or (verify_checksums and out.sha256(path) != f.sha256):
                raise CommitError(f"{path} does not match its commit marker (size or sha256)")
            files.append(path)
        markers.append(m)
    if missing:
        raise CommitError(f"{len(missing)} of {len(plan.shards)} shard(s) not committed: {missing[:10]}")
    return files, markers


def check_marker_path(path: Any, shard_id: str, where: str) -> None:
    """``path`` is ``shards/<shard_id>/attempts/<attempt>/chunk-NNNNN.parquet``; CommitError otherwise."""
    parts = path.split("/") if isinstance(path, str) else []
    ok = (len(parts) == 5 and parts[0] == "shards" and parts[1] == shard_id and parts[2] == "attempts"
          and _ATTEMPT.match(parts[3]) is not None and parts[3] not in (".", "..")
          and _CHUNK_NAME.match(parts[4]) is not None)
    if not ok:
        raise CommitError(
            f"commit marker {where} names {path!r}, which is not a chunk file of shard {shard_id}'s own attempts "
            f"(shards/{shard_id}/attempts/<attempt>/chunk-NNNNN.parquet); refusing to merge a forged or corrupt "
            "marker: delete the shard's folder and rerun the shard"
        )


def check_duplicates(con: duckdb.DuckDBPyConnection, total: int, distinct: int) -> Duplicates:
    """Ids committed more than once (counted before any dedupe); VerificationError when copies differ.

    Copies are the same result when every column but ``PROVENANCE_COLUMNS`` is equal.
    """
    content = ", ".join(f.name for f in ROW_SCHEMA if f.name not in ("id", *PROVENANCE_COLUMNS))
    con.execute(
        "CREATE TEMP TABLE dup_ids AS SELECT id, count(*) AS n, "
        f"count(DISTINCT row({content})) AS versions, "
        "string_agg(DISTINCT shard_id || '/' || attempt_id, ', ' ORDER BY shard_id || '/' || attempt_id) AS made_by "
        "FROM chunks GROUP BY id HAVING count(*) > 1"
    ).fetchall()
    n_ids, n_differ = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE versions > 1) FROM dup_ids").fetchall()[0]
    if n_differ:
        bad = con.execute("SELECT id, n, made_by FROM dup_ids WHERE versions > 1 ORDER BY id "
                          f"LIMIT {DUPLICATE_EXAMPLES}").fetchall()
        shown = "; ".join(f"{i!r} x{n} (from {by})" for i, n, by in bad)
        raise VerificationError(
            f"{n_differ} id(s) have committed outputs that differ: {shown}; refusing to pick one. Each id must be "
            "committed once; delete the folders of the shards involved and rerun them"
        )
    examples = [r[0] for r in con.execute(f"SELECT id FROM dup_ids ORDER BY id LIMIT {DUPLICATE_EXAMPLES}").fetchall()]
    return Duplicates(ids=int(n_ids), rows_dropped=int(total - distinct), examples=[str(e) for e in examples])


def register_input_ids(con: duckdb.DuckDBPyConnection, spec: JobSpec, plan: Plan, root: Storage) -> None:
    """View ``input_ids(id VARCHAR)``: all input ids, the independent side of the verification."""
    names = [f["path"] for f in plan.files]
    if plan.format == "parquet" and plan.total_rows:
        col = '"' + spec.prompt.id_column.replace('"', '""') + '"'
        con.execute(f"CREATE VIEW input_ids AS SELECT CAST({col} AS VARCHAR) AS id "
                    f"FROM read_parquet({duck.file_list(root, names)})").fetchall()
        return
    ids: list[str] = []
    if plan.format != "parquet":
        for name in names:
            ids += input_format(plan.format).file_ids(root, name, spec)
    con.register("input_ids", pa.table({"id": pa.array(ids, pa.string())}))


def verify(con: duckdb.DuckDBPyConnection, source: str, planned_rows: int) -> None:
    """input ids == output ids, each once; raises VerificationError naming counts and examples.

    ``source`` has distinct ids (deduped) and the input's ids are distinct (checked by the
    plan, files unchanged since), so equal counts plus every output id found in the input
    prove the two sets equal; one semi-join instead of a full outer join.
    """
    n_in, n_out, n_found = con.execute(
        f"SELECT (SELECT count(*) FROM input_ids), (SELECT count(*) FROM {source}), "
        f"(SELECT count(*) FROM {source} WHERE id IN (SELECT id FROM input_ids))"
    ).fetchall()[0]
    if n_in == planned_rows == n_out == n_found:
        return
    ex_missing = [r[0] for r in con.execute(
        f"SELECT id FROM input_ids WHERE id NOT IN (SELECT id FROM {source}) ORDER BY id LIMIT 5").fetchall()]
    ex_extra = [r[0] for r in con.execute(
        f"SELECT id FROM {source} WHERE id NOT IN (SELECT id FROM input_ids) ORDER BY id LIMIT 5").fetchall()]
    raise VerificationError(
        f"row accounting failed: {n_in} input ids (plan: {planned_rows}), {n_out} output rows; "
        f"{n_in - n_found} missing (e.g. {ex_missing}), {n_out - n_found} not in the input (e.g. {ex_extra})"
    )


def write_openai_outputs(out: Storage, spec: JobSpec, plan: Plan) -> dict[str, str]:
    """results/output.jsonl and results/errors.jsonl in the OpenAI Batch API line formats."""
    from airflow_provider_vllm.core.openai_output import error_line, response_line

    for rel, fn in ((RESULTS, response_line), (ERRORS, error_line)):
        dest = OPENAI_OUT if rel == RESULTS else OPENAI_ERR
        with out.open(rel) as fh:
            pf = pq.ParquetFile(fh)
            lines = []
            for batch in pf.iter_batches(batch_size=8192):
                lines += [json.dumps(fn(r, spec), ensure_ascii=False) for r in batch.to_pylist()]
        out.write_atomic(dest, ("\n".join(lines) + ("\n" if lines else "")).encode())
    return {"openai_output": OPENAI_OUT, "openai_errors": OPENAI_ERR}


def _publish_file(out: Storage, local: str, rel: str) -> None:
    """Move a finished local file to rel so that readers see all of it or nothing."""
    if out.is_local:
        dest = out.path(rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = f"{dest}.tmp-{os.getpid()}"
        faults.partial_copy(local, tmp, "merge.mid_file")
        shutil.move(local, tmp)  # may cross filesystems; the rename below may not
        os.replace(tmp, dest)
    else:
        out.upload(local, rel)  # one object: visible whole or not at all


def _empty_chunk() -> str:
    from airflow_provider_vllm.core.rows import ROW_SCHEMA

    path = os.path.join(tempfile.gettempdir(), "vllm_batch_empty_chunk.parquet")
    if not os.path.exists(path):
        pq.write_table(ROW_SCHEMA.empty_table(), path)
    return path
