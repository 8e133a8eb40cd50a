"""Each distinct prompt once per run: rows of one rendered input are inferred once and share the answer.

* Which jobs (``why_not``): deterministic sampling only (task embed or classify; generate/chat with
  ``sampling.temperature`` 0, or with a ``sampling.seed``, which vLLM applies to every request alike), Parquet
  input (the key is computed by DuckDB over the typed columns, as the result cache's), and
  ``sharding.dedupe`` left on. Anything else infers every row.
* Which rows are the same (``key.key_sql``, the result cache's key): equal keys mean equal (DuckDB type, value)
  for every column the worker renders, hence byte-identical prompts. Without the cache the keys are salted
  with the job's output hash (``salt``): only rows of one run are compared.
* Plan (``split``): over the rows to infer (the input, or with the result cache its misses), in input order,
  the first row of each key is its leader and goes to a shard; every other row of the key is a follower. The
  followers file (``_cache/followers-<sha16>.parquet``: follower id, leader id, the follower's passthrough
  columns, in input order) is named with its size and sha256 in the sealed plan (``DedupePlan``).
* Merge (``follower_parts``): the followers file is read only when it has the sealed bytes; each follower
  gets its leader's result row (or error row) with its own id and passthrough values, written as one more
  part of ``results/`` (and of ``errors/``), checked by the same exactly-once accounting as every part.

No Airflow.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.plan import CacheFile, DedupePlan, Passthrough, Plan
from airflow_provider_vllm.core.records import FileRef
from airflow_provider_vllm.core.rows import samples_at_random
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import Storage, copies_folder

FOLLOWERS = "followers"  # ``_cache/followers-<sha16>.parquet``: the plan's; ``_cache/followers-<kind>-*``: merge's
LEADER = "_vllm_leader"  # the leader's id in the followers file
PLACE = "_vllm_r"


def _q(col: str) -> str:
    return '"' + col.replace('"', '""') + '"'


def _sql_str(s: str) -> str:
    return s.replace("'", "''")


def deterministic(spec: JobSpec) -> str | None:
    """Why two identical requests of this job could get different answers by design; None when they cannot.

    Pooling tasks (embed, classify) do not sample. Generation is greedy at temperature 0; above it, only a
    per-request ``sampling.seed`` (the same for every row) makes vLLM draw the same tokens for the same prompt.
    ``engine.seed`` alone does not: it seeds one generator that successive requests draw from.
    """
    if spec.task in ("embed", "classify"):
        return None
    if not samples_at_random(spec.sampling.temperature, spec.sampling.seed):
        return None
    return (
        f"sampling.temperature is {spec.sampling.temperature} without a sampling.seed: two rows of one prompt "
        "may be answered differently by design"
    )


def why_not(spec: JobSpec, input_format: str) -> str | None:
    """Why this job's rows are not deduplicated (every row is inferred), or None when they are."""
    if not spec.sharding.dedupe:
        return "sharding.dedupe is false"
    if input_format != "parquet":
        return f"the input is {input_format}: only Parquet input is deduplicated (typed columns)"
    reason = deterministic(spec)
    if reason is not None:
        return reason
    from airflow_provider_vllm.steps.cache.key import key_columns

    if any(c.startswith("_vllm_") for c in {spec.prompt.id_column, *key_columns(spec)}):
        return "a template or id column name starts with '_vllm_' (reserved)"
    return None


def _unkeyable(e: SpecError) -> str:
    """Why rows cannot be keyed, from ``key.check_key_types``' refusal (which speaks of the cache)."""
    m = re.search(r"template column ('[^']*')", str(e))
    col = f"template column {m.group(1)}" if m else "a template column"
    return (
        f"{col} has a type the key does not encode (a timestamp with a time zone in nanoseconds, ENUM, BIT, nested "
        "types, ...)"
    )


def salt(spec: JobSpec) -> str:
    """The key hash of a run without the result cache: what decides an answer besides the row (the spec's
    output hash), so that keys of one run are compared only with keys of the same run."""
    return hashlib.sha256(f"dedupe|{spec.output_hash()}".encode()).hexdigest()


