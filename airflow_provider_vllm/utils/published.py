"""``changes.previous_published``: the run a job last published, from its Asset's events in Airflow's metadata
database (the channel the bucket's writers cannot touch), for the plan task.

Only an event that the job's own publish task emitted counts (``source_dag_id`` and ``source_task_id``): one made
through the REST API, or by another DAG's task that updates the same Asset, names nothing this job published.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from airflow_provider_vllm.core.allow_list import canonical_uri
from airflow_provider_vllm.core.plan import LastPublished

log = logging.getLogger(__name__)

LOOKBACK_EVENTS = 100  # the newest events read; a job's own publishes are among them unless others flood the Asset


def last_published(
    events: Iterable[Any], asset_uri: str, dag_id: str, publish_task_id: str, own_uri: str
) -> LastPublished:
    """The newest of ``events`` (newest first: Airflow's ``AssetEventResult``) that ``dag_id``'s task
    ``publish_task_id`` emitted for a run other than ``own_uri``, as a ``LastPublished`` (its fields None: none)."""
    own = canonical_uri(own_uri, "io.output_uri", resolve=False).rstrip("/")
    for ev in events:
        if ev.source_dag_id != dag_id or ev.source_task_id != publish_task_id:
            log.info(
                "changes.previous_published: Asset event %s was not emitted by %s.%s; skipped",
                ev.id,
                dag_id,
                publish_task_id,
            )
            continue
        extra = ev.extra if isinstance(ev.extra, dict) else {}
        uri, sha = extra.get("output_uri"), extra.get("success_sha256")
        if not isinstance(uri, str) or not isinstance(sha, str):
            log.warning(
                "changes.previous_published: Asset event %s names no output_uri and success_sha256; skipped", ev.id
            )
            continue
        try:
            if canonical_uri(uri, "output_uri", resolve=False).rstrip("/") == own:
                continue  # this run published before (a retried run): the baseline is the run before it
        except ValueError:
            pass  # refused with its reason when the plan pins it
        stamp = ev.timestamp.isoformat() if hasattr(ev.timestamp, "isoformat") else str(ev.timestamp)
        return LastPublished(asset=asset_uri, event_id=ev.id, timestamp=stamp, output_uri=uri, success_sha256=sha)
    return LastPublished(asset=asset_uri)
