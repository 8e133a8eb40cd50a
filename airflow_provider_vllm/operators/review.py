"""The human gate between QA and publish: an Airflow HITL approval when QA says 'warn'.

QA 'pass' -> approved without asking; 'warn' -> the task waits (Airflow 3.3: state
``awaiting_input``) until a person chooses *Approve* (publish runs) or *Reject* (this task
fails, so the run fails and nothing is published); 'fail' -> QA has already failed the run,
and this task fails too if it is ever reached.

The verdict decided on, and what the person is shown, are QA's sealed verdict (``qa/_QA.json``, checked with the
deployment's key, made in this DAG run by the QA task of this task's group and map index: its job) and the
``report.json`` it names, read from the run's output: never the QA task's XCom alone, which whoever may write XCom
(the REST API's XCom endpoints) can change after QA wrote it.

The decision is written, sealed, to ``qa/_REVIEW.json`` (``records.ReviewRecord``) before the task returns or fails:
which verdict, its status, whether a person was asked, their answer, and the DAG run. Publish decides from that
record, not from this task's XCom.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.providers.standard.exceptions import HITLRejectException, HITLTimeoutError
from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk.exceptions import AirflowFailException, TaskAwaitingInput  # Airflow 3.3+ (setup.cfg's floor)

from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.records import QARecord, ReviewAnswer, ReviewRecord
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.hooks.filesystems import task_filesystems
from airflow_provider_vllm.links.report import VllmQAReportLink, base_url, report_url
from airflow_provider_vllm.steps.qa.store import QA_RECORD, read_qa, read_verified, remove_review, write_review
from airflow_provider_vllm.utils import provenance
from airflow_provider_vllm.utils.deployment import check_spec_allowed, signing_keyring, variables_may_loosen_qa
from airflow_provider_vllm.utils.job_spec import data_plane_errors, load_spec
from airflow_provider_vllm.utils.run_binding import (
    check_this_job,
    read_sealed,
    this_dag_run,
    this_task_group,
)

SUBJECT = "Publish this batch run? QA needs review"
# the seal of the QA verdict a person is asked about, kept while the task waits in its resume arguments (the task
# instance's ``next_kwargs`` in the metadata database): on resume Airflow re-renders ``qa_result``, which may name a
# later QA by then, and a waiting task's own XComs may be rewritten through the REST API's XCom endpoints
REVIEWED = "reviewed_record_mac"
RERUN_QA = "run the QA task again (it writes and seals qa/_QA.json), then review"


def parse_flag(value: Any, name: str) -> bool:
    """``True``/``False`` or their usual spellings (a rendered template); anything else fails."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise AirflowFailException(f"review: {name}={value!r} is not a boolean (true/false)")


_MARKUP = re.compile(r"([\\`*\[\]<>|])")
_LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f]+")


def md_text(value: Any) -> str:
    """``value`` as literal Markdown text on one line: no emphasis, link, autolink, HTML, code span or cell break."""
    return _MARKUP.sub(r"\\\1", _LINE_BREAKS.sub(" ", str(value)))


def md_code(value: Any) -> str:
    """``value`` as one Markdown code span whatever it holds: the fence is longer than any run of backticks in it
    (CommonMark), so nothing in it closes the span and renders as Markdown."""
    text = _LINE_BREAKS.sub(" ", str(value))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


DETAIL_CHARS = 600  # of a check's detail shown in the request (the report has all of it)