def keyed_rows(spec: JobSpec, found, workdir: str, needed: list[str], memory_limit: str) -> tuple[str, str, int] | str:
    """Without the result cache: every input row with its key (``matching.write_all_misses``), in input order.

    Returns (local file, key hash, rows), the file "" when no prompt repeats (nothing written); or why the rows
    cannot be keyed (a template column of a type the key does not encode): then nothing is deduplicated.
    """
    from airflow_provider_vllm.steps.cache import matching
    from airflow_provider_vllm.steps.cache.key import column_types, key_message_sql

    khash = salt(spec)
    con = duck.connect(found.root, memory_limit=memory_limit)
    try:
        src = f"read_parquet({duck.file_list(found.root, found.names)}, union_by_name = true)"
        try:
            types = column_types(con, src, spec)
        except SpecError as e:
            return _unkeyable(e)
        # Distinct 64-bit hashes of the keys' messages prove distinct prompts (equal messages hash equal), at a
        # fraction of the cost of writing every row with its sha256: the common input without repeats stops here.
        con.execute(f"SET temp_directory = '{_sql_str(os.path.join(workdir, 'duck-tmp'))}'")
        rows, distinct = con.execute(
            f"SELECT count(*), count(DISTINCT hash({key_message_sql(spec, khash, types)})) FROM {src}"
        ).fetchall()[0]
        if rows == distinct:
            return "", khash, int(rows)
        dest = os.path.join(workdir, "keyed.parquet")
        rows = matching.write_all_misses(con, spec, found, khash, types, needed, dest)
    finally:
        con.close()
    return dest, khash, rows


@dataclass
class Split:
    """What ``split`` wrote: the leaders (the rows to infer, the input file's columns) and the followers."""

    leaders_file: str
    followers_file: str
    rows: int
    leaders: int
    followers: int
    follower_tokens: int


def split(
    spec: JobSpec, keyed: str, workdir: str, passthrough: Passthrough | None, memory_limit: str = "512MB"
) -> Split:
    """The first row of each key (in input order) -> the leaders file (same columns as ``keyed``, input order);
    every other row -> the followers file: id (text), its leader's id (text), its passthrough columns under
    their published names and types, in input order."""
    from airflow_provider_vllm.steps.cache.matching import KEY_COLUMN

    leaders_local = os.path.join(workdir, "leaders.parquet")
    followers_local = os.path.join(workdir, "followers.parquet")
    idc = _q(spec.prompt.id_column)
    pairs = list(zip(passthrough.columns, passthrough.names)) if passthrough is not None else []
    carried = "".join(f", m.{_q(c)} AS {_q(n)}" for c, n in pairs)
    chars = " + ".join(f"coalesce(length(CAST(m.{_q(c)} AS VARCHAR)), 0)" for c in spec.prompt.texts) or "0"
    con = duck.connect(memory_limit=memory_limit)
    try:
        con.execute(f"SET temp_directory = '{_sql_str(os.path.join(workdir, 'duck-tmp'))}'")
        rows, leaders = con.execute(
            f"SELECT count(*), count(DISTINCT {KEY_COLUMN}) FROM read_parquet('{_sql_str(keyed)}')"
        ).fetchall()[0]
        if rows == leaders:  # no repeated prompt: nothing to split (the caller keeps its file)
            return Split(keyed, "", int(rows), int(leaders), 0, 0)
        con.execute(
            f"CREATE TEMP TABLE m AS SELECT * EXCLUDE (file_row_number), file_row_number AS {PLACE} "
            f"FROM read_parquet('{_sql_str(keyed)}', file_row_number = true)"
        )
        con.execute(f"CREATE TEMP TABLE lead AS SELECT {KEY_COLUMN} AS k, min({PLACE}) AS r FROM m GROUP BY 1")
        rows, leaders = con.execute("SELECT (SELECT count(*) FROM m), (SELECT count(*) FROM lead)").fetchall()[0]
        from airflow_provider_vllm.steps.cache.matching import MISSES_ROW_GROUP

        con.execute(
            f"COPY (SELECT * EXCLUDE ({PLACE}) FROM m WHERE {PLACE} IN (SELECT r FROM lead) ORDER BY {PLACE}) "
            f"TO '{_sql_str(leaders_local)}' (FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {MISSES_ROW_GROUP})"
        )
        reader = con.sql(
            f"SELECT CAST(m.{idc} AS VARCHAR) AS id, CAST(l.{idc} AS VARCHAR) AS {LEADER}{carried}, "
            f"CAST(ceil(({chars}) / {float(spec.sharding.chars_per_token)}) AS BIGINT) AS _vllm_tokens "
            f"FROM m JOIN lead ON m.{KEY_COLUMN} = lead.k JOIN m l ON l.{PLACE} = lead.r "
            f"WHERE m.{PLACE} <> lead.r ORDER BY m.{PLACE}"
        ).to_arrow_reader(1 << 16)
        schema = followers_schema(passthrough)
        followers = tokens = 0
        with pq.ParquetWriter(followers_local, schema, compression="zstd") as w:
            for b in reader:
                tokens += int(pc.sum(b.column("_vllm_tokens")).as_py() or 0)
                t = pa.Table.from_batches([b]).drop_columns(["_vllm_tokens"])
                w.write_table(pa.Table.from_arrays([t.column(f.name).cast(f.type) for f in schema], schema=schema))
                followers += b.num_rows
        reader.close()
        del reader, w  # freed here (ParquetWriter.__del__), not in the caller's frame
    finally:
        con.close()
    if rows != leaders + followers:
        raise CommitError(f"dedupe: {rows} rows but {leaders} leaders and {followers} followers (a bug); plan again")
    return Split(leaders_local, followers_local, int(rows), int(leaders), followers, tokens)


