"""QA of a result set: ``evaluate`` measures merged ``results`` / ``errors`` tables and returns a
``QAReport`` (metrics, threshold checks, verdict and a deterministic sample).

Pure computation over Arrow tables (DuckDB does the sample's scans); no Airflow, no vLLM, no
I/O. The QA step (``stage.qa_run``) reads the merged output, calls ``evaluate``, and stores the
report with ``store.write_qa``; the caller raises ``QAFailed`` (or asks a human) according to
``QAReport.status``. Metric definitions are in ``metrics``, the sampling rule in ``sample``.
"""

from __future__ import annotations

import json
from typing import Any

import duckdb
import pyarrow as pa

from airflow_provider_vllm.core import duck
from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa.checks import overall_status, run_checks
from airflow_provider_vllm.steps.qa.confidence import (
    LEAST_SQL,
    ConfidenceTally,
    answer_stats,
    confidence_metrics,
    consistency_counts,
    consistency_metrics,
    least_ids,
)
from airflow_provider_vllm.steps.qa.labelled import labelled_view, quality
from airflow_provider_vllm.steps.qa.metrics import (
    ERROR_NEEDS,
    RESULT_NEEDS,
    add_label_drift,
    compute_metrics,
    conform,
    duplicate_metrics,
    throughput_metrics,
)
from airflow_provider_vllm.steps.qa.metrics_stream import ResultTally
from airflow_provider_vllm.steps.qa.reference import References, label_sql
from airflow_provider_vllm.steps.qa.report import QAReport, of_this_job
from airflow_provider_vllm.steps.qa.sample import Ride, draw_sample, draw_sample_by, least_confident

IN_LIST_MAX = 10_000  # picked rows read with a constant IN list up to this many ids, else a semi-join
KNOWN_IN_SCAN = 10_000  # known ids (a golden set) collected by the sample's ranking scan up to this many


