"""The known labels QA scores against (``qa.reference``), as DuckDB relations for ``labelled``.

``attach_references(con, spec, plan, out)`` creates, on a connection that already has the run's
``r`` and ``e``:

* ``ref(id, label)`` from ``input_column`` (the run's own Parquet input, read through the plan's
  file list) or from ``golden_uri`` (a Parquet file or folder of id and label columns: the files the plan
  pinned, read from checked copies, ``golden_set.py``);
* ``gref``, ``gr``, ``ge`` for the ride-along golden rows: their known labels (the plan's golden
  input file) and the results / errors merge published under ``golden/`` (``steps.golden``).

Labels are compared as text, trimmed; a null or blank label is not a label. A golden set with
a missing column, a null id or an id twice is refused (``SpecError`` naming the file and the
column): a reference that cannot be trusted must not grade a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

from airflow_provider_vllm.core import duck
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.plan import GoldenSetPin, Plan
from airflow_provider_vllm.core.spec import JobSpec, ReferenceSpec
from airflow_provider_vllm.core.storage import FileSystems, Storage, copies_folder
from airflow_provider_vllm.steps.qa.golden_set import checked_golden_set, pin_golden_set

EXAMPLES = 5


@dataclass
class References:
    """Which reference relations a connection has, and how many known labels each source holds."""

    run_source: str | None = None  # 'input_column' | 'golden_set'
    ride_along: bool = False
    known: dict[str, int] = field(default_factory=dict)
    locations: dict[str, str] = field(default_factory=dict)  # source -> where its labels came from


def _q(c: str) -> str:
    return '"' + c.replace('"', '""') + '"'


def label_sql(column: str) -> str:
    """A label column as compared: text, stripped as the worker strips an answer; NULL when null or blank."""
    return duck.label_sql(_q(column))


def load_labels(
    con: duckdb.DuckDBPyConnection,
    table: str,
    files: str,
    *,
    id_column: str,
    label_column: str,
    what: str,
    unique: bool = True,
) -> int:
    """Temp table ``table(id, label)`` from the Parquet ``files`` (a SQL list); returns its rows.

    Rows without a label are left out. ``unique``: refuse null or repeated ids (a golden set);
    the run's own input was checked by the plan.
    """
    try:
        cols = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM read_parquet({files})").fetchall()}
    except duckdb.Error as e:
        raise SpecError(f"{what}: cannot be read as Parquet ({type(e).__name__}: {str(e).splitlines()[0]})") from e
    for c, role in ((id_column, "id"), (label_column, "label")):
        if c not in cols:
            raise SpecError(f"{what}: no column {c!r} (the {role} column); columns: {sorted(cols)[:20]}")
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT CAST({_q(id_column)} AS VARCHAR) AS id, "
        f"{label_sql(label_column)} AS label FROM read_parquet({files})"
    )
    if unique:
        nulls, total, distinct = con.execute(
            f"SELECT count(*) FILTER (WHERE id IS NULL), count(*), count(DISTINCT id) FROM {table}"
        ).fetchall()[0]
        if nulls:
            raise SpecError(f"{what}: {nulls} row(s) with a null {id_column!r}")
        if distinct != total:
            dup = [
                r[0]
                for r in con.execute(
                    f"SELECT id FROM {table} GROUP BY id HAVING count(*) > 1 ORDER BY id LIMIT {EXAMPLES}"
                ).fetchall()
            ]
            raise SpecError(f"{what}: {total - distinct} repeated id(s) in {id_column!r}, e.g. {dup}")
    con.execute(f"DELETE FROM {table} WHERE label IS NULL")
    return int(con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0])


@dataclass(frozen=True)
class LabelFiles:
    """Where one source's known labels are: the Parquet files, their id and label columns."""

    source: str  # 'input_column' | 'golden_set'
    root: Storage
    names: list[str]
    id_column: str
    label_column: str
    location: str  # the spec's URI, for messages and lineage
    unique: bool  # refuse null or repeated ids (a golden set; the run's input was checked by the plan)
    local: tuple[str, ...] | None = None  # checked local copies of the files, read instead of root/names
    pin: GoldenSetPin | None = None  # the golden set as the plan pinned it (the report names it)

    def sql_list(self) -> str:
        """The files as DuckDB reads them: the checked copies when there are, else the files under ``root``."""
        return duck.local_list(list(self.local)) if self.local is not None else duck.file_list(self.root, self.names)