def followers_schema(passthrough: Passthrough | None) -> pa.Schema:
    """The followers file: id, the leader's id, then the passthrough columns as results/ publishes them."""
    fields = [pa.field("id", pa.string(), nullable=False), pa.field(LEADER, pa.string(), nullable=False)]
    return pa.schema(fields + (list(passthrough.arrow_schema()) if passthrough is not None else []))


def plan_record(s: Split, khash: str, followers_file: CacheFile | None, misses_root: str | None) -> DedupePlan:
    return DedupePlan(
        key_hash=khash,
        rows=s.rows,
        leaders=s.leaders,
        followers=s.followers,
        followers_file=followers_file,
        misses_root=misses_root,
        follower_est_tokens=s.follower_tokens,
    )


# ---- merge ------------------------------------------------------------------------------
def follower_parts(
    out: Storage, plan: Plan, computed: dict[str, list[str]], index: dict[str, int]
) -> dict[str, tuple[FileRef, str]]:
    """Per kind (results, errors): the followers' part (staged under ``_cache/``, named by content) and its
    published name ``part-<index>-followers.parquet``; a kind without follower rows is left out.

    ``computed``: per kind, local copies of the committed parts of this run's shards, each checked against its
    sealed marker as it was copied (``storage.CheckedCopies``): the leaders' rows are there. The followers file
    must be what the sealed plan names (size and sha256); each follower gets its leader's row with its own id and
    passthrough values. A follower whose leader is in neither kind gets no row, and the merge's id check names it.
    """
    d = plan.dedupe
    assert d is not None and d.followers_file is not None
    f = d.followers_file
    if f.rows != d.followers:
        raise CommitError(f"{out.uri(f.path)}: the plan names {f.rows} rows and {d.followers} followers")
    done: dict[str, tuple[FileRef, str]] = {}
    with copies_folder("dedupe") as tmp:  # swept by the next one when a merge killed with SIGKILL leaves it
        local = os.path.join(tmp, "followers.parquet")
        try:
            out.fetch_verified(f.path, f.bytes, f.sha256, local)
        except (CommitError, FileNotFoundError, OSError) as e:
            raise CommitError(
                f"{out.uri(f.path)} does not match the plan ({str(e)[:200]}); the plan's files must not change: "
                "delete the output prefix and rerun the job"
            ) from None
        if not pq.read_schema(local).equals(followers_schema(plan.passthrough)):
            raise CommitError(f"{out.uri(f.path)} is not a followers file of this plan (its schema differs)")
        con = duck.connect(out)
        try:
            con.execute(
                f"CREATE TEMP VIEW fol AS SELECT * EXCLUDE (file_row_number), file_row_number AS {PLACE} "
                f"FROM read_parquet('{_sql_str(local)}', file_row_number = true)"
            )
            carried = set(plan.passthrough.names) if plan.passthrough is not None else set()
            for kind, schema in (("results", plan.result_schema()), ("errors", plan.error_schema())):
                if not computed.get(kind):
                    continue
                rows = _write_kind(con, computed[kind], schema, carried, os.path.join(tmp, f"{kind}.parquet"))
                if not rows:
                    continue
                ref = _stage(out, os.path.join(tmp, f"{kind}.parquet"), f"_cache/{FOLLOWERS}-{kind}", rows)
                width = max(5, len(str(index[kind])))
                done[kind] = (ref, f"part-{index[kind]:0{width}d}-followers.parquet")
        finally:
            con.close()
    faults.hit("dedupe.after_parts")
    return done