def evaluate(
    results: pa.Table,
    errors: pa.Table,
    *,
    spec: QASpec,
    labels: list[str] | None,
    structured: bool,
    shard_stats: list[dict] | None = None,
    previous: dict | None = None,
    run_info: dict[str, Any] | None = None,
    duplicates: dict[str, Any] | None = None,
    changes: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
    reference: pa.Table | None = None,
    reference_source: str = "golden_set",
    ride_along: tuple[pa.Table, pa.Table, pa.Table] | None = None,
    compared: str | None = "label",
    yardsticks: dict[str, dict] | None = None,
) -> QAReport:
    """Metrics, threshold checks and a deterministic stratified sample (pure computation).

    ``results`` has RESULT_COLUMNS (extra columns such as ``input_excerpt`` are kept in the
    sample), ``errors`` has ERROR_COLUMNS; either may be empty. ``previous`` is an earlier
    report dict (``QAReport.to_dict()``) for label drift. ``run_info`` (optional, small,
    JSON-serialisable) is copied into the report header (run id, job name ...). ``duplicates``
    is merge's count of ids committed more than once, taken before its dedupe (``_MERGED.json``).
    ``changes``: ``ChangesSummary.dump()`` (``steps/merge/changes.py``) for the churn_rate check and the
    churn matrix; ``cache``: ``{rows, hits, misses, hit_rate}`` of the result cache (``stage.cache_metrics``).
    ``reference``: known labels of this run's rows (columns id, label; from ``reference_source``,
    'input_column' or 'golden_set'); ``ride_along``: the ride-along golden rows' (results, errors,
    known labels). ``compared``: the result column whose answers the consistency check compares
    (None: not checked). ``yardsticks``: per source of known labels, what the plan pinned it to
    (``yardstick.plan_identities``; the report records it, and the change in accuracy compares like with like).
    """
    results = conform(results, RESULT_NEEDS)
    errors = conform(errors, ERROR_NEEDS)
    previous = of_this_job(previous, run_info, spec.previous_report_uri)
    notes: list[str] = []
    con = duckdb.connect(config={"temp_directory": duck.spill_dir()})  # spills outside the working directory
    try:
        con.register("r", results)
        con.register("e", errors)
        refs = References()
        if reference is not None:
            con.register("ref_in", reference)
            con.execute(
                f"CREATE TEMP TABLE ref AS SELECT CAST(id AS VARCHAR) AS id, {label_sql('label')} AS label "
                f"FROM ref_in WHERE {label_sql('label')} IS NOT NULL"
            )
            refs.run_source = reference_source
            refs.known[reference_source] = con.execute("SELECT count(*) FROM ref").fetchall()[0][0]
        if ride_along is not None:
            gres, gerr, glab = ride_along
            con.register("gr", conform(gres, RESULT_NEEDS))
            con.register("ge", conform(gerr, ERROR_NEEDS))
            con.register("gref_in", glab)
            con.execute(
                f"CREATE TEMP TABLE gref AS SELECT CAST(id AS VARCHAR) AS id, {label_sql('label')} AS label "
                f"FROM gref_in WHERE {label_sql('label')} IS NOT NULL"
            )
            refs.ride_along = True
            refs.known["ride_along"] = con.execute("SELECT count(*) FROM gref").fetchall()[0][0]
        metrics = compute_metrics(results, errors, labels=labels, structured=structured, notes=notes)
        metrics.update(
            measure_answers(
                con,
                spec=spec,
                labels=labels,
                previous=previous,
                refs=refs,
                compared=compared,
                notes=notes,
                yardsticks=yardsticks,
            )
        )
        least = metrics["confidence"]["least_confident_ids"] if metrics.get("confidence") else []
        return _report(
            metrics,
            notes,
            lambda sizes: least_confident(
                draw_sample(con, results, errors, spec=spec, label_sizes=sizes), results, least, spec.seed
            ),
            spec=spec,
            structured=structured,
            shard_stats=shard_stats,
            previous=previous,
            run_info=run_info,
            duplicates=duplicates,
            changes=changes,
            cache=cache,
        )
    finally:
        con.close()


