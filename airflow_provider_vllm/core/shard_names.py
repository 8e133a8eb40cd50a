"""Readable names for planned shards, shown by Airflow as the mapped task's name.

``shard 3/8 rows 1200-1599``: the shard's 0-based index (the Airflow map index), the shard
count, and the 0-based input row positions it covers. Shards of a length-bucketed plan
(``sharding.long_row_tokens``) are not contiguous in the input, so they name their bucket
and row count instead: ``shard 5/8 long, 37 rows``. Shards of the golden rows that ride along
(``qa.reference.ride_along_uri``) come after the input's: ``golden rows 0, 200 rows``.
"""

from __future__ import annotations

from collections.abc import Sequence

from airflow_provider_vllm.core.plan import ShardSummary


def shard_display_names(shards: Sequence[ShardSummary]) -> list[str]:
    """One name per shard summary, in plan order."""
    names: list[str] = []
    start = 0
    n = sum(1 for s in shards if not s.golden)
    for s in shards:
        head = f"shard {s.index}/{n}"
        if s.golden:
            names.append(f"golden rows {s.index}, {s.rows} rows")
        elif s.bucket == "all":
            names.append(f"{head} rows {start}-{start + s.rows - 1}" if s.rows else f"{head} (no rows)")
            start += s.rows
        else:
            names.append(f"{head} {s.bucket}, {s.rows} rows")
    return names


def with_display_names(shards: Sequence[ShardSummary]) -> list[ShardSummary]:
    """The shard summaries with ``name`` set (the mapped task's display name)."""
    return [s.model_copy(update={"name": name}) for s, name in zip(shards, shard_display_names(shards))]
