"""DuckDB connections that read Parquet files straight from a Storage (local or fsspec)."""

from __future__ import annotations

import os
import secrets
import tempfile

import duckdb

from airflow_provider_vllm.core.storage import GLOB_CHARS, Storage, has_glob, process_copies_folder

FILENAME = "_vllm_filename"
"""The name of the file-name column that ``read_parquet(..., filename = '_vllm_filename')`` adds: with
``filename = true`` a column ``filename`` of the file itself fails the query (BinderException). DuckDB cannot
rename the ``file_row_number`` column: an input column of that name is refused (``formats.parquet``)."""


# What Python's ``str.strip()`` removes (``str.isspace``), as the worker strips a chosen label: DuckDB's one-argument
# ``trim`` removes spaces only, so a known label "bug\n" or "bug\xa0" never matched the answer "bug".
SPACES = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def label_sql(expr: str) -> str:
    """A label as compared with the answers: text, stripped as Python strips; NULL when null or blank."""
    return f"nullif(trim(CAST({expr} AS VARCHAR), '{SPACES}'), '')"


def connect(*storages: Storage, memory_limit: str = "1GB") -> duckdb.DuckDBPyConnection:
    """A connection that can read the given storages' files (remote ones through fsspec), in UTC.

    The TimeZone is pinned so that no text made of a TIMESTAMPTZ depends on the machine's zone (the
    setting comes with the ICU extension, loaded by the first SET; without ICU, DuckDB renders UTC).
    """
    con = duckdb.connect(
        config={
            "memory_limit": memory_limit,
            "threads": os.cpu_count() or 2,
            "preserve_insertion_order": True,
            "temp_directory": spill_dir(),
        }
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


def spill_dir() -> str:
    """Where a DuckDB connection spills what exceeds its memory limit: a directory of its own, with an unguessable
    name, that DuckDB creates when it first spills and removes when the connection closes, inside this process's
    swept folder under the system's temporary directory (``TMPDIR``; ``storage.process_copies_folder("duckdb")``):
    what a task killed with SIGKILL left there is removed by the next process's first connection. DuckDB's default is
    ``.tmp`` in the process's working directory: an Airflow task's working directory may be read-only, gone, or
    shared with concurrent tasks (one task's close would remove the directory another is spilling into), and QA over
    100M distinct prompts spills (its consistency ``GROUP BY``)."""
    name = f"vllm-batch-duckdb-{secrets.token_hex(16)}"
    try:
        root = tempfile.gettempdir()
    except FileNotFoundError:  # no writable temporary directory at all: DuckDB's default (a spill would fail)
        return ".tmp"
    try:
        return os.path.join(process_copies_folder("duckdb"), name)
    except OSError:  # no folder can be made there now: DuckDB's own, unswept (a spill would likely fail too)
        return os.path.join(root, name)


def file_list(storage: Storage, rels: list[str]) -> str:
    """A SQL list literal of the files' paths, as DuckDB reads them (ValueError: see ``local_list``)."""
    return local_list([storage.path(r) if storage.is_local else storage.uri(r) for r in rels])


def local_list(paths: list[str]) -> str:
    """A SQL list literal of file paths; ValueError for a path with a glob character (``GLOB_CHARS``).

    DuckDB expands each path of ``read_parquet([...])`` as a glob: ``[_]data.parquet`` reads ``_data.parquet``
    and ``p*.parquet`` every ``p...`` file. Escaping (``[[]``) reads the right files but DuckDB's ``filename``
    column then gives the path as the glob found it, which callers match against these literals."""
    bad = next((p for p in paths if has_glob(p)), None)
    if bad is not None:
        raise ValueError(
            f"{bad}: a path DuckDB reads may not hold a glob character ({' '.join(GLOB_CHARS)}): DuckDB would expand it"
        )
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"