def _write_kind(
    con: duckdb.DuckDBPyConnection, parts: list[str], schema: pa.Schema, carried: set[str], dest: str
) -> int:
    """The followers of leaders in ``parts`` (local files) as rows of ``schema``, in the followers' order; the rows
    written."""
    cols = ", ".join(f"fol.{_q(n)}" if n == "id" or n in carried else f"src.{_q(n)}" for n in schema.names)
    # one row per leader id (the merge drops identical copies of a row committed twice; it fails on others)
    src = (
        f"(SELECT * FROM read_parquet({duck.local_list(parts)}) WHERE id IN (SELECT {LEADER} FROM fol) "
        "QUALIFY row_number() OVER (PARTITION BY id ORDER BY shard_id, attempt_id) = 1)"
    )
    reader = con.sql(
        f"SELECT {cols} FROM fol JOIN {src} src ON src.id = fol.{LEADER} ORDER BY fol.{PLACE}"
    ).to_arrow_reader(1 << 16)
    rows = 0
    with pq.ParquetWriter(dest, schema, compression="zstd") as w:
        for b in reader:
            w.write_table(pa.Table.from_arrays([b.column(i).cast(f.type) for i, f in enumerate(schema)], schema=schema))
            rows += b.num_rows
    reader.close()
    return rows


def _stage(out: Storage, local: str, stem: str, rows: int) -> FileRef:
    from airflow_provider_vllm.steps.cache.result_cache import put_by_content

    f = put_by_content(out, local, stem, rows)
    return FileRef(path=f.path, bytes=f.bytes, sha256=f.sha256, rows=f.rows)


# ---- dry run ----------------------------------------------------------------------------
def expected(spec: JobSpec, found, memory_limit: str = "512MB") -> dict:
    """What the dedupe would save on this input now (the dry run; nothing written): ``applied``, ``reason``
    (why not), ``rows``, ``distinct`` prompts, ``duplicates`` (rows that repeat an earlier row's prompt) and
    their estimated prompt tokens. Over the whole input: with the result cache, some of them are hits anyway."""
    reason = why_not(spec, found.format)
    if reason is None:
        from airflow_provider_vllm.steps.cache.key import column_types, key_sql

        con = duck.connect(found.root, memory_limit=memory_limit)
        try:
            src = f"read_parquet({duck.file_list(found.root, found.names)}, union_by_name = true)"
            try:
                types = column_types(con, src, spec)
            except SpecError as e:
                reason = _unkeyable(e)
            else:
                chars = " + ".join(f"coalesce(length(CAST({_q(c)} AS VARCHAR)), 0)" for c in spec.prompt.texts) or "0"
                tokens = f"CAST(ceil(({chars}) / {float(spec.sharding.chars_per_token)}) AS BIGINT)"
                rows, distinct, dup_tokens = con.execute(
                    "SELECT coalesce(sum(n), 0), count(*), coalesce(sum(t * (n - 1)), 0) FROM ("
                    f"SELECT {key_sql(spec, salt(spec), types)} AS k, count(*) AS n, any_value({tokens}) AS t "
                    f"FROM {src} GROUP BY 1)"
                ).fetchall()[0]
        finally:
            con.close()
    if reason is not None:
        return {"applied": False, "reason": reason}
    rows, distinct = int(rows), int(distinct)
    return {
        "applied": True,
        "rows": rows,
        "distinct": distinct,
        "duplicates": rows - distinct,
        "duplicate_rate": round((rows - distinct) / rows, 6) if rows else 0.0,
        "duplicate_est_tokens": int(dup_tokens),
    }


def qa_metrics(plan: Plan, merged) -> dict | None:
    """QA's figures of the dedupe (``plan.dedupe`` and the merge's ``dedupe``): None when the plan has none."""
    d = getattr(plan, "dedupe", None)
    if d is None:
        return None
    m = getattr(merged, "dedupe", None)
    return {
        "rows": int(d.rows),
        "inferred": int(d.leaders),
        "followers": int(d.followers),
        "duplicate_rate": d.followers / d.rows if d.rows else 0.0,
        "saved_est_tokens": int(d.follower_est_tokens),
        "followers_ok": int(m.ok_rows) if m is not None else None,
        "followers_error": int(m.error_rows) if m is not None else None,
    }
