"""Passthrough columns (``io.passthrough``): resolved once, by the plan, against the input's own schema.

The plan names the input columns that every row of ``results/`` and ``errors/`` carries, their names
there (``io.passthrough_prefix`` + column) and their types exactly (an Arrow schema in the sealed plan,
``core.plan.Passthrough``). The workers read those columns with the rows they read anyway and append
them to their parts; the result cache's hits file gets them from the plan's join; merge publishes the
parts by reference and never reads the input for them.

Refused here, naming the column: a column some input file lacks or types differently, an output name
that is a column of results/ or errors/ (``core.rows.passthrough_clash``), and, with the result cache,
a type that does not come back from DuckDB as itself (the hits and the shards' inputs pass through it).
"""

from __future__ import annotations

import pyarrow as pa

from airflow_provider_vllm.core import duck
from airflow_provider_vllm.core.errors import DatasetError, SpecError
from airflow_provider_vllm.core.formats.files import Input
from airflow_provider_vllm.core.formats.parquet import parquet_metadata
from airflow_provider_vllm.core.plan import Passthrough
from airflow_provider_vllm.core.rows import encode_schema, passthrough_clash
from airflow_provider_vllm.core.spec import JobSpec


def resolve_passthrough(spec: JobSpec, found: Input) -> Passthrough | None:
    """The plan's passthrough record for this input, or None when the job passes nothing through."""
    wanted = spec.io.passthrough
    if not wanted:
        return None
    if found.format != "parquet":
        raise SpecError(f"io.passthrough needs Parquet input (typed columns); the input is {found.format}")
    schemas = [(name, parquet_metadata(found.root, name).schema.to_arrow_schema()) for name in found.names]
    if not schemas:
        return None
    first_name, first = schemas[0]
    idc = spec.prompt.id_column
    if wanted == "all":
        columns = [c for c in first.names if c != idc]
    else:
        columns = list(wanted)
        dup = sorted({c for c in columns if columns.count(c) > 1})
        if dup:
            raise SpecError(f"io.passthrough names {dup} more than once")
    for name, schema in schemas:
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise DatasetError(
                f"io.passthrough: input file {name} has no column(s) {missing}; it has {schema.names[:20]}"
            )
        for c in columns:
            if schema.field(c).type != first.field(c).type:
                raise DatasetError(
                    f"io.passthrough: column {c!r} is {schema.field(c).type} in {name} but {first.field(c).type} in "
                    f"{first_name}; every input file must give a passed-through column one type"
                )
    prefix = spec.io.passthrough_prefix
    names = [prefix + c for c in columns]
    for c, n in zip(columns, names):
        why = passthrough_clash(n)
        if why:
            raise SpecError(
                f"io.passthrough: input column {c!r} would be {n!r} in results/ and errors/, which {why}; set "
                "io.passthrough_prefix (e.g. 'input_') or leave the column out"
            )
    fields = [pa.field(n, first.field(c).type) for c, n in zip(columns, names)]
    if spec.cache.uri is not None:
        _check_round_trip(found, columns, fields)
    schema = pa.schema(fields)
    return Passthrough(
        columns=columns, names=names, schema_ipc=encode_schema(schema), types=[str(f.type) for f in fields]
    )


def _check_round_trip(found: Input, columns: list[str], fields: list[pa.Field]) -> None:
    """SpecError for a column whose type DuckDB does not give back castable to itself (with the result cache the
    hits and the shards' input files are written by DuckDB)."""
    con = duck.connect(found.root)
    try:
        q = ", ".join('"' + c.replace('"', '""') + '"' for c in columns)
        back = con.sql(
            f"SELECT {q} FROM read_parquet({duck.file_list(found.root, found.names[:1])}) LIMIT 0"
        ).to_arrow_table()
    finally:
        con.close()
    for c, f, got in zip(columns, fields, back.schema):
        try:
            pa.array([], got.type).cast(f.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise SpecError(
                f"io.passthrough: column {c!r} of type {f.type} comes back from DuckDB as {got.type}, which does not "
                f"convert back ({e}); with cache.uri the passed-through columns go through DuckDB: leave it out or "
                "store it as another type"
            ) from None
