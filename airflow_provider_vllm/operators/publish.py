"""The publish task: the final marker, written last, and an Asset event."""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm import __version__
from airflow_provider_vllm.core.allow_list import canonical_uri
from airflow_provider_vllm.core.errors import CommitError, SealError
from airflow_provider_vllm.core.part_names import check_inside, run_file
from airflow_provider_vllm.core.plan import changes_spec, load_plan, pinned_changes
from airflow_provider_vllm.core.records import SHA256_HEX, MergeSummary, QARecord, ReviewRecord
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.hooks.filesystems import task_filesystems
from airflow_provider_vllm.hooks.iceberg import tables as iceberg_tables
from airflow_provider_vllm.steps.cache.result_cache import vouch_published
from airflow_provider_vllm.steps.lineage import publish_lineage
from airflow_provider_vllm.steps.merge.changes import CHANGES, changes_to_publish
from airflow_provider_vllm.steps.merge.changes import SUMMARY as CHANGES_SUMMARY
from airflow_provider_vllm.steps.merge.merger import (
    ERRORS,
    MERGED,
    RESULTS,
    manifest_rel,
    read_merged,
    verified_parts,
)
from airflow_provider_vllm.steps.publish import SUCCESS, success_bytes
from airflow_provider_vllm.steps.qa.store import QA_RECORD, REVIEW_RECORD, read_qa, read_review
from airflow_provider_vllm.steps.tables.commit import commit_results
from airflow_provider_vllm.utils.deployment import allowed_prefixes, check_spec_allowed, signing_keyring
from airflow_provider_vllm.utils.job_spec import data_plane_errors, load_spec
from airflow_provider_vllm.utils.run_binding import check_this_job, read_sealed


def _run_date(context: Any) -> datetime.date:
    """The run's date: its logical date, else (runs without one) its run_after, else today (UTC)."""
    when = context.get("logical_date") or getattr(context.get("dag_run"), "run_after", None)
    return when.date() if when is not None else datetime.datetime.now(datetime.UTC).date()


def merged_results_sha(marker: dict[str, Any]) -> str | None:
    """The sha256 of the results manifest the marker names."""
    return marker.get("checksums", {}).get(manifest_rel(RESULTS))


QA_FILES = {
    "qa_report_json": "qa/report.json",
    "qa_report_html": "qa/report.html",
    "qa_sample": "qa/sample.parquet",
    "qa_record": QA_RECORD,
}
RERUN_QA = "run the QA task again (it writes and seals qa/_QA.json), then publish"
RERUN_MERGE = "clear the merge task (it writes and seals its files again), then QA and publish"
REREVIEW = "clear the review task (it decides again and seals its decision; a 'warn' asks again), then publish"
APPROVE = "Approve"  # the review's (Airflow's ApprovalOperator's) approving option


