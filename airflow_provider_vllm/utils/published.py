"""``changes.previous_published``: the run a job last published before this one, from its Asset's events in
Airflow's metadata database (the channel the bucket's writers cannot touch), for the plan task.

Only an event that the job's own publish task emitted counts (``source_dag_id`` and ``source_task_id``): one made
through the REST API, or by another DAG's task that updates the same Asset, names nothing this job published.
Runs are ordered by their logical date, not by when they published: a run of date D compares with the published
run of the latest date before D (the day before when it was published; a date that failed QA is skipped), so a
backfill of old dates never compares with tonight's run. A run without a logical date (a manual run of Airflow 3)
compares with the newest publish. Events of others do not hide the job's own: they are read past, a page at a
time (``newest_events``), and past ``MOST_EVENTS`` with no publish of the job found the plan fails rather than take
"nothing published" from a window someone else filled.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from airflow_provider_vllm.core.allow_list import canonical_uri, store_form
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.plan import LastPublished

log = logging.getLogger(__name__)

# the newest publishes of the job read: about three years of one nightly job's; a backfill of dates older than
# those finds no earlier publish among them and writes no change set
LOOKBACK_EVENTS = 1000
PAGE_EVENTS = 100  # the events one query reads (newest first)
MOST_EVENTS = 10_000  # the events read in all, others' included (the REST API, other DAGs); then fail or stop


def newest_events(accessor: Any, page: int = PAGE_EVENTS, most: int = MOST_EVENTS) -> Iterator[Any]:
    """The Asset's events newest first (``accessor``: Airflow's ``InletEventsAccessor``), ``page`` per query, each
    query before the oldest event of the last (``before`` is inclusive: an event read again is skipped by its id).
    CommitError once ``most`` were read, or when a whole page shares one timestamp (no query reaches past it): what
    lies beyond is not known."""
    accessor = accessor.ascending(False).limit(page)
    seen: set[int] = set()
    while True:
        events = list(accessor)
        fresh = [ev for ev in events if ev.id not in seen]
        for ev in fresh:
            if len(seen) >= most:
                raise CommitError(f"read the newest {most} events of the Asset")
            seen.add(ev.id)
            yield ev
        if len(events) < page:
            return
        if not fresh:
            raise CommitError(f"{page} events of the Asset share the timestamp {events[-1].timestamp}")
        accessor = accessor.before(events[-1].timestamp)


def _date(value: Any) -> dt.datetime | None:
    """An aware datetime from an event's ISO text or a context's datetime (None: none, or not a date)."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        return None
    return value


def last_published(
    events: Iterable[Any],
    asset_uri: str,
    dag_id: str,
    publish_task_id: str,
    own_uri: str,
    logical_date: Any = None,
) -> LastPublished:
    """Of ``events`` (newest first: Airflow's ``AssetEventResult``, e.g. ``newest_events``), the one ``dag_id``'s task
    ``publish_task_id`` emitted for the run of the latest logical date before ``logical_date`` (the newest of those
    when a date was published more than once; no ``logical_date``: the newest event), never for ``own_uri``, among
    the job's newest ``LOOKBACK_EVENTS`` publishes; as a ``LastPublished`` (its fields None: none). CommitError,
    naming the Asset, when ``events`` stops early (``newest_events``: too many of them) before one was found."""
    own = store_form(canonical_uri(own_uri, "io.output_uri", resolve=False)).rstrip("/")  # s3a is s3, gcs gs
    before = _date(logical_date)
    best: tuple[dt.datetime, Any, dict] | None = None
    mine = others = 0
    try:
        for ev in events:
            if ev.source_dag_id != dag_id or ev.source_task_id != publish_task_id:
                others += 1
                continue
            mine += 1
            if mine > LOOKBACK_EVENTS:
                break
            extra = ev.extra if isinstance(ev.extra, dict) else {}
            if extra.get("from_rest_api"):  # Airflow marks the events its REST API makes (they carry no source task)
                continue
            uri, sha = extra.get("output_uri"), extra.get("success_sha256")
            if not isinstance(uri, str) or not isinstance(sha, str):
                log.warning(
                    "changes.previous_published: Asset event %s names no output_uri and success_sha256; skipped",
                    ev.id,
                )
                continue
            try:
                if store_form(canonical_uri(uri, "output_uri", resolve=False)).rstrip("/") == own:
                    continue  # this run published before (its folder was planned again): no baseline of its own
            except ValueError:
                pass  # refused with its reason when the plan pins it
            if before is None:
                return _found(asset_uri, ev, extra)
            date = _date(extra.get("logical_date"))
            if date is None or date >= before:
                continue  # a later date (tonight's run, seen by a backfill), or a publish without a logical date
            if best is None or date > best[0]:  # newest first: a date's newest publish is met first
                best = (date, ev, extra)
    except CommitError as e:
        if best is None:  # not "nothing published": what was not read is not known
            raise CommitError(
                f"changes.previous_published: Asset {asset_uri}: {e}, {others} of them not emitted by "
                f"{dag_id}.{publish_task_id} (the REST API, another DAG or task), and none names a run it published "
                "before this one, so which run that is is not known. Compare with a run named explicitly "
                "(changes.previous_uri, with changes.previous_published false, and qa.previous_published false: "
                "qa.previous_report_uri names the report to compare with)"
            ) from None
        # else: the best of the job's publishes newer than any not read
    finally:
        if others:
            log.info(
                "changes.previous_published: skipped %d Asset event(s) not emitted by %s.%s",
                others,
                dag_id,
                publish_task_id,
            )
    return _found(asset_uri, best[1], best[2]) if best is not None else LastPublished(asset=asset_uri)


def _found(asset_uri: str, ev: Any, extra: dict) -> LastPublished:
    stamp = ev.timestamp.isoformat() if hasattr(ev.timestamp, "isoformat") else str(ev.timestamp)
    date = extra.get("logical_date")
    return LastPublished(
        asset=asset_uri,
        event_id=ev.id,
        timestamp=stamp,
        logical_date=date if isinstance(date, str) else None,
        output_uri=extra["output_uri"],
        success_sha256=extra["success_sha256"],
    )
