"""Readable names for planned shards, shown by Airflow as the mapped task's name.

``shard 3/8 rows 1200-1599``: the shard's 0-based index (the Airflow map index), the shard
count, and the 0-based input row positions it covers. Shards of a length-bucketed plan
(``sharding.long_row_tokens``) are not contiguous in the input, so they name their bucket
and row count instead: ``shard 5/8 long, 37 rows``. Shards of the golden rows that ride along
(``qa.reference.ride_along_uri``) come after the input's: ``golden rows 0, 200 rows``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def shard_display_names(shards: Sequence[dict[str, Any]]) -> list[str]:
    """One name per shard summary (``index``, ``rows``, ``bucket``), in plan order."""
    names: list[str] = []
    start = 0
    n = sum(1 for s in shards if not s.get("golden"))
    for s in shards:
        rows = int(s["rows"])
        head = f"shard {int(s['index'])}/{n}"
        if s.get("golden"):
            names.append(f"golden rows {int(s['index'])}, {rows} rows")
        elif s.get("bucket", "all") == "all":
            names.append(f"{head} rows {start}-{start + rows - 1}" if rows else f"{head} (no rows)")
            start += rows
        else:
            names.append(f"{head} {s['bucket']}, {rows} rows")
    return names


def with_display_names(shards: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The shard summaries with a ``name`` key added (the mapped task's display name)."""
    return [{**s, "name": name} for s, name in zip(shards, shard_display_names(shards))]
