"""Golden rows that ride along with every run (``qa.reference.ride_along_uri``): planned, merged and
read apart from the input's rows.

* Plan (``with_golden``): the labelled file's rows become ``_golden/input-<sha16>.parquet`` (named by
  its content, so a plan killed before its create-only ``_plan.json`` leaves an orphan, never a file
  that changed under a plan): ids under ``RESERVED_ID_PREFIX``, the template's columns (and
  ``model.adapter_column``, which the golden file must carry too: a golden row names its adapter as an
  input row does), the known label in ``GOLDEN_LABEL``. Shards ``golden-NNNNN-<hash>`` are cut over it
  (``sharding.target_rows``) and recorded in ``Plan.golden``, never in ``Plan.shards``: the input's row
  accounting, the cache's join and the change set never see them.
  The input's ids may not start with the reserved prefix.
* Workers: a golden shard reads the plan through ``Plan.for_shard`` (its input file, no cache, no
  passthrough columns: the golden file holds none of the input's other columns, so golden parts have the
  plain ``RESULT_SCHEMA`` / ``ERROR_SCHEMA``) and commits like any shard, under ``shards/<golden shard>/``.
* Merge (``merge_golden``): the golden shards' committed parts, checked like the input's by merge
  (markers, paths, sizes, sha256), their ids against the golden file exactly once, are written as
  ``golden/results.parquet``, ``golden/errors.parquet``, then ``golden/_golden.json``
  (``records.GoldenSummary``) last. Nothing under ``results/`` or ``errors/``; nothing to the cache.
* QA (``attach_golden``): the relations ``gr``, ``ge`` and ``gref`` for ``labelled``.

Also ``check_reference_columns``: an input column of known labels must exist before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core.errors import (
    CommitError,
    DatasetError,
    LinkRefused,
    SpecError,
    TransientError,
    VerificationError,
)
from airflow_provider_vllm.core.formats import input_format
from airflow_provider_vllm.core.formats.base import row_columns
from airflow_provider_vllm.core.formats.files import Input, describe_files, find_input
from airflow_provider_vllm.core.plan import CacheFile, GoldenPlan, Plan, Segment, ShardPlan
from airflow_provider_vllm.core.records import SHA256_HEX, GoldenSummary, MergeSummary
from airflow_provider_vllm.core.rows import ERROR_SCHEMA, RESULT_SCHEMA
from airflow_provider_vllm.core.spec import RESERVED_ID_PREFIX, JobSpec
from airflow_provider_vllm.core.storage import CheckedCopies, FileSystems, Storage, copies_folder
from airflow_provider_vllm.steps.qa.golden_set import check_golden_files, golden_reader, link_error, removed_error

MERGED_FILE = "_MERGED.json"  # merge's sealed summary (steps/merge/merger.py MERGED), which holds GoldenSummary
RIDE_ALONG = "qa.reference.ride_along_uri"  # the spec's field that names the golden rows riding along
GOLDEN_IN = "_golden"  # the plan's copy of the golden rows, under the output prefix
GOLDEN_OUT = "golden"  # merge's published golden results and errors
GOLDEN_LABEL = "_vllm_golden_label"  # the known label's column in the golden input file
RESULTS_FILE, ERRORS_FILE, SUMMARY_FILE = (
    f"{GOLDEN_OUT}/results.parquet",
    f"{GOLDEN_OUT}/errors.parquet",
    (f"{GOLDEN_OUT}/_golden.json"),
)
DEFAULT_TARGET_ROWS = 10_000
EXAMPLES = 5


def _q(c: str) -> str:
    return '"' + c.replace('"', '""') + '"'


def _sql_str(s: str) -> str:
    return s.replace("'", "''")


# ---- plan ---------------------------------------------------------------------------------
def check_reference_columns(spec: JobSpec, found: Input) -> None:
    """SpecError before any worker starts when ``qa.reference.input_column`` cannot be read from the input."""
    col = spec.qa.reference.input_column
    if col is None:
        return
    if found.format != "parquet":
        raise SpecError(
            f"qa.reference.input_column needs Parquet input; {spec.io.input_name} is {found.format}: use "
            "qa.reference.golden_uri (an id -> label file) instead"
        )
    for name in found.names:
        with found.root.open(name) as f:
            names = pq.ParquetFile(f).schema_arrow.names
        if col not in names:
            raise SpecError(
                f"qa.reference.input_column {col!r} is not a column of input file {name} (it has {names[:20]})"
            )


def check_reserved_ids(spec: JobSpec, found: Input) -> None:
    """DatasetError when an input id starts with the golden rows' reserved prefix."""
    if found.format == "parquet":
        con = duck.connect(found.root)
        try:
            bad = [
                r[0]
                for r in con.execute(
                    f"SELECT CAST({_q(spec.prompt.id_column)} AS VARCHAR) AS i FROM read_parquet("
                    f"{duck.file_list(found.root, found.names)}) WHERE starts_with(i, $p) LIMIT {EXAMPLES}",
                    {"p": RESERVED_ID_PREFIX},
                ).fetchall()
            ]
        finally:
            con.close()
    else:
        fmt = input_format(found.format)
        ids = (i for name in found.names for i in fmt.file_ids(found.root, name, spec))
        bad = [i for i in ids if i.startswith(RESERVED_ID_PREFIX)][:EXAMPLES]
    if bad:
        raise DatasetError(
            f"input ids may not start with {RESERVED_ID_PREFIX!r} (reserved for the golden rows that ride along, "
            f"qa.reference.ride_along_uri): e.g. {bad}"
        )