def find_references(
    spec: JobSpec, plan: Plan, out: Storage, tmp: str, filesystems: FileSystems | None = None
) -> LabelFiles | None:
    """The known labels of this run's rows (``input_column`` or ``golden_uri``), or None. A golden set is the one
    the plan pinned, copied and checked into ``tmp`` (``golden_set.checked_golden_set``: InputChangedError when it
    changed since the plan); so is a materialized table's file that ``input_column`` reads (``Plan.input_storage``)."""
    ref = spec.qa.reference
    if ref.input_column is not None:
        if plan.format != "parquet":
            raise SpecError(
                f"qa.reference.input_column needs Parquet input; this run's input is {plan.format}: "
                "use qa.reference.golden_uri (an id -> label file) instead"
            )
        return LabelFiles(
            "input_column",
            plan.input_storage(out, tmp)[0],  # a materialized table's file: a checked local copy
            [f.path for f in plan.files],
            spec.prompt.id_column,
            ref.input_column,
            spec.io.input_name,
            unique=False,
        )
    if ref.golden_uri is not None:
        pin, local = checked_golden_set(spec, plan, tmp, filesystems)
        return _golden_label_files(out, ref.golden_uri, ref, pin, local)
    return None


def _golden_label_files(out: Storage, uri: str, ref: ReferenceSpec, pin: GoldenSetPin, local: list[str]) -> LabelFiles:
    """The labels of the golden set at ``uri`` as the plan pinned it, read from ``local`` (its checked copies)."""
    return LabelFiles(
        "golden_set",
        out,
        [f.path for f in pin.files],
        ref.id_column,
        ref.label_column,
        uri,
        unique=True,
        local=tuple(local),
        pin=pin,
    )


def attach_references(con: duckdb.DuckDBPyConnection, found: LabelFiles | None) -> References:
    """Create ``ref`` on ``con`` (made with ``duck.connect`` over ``found.root`` too); what was attached."""
    refs = References()
    if found is None:
        return refs
    what = (
        f"qa.reference.input_column {found.label_column!r} of {found.location}"
        if found.source == "input_column"
        else f"qa.reference.golden_uri {found.location}"
    )
    refs.known[found.source] = load_labels(
        con,
        "ref",
        found.sql_list(),
        id_column=found.id_column,
        label_column=found.label_column,
        what=what,
        unique=found.unique,
    )
    refs.run_source = found.source
    refs.locations[found.source] = found.location
    return refs


def with_golden_set(plan: Plan, spec: JobSpec, filesystems: FileSystems | None = None) -> Plan:
    """``plan`` with its golden set pinned (``Plan.golden_set``, ``golden_set.pin_golden_set``); unchanged without
    ``qa.reference.golden_uri``. The copies the pin hashed are checked as QA will read the pinned bytes (SpecError
    naming the file and the column: not Parquet, a missing column, a null or repeated id), so a golden set that
    cannot grade the run fails the plan, before any shard runs. Each golden file is read once, and what is checked
    is what is pinned."""
    ref = spec.qa.reference
    if ref.golden_uri is None:
        return plan
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    with copies_folder("plan") as tmp:
        pinned = pin_golden_set(spec, tmp, filesystems)
        assert pinned is not None
        pin, local = pinned
        found = _golden_label_files(out, ref.golden_uri, ref, pin, local)
        con = duck.connect(out)
        try:
            attach_references(con, found)
        finally:
            con.close()
    return plan.model_copy(update={"golden_set": pin})
