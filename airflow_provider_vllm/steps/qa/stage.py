"""The QA step of a run: merged outputs -> report files + a pass/warn/fail verdict."""

from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from airflow_provider_vllm.core import duck
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.plan import Plan, changes_spec, load_plan, pinned_changes
from airflow_provider_vllm.core.records import DagRunRef, TaskGroupRef
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import CheckedCopies, FileSystems, Storage, copies_folder
from airflow_provider_vllm.steps.cache.dedupe import qa_metrics as dedupe_metrics
from airflow_provider_vllm.steps.golden import attach_golden
from airflow_provider_vllm.steps.merge.changes import compared_column, compute_changes
from airflow_provider_vllm.steps.merge.merger import ERRORS, MERGED, RESULTS, checked_parts, read_merged
from airflow_provider_vllm.steps.qa.evaluate import evaluate, evaluate_stream
from airflow_provider_vllm.steps.qa.golden_set import golden_set_info
from airflow_provider_vllm.steps.qa.reference import attach_references, find_references
from airflow_provider_vllm.steps.qa.report import QAReport
from airflow_provider_vllm.steps.qa.store import load_pinned_report, load_previous_report, write_qa
from airflow_provider_vllm.steps.qa.yardstick import plan_identities

EXCERPT_CHARS = 300
# Above this many merged rows QA streams the files (bounded memory) instead of loading them as tables.
STREAM_ABOVE_ROWS = 2_000_000


def qa_run(
    spec: JobSpec,
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
    merged_mac: str | None = None,
    dag_run: DagRunRef | None = None,
    task_group: TaskGroupRef | None = None,
) -> tuple[QAReport, dict[str, str]]:
    """Compute QA over a merged run and write ``qa/report.{json,html}`` and ``qa/sample.parquet``.

    Returns the report and the written paths; the caller decides what a 'fail' does.
    ``filesystems``: how object stores are reached (``storage.FileSystems``; default fsspec).
    ``keyring``: the deployment's signing keys (default ``VLLM_BATCH_SIGNING_KEY``): QA measures only a run
    whose ``_MERGED.json`` this deployment's merge sealed, and only parts with the sealed sha256.
    ``merged_mac``: the seal the merge task reported (its XCom): CommitError for any other ``_MERGED.json`` (an
    earlier merge of this folder, put back, is sealed for it too).
    ``dag_run``: the Airflow DAG run this QA runs in (the operator's ``dag_id`` / ``run_id``), named in the sealed
    verdict: review and publish take no verdict of another run (None: named nowhere, and they refuse it).
    ``task_group``: the QA task's group and map index (its job in that run), named in the sealed verdict the same way.
    """
    with copies_folder("qa") as tmp:
        return _qa_run(spec, filesystems, keyring or Keyring.from_env(), tmp, merged_mac, dag_run, task_group)