def _number(value: Any) -> str:
    """A check's figure as shown: 4 significant digits for a float, 'n/a' for none, anything else as text."""
    if value is None:
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def review_body(qa_result: Mapping[str, Any], report_link: str | None = None) -> str:
    """The Markdown shown to the approver: the QA verdict, each check (with why it says what it says) and where the
    report is.

    Values that come from the run (the summary, the report's path under the output prefix a trigger may choose)
    are escaped or fenced: nothing in them renders as a link, HTML or formatting in the box that asks a person
    to approve."""
    lines = [f"**{md_text(qa_result.get('summary', 'QA result'))}**", ""]
    checks = [c for c in qa_result.get("checks") or [] if isinstance(c, Mapping) and c.get("status") != "skip"]
    if checks:
        lines += ["| check | value | warns | fails | status | why |", "|---|---|---|---|---|---|"]
        for c in checks:
            value = _number(c.get("value"))
            interval = c.get("interval")
            if (
                c.get("value") is not None
                and isinstance(interval, (list, tuple))
                and len(interval) == 2
                and None not in interval
            ):
                value = f"{value} (95% interval {_number(interval[0])} to {_number(interval[1])})"
            status = md_text(c.get("status"))
            mark = f"**{status}**" if c.get("status") in ("warn", "fail") else status
            # accuracy warns and fails *below* its thresholds, the other checks above theirs
            side = "below" if c.get("direction") == "below" else "above"
            warn, fail = (f"{side} {c.get(k)}" for k in ("warn", "fail"))
            # why it warns: e.g. accuracy_drop not compared because the golden set changed, naming both sets
            why = str(c.get("detail") or "")
            why = why if len(why) <= DETAIL_CHARS else why[:DETAIL_CHARS] + "…"
            cells = [md_text(x) for x in (c.get("name"), value, warn, fail)]
            lines.append(f"| {' | '.join(cells)} | {mark} | {md_text(why)} |")
        lines.append("")
    if report_link:
        lines.append(f"[Open the QA report]({report_link}) (charts and sampled rows).")
    lines.append(f"Report file: {md_code(qa_result.get('report_html'))}")
    lines += ["", "*Approve* publishes the results; *Reject* fails the run and publishes nothing."]
    return "\n".join(lines)


