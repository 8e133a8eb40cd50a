"""Storing QA reports: ``write_qa`` writes ``qa/sample.parquet``, ``qa/report.html`` and, last,
``qa/report.json``; ``load_report`` reads a stored report.json back (e.g. the previous run's)."""

from __future__ import annotations

import json
import posixpath
from typing import Any

from airflow_provider_vllm.core.errors import VllmBatchError
from airflow_provider_vllm.core.storage import FileSystems, Storage
from airflow_provider_vllm.steps.qa.html import render_report_html
from airflow_provider_vllm.steps.qa.report import QAReport

SAMPLE_HTML_COLUMNS = (
    "id",
    "status",
    "input_excerpt",
    "output",
    "label",
    "parsed_json",
    "valid",
    "finish_reason",
    "error_code",
    "error_message",
    "shard_id",
    "qa_stratum",
    "confidence",
    "known_label",
)


def write_qa(report: QAReport, storage: Storage, prefix: str = "qa") -> dict[str, str]:
    """Write ``{prefix}/sample.parquet``, ``report.html`` and, last, ``report.json`` atomically.

    Returns the relative paths under ``storage``: keys ``report_json``, ``report_html``, ``sample``.
    """
    prefix = prefix.strip("/")
    paths = {
        "sample": posixpath.join(prefix, "sample.parquet") if prefix else "sample.parquet",
        "report_html": posixpath.join(prefix, "report.html") if prefix else "report.html",
        "report_json": posixpath.join(prefix, "report.json") if prefix else "report.json",
    }
    d = report.to_dict()
    sample = report.sample
    storage.write_parquet_atomic(
        paths["sample"], sample, metadata={"qa_seed": str(d["metrics"].get("sample", {}).get("seed", ""))}
    )
    cols = [c for c in SAMPLE_HTML_COLUMNS if c in sample.column_names]
    rows = sample.select(cols).to_pylist() if cols else []
    for row in rows:  # bound the page size: outputs can be long
        for c in ("output", "input_excerpt", "parsed_json", "error_message"):
            if isinstance(row.get(c), str) and len(row[c]) > 1000:
                row[c] = row[c][:1000]
    storage.write_atomic(paths["report_html"], render_report_html(d, rows).encode("utf-8"))
    storage.write_atomic(paths["report_json"], dumps_report(d).encode("utf-8"))
    return paths


def dumps_report(d: dict[str, Any]) -> str:
    """A report dict as stored in report.json (indented, UTF-8 text, no NaN)."""
    return json.dumps(d, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def load_report(
    uri: str | None, storage_options: dict[str, Any] | None = None, filesystems: FileSystems | None = None
) -> dict[str, Any] | None:
    """A stored report.json (e.g. ``QASpec.previous_report_uri``) as a dict; None if absent."""
    if not uri:
        return None
    parent, name = posixpath.split(uri.rstrip("/"))
    if parent.endswith(":/"):  # 'memory://report.json' and the like
        parent += "/"
    st = Storage(parent or ".", storage_options or {}, filesystems)
    try:
        raw = st.read_bytes(name)
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise VllmBatchError(f"cannot parse QA report {uri}: {e}") from None
    if not isinstance(d, dict):
        raise VllmBatchError(f"QA report {uri} is not a JSON object")
    return d