def _qa_run(
    spec: JobSpec,
    filesystems: FileSystems | None,
    keyring: Keyring,
    tmp: str,
    merged_mac: str | None = None,
    dag_run: DagRunRef | None = None,
    task_group: TaskGroupRef | None = None,
) -> tuple[QAReport, dict[str, str]]:
    """``qa_run``; ``tmp``: a private folder for the local copies QA reads, each checked as it was copied."""
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    merged = read_merged(out, keyring)
    if merged_mac is not None and (merged.seal is None or merged.seal.mac != merged_mac):
        raise CommitError(
            f"{out.uri(MERGED)} is not the merge this run's merge task wrote (another merge of this folder, or an "
            "earlier one put back); run the merge task again, then QA"
        )
    if merged.spec_hash != spec.content_hash():  # thresholds other than the run's would seal a verdict under its hash
        raise CommitError(
            f"the merge at {spec.io.output_uri} was made for another spec (another qa section, or another job); QA "
            "measures a run with the spec it was planned and merged with"
        )
    copies = CheckedCopies(out, tmp)
    # what QA measures is what the sealed summary names, read from copies checked as they were made: a part
    # swapped in the bucket during QA (and put back after) is never what QA reads
    parts = {kind: checked_parts(out, kind, merged, copies) for kind in (RESULTS, ERRORS)}
    # the plan the run was merged under (its pins: the change set's and QA's baseline), not an earlier one of the folder
    plan = load_plan(spec, filesystems, keyring, merged=merged)
    spec = changes_spec(spec, plan)  # changes.previous_table: the run the plan pinned
    previous = None
    if spec.qa.previous_published:  # the report of the run this job published last, as the plan pinned it
        previous, baseline = load_pinned_report(plan.changes_from, spec.io.storage_options, filesystems)
        # the checks and notes name the report compared with
        spec = spec.model_copy(update={"qa": spec.qa.model_copy(update={"previous_report_uri": baseline})})
    elif spec.qa.previous_report_uri:
        previous = load_previous_report(spec.qa.previous_report_uri, spec.io.storage_options, filesystems, keyring)
    # what moved since the previous run (changes/ output), before the checks that read it
    # (this run's parts: the checked copies above, passed on, not copied a second time)
    change_set = (
        compute_changes(
            spec,
            filesystems,
            keyring=keyring,
            verified=(merged, parts),
            pinned=plan.changes_from if pinned_changes(spec) else None,
        )
        if spec.changes.previous_uri
        else None
    )
    changes = change_set.dump() if change_set is not None else None
    st = spec.sampling.structured
    args: dict[str, Any] = dict(
        spec=spec.qa,
        labels=list(st.choice) if st is not None and st.choice else None,
        structured=st is not None,
        shard_stats=[s.dump() for s in merged.shard_stats] if merged.shard_stats is not None else None,
        previous=previous,
        duplicates=merged.duplicates.dump(),
        changes=changes,
        cache=cache_metrics(plan),
        run_info={
            "job": spec.name,
            "model": spec.model.name,
            "output_uri": spec.io.output_uri,
            "config_hash": merged.config_hash,
            "rows": merged.rows,
            # io.input_table: the snapshot the run read (the report's header and report.json name it)
            **({"input_snapshot": f"{plan.table.identifier}@{plan.table.snapshot_id}"} if plan.table else {}),
        },
    )
    # a golden set: the bytes the plan pinned, read from checked copies (refused when changed since the plan)
    found = find_references(spec, plan, out, tmp, filesystems)
    if found is not None and found.pin is not None:  # the report names the labels that gated the run
        args["run_info"]["golden_set"] = golden_set_info(found.pin)
    # what each source scored against, as the plan pinned it: the report records it, and the change in accuracy
    # compares only reports that scored the same (steps/qa/yardstick.py)
    args["yardsticks"] = plan_identities(
        plan,
        found.pin if found is not None else None,
        found.label_column if found is not None and found.source == "input_column" else None,
        spec.io.input_name,
    )
    compared = None if spec.task == "embed" else compared_column(spec)
    con = duck.connect(out, *([found.root] if found is not None else []))
    try:
        # QA scans the same parts about ten times: their footers are parsed once (about 0.03 CPU-s per scan
        # of 200 parts otherwise). The cache lives with this connection; the parts were verified above.
        con.execute("SET parquet_metadata_cache = true")
        # Only what QA reads; vectors are replaced by a presence marker (10M x 384 floats would not fit).
        con.execute(
            f"CREATE TEMP VIEW r AS SELECT id, output, label, parsed_json, valid, "
            f"CASE WHEN embedding IS NULL THEN NULL ELSE []::FLOAT[] END AS embedding, scores, finish_reason, "
            f"prompt_tokens, completion_tokens, truncated, latency_ms, model, model_revision, shard_id, "
            f"confidence, prompt_hash "
            f"FROM read_parquet({duck.local_list(parts[RESULTS])})"
        )
        con.execute(
            f"CREATE TEMP VIEW e AS SELECT id, error_code, error_message, shard_id "
            f"FROM read_parquet({duck.local_list(parts[ERRORS])})"
        )
        refs = attach_references(con, found)
        golden_rows = attach_golden(con, out, plan, spec, merged, copies)  # the ride-along rows: gr, ge, gref
        if golden_rows is not None:
            refs.ride_along = True
            refs.known["ride_along"] = golden_rows
            refs.locations["ride_along"] = plan.golden.uri if plan.golden is not None else ""
        result_rows = merged.ok_rows  # as sealed, and as the checked manifests name them (checked_parts)
        if result_rows + merged.error_rows > STREAM_ABOVE_ROWS:
            report = evaluate_stream(con, result_rows=result_rows, refs=refs, compared=compared, task=spec.task, **args)
        else:
            report = evaluate(
                con.sql("SELECT * FROM r").to_arrow_table(),
                con.sql("SELECT * FROM e").to_arrow_table(),
                reference=con.sql("SELECT id, label FROM ref").to_arrow_table() if refs.run_source else None,
                reference_source=refs.run_source or "golden_set",
                ride_along=(
                    (
                        con.sql("SELECT * FROM gr").to_arrow_table(),
                        con.sql("SELECT * FROM ge").to_arrow_table(),
                        con.sql("SELECT id, label FROM gref").to_arrow_table(),
                    )
                    if refs.ride_along
                    else None
                ),
                compared=compared,
                **args,
            )
            if report.metrics.get("quality") is not None:
                report.metrics["quality"]["locations"] = dict(refs.locations)
        if refs.run_source:
            report.sample = _with_known_labels(con, report.sample)
    finally:
        con.close()
    if spec.qa.previous_published and previous is None:
        report.notes.append(
            "previous report: this job published nothing before this run (qa.previous_published): label drift and "
            "the change in accuracy are not judged"
        )
    elif spec.qa.previous_report_uri and previous is None:  # no run there at all (a first run, or a wrong folder)
        report.notes.append(
            f"previous report: no run at {spec.qa.previous_report_uri} (neither its QA files nor its merge): "
            "label drift and the change in accuracy are not judged"
        )
    report.sample = _with_input_excerpt(spec, report.sample, out, plan, tmp)
    if (dedupe := dedupe_metrics(plan, merged)) is not None:  # rows answered by a row of the same prompt
        report.metrics["dedupe"] = dedupe
    # the sealed qa/_QA.json last, naming the merge it measured and the change set it judged
    paths = write_qa(
        report, out, keyring=keyring, measured=merged, changes=change_set, dag_run=dag_run, task_group=task_group
    )
    return report, paths