def with_golden(
    plan: Plan,
    spec: JobSpec,
    out: Storage,
    filesystems: FileSystems | None = None,
    max_shards: int | None = None,
    found: Input | None = None,
) -> Plan:
    """``plan`` with its golden rows (``Plan.golden``), their input file written under ``_golden/``; unchanged
    without ``qa.reference.ride_along_uri``. Also checks the reference columns and the reserved ids.
    ``found``: the input as the plan found it (a table's pinned files); default: find ``io.input_uri``."""
    ref = spec.qa.reference
    if ref.input_column is not None or ref.ride_along_uri is not None:
        if found is None:
            assert spec.io.input_uri is not None  # a table's plan passes its files
            found = find_input(spec.io.input_uri, spec.io.storage_options, spec.io.input_format, filesystems)
        check_reference_columns(spec, found)
    if ref.ride_along_uri is None:
        return plan
    assert found is not None  # found above: ride_along_uri is set
    check_reserved_ids(spec, found)
    golden = plan_golden(spec, out, filesystems)
    if max_shards is not None and len(plan.shards) + len(golden.shards) > max_shards:
        raise SpecError(
            f"the plan has {len(plan.shards)} shards and {len(golden.shards)} of golden rows, more than the "
            f"{max_shards} mapped tasks allowed; raise sharding.target_rows"
        )
    return plan.model_copy(update={"golden": golden})


