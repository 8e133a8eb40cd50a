"""The QA sample: a deterministic, stratified draw of result and error rows for human review.

Ok rows are stratified by label (else by shard id) and error rows by error code; at most
``ERROR_SAMPLE_FRACTION`` of the sample comes from error rows. Inside each stratum rows are
ranked by a 64-bit DuckDB hash of id and seed (``SAMPLE_KEY``, ``_KEY_SQL``; ties by id): the same inputs and
seed give the same sample in any process and on either QA path. The key is DuckDB's hash
function, so a DuckDB release that changes it changes the sample (the report records the key
and the DuckDB version in ``metrics["sample"]``). Before this key ("duckdb-hash-v1") it was
``md5(f"{seed}:{id}")`` (see docs/BENCHMARKS.md for what the change saves at 100M rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from airflow_provider_vllm.core.rows import ROW_SCHEMA
from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa.confidence import EXAMPLE_GROUP_SQL, consistency_examples, examples_from
from airflow_provider_vllm.steps.qa.metrics import json_key, value_counts

ERROR_SAMPLE_FRACTION = 0.10  # at most this share of the sample comes from error rows
SAMPLE_KEY = "duckdb-hash-v1"  # the ranking key's definition, recorded in the report (was md5 of "seed:id")
# $seed is str(seed), so any Python int works; hashing the id's hash with the seed's costs half of hash(id, seed)
_KEY_SQL = "hash(xor(hash(CAST(id AS VARCHAR)), hash($seed)))"
_MARGIN = 4  # a prefilter keeps about this many times the keys a stratum needs
_PREFILTER_MAX = 1 / 32  # a stratum that needs a larger share of its keys is scanned whole


def sample_keys(seed: int, ids: list[str], con=None) -> list[str]:
    """The sample's ranking keys of ``ids`` (``_KEY_SQL``: DuckDB ``hash(xor(hash(id), hash(str(seed))))``)
    as 16 hex digits, so string order is numeric order; ``con``: a DuckDB connection to reuse (default: a new one)."""
    if not ids:
        return []
    sql = f"SELECT list_transform($ids, lambda id: {_KEY_SQL})"
    if con is None:
        with duckdb.connect() as own:
            keys = own.execute(sql, {"ids": ids, "seed": str(seed)}).fetchall()[0][0]
    else:
        keys = con.execute(sql, {"ids": ids, "seed": str(seed)}).fetchall()[0][0]
    return [f"{k:016x}" for k in keys]


def sample_key(seed: int, row_id: str) -> str:
    """The ranking key of one row (``sample_keys`` of one id)."""
    return sample_keys(seed, [row_id])[0]


def allocate(sizes: dict[Hashable, int], k: int) -> dict[Hashable, int]:
    """Split k draws over strata proportionally to their sizes (largest remainder), with at
    least one per non-empty stratum when k allows it; never more than a stratum holds. When k
    is smaller than the number of strata the k largest strata get one each."""
    alloc = {s: 0 for s in sizes}
    total = sum(max(0, n) for n in sizes.values())
    k = min(max(0, k), total)
    if k == 0:
        return alloc
    nonempty = sorted((s for s, n in sizes.items() if n > 0), key=lambda s: (-sizes[s], str(s)))
    if k < len(nonempty):
        for s in nonempty[:k]:
            alloc[s] = 1
        return alloc
    quota = {s: k * sizes[s] / total for s in nonempty}
    for s in nonempty:
        alloc[s] = min(sizes[s], max(1, math.floor(quota[s])))
    diff = k - sum(alloc.values())
    while diff > 0:
        room = sorted(
            (s for s in nonempty if alloc[s] < sizes[s]), key=lambda s: (alloc[s] - quota[s], -sizes[s], str(s))
        )
        for s in room[:diff]:
            alloc[s] += 1
        diff = k - sum(alloc.values())
    while diff < 0:
        over = sorted((s for s in nonempty if alloc[s] > 1), key=lambda s: (quota[s] - alloc[s], sizes[s], str(s)))
        for s in over[:-diff]:
            alloc[s] -= 1
        diff = k - sum(alloc.values())
    return alloc


@dataclass
class Ride:
    """Rows that the ranking scan of ``r`` collects on its way (it reads every id anyway, so a second
    scan of the ids is saved): the rows where ``where`` holds, with ``id`` and ``columns`` (columns of
    ``r``). ``rows`` is set by that scan (None: no ranking of ``r`` ran; ``read`` then scans for them)."""

    where: str  # SQL over ``id``, ``columns`` and ``hid``: the id's 64-bit hash, ``hash(CAST(id AS VARCHAR))``
    columns: tuple[str, ...]
    rows: pa.Table | None = None
    # (SQL over the columns with a parameter ``$least_cut``, its value, k): the scan also finds the ids of the k
    # rows that the SQL selects with the smallest (confidence, id), as ``ORDER BY confidence, id LIMIT k`` does
    least: tuple[str, float, int] | None = None
    least_ids: list[str] | None = None  # set by that scan
    # (the answer column, the prompt hashes, a SQL relation with them as column ``h``): the consistency examples of
    # those prompts, grouped in the scan by (stratum, prompt, answer), so that a prompt sent millions of times
    # costs a group per distinct answer, not a row per row (``confidence.examples_from``)
    examples: tuple[str, list[int], str] | None = None
    example_groups: list[tuple[int, list[str], str | None, int]] | None = None  # set by that scan

    def read(self, con, table: str = "r") -> pa.Table:
        """``rows``, or the same rows read by a scan of their own when no ranking collected them."""
        if self.rows is None:
            cols = ", ".join(f'"{c}"' for c in self.columns)
            self.rows = con.sql(
                f"SELECT id, {cols} FROM (SELECT CAST(id AS VARCHAR) AS id, hash(CAST(id AS VARCHAR)) AS hid, {cols} "
                f"FROM {table} WHERE id IS NOT NULL) WHERE {self.where}"
            ).to_arrow_table()
        return self.rows

    def examples_found(self, con, table: str = "r") -> list[dict[str, Any]]:
        """The consistency examples of ``examples``: from the ranking scan's groups, or (no ranking of ``r`` ran)
        a query of their own."""
        if self.examples is None:
            return []
        value, picked, _ = self.examples
        if self.example_groups is None:
            return consistency_examples(con, table, value=value, picked=picked)
        return examples_from(self.example_groups)


def _top_by_stratum(
    con,
    table: str,
    stratum: str | None,
    seed: int,
    alloc: dict[Any, int],
    sizes: dict[Any, int],
    ride: Ride | None = None,
) -> dict[Any, list[tuple[int, str]]]:
    """Per stratum, the alloc[s] (key, id) with the smallest keys, ascending. One parallel scan of
    the id and stratum columns; the keys are uniform, so a stratum whose ``sizes[s]`` rows are many
    more than it needs keeps only keys below a threshold (a cheap filter before the group-by) and
    is scanned again whole in the unlikely case that too few pass. The k + 1st key is kept so that a
    tie at the cut is seen. ``ride``: rows the first scan also collects (``Ride``)."""
    need = {s: n + 1 for s, n in alloc.items() if n > 0}
    if not need:
        return {}
    kmax = max(need.values())
    frac = {s: _MARGIN * n / max(1, sizes.get(s) or 0) for s, n in need.items()}
    whole = [s for s, f in frac.items() if f > _PREFILTER_MAX]
    params: dict[str, Any] = {"seed": str(seed)}
    where = ""
    if len(whole) < len(need):
        params.update(
            cut=min(int(_PREFILTER_MAX * 2**64), 2**64 - 1),
            whole=[str(s) for s in whole if s is not None],
            whole_null=None in whole,
        )
        where = "WHERE h < $cut OR list_contains($whole, CAST(s AS VARCHAR)) OR (s IS NULL AND $whole_null)"
    found = dict(_top_query(con, table, stratum, kmax, where, params, ride))
    short = [s for s in need if s not in whole and len(found.get(s) or []) < need[s]]
    if short:  # fewer keys under the threshold than needed: that stratum whole
        again = {"seed": str(seed), "whole": [str(s) for s in short if s is not None], "whole_null": None in short}
        found.update(
            _top_query(
                con,
                table,
                stratum,
                kmax,
                "WHERE list_contains($whole, CAST(s AS VARCHAR)) OR (s IS NULL AND $whole_null)",
                again,
            )
        )
    out = {}
    wanted = [(s, ids) for s, ids in found.items() if s in need]
    keyed = iter(sample_keys(seed, [i for _, ids in wanted for i in ids], con))  # one query for every stratum
    for s, ids in wanted:
        keys = [int(next(keyed), 16) for _ in ids]
        ranked = sorted(zip(keys, ids))
        k = need[s] - 1
        if len(ranked) > k and ranked[k - 1][0] == ranked[k][0]:
            ranked = _ties_at_the_cut(con, table, stratum or "NULL", s, seed, ranked, k)
        out[s] = ranked[:k]
    return out


def _top_query(con, table, stratum, kmax, where, params, ride: Ride | None = None) -> list[tuple[Any, list[str]]]:
    if ride is None:
        rows = con.execute(
            f"""
            SELECT s, min_by(id, h, {int(kmax)}) FROM (
                SELECT {stratum or "NULL"} AS s, CAST(id AS VARCHAR) AS id, {_KEY_SQL} AS h FROM {table}
                WHERE id IS NOT NULL
            ) {where} GROUP BY s
            """,
            params,
        ).fetchall()
        return [(s, ids) for s, ids in rows]
    # The same ranking, plus the rows the ride wants: they pass the scan's filter too and are listed apart.
    # ``hid`` (the id's hash, which the key hashes again with the seed) is computed once for both.
    kept = where.removeprefix("WHERE ") or "true"
    columns = (*ride.columns, *(["confidence"] if ride.least is not None and "confidence" not in ride.columns else []))
    fields = "".join(f', "{c}" := "{c}"' for c in ride.columns)
    least, least_agg = "false", ""
    if ride.least is not None:
        least, cut, k = ride.least
        params = {**params, "least_cut": cut}
        least_agg = f", min(struct_pack(c := confidence, i := id), {int(k)}) FILTER (WHERE least) AS least"
    # the examples' rows: grouped by (stratum, prompt, answer) below, each group keeping its smallest ids and its answer
    ex_cols, ex_flag, ex_keys, ex_group, ex_aggs = "", "false", "", "", ""
    if ride.examples is not None:
        value, _, relation = ride.examples
        ex_cols = f', prompt_hash AS qa_ph, CAST("{value}" AS VARCHAR) AS qa_answer'
        ex_flag = f"qa_ph IN (SELECT h FROM {relation})"
        ex_keys = ", CASE WHEN ex THEN qa_ph END AS exh, CASE WHEN ex THEN hash(qa_answer) END AS exv"
        ex_group = ", exh, exv"
        ex_aggs = ", exh, exv, " + EXAMPLE_GROUP_SQL.format(value="qa_answer", where="ex")
    carried = "".join(f', "{c}"' for c in columns)
    got = con.sql(
        f"""
        SELECT s, min_by(id, h, {int(kmax)}) FILTER (WHERE {kept}) AS ids,
            list(struct_pack(id := id{fields})) FILTER (WHERE ride) AS ride{least_agg}{ex_aggs} FROM (
            SELECT *{ex_keys} FROM (
                SELECT *, {_KEY_SQL.replace("hash(CAST(id AS VARCHAR))", "hid")} AS h, ({ride.where}) AS ride,
                    ({least}) AS least, ({ex_flag}) AS ex FROM (
                    SELECT {stratum or "NULL"} AS s, CAST(id AS VARCHAR) AS id, hash(CAST(id AS VARCHAR)) AS hid
                        {carried}{ex_cols}
                    FROM {table} WHERE id IS NOT NULL
                )
            )
        ) WHERE ({kept}) OR ride OR least OR ex GROUP BY s{ex_group}
        """,
        params=params,
    ).to_arrow_table()
    ride.rows = _flat(got.column("ride"))
    if ride.least is not None:  # each stratum's k smallest (confidence, id): the k smallest of them all
        smallest = con.from_arrow(_flat(got.column("least"))).order("c, i").limit(int(ride.least[2]))
        ride.least_ids = [i for _, i in smallest.fetchall()]
    if ride.examples is not None:
        ride.example_groups = list(zip(*(got.column(c).to_pylist() for c in ("exh", "ex_ids", "ex_answer", "exv"))))
    # a stratum's candidates may come in several groups (one per prompt and answer of the examples' rows): the
    # union holds the stratum's kmax smallest keys, which the caller ranks again
    ranked: dict[Any, list[str]] = {}
    for s, ids in zip(got.column("s").to_pylist(), got.column("ids").to_pylist()):
        if ids is not None:
            ranked.setdefault(s, []).extend(ids)
    return list(ranked.items())


def _flat(lists: pa.ChunkedArray) -> pa.Table:
    """A column of lists of structs as one table of their rows."""
    listed = pc.list_flatten(lists)
    return pa.Table.from_batches(
        [pa.RecordBatch.from_struct_array(c) for c in listed.chunks], schema=pa.schema(listed.type)
    )


def _ties_at_the_cut(con, table, skey, s, seed, ranked, kmax):
    """All rows of stratum ``s`` whose key equals the key at the cut, so that ties go by id (a 64-bit
    collision at the cut: practically never, but the sample must not depend on scan order)."""
    cut = ranked[kmax - 1][0]
    rows = con.execute(
        f"SELECT DISTINCT CAST(id AS VARCHAR) FROM {table} WHERE id IS NOT NULL AND {skey} IS NOT DISTINCT FROM $s "
        f"AND {_KEY_SQL} = $cut",
        {"seed": str(seed), "s": s, "cut": cut},
    ).fetchall()
    return sorted([(k, i) for k, i in ranked if k < cut] + [(cut, i) for (i,) in rows])


def _pick(
    con, table: str, stratum: str | None, sizes: dict[Any, int], k: int, seed: int, ride: Ride | None = None
) -> list[tuple[Any, str]]:
    alloc = allocate(sizes, k)
    tops = _top_by_stratum(con, table, stratum, seed, alloc, sizes, ride)
    picked: list[tuple[Any, str]] = []
    for s in sorted(alloc, key=lambda s: (s is None, str(s))):
        picked += [(s, i) for _, i in (tops.get(s) or [])[: alloc[s]]]
    return picked


def draw_sample(
    con, results: pa.Table, errors: pa.Table, *, spec: QASpec, label_sizes: dict[Any, int] | None
) -> tuple[pa.Table, dict]:
    """(sample table, sample info) of ``spec.sample_size`` rows drawn from ``results`` and ``errors``,
    which ``con`` (DuckDB) has registered as ``r`` and ``e``. ``label_sizes`` (label -> ok rows,
    None for unlabelled) stratifies by label; without it the draw is stratified by shard id."""
    tables = {"r": results, "e": errors}
    return draw_sample_by(
        con,
        spec=spec,
        label_sizes=label_sizes,
        n_ok=results.num_rows,
        n_err=errors.num_rows,
        some_shard_ids=results.column("shard_id").null_count < results.num_rows,
        counts=lambda t, c: value_counts(tables[t].column(c)),
        rows=lambda t, ids: tables[t],
    )


def draw_sample_by(
    con,
    *,
    spec: QASpec,
    label_sizes: dict[Any, int] | None,
    n_ok: int,
    n_err: int,
    some_shard_ids: bool,
    counts: Callable[[str, str], dict[Any, int]],
    rows: Callable[[str, list[str]], pa.Table],
    ride: Ride | None = None,
) -> tuple[pa.Table, dict]:
    """``draw_sample`` over tables known by their sizes: ``counts(table, column)`` is
    ``value_counts`` of a column of ``r`` or ``e`` and ``rows(table, ids)`` a table holding
    (at least) those rows of it; ``con`` has ``r`` and ``e`` (tables or views over files).
    ``ride``: rows of ``r`` that the ranking of ``r`` collects as it goes (``Ride``)."""
    seed, k = spec.seed, spec.sample_size
    stratum = "label" if label_sizes else ("shard_id" if some_shard_ids else None)

    err_quota = max(1, round(ERROR_SAMPLE_FRACTION * k)) if k >= 2 and n_err else 0
    k_err = min(n_err, err_quota)
    k_ok = min(n_ok, k - k_err)
    k_err = min(n_err, k - k_ok)  # few ok rows: fill up with errors

    ok_sizes: dict[Any, int] = {}
    if k_ok:
        if stratum == "label":
            ok_sizes = dict(label_sizes or {})
        elif stratum:
            ok_sizes = counts("r", stratum)
        else:
            ok_sizes = {None: n_ok}
    err_sizes = counts("e", "error_code") if k_err else {}
    ok_pick = _pick(con, "r", stratum, ok_sizes, k_ok, seed, ride) if k_ok else []
    err_pick = _pick(con, "e", "error_code", err_sizes, k_err, seed) if k_err else []

    ok_part = _take(rows("r", [i for _, i in ok_pick]), ok_pick, "ok", seed)
    err_part = _take(rows("e", [i for _, i in err_pick]), err_pick, "error", seed)
    sample = pa.concat_tables([ok_part, err_part], promote_options="permissive")
    info = {
        "requested": k,
        "seed": seed,
        "key": SAMPLE_KEY,
        "duckdb": duckdb.__version__,
        "rows": sample.num_rows,
        "ok_rows": ok_part.num_rows,
        "error_rows": err_part.num_rows,
        "stratified_by": stratum,
        "allocation": {json_key(s): n for s, n in allocate(ok_sizes, k_ok).items() if n} if k_ok else {},
        "error_allocation": {json_key(s): n for s, n in allocate(err_sizes, k_err).items() if n} if k_err else {},
        "ids": [i for _, i in ok_pick] + [i for _, i in err_pick],
    }
    return sample, info


def _take(table: pa.Table, picked: list[tuple[Any, str]], status: str, seed: int) -> pa.Table:
    """The picked rows in pick order, conformed to ROW_SCHEMA (+ extra columns, + qa columns)."""
    ids = [i for _, i in picked]
    if ids:
        value_set = pa.array(ids, pa.string())
        idcol = table.column("id")
        if idcol.type != pa.string():
            idcol = pc.cast(idcol, pa.string())
        mask = pc.is_in(idcol, value_set=value_set)
        sub = table.filter(mask)
        pos = pc.index_in(pc.cast(sub.column("id"), pa.string()), value_set=value_set).to_pylist()
        seen: set[int] = set()
        order = []
        for row, p in sorted(enumerate(pos), key=lambda t: (t[1], t[0])):
            if p not in seen:  # ids are unique after merge; keep the first if not
                seen.add(p)
                order.append(row)
        sub = sub.take(pa.array(order, pa.int64()))
        strata = [picked[p][0] for p in sorted(seen)]
    else:
        sub = table.slice(0, 0)
        strata = []
    n = sub.num_rows
    cols, fields = [], []
    names = set(sub.column_names)
    for f in ROW_SCHEMA:
        if f.name == "status":
            cols.append(pa.array([status] * n, pa.string()))
        elif f.name in names:
            col = sub.column(f.name)
            if col.type != f.type:
                try:
                    col = pc.cast(col, f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    f = pa.field(f.name, col.type)
            cols.append(col)
        else:
            cols.append(pa.nulls(n, f.type))
        fields.append(pa.field(f.name, cols[-1].type, nullable=f.nullable or cols[-1].null_count > 0))
    for name in sub.column_names:  # extra columns (input_excerpt ...)
        if name not in ROW_SCHEMA.names and name not in ("qa_stratum", "qa_sample_key"):
            cols.append(sub.column(name))
            fields.append(pa.field(name, sub.column(name).type))
    cols.append(pa.array([None if s is None else str(s) for s in strata], pa.string()))
    fields.append(pa.field("qa_stratum", pa.string()))
    cols.append(pa.array(sample_keys(seed, sub.column("id").to_pylist()), pa.string()))
    fields.append(pa.field("qa_sample_key", pa.string()))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


LEAST_CONFIDENT = "least_confident"  # qa_stratum of the rows the sample takes for their low confidence


def least_confident(drawn: tuple[pa.Table, dict], table: pa.Table, ids: list[str], seed: int) -> tuple[pa.Table, dict]:
    """The drawn (sample, info) plus the ok rows ``ids`` of ``table`` (the least confident, least first)
    that the draw did not already take, with ``qa_stratum`` 'least_confident'."""
    sample, info = drawn
    have = set(info.get("ids") or [])
    extra = [i for i in ids if i not in have]
    if not extra:
        return sample, {**info, "least_confident": 0}
    part = _take(table, [(LEAST_CONFIDENT, i) for i in extra], "ok", seed)
    sample = pa.concat_tables([sample, part], promote_options="permissive")
    return sample, {
        **info,
        "rows": sample.num_rows,
        "least_confident": part.num_rows,
        "ids": list(info.get("ids") or []) + part.column("id").to_pylist(),
    }