class VllmPublishOperator(BaseOperator):
    """Mark the run's output as current: write ``_SUCCESS.json`` under the output prefix.

    Runs after merge and QA (and any ``before_publish`` step); checks that ``_MERGED.json``
    belongs to this spec, that QA's sealed verdict (``qa/_QA.json``) is on this merge and did not
    fail, that the QA files are the ones it wrote, that merge's OpenAI batch files are the bytes it sealed, and
    that every named file exists, then writes the marker atomically, naming files, counts, checksums (manifests,
    OpenAI batch files, QA files, change set, extra files), the QA verdict and the Airflow run. For each Asset in
    ``outlets`` the Asset event carries the concrete output URI in its ``extra`` (the Asset names the dataset; the
    URI names this run's partition). With ``cache.uri``, once the marker is written it vouches for the run's cache
    entry (``result_cache.vouch_published``): only entries of published runs serve later runs. ``extra_files``
    (name -> path of a file under the prefix) are listed, and their sha256 as publish reads them is sealed into
    ``_SUCCESS.json`` (a folder or a path outside the prefix fails).

    The sealed verdict must have been made in this task's DAG run (it names its ``dag_id`` and ``run_id``), by the QA
    task of this task's group and map index (its job; ``vllm_batch_job`` puts QA, review and publish in one group):
    the folder of another run, or of another job of this run, named through the plan task's ``spec`` XCom, is
    refused, and so is a verdict of an earlier version that names no run or group (run QA again). The review
    decision likewise.

    ``qa_result``: the QA task's XCom (``qa.output``; ``vllm_batch_job`` passes it): the sealed verdict must be
    the one that task wrote, not an earlier genuine one put back in the folder. None: not checked, unless
    ``require_qa_result`` (set by ``vllm_batch_job``): then a missing XCom (a task marked success by hand) fails.
    Whether the run needs a review is the DAG file's choice, never an XCom's: with ``require_review_result``, or a
    ``review_result`` given in the DAG file (``vllm_batch_job`` sets both when it adds the review), publish decides
    from the review task's sealed decision, ``qa/_REVIEW.json``: made in this DAG run, on the very verdict publish
    checks (its seal and status), and an approval: a person chose *Approve*, or nobody was asked because that verdict
    is 'pass' or the review was off for it. A missing, rejected or stale decision publishes nothing (clear the review
    task). ``review_result`` (the review task's XCom) is then a cross-check: the verdict and the decision it names
    must be those records (a mismatch fails), and when the DAG file wires it, a result that renders to nothing fails
    too (the review task marked success after a rejection or a timeout, or killed before it returned: an earlier
    attempt's approval put back in the folder would otherwise decide; clear the review task).

    ``aws_conn_id`` / ``gcp_conn_id``: the Airflow Connections through which this task reaches
    ``s3://`` / ``gs://`` locations (DAG-file settings, never templated; None: ``[vllm_batch]
    aws_conn_id`` / ``gcp_conn_id``, else ``aws_default`` / ``google_cloud_default``). See
    ``airflow_provider_vllm.hooks.filesystems``.
    """

    template_fields: Sequence[str] = ("spec", "extra_files", "qa_result", "review_result")
    template_fields_renderers = {"spec": "json", "extra_files": "json", "qa_result": "json", "review_result": "json"}
    ui_color = "#f3e8fd"

    def __init__(
        self,
        *,
        spec: Any,
        extra_files: dict[str, str] | None = None,
        qa_result: Any = None,
        require_qa_result: bool = False,
        review_result: Any = None,
        require_review_result: bool = False,
        aws_conn_id: str | None = None,
        gcp_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self.spec = spec
        self.extra_files = extra_files
        self.qa_result = qa_result
        self.require_qa_result = require_qa_result
        self.review_result = review_result
        self.require_review_result = require_review_result
        # decided by the DAG file's arguments before rendering: a review result that renders to nothing (its XCom
        # deleted) must not turn the review's check off
        self._review_required = require_review_result or review_result is not None
        # the DAG file wired the review task's result: its XCom must then be there (a review marked success after a
        # rejection, or killed before it returned, pushed none) and name the sealed decision
        self._review_result_wired = review_result is not None

    def execute(self, context: Any) -> dict[str, Any]:
        spec = load_spec(self.spec, "publish")
        check_spec_allowed(spec, "publish")  # the spec came through XCom: the deployment's rules again
        out = Storage(spec.io.output_uri, spec.io.storage_options, task_filesystems(self.aws_conn_id, self.gcp_conn_id))
        keyring = signing_keyring()
        with data_plane_errors("publish"):
            marker = self._marker(spec, out, context, keyring)
            if spec.io.output_table is not None:  # before the marker, which names the snapshot
                marker["table"] = self._commit_table(spec, out, context, keyring, marker).event()
            body = success_bytes(marker, keyring, spec.io.output_uri)
            out.write_atomic(SUCCESS, body)
            # the run is published: its cache entry may now serve later runs (a publish killed before this line is
            # run again by the task's retry, which writes both again; until then the entry serves nothing)
            vouch_published(spec, self._plan, self._merged, keyring, out.filesystems)
        self.log.info(
            "published %s (%d rows: %d ok, %d errors; QA %s)",
            out.uri(SUCCESS),
            marker["rows"],
            marker["ok_rows"],
            marker["error_rows"],
            marker["qa"]["status"],
        )
        event = {
            "output_uri": spec.io.output_uri,
            "success_marker": out.uri(SUCCESS),
            "job": spec.name,
            "rows": marker["rows"],
            "ok_rows": marker["ok_rows"],
            "error_rows": marker["error_rows"],
            "qa_status": marker["qa"]["status"],
            "config_hash": marker["config_hash"],
            # the run's logical date: changes.previous_published takes the latest-dated publish before a run's own
            "logical_date": marker["airflow"]["logical_date"],
            # the consumer's check of the files, through Airflow's metadata database (steps/publish.py)
            "success_sha256": hashlib.sha256(body).hexdigest(),
            **({"table": marker["table"]} if "table" in marker else {}),
        }
        self._lineage = publish_lineage(spec, event, self._engine_versions)
        for outlet in self.outlets or []:
            context["outlet_events"][outlet].extra = event
        return event

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: results and errors in; the published output location out; the run facet naming what
        produced the answers (recorded by ``execute``)."""
        from airflow_provider_vllm.utils.openlineage_facets import operator_lineage

        return operator_lineage(getattr(self, "_lineage", None))

    def _commit_table(self, spec: Any, out: Storage, context: Any, keyring: Keyring, marker: dict[str, Any]) -> Any:
        """Commit the verified result parts to ``io.output_table`` as one snapshot (a no-op when this run's is
        there already); the catalog is the deployment's Connection (``hooks/iceberg.py``)."""
        target = spec.io.output_table
        plan = self._plan
        run_date = _run_date(context)
        commit = commit_results(
            target,
            iceberg_tables(allowed_prefixes()),
            out,
            self._result_parts,
            plan.result_schema(),
            run_id=canonical_uri(spec.io.output_uri, "io.output_uri", resolve=False),
            run_date=run_date,
            keyring=keyring,
            report_sha256=marker["checksums"].get(QA_FILES["qa_report_json"]),
            properties={
                "airflow-run": f"{marker['airflow']['dag_id']}/{marker['airflow']['run_id']}",
                "results-manifest-sha256": str(merged_results_sha(marker)),
                "spec-hash": marker["spec_hash"],
                "config-hash": marker["config_hash"],
                **({"input-snapshot": f"{plan.table.identifier}@{plan.table.snapshot_id}"} if plan.table else {}),
            },
        )
        self.log.info(
            "table %s: snapshot %d %s (%d file(s), %d rows; %s)",
            commit.identifier,
            commit.snapshot_id,
            "was already committed by this run" if commit.already else "committed",
            commit.files,
            commit.rows,
            target.mode if target.date_column is None else f"{target.mode} {target.date_column}={run_date}",
        )
        return commit

    def _marker(self, spec: Any, out: Storage, context: Any, keyring: Keyring) -> dict[str, Any]:
        try:
            merged = read_merged(out, keyring)
        except FileNotFoundError as e:
            raise AirflowFailException(f"publish: nothing to publish under {spec.io.output_uri}: {e}") from None
        except SealError as e:
            raise AirflowFailException(f"publish: {e}") from None
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            raise AirflowFailException(f"publish: {out.uri(MERGED)} is not a merge summary: {e}") from None
        if merged.spec_hash != spec.content_hash():
            raise AirflowFailException(f"publish: {out.uri(MERGED)} was merged for another spec")
        self._engine_versions = merged.engine_versions  # for the lineage facet
        self._merged = merged  # its cache entry is vouched for once the marker is written
        # the plan the run was merged under, not an earlier one of this folder put back (another pin), checked as QA
        # checks it, whether or not the change set or the table commit reads it: a merge summary that names no plan
        # (plan_mac) or another one is refused (fail closed)
        self._plan = load_plan(spec, out.filesystems, keyring, merged=merged)
        qa = self._qa_verdict(out, keyring, merged)
        check_this_job(qa, self, context, "publish", f"the sealed QA verdict {out.uri(QA_RECORD)}", RERUN_QA)
        self._check_this_runs_qa(out, qa)
        review = self._review_decision(out, keyring, qa, context) if self._review_required else None
        if qa.status == "fail":
            raise AirflowFailException(f"publish: QA failed ({qa.summary}); not publishing")
        # changes.previous_uri set: QA wrote changes/ (what moved since that run); a reader syncs from it
        if pinned_changes(spec):  # the run the plan pinned, if any
            spec = changes_spec(spec, self._plan)
        changes = {"changes": CHANGES, "changes_summary": CHANGES_SUMMARY} if spec.changes.previous_uri else {}
        own = {**merged.files, **QA_FILES, **changes}
        # an extra file must not take the name or the place of one publish vouches for itself (a consumer reading
        # files["qa_report_json"], or the checksum of qa/report.json, would get what the extra entry names instead)
        clash = sorted(
            f"{name!r}: {rel!r}" for name, rel in (self.extra_files or {}).items() if name in own or rel in own.values()
        )
        if clash:
            raise AirflowFailException(
                f"publish: extra_files {clash} name a file publish lists itself ({sorted(own)}); give the extra files "
                "other names and paths"
            )
        files = {**own, **(self.extra_files or {})}
        missing = sorted(p for p in files.values() if not out.exists(p))
        if missing:
            raise AirflowFailException(f"publish: files missing under {spec.io.output_uri}: {missing}")
        # the folders: every part their sealed manifests name, with exactly its size and sha256 (a streaming read)
        self._result_parts = verified_parts(out, RESULTS, merged)
        verified_parts(out, ERRORS, merged)
        # merge's other files (openai/*.jsonl): the sha256 of the bytes it wrote, sealed in _MERGED.json
        merged_sizes = merged.sizes or {}  # None: merged before sizes were recorded (read whole)
        for rel, sha in sorted(merged.checksums.items()):
            if (
                rel not in (manifest_rel(RESULTS), manifest_rel(ERRORS))
                and out.sha256(rel, merged_sizes.get(rel)) != sha
            ):
                raise AirflowFailException(
                    f"publish: {out.uri(rel)} is not the file the sealed {MERGED} names (size or sha256 differs); "
                    f"{RERUN_MERGE}"
                )
        # beside each checksum its size, where known: verify_published reads no more than that of each file
        checksums = {**merged.checksums, **{f.path: f.sha256 for f in qa.files.values()}}
        sizes = {**merged_sizes, **{f.path: f.bytes for f in qa.files.values()}}
        # extra files (written by a task before publish, e.g. an embedding table): vouched for as published now
        for rel in sorted(set((self.extra_files or {}).values())):
            try:
                check_inside(out, run_file(rel), "extra_files")
                sizes[rel] = out.size(rel)
                checksums[rel] = out.sha256(rel, sizes[rel])  # a file that grows meanwhile: refused below
            except (ValueError, CommitError, IsADirectoryError) as e:
                raise AirflowFailException(f"publish: extra_files: {rel!r} is not a file of the run ({e})") from None
            if not SHA256_HEX.fullmatch(checksums[rel]):
                raise AirflowFailException(
                    f"publish: extra_files: {out.uri(rel)} changed while publish read it ({checksums[rel]}); let the "
                    "task that writes it finish, then publish"
                )
        if changes:  # the change set QA made from this merge and judged: changes.parquet and its summary as read
            for rel, (size, sha) in changes_to_publish(out, keyring, merged, qa.changes_mac).items():
                checksums[rel] = sha
                if size is not None:
                    sizes[rel] = size
        dag_run = context.get("dag_run")
        logical_date = context.get("logical_date")
        return {
            "format": "vllm-batch-success",
            "version": 1,
            "job": spec.name,
            "output_uri": spec.io.output_uri,
            "rows": merged.rows,
            "ok_rows": merged.ok_rows,
            "error_rows": merged.error_rows,
            "files": files,
            "checksums": checksums,
            "sizes": sizes,
            "spec_hash": merged.spec_hash,
            "config_hash": merged.config_hash,
            "qa": {"status": qa.status, "summary": qa.summary},
            **({"review": _review_summary(review)} if review is not None else {}),
            "airflow": {
                "dag_id": getattr(dag_run, "dag_id", None),
                "run_id": getattr(dag_run, "run_id", None),
                "logical_date": logical_date.isoformat() if logical_date else None,
                "task_id": self.task_id,
            },
            "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {"airflow-provider-vllm": __version__},
        }

    def _check_this_runs_qa(self, out: Storage, qa: QARecord) -> None:
        """With ``qa_result`` (the QA task's XCom, through Airflow's metadata database): the sealed verdict in the
        folder must be the one that task wrote (its seal's mac). Sealed records of an earlier merge and QA of this
        same folder are genuine too: put back together, they would publish the earlier state instead. The QA task's
        result must say the sealed verdict's status too."""
        mac = qa.seal.mac if qa.seal is not None else None
        if self.qa_result is not None or self.require_qa_result:
            told = self.qa_result.get("record_mac") if isinstance(self.qa_result, Mapping) else None
            if not told:
                raise AirflowFailException(
                    "publish: the QA task's result names no sealed verdict (QA of an earlier version, or no QA "
                    f"result); {RERUN_QA}"
                )
            if mac != told:
                raise AirflowFailException(
                    f"publish: {out.uri(QA_RECORD)} is not the verdict this run's QA task wrote (another QA of this "
                    f"folder, or an earlier merge and QA put back); {RERUN_QA}"
                )
        if self.qa_result is not None or self.require_qa_result:
            said = self.qa_result.get("status") if isinstance(self.qa_result, Mapping) else None
            if said != qa.status:
                raise AirflowFailException(
                    f"publish: the QA task's result says {said!r}, but the sealed verdict {out.uri(QA_RECORD)} is "
                    f"{qa.status!r} (the result was changed after QA wrote it); {RERUN_QA}"
                )

    def _review_decision(self, out: Storage, keyring: Keyring, qa: QARecord, context: Any) -> ReviewRecord:
        """The review task's sealed decision (``qa/_REVIEW.json``) approving exactly ``qa`` in this DAG run, checked
        against the review task's XCom when given; AirflowFailException (no retry) naming what differs otherwise."""
        where = out.uri(REVIEW_RECORD)
        missing = "the review task did not decide, or decided before this version, which writes it"
        review = read_sealed("publish", lambda: read_review(out, keyring), "review decision", where, missing, REREVIEW)
        check_this_job(review, self, context, "publish", f"the sealed review decision {where}", REREVIEW)
        mac = qa.seal.mac if qa.seal is not None else None
        if review.qa_record_mac != mac:
            raise AirflowFailException(
                f"publish: the sealed review decision {where} is on another QA verdict (QA ran again after the "
                f"review), not on {out.uri(QA_RECORD)}; {REREVIEW}"
            )
        if review.qa_status != qa.status:  # sealed by the review, so only a review that misread the verdict
            raise AirflowFailException(
                f"publish: the sealed review decision {where} was made on a {review.qa_status!r} verdict, but "
                f"{out.uri(QA_RECORD)} is {qa.status!r}; {REREVIEW}"
            )
        if not review.approved:
            who = (review.answer.responded_by if review.answer is not None else None) or "a reviewer"
            raise AirflowFailException(f"publish: {who} rejected publication ({where}); not publishing")
        if review.asked:
            if review.answer is None or review.answer.chosen_options != [APPROVE]:
                raise AirflowFailException(f"publish: {where} records no {APPROVE!r} answer; {REREVIEW}")
        elif qa.status != "pass" and review.ask is not False:
            raise AirflowFailException(
                f"publish: {where} approves a {qa.status!r} verdict without asking anyone, with the review on; "
                f"{REREVIEW}"
            )
        self._cross_check_review_result(review, where)
        return review

    def _cross_check_review_result(self, review: ReviewRecord, where: str) -> None:
        """The review task's XCom must name the verdict and the decision the sealed record holds: when the DAG file
        wired it (``review_result``), a missing one fails too."""
        told = self.review_result
        if told is None:
            if self._review_result_wired:
                # no result: the review task did not return (a rejection or a timeout marked success, a review killed
                # after it sealed a decision); an earlier attempt's approval put back in the folder would decide
                raise AirflowFailException(
                    f"publish: the review task's result is missing, so nothing says its last attempt decided {where} "
                    f"(the task was marked success, or killed before it returned); {REREVIEW}"
                )
            return  # require_review_result alone: the record decides
        sealed = {
            "record_mac": review.qa_record_mac,
            "review_mac": review.seal.mac if review.seal is not None else None,
            "asked": review.asked,
        }
        differ = (
            sorted(k for k, v in sealed.items() if k in told and told[k] != v)
            if isinstance(told, Mapping)
            else ["the result is not a mapping"]
        )
        if differ:
            raise AirflowFailException(
                f"publish: the review task's result does not match its sealed decision {where} ({', '.join(differ)}: "
                f"the result was changed after the review wrote it, or the review ran again); {REREVIEW}"
            )

    def _qa_verdict(self, out: Storage, keyring: Keyring, merged: MergeSummary) -> QARecord:
        """QA's sealed verdict on this very merge (``qa/_QA.json``, with its files as QA wrote them), never what
        report.json says on its own; AirflowFailException naming the file otherwise."""
        where = out.uri(QA_RECORD)
        missing = "QA did not finish, or ran before QA verdicts were sealed"
        qa = read_sealed("publish", lambda: read_qa(out, keyring), "QA verdict", where, missing, RERUN_QA)
        if qa.spec_hash != merged.spec_hash:
            raise AirflowFailException(f"publish: {where} is QA's verdict on a run of another spec; {RERUN_QA}")
        if qa.merged_mac != getattr(merged.seal, "mac", None):
            raise AirflowFailException(
                f"publish: {where} is QA's verdict on an earlier merge of this folder, not on {out.uri(MERGED)}; "
                f"{RERUN_QA}"
            )
        return qa


def _review_summary(review: ReviewRecord) -> dict[str, Any]:
    """The review decision as ``_SUCCESS.json`` carries it (sealed with the marker): asked, by whom, when."""
    answer = review.answer
    return {
        "asked": review.asked,
        "by": answer.responded_by if answer is not None else None,
        "at": answer.responded_at if answer is not None else None,
        "review_mac": review.seal.mac if review.seal is not None else None,
    }
