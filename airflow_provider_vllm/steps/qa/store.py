"""Storing QA reports: ``write_qa`` writes ``qa/sample.parquet``, ``qa/report.html``, ``qa/report.json`` and, last,
the sealed ``qa/_QA.json`` (``records.QARecord``: the verdict and each file's size and sha256).

``write_review`` / ``read_review``: the review task's sealed decision on that verdict, ``qa/_REVIEW.json``
(``records.ReviewRecord``), which publish decides from.

``read_qa`` is how publish learns QA's verdict: the sealed record, and the files as it names them, never
``report.json`` on its own (anyone who may write the output prefix can rewrite that). ``load_previous_report``
reads a previous run's ``report.json`` for the drift checks only when that run's sealed record vouches for its
bytes; otherwise it says why it was not used (``report.refused_previous``), and the checks that needed it warn.
``load_pinned_report`` reads the report of the run the plan pinned as the one this job published last
(``qa.previous_published``): its bytes must be the ones that run's sealed ``_SUCCESS.json`` names.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.errors import CommitError, SealError
from airflow_provider_vllm.core.part_names import check_inside
from airflow_provider_vllm.core.plan import ChangesFrom
from airflow_provider_vllm.core.records import (
    ChangesSummary,
    DagRunRef,
    MergeSummary,
    QAFile,
    QARecord,
    ReviewRecord,
    TaskGroupRef,
)
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import FileSystems, Storage, parquet_bytes
from airflow_provider_vllm.steps.merge.merger import MERGED, REPORT_JSON, keep_published, published_state
from airflow_provider_vllm.steps.qa.html import render_report_html
from airflow_provider_vllm.steps.qa.report import QAReport, refused_previous

QA_RECORD = "qa/_QA.json"
REVIEW_RECORD = "qa/_REVIEW.json"
RERUN = "run the QA task of that run again (it writes the sealed record)"
_RESTORE = (
    "restore the published run's files (verify_published names what differs), or publish that run again and run this "
    "one from an empty output prefix (this run's plan keeps the pin it made)"
)

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


def write_qa(
    report: QAReport,
    storage: Storage,
    prefix: str = "qa",
    *,
    keyring: Keyring | None = None,
    measured: MergeSummary | None = None,
    changes: ChangesSummary | None = None,
    dag_run: DagRunRef | None = None,
    task_group: TaskGroupRef | None = None,
) -> dict[str, str]:
    """Write ``{prefix}/sample.parquet``, ``report.html``, ``report.json`` and, given ``keyring`` and ``measured``
    (the sealed merge summary QA measured), last the sealed ``{prefix}/_QA.json``; each atomically. ``changes``: the
    sealed change set QA wrote and judged (``changes.previous_uri``), named in the record by its seal. ``dag_run``:
    the Airflow DAG run QA runs in, named in the record (review and publish take no other run's verdict);
    ``task_group``: the QA task's group and map index in that run (its job), named there too.

    Returns the relative paths under ``storage``: keys ``report_json``, ``report_html``, ``sample``; and the sha256
    of the two reports as written, keys ``report_json_sha256`` and ``report_html_sha256`` (the QA task's XCom
    carries them: the report page serves a report only when its bytes are these).
    """
    prefix = prefix.strip("/")
    paths = {
        "sample": posixpath.join(prefix, "sample.parquet") if prefix else "sample.parquet",
        "report_html": posixpath.join(prefix, "report.html") if prefix else "report.html",
        "report_json": posixpath.join(prefix, "report.json") if prefix else "report.json",
    }
    record_path = posixpath.join(prefix, "_QA.json")
    d = report.to_dict()
    sample = report.sample
    cols = [c for c in SAMPLE_HTML_COLUMNS if c in sample.column_names]
    rows = sample.select(cols).to_pylist() if cols else []
    for row in rows:  # bound the page size: outputs can be long
        for c in ("output", "input_excerpt", "parsed_json", "error_message"):
            if isinstance(row.get(c), str) and len(row[c]) > 1000:
                row[c] = row[c][:1000]
    bodies = {
        "sample": parquet_bytes(sample, {"qa_seed": str(d["metrics"].get("sample", {}).get("seed", ""))}),
        "report_html": render_report_html(d, rows).encode("utf-8"),
        "report_json": dumps_report(d).encode("utf-8"),
    }
    written = {kind: (len(body), hashlib.sha256(body).hexdigest()) for kind, body in bodies.items()}
    if keyring is not None and measured is not None:
        # a published run keeps the QA files its publish vouched for: other bytes fail here, before anything is
        # written (the same bytes again, e.g. a cleared DAG run, go on and seal a record of the current merge)
        published = published_state(storage, keyring)
        for kind, (_, sha) in written.items():
            keep_published(storage, published, paths[kind], sha, "QA")
        storage.remove(record_path)  # a rerun stopped half way leaves no record of files it replaced: publish refuses
    for kind, body in bodies.items():
        storage.write_atomic(paths[kind], body)
    digests = {f"{kind}_sha256": written[kind][1] for kind in ("report_html", "report_json")}
    if keyring is not None and measured is not None:
        files = {k: QAFile(path=paths[k], bytes=n, sha256=sha) for k, (n, sha) in written.items()}
        digests["record_mac"] = _write_record(
            storage, record_path, report, files, keyring, measured, changes, dag_run, task_group
        )
    return {**paths, **digests}


def _write_record(
    storage: Storage,
    rel: str,
    report: QAReport,
    files: dict[str, QAFile],
    keyring: Keyring,
    measured: MergeSummary,
    changes: ChangesSummary | None = None,
    dag_run: DagRunRef | None = None,
    task_group: TaskGroupRef | None = None,
) -> str:
    """The sealed ``QARecord`` of what QA concluded about the merge it measured and the change set it judged, and
    the files it wrote (their size and sha256 as written, not as the bucket holds them later); returns its seal's
    mac."""
    merged_seal = seals.seal_of(measured)
    if merged_seal is None:  # QA measures only a sealed merge (read_merged)
        raise SealError(f"{storage.uri(MERGED)}: QA measured a merge summary without a seal; nothing to vouch for")
    changes_seal = seals.seal_of(changes) if changes is not None else None
    if changes is not None and changes_seal is None:  # compute_changes seals what it writes
        raise SealError("QA judged a change set without a seal; nothing to vouch for")
    record = QARecord(
        status=report.status,
        summary=report.summary_line(),
        spec_hash=measured.spec_hash,
        config_hash=measured.config_hash,
        merged_mac=merged_seal.mac,
        rows=measured.rows,
        files=files,
        **({"changes_mac": changes_seal.mac} if changes_seal is not None else {}),
        **({"dag_run": dag_run} if dag_run is not None else {}),
        **({"task_group": task_group} if task_group is not None else {}),
    )
    record = seals.seal_record(keyring, seals.QA, seals.scope_of(storage.uri()), record)
    storage.write_atomic(rel, seals.record_bytes(record))
    assert record.seal is not None
    return record.seal.mac


def dumps_report(d: dict[str, Any]) -> str:
    """A report dict as stored in report.json (indented, UTF-8 text, no NaN)."""
    return json.dumps(d, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def read_qa(out: Storage, keyring: Keyring, *, files: bool = True) -> QARecord:
    """``qa/_QA.json`` of the run under ``out``: validated and its seal checked (SealError: not written by this
    deployment's QA for this run); with ``files``, each file it names must have exactly its size and sha256
    (CommitError naming the file). FileNotFoundError when there is no record."""
    record = QARecord.model_validate_json(out.read_bytes(QA_RECORD))
    seals.verify_record(keyring, seals.QA, seals.scope_of(out.uri()), record, out.uri(QA_RECORD))
    for f in record.files.values() if files else ():
        _check_named(out, f)
        if out.sha256(f.path, f.bytes) != f.sha256:  # not read past its size
            raise _not_named(out, f)
    return record


def write_review(out: Storage, keyring: Keyring, record: ReviewRecord) -> ReviewRecord:
    """Seal ``record`` for the run under ``out`` (domain ``review``) and write it to ``qa/_REVIEW.json``
    atomically; returns the sealed record."""
    record = seals.seal_record(keyring, seals.REVIEW, seals.scope_of(out.uri()), record)
    out.write_atomic(REVIEW_RECORD, seals.record_bytes(record))
    return record


def remove_review(out: Storage) -> None:
    """Remove the run's ``qa/_REVIEW.json`` (a review starting again: no earlier decision outlives it)."""
    out.remove(REVIEW_RECORD)


def read_review(out: Storage, keyring: Keyring) -> ReviewRecord:
    """``qa/_REVIEW.json`` of the run under ``out``, validated and its seal checked (SealError: not written by this
    deployment's review for this run's folder; ValueError: not a review record). FileNotFoundError when absent."""
    record = ReviewRecord.model_validate_json(out.read_bytes(REVIEW_RECORD))
    seals.verify_record(keyring, seals.REVIEW, seals.scope_of(out.uri()), record, out.uri(REVIEW_RECORD))
    return record


def read_verified(out: Storage, f: QAFile) -> bytes:
    """The bytes of a file a verified QA record names, read once and checked (size, sha256): CommitError otherwise."""
    _check_named(out, f)
    try:
        raw = out.read_bytes(f.path, limit=f.bytes)
    except CommitError:  # larger than the record says: not read
        raise _not_named(out, f) from None
    if len(raw) != f.bytes or hashlib.sha256(raw).hexdigest() != f.sha256:
        raise _not_named(out, f)
    return raw


def _check_named(out: Storage, f: QAFile) -> None:
    check_inside(out, f.path, out.uri(QA_RECORD))
    if not out.exists(f.path):
        raise CommitError(f"{out.uri(f.path)} is missing; the sealed {QA_RECORD} names it")


def _not_named(out: Storage, f: QAFile) -> CommitError:
    return CommitError(
        f"{out.uri(f.path)} is not the file the sealed {QA_RECORD} names (size or sha256 differs): "
        "it was changed after QA wrote it"
    )


def load_previous_report(
    uri: str | None,
    storage_options: dict[str, Any] | None = None,
    filesystems: FileSystems | None = None,
    keyring: Keyring | None = None,
) -> dict[str, Any] | None:
    """The previous run's report.json (``QASpec.previous_report_uri``) as a dict, when that run's sealed
    ``qa/_QA.json`` vouches for its bytes; None when there is no run there (neither its QA files nor its
    ``_MERGED.json``); otherwise ``report.refused_previous(uri, why)``: not used, and the checks that need it warn.

    The run is the URI without its trailing ``qa/report.json``: its record is sealed for that folder.
    """
    if not uri:
        return None
    base = uri.rstrip("/")
    if base != REPORT_JSON and not base.endswith("/" + REPORT_JSON):
        return refused_previous(uri, f"it does not end in /{REPORT_JSON}, so no run's sealed QA record vouches for it")
    prev = Storage(base[: -len(REPORT_JSON)] or ".", storage_options or {}, filesystems)
    if not prev.exists(QA_RECORD):
        if prev.exists(REPORT_JSON) or prev.exists(MERGED):
            return refused_previous(
                uri,
                f"its run has no sealed QA record {prev.uri(QA_RECORD)} (written before seals, or removed); {RERUN}",
            )
        return None
    try:
        record = read_qa(prev, keyring or Keyring.from_env(), files=False)
        raw = read_verified(prev, record.files["report_json"])
    except CommitError as e:  # SealError included
        return refused_previous(uri, str(e))
    except ValueError as e:  # pydantic's ValidationError: not a record this provider wrote
        return refused_previous(uri, f"{prev.uri(QA_RECORD)} is not a QA record ({str(e).splitlines()[0]})")
    except FileNotFoundError as e:  # removed while it was read
        return refused_previous(uri, f"a file of its sealed QA record is missing ({e})")
    return json.loads(raw)  # the bytes QA wrote (dumps_report): a JSON object


def load_pinned_report(
    pin: ChangesFrom | None,
    storage_options: dict[str, Any] | None = None,
    filesystems: FileSystems | None = None,
) -> tuple[dict[str, Any] | None, str | None]:
    """``qa.previous_published``: (the report, its URI) of the run the plan pinned through
    ``changes.previous_published`` or ``changes.previous_table``, the run this job published last; (None, None)
    when nothing was published.

    The plan pinned the sha256 of ``qa/report.json`` that the run's sealed ``_SUCCESS.json`` (through the Asset
    event, not the bucket) or ``_PUBLISHING.json`` (whose run, table and merge the table's snapshot names) names;
    the bytes read must have it, or CommitError (fail closed: a published baseline that was changed since is no
    baseline, and a silent fallback would pass a run against nothing). A record that names no report
    (``report_sha256`` None): ``report.refused_previous``, so the checks warn.
    """
    if pin is None:
        raise CommitError(
            "qa.previous_published: the plan pinned no published run (changes.previous_published or "
            "changes.previous_table); plan the run again"
        )
    if pin.previous_uri is None:
        return None, None
    prev = Storage(pin.previous_uri, storage_options or {}, filesystems)
    uri = prev.uri(REPORT_JSON)
    record = "_SUCCESS.json" if pin.source == "published" else "_PUBLISHING.json"
    if pin.report_sha256 is None:
        return refused_previous(uri, f"{pin.describe()}: that run's {record} names no {REPORT_JSON}"), uri
    try:
        raw = prev.read_bytes(REPORT_JSON)
    except FileNotFoundError:
        raise CommitError(
            f"qa.previous_published: {uri} is missing; {pin.describe()} published it: {_RESTORE}"
        ) from None
    if hashlib.sha256(raw).hexdigest() != pin.report_sha256:
        raise CommitError(
            f"qa.previous_published: {uri} is not the report {pin.describe()} published (its sha256 differs from "
            f"the one that run's sealed {record} names): {_RESTORE}"
        )
    try:
        doc = json.loads(raw)
    except ValueError as e:  # published, so QA wrote it: only a forged marker could name other bytes
        raise CommitError(f"qa.previous_published: {uri} is not a JSON report ({e})") from None
    if not isinstance(doc, dict):
        raise CommitError(f"qa.previous_published: {uri} is not a JSON object")
    return doc, uri