def _with_known_labels(con, sample: pa.Table) -> pa.Table:
    """The sample with ``known_label``: each row's label from the reference (``ref`` on ``con``), if any."""
    if sample.num_rows == 0:
        return sample
    con.register("qa_sample_ids", pa.table({"id": sample.column("id").cast(pa.string())}))
    try:
        known = dict(con.execute("SELECT s.id, ref.label FROM qa_sample_ids s JOIN ref ON ref.id = s.id").fetchall())
    finally:
        con.unregister("qa_sample_ids")
    col = pa.array([known.get(i) for i in sample.column("id").to_pylist()], pa.string())
    if "known_label" in sample.column_names:
        sample = sample.drop_columns(["known_label"])
    return sample.append_column("known_label", col)


def cache_metrics(plan: Plan) -> dict[str, Any] | None:
    """The result cache's share of the plan (``plan.cache``: rows, hits, misses), when the plan has one."""
    c = getattr(plan, "cache", None)  # an optional Plan field (steps/cache/result_cache.py); older plans lack it
    rows, hits = getattr(c, "rows", None), getattr(c, "hits", None)
    if c is None or rows is None or hits is None:
        return None
    misses = getattr(c, "misses", None)
    return {
        "rows": int(rows),
        "hits": int(hits),
        "misses": int(misses if misses is not None else rows - hits),
        "hit_rate": hits / rows if rows else None,
    }