def plan_golden(spec: JobSpec, out: Storage, filesystems: FileSystems | None = None) -> GoldenPlan:
    """Write ``_golden/input-<sha16>.parquet`` from ``qa.reference.ride_along_uri`` and cut its shards."""
    ref = spec.qa.reference
    assert ref.ride_along_uri is not None
    where = f"{RIDE_ALONG} {ref.ride_along_uri}"
    src = find_input(ref.ride_along_uri, spec.io.storage_options, "parquet", filesystems)
    # the golden set's bounds, on stated sizes: unread; a uri naming one linked file is the user's, as golden_uri's
    check_golden_files(src, where, "ride-along golden rows", uri=ref.ride_along_uri, param=RIDE_ALONG)
    idc = spec.prompt.id_column
    # what the worker reads of a row (the template's columns, and model.adapter_column: a golden row names its
    # adapter as an input row does, so the golden rows score the adapters the job's rows run with)
    columns = [c for c in row_columns(spec) if c != idc]
    # a private folder (the copies: up to 8 GiB) that a plan killed with SIGKILL leaves to the next plan's sweep
    with copies_folder("golden") as tmp:
        con = duck.connect(src.root)
        try:
            files = duck.local_list(_bounded_copies(src, tmp, where, ref.ride_along_uri))
            have = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM read_parquet({files})").fetchall()}
            missing = [c for c in [ref.id_column, ref.label_column, *columns] if c not in have]
            if missing:
                raise SpecError(f"{where}: missing column(s) {missing}; it has {sorted(have)[:20]}")
            label = duck.label_sql(_q(ref.label_column))
            con.execute(
                f"CREATE TEMP TABLE g AS SELECT CAST({_q(ref.id_column)} AS VARCHAR) AS _id, {label} AS _label"
                + "".join(f", {_q(c)}" for c in columns)
                + f" FROM read_parquet({files})"
            )
            rows, nulls, distinct, unlabelled = con.execute(
                "SELECT count(*), count(*) FILTER (WHERE _id IS NULL), count(DISTINCT _id), "
                "count(*) FILTER (WHERE _label IS NULL) FROM g"
            ).fetchall()[0]
            if not rows:
                raise SpecError(f"{where}: no rows")
            if nulls:
                raise SpecError(f"{where}: {nulls} row(s) with a null {ref.id_column!r}")
            if distinct != rows:
                dup = [
                    r[0]
                    for r in con.execute(
                        f"SELECT _id FROM g GROUP BY 1 HAVING count(*) > 1 LIMIT {EXAMPLES}"
                    ).fetchall()
                ]
                raise SpecError(f"{where}: {rows - distinct} repeated id(s) in {ref.id_column!r}, e.g. {dup}")
            if unlabelled:
                raise SpecError(
                    f"{where}: {unlabelled} row(s) without a label in {ref.label_column!r}; every golden row needs one"
                )
            texts = spec.prompt.texts
            chars = " + ".join(f"coalesce(length(CAST({_q(c)} AS VARCHAR)), 0)" for c in texts) or "0"
            tokens = [
                int(t)
                for (t,) in con.execute(
                    f"SELECT ceil(({chars}) / {float(spec.sharding.chars_per_token)}) FROM g ORDER BY _id"
                ).fetchall()
            ]
            local = os.path.join(tmp, "input.parquet")  # beside the copies (000000.parquet, ...)
            con.execute(
                f"COPY (SELECT '{_sql_str(RESERVED_ID_PREFIX)}' || _id AS {_q(idc)}"
                + "".join(f", {_q(c)}" for c in columns)
                + f", _label AS {_q(GOLDEN_LABEL)} FROM g ORDER BY _id) TO '{_sql_str(local)}' "
                "(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 4096)"
            ).fetchall()
            faults.hit("golden.before_file")
            file = _put(out, local, int(rows))
        finally:
            con.close()
    target = spec.sharding.target_rows or DEFAULT_TARGET_ROWS
    n = max(1, math.ceil(rows / target))
    bounds = [round(rows * k / n) for k in range(n + 1)]
    shards = []
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg = Segment(file=0, start=a, count=b - a)
        key = hashlib.sha256(f"{file.sha256}:{json.dumps(seg.model_dump())}".encode()).hexdigest()
        shards.append(
            ShardPlan(
                shard_id=f"golden-{k:05d}-{key[:8]}",
                index=k,
                bucket="all",
                rows=b - a,
                est_tokens=int(sum(tokens[a:b])),
                segments=[seg],
            )
        )
    return GoldenPlan(
        uri=ref.ride_along_uri,
        fingerprint=src.fingerprint,
        root=out.uri(GOLDEN_IN),
        input_file=file,
        rows=int(rows),
        shards=shards,
    )