class VllmQAReviewOperator(ApprovalOperator):
    """Ask a person to approve publication when QA lands between its warn and fail thresholds.

    :param spec: the job spec as the plan task pushed it (templated; ``vllm_batch_job`` passes the plan task's
        ``spec`` XCom, as it does to publish): where the run's sealed QA verdict lies.
    :param qa_result: the QA task's XCom (``qa_summary``): its ``record_mac`` names the sealed verdict that task
        wrote; the verdict in the run's folder must be that one and say the same status (else the task fails
        without retry). The status decided on and the checks shown come from the sealed verdict and its report.
    :param qa_task_id: the QA task, for the report link shown to the approver.
    :param response_timeout: how long a 'warn' waits (Airflow's HITL timeout, enforced by the
        scheduler); without an answer the task fails and nothing is published. No default option
        is set on purpose: silence never approves.
    :param notifiers: Airflow notifiers called when the request is made.
    :param ask: whether a 'warn' waits for a person (templated); false: a 'warn' is logged and
        approved automatically. Off is looser than on: false from the DAG file (a literal, or a template over
        the deployment's ``conf``) is taken; from a template that reads a Variable only with
        ``[vllm_batch] qa_settings_from_variables = True``; from the trigger never (the task fails without
        retry, naming who turned it off, and nothing is published). The plan task checks the same when
        ``vllm_batch_job`` wires them.

    Each decision is sealed into ``qa/_REVIEW.json`` (an approval before the task returns, a rejection before it
    fails; an earlier one is removed when the task starts): publish decides from that record. Returns
    ``{"approved": True, "asked": False, "qa_status": "pass", "record_mac": ..., "review_mac": ...}`` without asking
    on a pass, else the HITL response (chosen option, who, when), ``record_mac`` and ``review_mac``. *Reject* raises
    an ``AirflowFailException`` naming who rejected (not retried). ``record_mac`` is the seal of the QA verdict that
    was approved (``qa_result``'s, as it was when the person was asked), ``review_mac`` the seal of the review record:
    publish cross-checks both against the sealed records.

    ``aws_conn_id`` / ``gcp_conn_id``: the Airflow Connections through which this task reads ``s3://`` / ``gs://``
    outputs (as publish's; None: ``[vllm_batch] aws_conn_id`` / ``gcp_conn_id``).
    """

    template_fields: Sequence[str] = (*ApprovalOperator.template_fields, "spec", "qa_result", "ask")
    template_fields_renderers = {"spec": "json", "qa_result": "json", "body": "markdown"}
    operator_extra_links = (VllmQAReportLink(),)
    ui_color = "#fff4d6"

    def __init__(
        self,
        *,
        spec: Any,
        qa_result: Any,
        qa_task_id: str | None = None,
        ask: bool | str = True,
        subject: str = SUBJECT,
        aws_conn_id: str | None = None,
        gcp_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("retries", 0)  # a retry would ask the person again
        super().__init__(subject=subject, fail_on_reject=True, **kwargs)
        self.spec = spec
        self.qa_result = qa_result
        self.qa_task_id = qa_task_id
        self.ask = ask
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self._raw_ask = ask  # the DAG file's value before rendering: who turned the review off (utils/provenance.py)

    def _output(self) -> Storage:
        """The run's output prefix, from the spec (rendered again on resume)."""
        spec = load_spec(self.spec, "review")
        check_spec_allowed(spec, "review")  # the spec came through XCom: the deployment's rules again
        return Storage(
            spec.io.output_uri, spec.io.storage_options, task_filesystems(self.aws_conn_id, self.gcp_conn_id)
        )

    def _decide(
        self,
        out: Storage,
        context: Any,
        qa_mac: str,
        qa_status: Any,
        *,
        ask: bool | None,
        answer: ReviewAnswer | None = None,
        approved: bool = True,
    ) -> str:
        """Seal the decision into ``qa/_REVIEW.json`` (publish decides from it); returns the record's seal's mac."""
        record = ReviewRecord(
            dag_run=this_dag_run(context),
            task_group=this_task_group(self, context),
            qa_record_mac=qa_mac,
            qa_status=qa_status,
            ask=ask,
            asked=answer is not None,
            approved=approved,
            decided_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            **({"answer": answer} if answer is not None else {}),
        )
        sealed = write_review(out, signing_keyring(), record)
        assert sealed.seal is not None
        return sealed.seal.mac

    def execute(self, context: Any) -> Any:
        qa = self.qa_result if isinstance(self.qa_result, Mapping) else {}
        out = self._output()
        with data_plane_errors("review"):
            record = self._sealed_verdict(out, qa)
            check_this_job(record, self, context, "review", f"the sealed QA verdict {out.uri(QA_RECORD)}", RERUN_QA)
            remove_review(out)  # this attempt decides afresh: no decision of an earlier one outlives it
            status, mac = record.status, record.seal.mac if record.seal is not None else ""
            if status == "pass":
                self.log.info("QA passed (%s): publishing without review", record.summary)
                sealed = self._decide(out, context, mac, status, ask=None)
                return {"approved": True, "asked": False, "qa_status": status, "record_mac": mac, "review_mac": sealed}
            if status != "warn":
                raise AirflowFailException(f"review: QA status is {status!r}, not 'pass' or 'warn'; not publishing")
            if not parse_flag(self.ask, "ask"):
                why = provenance.review_ask_violation(
                    self._raw_ask, False, provenance.template_env(self), variables_may_loosen_qa()
                )
                if why:
                    raise AirflowFailException(f"review: {why}; not publishing")
                self.log.warning("QA warned (%s); review is off: publishing without asking", record.summary)
                sealed = self._decide(out, context, mac, status, ask=False)
                return {"approved": True, "asked": False, "qa_status": status, "record_mac": mac, "review_mac": sealed}
            shown = self._sealed_report(out, record)
        ti = context["ti"]
        link = report_url(ti.dag_id, ti.run_id, self.qa_task_id, base_url=base_url()) if self.qa_task_id else None
        self.body = review_body(shown, link)
        self.log.info("QA warned (%s): waiting for a person to approve or reject publication", record.summary)
        # the verdict this person is shown, what an approval approves, goes with the wait itself (next_kwargs), not
        # in an XCom: whoever may write XCom could otherwise make an approval name another verdict
        try:
            return super().execute(context)
        except TaskAwaitingInput as wait:  # on Airflow 3.3+ a HITL task waits in awaiting_input, never defers
            raise TaskAwaitingInput(
                method_name=wait.method_name, kwargs={**(wait.kwargs or {}), REVIEWED: mac}, timeout=wait.timeout
            ) from None

    def _sealed_verdict(self, out: Storage, qa: Mapping[str, Any]) -> QARecord:
        """The run's sealed QA verdict, which must be the one the QA task wrote (``qa_result``'s ``record_mac``) and
        say the status that task's result says; AirflowFailException (no retry) naming the file otherwise."""
        where = out.uri(QA_RECORD)
        record = read_sealed("review", lambda: read_qa(out, signing_keyring()), "QA verdict", where, "", RERUN_QA)
        told = qa.get("record_mac")
        if not told or record.seal is None or record.seal.mac != told:
            raise AirflowFailException(
                f"review: {where} is not the verdict this run's QA task wrote"
                + ("" if told else " (its result names none: QA of an earlier version, or no QA result)")
                + f"; {RERUN_QA}"
            )
        if qa.get("status") != record.status:
            # the result in XCom was changed after QA wrote it: decide on nothing it says
            raise AirflowFailException(
                f"review: the QA task's result says {qa.get('status')!r}, but its sealed verdict {where} is "
                f"{record.status!r} (the result was changed after QA wrote it); {RERUN_QA}"
            )
        return record

    def _sealed_report(self, out: Storage, record: QARecord) -> dict[str, Any]:
        """What the person is shown: the summary and checks of the ``report.json`` the sealed verdict names (its
        bytes checked), and where the report is."""
        try:
            report = json.loads(read_verified(out, record.files["report_json"]))
        except (CommitError, FileNotFoundError, ValueError) as e:
            raise AirflowFailException(f"review: {e}; {RERUN_QA}") from None
        if not isinstance(report, Mapping) or not isinstance(report.get("checks"), list):
            raise AirflowFailException(f"review: {out.uri(record.files['report_json'].path)} is not a QA report")
        return {
            "summary": record.summary,
            "checks": [c for c in report["checks"] if isinstance(c, Mapping)],
            "report_html": out.uri(record.files["report_html"].path),
        }

    def execute_complete(self, context: Any, event: dict[str, Any], reviewed_record_mac: str | None = None) -> Any:
        """The person's answer; ``reviewed_record_mac``: the seal of the verdict they were shown (``execute`` left it
        in the resume arguments)."""
        try:
            result = super().execute_complete(context, event)
        except HITLRejectException:
            who = (event.get("responded_by_user") or {}).get("name") or "a reviewer"
            if isinstance(reviewed_record_mac, str) and reviewed_record_mac:  # the rejection, on record for an audit
                with data_plane_errors("review"):
                    self._decide(
                        self._output(),
                        context,
                        reviewed_record_mac,
                        "warn",
                        ask=True,
                        answer=_answer(event),
                        approved=False,
                    )
            raise AirflowFailException(f"review: publication rejected by {who}; nothing is published") from None
        except HITLTimeoutError:
            raise AirflowFailException(
                f"review: no decision within {self.response_timeout}; nothing is published "
                "(clear this task to ask again)"
            ) from None
        if not isinstance(reviewed_record_mac, str) or not reviewed_record_mac:
            # a request made by a version that kept the verdict in XCom: no approval names a verdict it cannot vouch for
            raise AirflowFailException(
                "review: the approval names no QA verdict the person was shown (a request made before an upgrade); "
                "clear this task to ask again"
            )
        with data_plane_errors("review"):
            # only a 'warn' asks: the verdict the person was shown said 'warn'
            sealed = self._decide(self._output(), context, reviewed_record_mac, "warn", ask=True, answer=_answer(event))
        self.log.info("publication approved by %s", (result.get("responded_by_user") or {}).get("name"))
        return {**result, "record_mac": reviewed_record_mac, "review_mac": sealed}


def _answer(event: Mapping[str, Any]) -> ReviewAnswer:
    """A person's answer as Airflow's HITL event gives it (chosen options, who, when)."""
    who = event.get("responded_by_user") or {}
    when = event.get("responded_at")
    return ReviewAnswer(
        chosen_options=[str(o) for o in event.get("chosen_options") or []],
        responded_by=None if who.get("name") is None else str(who["name"]),
        responded_by_id=None if who.get("id") is None else str(who["id"]),
        responded_at=when.isoformat() if isinstance(when, datetime.datetime) else None if when is None else str(when),
    )