def _with_input_excerpt(spec: JobSpec, sample: pa.Table, out: Storage, plan: Plan, tmp: str) -> pa.Table:
    """Add the sampled rows' input text (first text column) for the report; Parquet inputs only. A materialized
    table's file is read from a local copy checked against the sealed plan (``Plan.input_storage``, into ``tmp``)."""
    if plan.format != "parquet" or sample.num_rows == 0 or not spec.prompt.texts:
        return sample
    root, _ = plan.input_storage(out, tmp)
    q = lambda c: '"' + c.replace('"', '""') + '"'  # noqa: E731
    ids = sample.column("id").to_pylist()
    wanted = pa.table({"id": pa.array(ids, pa.string())})
    # a constant IN list for a sample's few ids: DuckDB filters inside the scan (2.5x faster than the join at 100M)
    listed = ", ".join("'" + i.replace("'", "''") + "'" for i in ids) if len(ids) <= 10_000 else "SELECT id FROM wanted"
    con = duck.connect(root)
    try:
        con.register("wanted", wanted)
        rows = con.execute(
            f"SELECT CAST({q(spec.prompt.id_column)} AS VARCHAR), left({q(spec.prompt.texts[0])}, {EXCERPT_CHARS}) "
            f"FROM read_parquet({duck.file_list(root, [f.path for f in plan.files])}) "
            f"WHERE CAST({q(spec.prompt.id_column)} AS VARCHAR) IN ({listed})"
        ).fetchall()
    except duckdb.InvalidInputException:  # a text that is not UTF-8 (its row is an INVALID_ROW error): read as bytes
        rows = _excerpts_as_bytes(root, [f.path for f in plan.files], spec.prompt.id_column, spec.prompt.texts[0], ids)
    finally:
        con.close()
    found = {i: t or "" for i, t in rows}
    excerpts = pa.array([found.get(i) for i in sample.column("id").to_pylist()], pa.string())
    if "input_excerpt" in sample.column_names:
        sample = sample.drop_columns(["input_excerpt"])
    return sample.append_column("input_excerpt", excerpts)


def _excerpts_as_bytes(
    root: Storage, names: list[str], idc: str, text: str, ids: list[str]
) -> list[tuple[str, str | None]]:
    """(id, excerpt) of the rows of ``ids``, the text read as bytes and decoded with U+FFFD for what is not UTF-8
    (DuckDB refuses a whole file holding one such string): each row group's ids, and the text of those that hold
    a wanted id. The rare path: the whole id column is read."""
    wanted = pa.array(ids, pa.string())
    rows: list[tuple[str, str | None]] = []
    for name in names:
        with root.open(name) as f:
            pf = pq.ParquetFile(f)
            for g in range(pf.metadata.num_row_groups):  # the ids first; the text only of row groups that match
                id_col = pf.read_row_group(g, columns=[idc]).column(idc).cast(pa.string())
                keep = pc.is_in(id_col, value_set=wanted)
                if not pc.any(keep).as_py():
                    continue
                texts = pf.read_row_group(g, columns=[text]).column(text).cast(pa.large_binary()).filter(keep)
                for i, raw in zip(id_col.filter(keep).to_pylist(), texts.to_pylist()):
                    rows.append((i, None if raw is None else raw.decode("utf-8", "replace")[:EXCERPT_CHARS]))
    return rows


def qa_summary(report: QAReport, paths: dict[str, str], out_uri: str) -> dict[str, Any]:
    """The small dict pushed to XCom / printed: status, failing checks, where the report is."""
    d = report.to_dict()
    return {
        "status": report.status,
        "summary": report.summary_line(),
        "duplicates": (report.metrics.get("duplicates") or {}).get("ids"),
        "checks": [
            {
                k: c.get(k)
                for k in ("name", "value", "warn", "fail", "status", "direction", "interval", "detail")
                if k in c
            }
            for c in d["checks"]
        ],
        # where the known labels came from (source -> URI), for lineage: the golden set is a QA input
        "references": ((d["metrics"].get("quality") or {}).get("locations")) or {},
        "report_html": f"{out_uri.rstrip('/')}/{paths['report_html']}",
        "report_json": f"{out_uri.rstrip('/')}/{paths['report_json']}",
        # the reports' bytes as QA wrote them: the report page (plugins/report.py) serves nothing else
        "report_sha256": {"html": paths.get("report_html_sha256"), "json": paths.get("report_json_sha256")},
        # the seal of the qa/_QA.json this task wrote: publish takes no other verdict (an earlier one put back)
        "record_mac": paths.get("record_mac"),
    }