def _bounded_copies(src: Input, tmp: str, where: str, uri: str) -> list[str]:
    """A private copy of each ride-along file, read no further than the size its store stated when it was listed
    (and bounded by ``check_golden_files``): a file that is no regular file (a FIFO, a device), or (local) is or lies
    under a symbolic link below the location, is refused naming it (``SpecError``), so that what the plan reads is
    the bytes it bounded, not a second read of the location. A file that grew or shrank since it was listed, or was
    removed since, is a ``TransientError`` naming it (its writer at work: a retry of the plan lists again). A
    ``uri`` naming one file may be a link (the user's, as ``golden_uri``'s): that one is followed; a file inside a
    folder is read without following links (``golden_set.golden_reader``, which the golden set's reads use too)."""
    paths = []
    for i, f in enumerate(src.files):
        dest = os.path.join(tmp, f"{i:06d}.parquet")
        reader = golden_reader(src.root, f.path, uri)  # inside a folder: each component opened with O_NOFOLLOW
        try:
            got = reader.fetch_pinned(f.path, f.size, dest)  # a FIFO or a device is refused, linked or not
        except LinkRefused:  # swapped for a link since check_golden_files: the user's folder, said as such
            raise link_error(src.root, f.path, where, RIDE_ALONG) from None
        except FileNotFoundError:  # listed, then removed before it was read: a retry lists again
            raise removed_error(src.root, f.path, where) from None
        except CommitError as e:  # a FIFO or a device where a golden file was listed (remote: an encoded object)
            if not src.root.is_local:
                raise SpecError(f"{where}: {e}") from None
            raise SpecError(
                f"{where}: {src.root.uri(f.path)} is not a regular file (a FIFO, a device or a socket, or a link to "
                f"one), so it is refused unopened: the plan reads the ride-along golden rows from Parquet files "
                f"only. Replace it with the file itself, or point {RIDE_ALONG} elsewhere"
            ) from None
        if not SHA256_HEX.fullmatch(got):  # "[at least] N bytes, not <size>": no sha256
            raise TransientError(
                f"{where}: {src.root.uri(f.path)} is {'larger' if got.startswith('at least') else 'smaller'} than the "
                f"{f.size} bytes stated when it was listed: it changed while the plan read it (its writer is at "
                "work); a retry of the plan lists the folder again"
            )
        paths.append(dest)
    return paths


def _put(out: Storage, local: str, rows: int) -> CacheFile:
    """``_golden/input-<sha16>.parquet``, as the result cache writes its files (``result_cache.put_by_content``): a file
    already at that name is kept only when it has these bytes (a killed plan's; the prefix has other writers, and
    the name is predictable), anything else (another file, a link, a FIFO, a folder) is replaced; with its version
    as the store states it."""
    from airflow_provider_vllm.steps.cache.result_cache import put_by_content

    f = put_by_content(out, local, f"{GOLDEN_IN}/input", rows)
    version = describe_files(out.sub(GOLDEN_IN), [f.path.split("/", 1)[1]])[0].version
    return f.model_copy(update={"version": version})


# ---- merge --------------------------------------------------------------------------------
def _golden_input(out: Storage, g: GoldenPlan, copies: CheckedCopies) -> str:
    """A checked local copy of the golden rows' input the sealed plan names."""
    f = g.input_file
    try:
        return copies.get(f.path, f.bytes, f.sha256)
    except (CommitError, FileNotFoundError):
        raise CommitError(
            f"{out.uri(f.path)} does not match the plan (the golden rows' input); rerun the job"
        ) from None