def evaluate_stream(
    con,
    *,
    result_rows: int,
    spec: QASpec,
    labels: list[str] | None,
    structured: bool,
    shard_stats: list[dict] | None = None,
    previous: dict | None = None,
    run_info: dict[str, Any] | None = None,
    duplicates: dict[str, Any] | None = None,
    changes: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
    refs: References | None = None,
    compared: str | None = "label",
    task: str | None = None,
    batch_rows: int = 1 << 20,
    yardsticks: dict[str, dict] | None = None,
) -> QAReport:
    """``evaluate`` over DuckDB relations ``r`` and ``e`` of ``con`` (views over the merged files)
    that need not fit in memory: the counts from one DuckDB aggregate (``metrics_stream``), the
    latencies fetched batch by batch (``batch_rows``), the sample by DuckDB over the views (only
    the picked rows are read). ``result_rows``: the rows of ``r`` (from footers), for one buffer.
    ``refs``: the reference relations ``con`` has (``reference.attach_references``); ``task``: the job's
    (chat and generate rows never carry vectors: their scans are skipped)."""
    previous = of_this_job(previous, run_info, spec.previous_report_uri)
    notes: list[str] = []
    refs = refs or References()
    tally = ResultTally(capacity=result_rows)
    # the confidence per bucket from the latency fetch's scan (one scan fewer than an aggregate of its own)
    confidence = ConfidenceTally(spec.low_confidence, spec.least_confident)
    vectors = None if task in (None, "embed", "classify") else False
    tally.tally(con, batch_rows, vectors=vectors, also=("confidence", confidence.add))
    metrics = tally.metrics(labels=labels, structured=structured, notes=notes)
    repeats = consistency_counts(con, value=compared) if compared else None  # it counts the rows with a hash
    picked = repeats[1] if repeats is not None else []
    # The rows QA reads whole (the sample's and the least confident) go in one scan of the results that
    # DuckDB filters by id inside the scan. The narrow rows of the known ids (a golden set of up to
    # KNOWN_IN_SCAN ids) and the inconsistent prompts' examples ride along the sample's ranking scan,
    # which reads every id anyway (``sample.Ride``): the ids are read and hashed once, not twice.
    n_known = refs.known.get(refs.run_source, 0) if refs.run_source else 0
    known = 0 < n_known <= KNOWN_IN_SCAN
    if picked:  # a semi-join: DuckDB tests a constant IN list on every row (10M rows: 0.218 CPU-s, the column 0.061)
        con.execute("CREATE OR REPLACE TEMP TABLE qa_prompts AS SELECT unnest($h::BIGINT[]) AS h", {"h": picked})
    ride = None
    if known or picked:
        # known ids by their 64-bit hash (the ranking hashes every id anyway; a collision only carries a row more,
        # which labelled_view drops: it joins the known ids by value), with what the quality view reads; each
        # column carried is decoded for every row of the scan. The examples' rows are grouped by prompt and
        # answer in the scan (a group per distinct answer, however many rows repeat a prompt).
        ride = Ride(
            "hid IN (SELECT hash(id) FROM ref)" if known else "false",
            ("label", "valid", "confidence") if known else (),
            examples=(compared, picked, "qa_prompts") if picked and compared else None,
        )
    # with a ride, which reads the confidence anyway, the ranking scan also finds the least confident ids
    stats = answer_stats(
        con,
        low=spec.low_confidence,
        least=spec.least_confident,
        counted=(tally.ok, None),
        tallied=confidence,
        find_least=ride is None,
    )
    if ride is not None and stats["least"] is None:
        ride.least = (LEAST_SQL, stats["least_cut"], spec.least_confident)

    def least_ids_() -> list[str]:
        """The least confident ids: from the ranking scan, else (no ranking of ``r`` ran) a query of their own."""
        if stats["least"] is None:
            found = ride.least_ids if ride is not None else None
            stats["least"] = found if found is not None else least_ids(con, stats["least_cut"], spec.least_confident)
        return stats["least"]

    needs = {"r": RESULT_NEEDS, "e": ERROR_NEEDS}

    def rows(table: str, ids: list[str]) -> pa.Table:
        if not ids:
            return conform(con.sql(f"SELECT * FROM {table} LIMIT 0").to_arrow_table(), needs[table])
        if len(ids) > IN_LIST_MAX:  # a huge sample: a semi-join (a SQL text of that size would be slow to parse)
            con.register("qa_picked", pa.table({"id": pa.array(ids, pa.string())}))
            try:
                return conform(
                    con.sql(f"SELECT * FROM {table} WHERE id IN (SELECT id FROM qa_picked)").to_arrow_table(),
                    needs[table],
                )
            finally:
                con.unregister("qa_picked")
        # a constant IN list: DuckDB filters inside the scan (4x faster than the join at 100M rows)
        listed = ", ".join("'" + i.replace("'", "''") + "'" for i in ids) or "NULL"
        return conform(con.sql(f"SELECT * FROM {table} WHERE id IN ({listed})").to_arrow_table(), needs[table])

    fetched: dict[str, pa.Table] = {}

    def rows_once(table: str, ids: list[str]) -> pa.Table:
        """``rows``; for the results, the sample's rows with every other row QA reads whole (one scan)."""
        if table != "r":
            return rows(table, ids)
        fetched["r"] = rows("r", list(dict.fromkeys([*ids, *least_ids_()])))
        return fetched["r"]

    def draw(sizes):
        drawn = draw_sample_by(
            con,
            spec=spec,
            label_sizes=sizes,
            n_ok=tally.ok,
            n_err=tally.n_err,
            some_shard_ids=tally.counts["shard_id"][None] < tally.ok,
            counts=lambda _t, c: tally.value_counts(c),
            rows=rows_once,
            ride=ride,
        )
        if "r" not in fetched:
            rows_once("r", [])
        return least_confident(drawn, fetched["r"], least_ids_(), spec.seed)

    def measure() -> None:
        """After the draw, from the rows its ranking scan collected: quality, confidence, consistency."""
        if known and ride is not None:
            con.register("qa_ridden", ride.read(con))
        try:
            labelled_view(
                con, run_source=refs.run_source, ride_along=refs.ride_along, results="qa_ridden" if known else "r"
            )
            q = quality(con, labels=labels, previous=previous, known=refs.known, notes=notes, yardsticks=yardsticks)
            if q is not None:
                q["locations"] = dict(refs.locations)
        finally:
            if known:
                con.unregister("qa_ridden")
        consistency = None
        if repeats is not None and compared is not None:
            consistency = repeats[0]
            consistency["examples"] = ride.examples_found(con) if ride is not None else []  # no ride: none picked
        least = least_ids_()
        metrics.update(
            quality=q, confidence=confidence_metrics({**stats, "least": least}, notes=notes), consistency=consistency
        )

    return _report(
        metrics,
        notes,
        draw,
        spec=spec,
        structured=structured,
        shard_stats=shard_stats,
        previous=previous,
        run_info=run_info,
        duplicates=duplicates,
        changes=changes,
        cache=cache,
        measure=measure,
    )


