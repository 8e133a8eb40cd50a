"""DuckDB connections that read Parquet files straight from a Storage (local or fsspec)."""

from __future__ import annotations

import os

import duckdb

from airflow_provider_vllm.core.storage import Storage


def connect(*storages: Storage, memory_limit: str = "1GB") -> duckdb.DuckDBPyConnection:
    """A connection that can read the given storages' files (remote ones through fsspec), in UTC.

    The TimeZone is pinned so that no text made of a TIMESTAMPTZ depends on the machine's zone (the
    setting comes with the ICU extension, loaded by the first SET; without ICU, DuckDB renders UTC).
    """
    con = duckdb.connect(
        config={"memory_limit": memory_limit, "threads": os.cpu_count() or 2, "preserve_insertion_order": True}
    )
    try:
        con.execute("SET TimeZone = 'UTC'")
    except (duckdb.CatalogException, duckdb.InvalidInputException):  # no ICU in this build: DuckDB renders UTC
        pass
    seen = set()
    for st in storages:
        if not st.is_local and id(st.fs) not in seen:
            con.register_filesystem(st.fs)
            seen.add(id(st.fs))
    return con


def file_list(storage: Storage, rels: list[str]) -> str:
    """A SQL list literal of the files' paths, as DuckDB reads them."""
    paths = [storage.path(r) if storage.is_local else storage.uri(r) for r in rels]
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def local_list(paths: list[str]) -> str:
    """A SQL list literal of local file paths."""
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"