def merge_golden(
    out: Storage, spec: JobSpec, plan: Plan, sources: dict[str, list], copies: CheckedCopies
) -> GoldenSummary | None:
    """Verify the golden rows and publish ``golden/`` (summary last); None without golden rows.

    ``sources``: the golden shards' committed parts per kind ('results', 'errors'; ``FileRef``s with ``rel``),
    as merge's ``committed_parts`` found them over ``plan.golden.view(plan)``: markers sealed by this
    deployment's workers (a golden shard not committed, or a marker that does not match its files, is its
    CommitError or SealError). They and the golden input are read from ``copies``, each checked against its
    sealed size and sha256 as it was copied. VerificationError: the golden ids are not the golden input's,
    exactly once.
    """
    g = plan.golden
    if g is None:
        return None
    golden_input = _golden_input(out, g, copies)
    parts = {k: copies.all([(p.rel, p.bytes, p.sha256) for p in sources.get(k, [])]) for k in ("results", "errors")}
    con = duck.connect()
    try:
        union = " UNION ALL ".join(
            f"SELECT id FROM read_parquet({duck.local_list(parts[k])})" for k in parts if parts[k]
        )
        con.execute("CREATE VIEW ids AS " + (union or "SELECT NULL::VARCHAR AS id WHERE false"))
        con.execute(
            f"CREATE VIEW input_ids AS SELECT CAST({_q(spec.prompt.id_column)} AS VARCHAR) AS id "
            f"FROM read_parquet({duck.local_list([golden_input])})"
        )
        n_in, n_out, distinct, found = con.execute(
            "SELECT (SELECT count(*) FROM input_ids), (SELECT count(*) FROM ids), "
            "(SELECT count(DISTINCT id) FROM ids), (SELECT count(*) FROM ids WHERE id IN (SELECT id FROM input_ids))"
        ).fetchall()[0]
        if not n_in == n_out == distinct == found == g.rows:
            raise VerificationError(
                f"golden rows: {n_in} in the golden input (plan: {g.rows}), {n_out} committed, {n_out - distinct} "
                f"committed more than once, {n_out - found} not golden ids; delete shards/golden-* and rerun them"
            )
        tables = {}
        for kind, schema in (("results", RESULT_SCHEMA), ("errors", ERROR_SCHEMA)):
            read = []
            for p in parts[kind]:
                read.append(pq.read_table(p, schema=schema))
            tables[kind] = pa.concat_tables(read) if read else schema.empty_table()
    finally:
        con.close()
    faults.hit("golden.before_write")
    # the size and sha256 of the bytes written, hashed before they left this process: a hash of what the bucket
    # holds after the write would vouch for whatever another writer put there in between
    written = {
        rel: out.write_parquet_atomic(rel, tables[kind])
        for kind, rel in (("results", RESULTS_FILE), ("errors", ERRORS_FILE))
    }
    summary = GoldenSummary(
        rows=g.rows,
        ok_rows=tables["results"].num_rows,
        error_rows=tables["errors"].num_rows,
        shards=len(g.shards),
        input_file=g.input_file.path,
        files={"results": RESULTS_FILE, "errors": ERRORS_FILE},
        checksums={rel: sha for rel, (_, sha) in written.items()},
        sizes={rel: size for rel, (size, _) in written.items()},
    )
    faults.hit("golden.before_summary")
    out.write_atomic(SUMMARY_FILE, json.dumps(summary.dump(), indent=1, sort_keys=True).encode())
    return summary


# ---- QA -----------------------------------------------------------------------------------
def read_golden(out: Storage) -> GoldenSummary:
    """``golden/_golden.json`` of a merged run, validated (for a consumer's reading; QA trusts only the copy inside
    the sealed ``_MERGED.json``)."""
    return GoldenSummary.model_validate_json(out.read_bytes(SUMMARY_FILE))


def attach_golden(
    con: duckdb.DuckDBPyConnection, out: Storage, plan: Plan, spec: JobSpec, merged: MergeSummary, copies: CheckedCopies
) -> int | None:
    """Views ``gr`` / ``ge`` (the published golden results / errors) and table ``gref(id, label)`` (the plan's
    golden input) on ``con``; the golden rows, or None without them.

    What QA scores is what this deployment's merge sealed: the golden summary inside the sealed
    ``_MERGED.json`` (``merged``, checked by ``read_merged``) names the sha256 of both published files, and
    the sealed plan names the golden input's; each file is read from a local copy (``copies``) checked against
    it as it was copied.
    """
    g = plan.golden
    if g is None:
        return None
    summary = merged.golden
    if summary is None:
        raise CommitError(
            f"{out.uri(MERGED_FILE)} names no golden rows: the plan has golden rows but merge did not publish them"
        )
    local = {}
    for rel in (RESULTS_FILE, ERRORS_FILE):
        try:
            local[rel] = copies.get(rel, (summary.sizes or {}).get(rel), str(summary.checksums.get(rel)))
        except (CommitError, FileNotFoundError):
            raise CommitError(f"{out.uri(rel)} does not match the merge's sealed summary; rerun the merge") from None
    golden_input = _golden_input(out, g, copies)
    for view, rel in (("gr", RESULTS_FILE), ("ge", ERRORS_FILE)):
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW {view} AS SELECT * FROM read_parquet({duck.local_list([local[rel]])})"
        )
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE gref AS SELECT CAST({_q(spec.prompt.id_column)} AS VARCHAR) AS id, "
        f"{_q(GOLDEN_LABEL)} AS label FROM read_parquet({duck.local_list([golden_input])})"
    )
    return g.rows
