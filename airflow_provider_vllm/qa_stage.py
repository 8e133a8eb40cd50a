"""The QA step of a run: merged outputs -> report files + a pass/warn/fail verdict."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from airflow_provider_vllm.merge import ERRORS, MERGED, RESULTS
from airflow_provider_vllm.planning import load_plan
from airflow_provider_vllm.qa import QAReport, load_report, run_qa, write_qa
from airflow_provider_vllm.spec import JobSpec
from airflow_provider_vllm.storage import Storage

EXCERPT_CHARS = 300


def qa_run(spec: JobSpec) -> tuple[QAReport, dict[str, str]]:
    """Compute QA over a merged run and write ``qa/report.{json,html}`` and ``qa/sample.parquet``.

    Returns the report and the written paths; the caller decides what a 'fail' does.
    """
    out = Storage(spec.io.output_uri, spec.io.storage_options)
    with out.open(RESULTS) as f:
        results = pq.read_table(f)
    with out.open(ERRORS) as f:
        errors = pq.read_table(f)
    merged = json.loads(out.read_bytes(MERGED))
    previous = None
    if spec.qa.previous_report_uri:
        previous = load_report(spec.qa.previous_report_uri, spec.io.storage_options)
    st = spec.sampling.structured
    report = run_qa(
        results,
        errors,
        spec=spec.qa,
        labels=list(st.choice) if st is not None and st.choice else None,
        structured=st is not None,
        shard_stats=merged.get("shard_stats"),
        previous=previous,
        run_info={"job": spec.name, "model": spec.model.name, "output_uri": spec.io.output_uri,
                  "config_hash": merged.get("config_hash"), "rows": merged.get("rows")},
    )
    report.sample = _with_input_excerpt(spec, report.sample)
    paths = write_qa(report, out)
    return report, paths


def _with_input_excerpt(spec: JobSpec, sample: pa.Table) -> pa.Table:
    """Add the sampled rows' input text (first text column) for the report; Parquet inputs only."""
    plan = load_plan(spec)
    if plan.format != "parquet" or sample.num_rows == 0 or not spec.prompt.texts:
        return sample
    root = Storage(plan.input_root, spec.io.storage_options)
    idc, col = spec.prompt.id_column, spec.prompt.texts[0]
    wanted = pa.array(sample.column("id").to_pylist(), pa.string())
    found: dict[str, str] = {}
    for f in plan.files:
        with root.open(f["path"]) as fh:
            t = pq.read_table(fh, columns=[idc, col])
        ids = t.column(idc).cast(pa.string())
        mask = pc.is_in(ids, value_set=wanted)
        for i, text in zip(pc.filter(ids, mask).to_pylist(), pc.filter(t.column(col), mask).to_pylist()):
            found[i] = (text or "")[:EXCERPT_CHARS]
    excerpts = pa.array([found.get(i) for i in sample.column("id").to_pylist()], pa.string())
    if "input_excerpt" in sample.column_names:
        sample = sample.drop_columns(["input_excerpt"])
    return sample.append_column("input_excerpt", excerpts)


def qa_summary(report: QAReport, paths: dict[str, str], out_uri: str) -> dict[str, Any]:
    """The small dict pushed to XCom / printed: status, failing checks, where the report is."""
    d = report.to_dict()
    return {
        "status": report.status,
        "summary": report.summary_line(),
        "checks": [{k: c.get(k) for k in ("name", "value", "warn", "fail", "status")} for c in d["checks"]],
        "report_html": f"{out_uri.rstrip('/')}/{paths['report_html']}",
        "report_json": f"{out_uri.rstrip('/')}/{paths['report_json']}",
    }