def measure_answers(
    con,
    *,
    spec: QASpec,
    labels,
    previous,
    refs: References,
    compared: str | None,
    notes: list[str],
    yardsticks: dict[str, dict] | None = None,
) -> dict[str, Any]:
    """``quality`` (labelled rows), ``confidence`` and ``consistency`` from ``con``'s ``r``, ``e`` and references."""
    labelled_view(con, run_source=refs.run_source, ride_along=refs.ride_along)
    q = quality(con, labels=labels, previous=previous, known=refs.known, notes=notes, yardsticks=yardsticks)
    if q is not None:
        q["locations"] = dict(refs.locations)
    stats = answer_stats(con, low=spec.low_confidence, least=spec.least_confident)
    return {
        "quality": q,
        "confidence": confidence_metrics(stats, notes=notes),
        "consistency": consistency_metrics(con, value=compared, hashed=stats["hashed"]) if compared else None,
    }


def _report(
    metrics, notes, draw, *, spec, structured, shard_stats, previous, run_info, duplicates, changes, cache, measure=None
) -> QAReport:
    """Throughput, duplicates, drift, changes, cache, the sample (``draw(label_sizes)``), checks: the report.
    ``measure()``: metrics that need the rows the draw read (the streamed path's quality measures)."""
    metrics["throughput"] = throughput_metrics(shard_stats)
    if changes is not None:  # steps/merge/changes.py's summary (ChangesSummary.dump()); drives the churn_rate check
        metrics["changes"] = _jsonable(changes)
        notes.extend(f"changes: {n}" for n in changes.get("notes") or [])
    if cache is not None:  # the result cache's share of this run's rows (plan.cache)
        metrics["cache"] = _jsonable(cache)
    metrics["duplicates"] = duplicate_metrics(duplicates, notes)
    add_label_drift(metrics, previous, notes)
    ld = metrics["label_distribution"] or {}
    label_sizes = None
    if ld.get("labelled"):  # stratify by label, reusing the counts
        label_sizes = {k: n for k, n in ld["counts"].items() if n}
        if ld["unlabelled"]:
            label_sizes[None] = ld["unlabelled"]
    sample, sample_info = draw(label_sizes)
    if measure is not None:
        measure()
    metrics["sample"] = sample_info
    checks = run_checks(metrics, spec, structured=structured)
    return QAReport(
        status=overall_status(checks),
        checks=checks,
        metrics=metrics,
        notes=notes,
        run_info=_jsonable(run_info or {}),
        sample=sample,
    )


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))
