"""The publish task: ``execute()`` over a merged and QA-checked run (shards committed in this process with the
fake engine), a minimal context, no Airflow process and no metadata DB."""

from __future__ import annotations

import hashlib
import json

import pytest
from airflow.sdk import Asset
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.errors import CommitError
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.operators.merge import VllmMergeOperator
from airflow_provider_vllm.operators.publish import VllmPublishOperator
from airflow_provider_vllm.operators.qa import VllmQAFailed, VllmQAOperator
from airflow_provider_vllm.steps.publish import verify_published
from tests.support.data import plan_xcom, shard_task
from tests.support.ledger import record_malicious
from tests.support.task_context import committed_job, context, rerun_a_shard


def checked_job(tmp_path, factory, **over):
    spec, _ = committed_job(tmp_path, factory, n=60, **over)
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    return spec


def test_construction_templates_the_spec_and_the_extra_files():
    assert tuple(VllmPublishOperator(task_id="publish", spec={}).template_fields) == (
        "spec",
        "extra_files",
        "qa_result",
        "review_result",
    )


def test_publish_writes_the_sealed_marker_last_and_fills_the_asset_event(tmp_path, fake_engine_factory):
    spec = checked_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    (out / "extra.txt").write_text("a file the DAG adds")
    asset = Asset(uri="x-vllm-batch://test")
    ctx = context()
    op = VllmPublishOperator(task_id="publish", spec=spec, outlets=[asset], extra_files={"notes": "extra.txt"})
    event = op.execute(ctx)
    body = (out / "_SUCCESS.json").read_bytes()
    assert event["success_sha256"] == hashlib.sha256(body).hexdigest() and event["rows"] == 60
    assert ctx["outlet_events"][asset].extra == event
    marker = json.loads(body)
    assert marker["files"]["notes"] == "extra.txt" and marker["airflow"] == {
        "dag_id": "d",
        "run_id": "r1",
        "logical_date": None,
        "task_id": "publish",
    }
    newest = max((p for p in out.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == "_SUCCESS.json"
    # a consumer checks the run through the event alone (no key): the marker and every part it names
    assert verify_published(str(out), success_sha256=event["success_sha256"])["rows"] == 60


def test_nothing_merged_is_nothing_to_publish(tmp_path, fake_engine_factory):
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=20)
    with pytest.raises(AirflowFailException, match="nothing to publish"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())


def test_a_missing_extra_file_or_a_changed_part_publishes_nothing(tmp_path, fake_engine_factory):
    spec = checked_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    with pytest.raises(AirflowFailException, match=r"files missing under .*\['absent.txt'\]"):
        VllmPublishOperator(task_id="publish", spec=spec, extra_files={"x": "absent.txt"}).execute(context())
    part = next((out / "results").glob("part-*.parquet"))
    data = bytearray(part.read_bytes())
    data[-20] ^= 0xFF  # same size, other bytes
    part.unlink()  # (a hard link to the committed chunk: replace it, leave the chunk alone)
    part.write_bytes(bytes(data))
    with pytest.raises(
        AirflowFailException, match=r"publish: CommitError: .*part-.* does not have the size and sha256"
    ):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert not (out / "_SUCCESS.json").exists()


def test_a_failed_qa_or_another_specs_merge_publishes_nothing(tmp_path, fake_engine_factory):
    spec, _ = committed_job(tmp_path, fake_engine_factory, empty=(3, 4), qa={"fail_error_rate": 0.01})
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    with pytest.raises(VllmQAFailed):
        VllmQAOperator(task_id="qa", spec=spec).execute(context())
    with pytest.raises(AirflowFailException, match="QA failed"):  # the verdict QA sealed
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    other = {**spec, "sampling": {**spec["sampling"], "max_tokens": spec["sampling"]["max_tokens"] + 1}}
    with pytest.raises(AirflowFailException, match="merged for another spec"):
        VllmPublishOperator(task_id="publish", spec=other).execute(context())
    assert not (tmp_path / "out" / "_SUCCESS.json").exists()


def flipped(raw: bytes) -> bytes:
    """The same size, one bit other."""
    return raw[:100] + bytes([raw[100] ^ 1]) + raw[101:]


def warned_job(tmp_path, factory):
    """A run whose QA says 'warn' (one empty input: error_rate above warn 0), its QA files sealed by QA."""
    return checked_job(tmp_path, factory, empty=(3,), qa={"warn_error_rate": 0.0, "fail_error_rate": 0.5})


@pytest.mark.reliability
def test_publish_takes_the_verdict_qa_sealed_not_what_report_json_says(tmp_path, fake_engine_factory):
    """A bucket writer rewrites qa/report.json from 'warn' to 'pass', or swaps report.html / sample.parquet: publish
    refuses each, naming the file; the genuine files publish QA's 'warn' into _SUCCESS.json and the Asset event."""
    spec = warned_job(tmp_path, fake_engine_factory)
    qa = tmp_path / "out" / "qa"
    genuine = {name: (qa / name).read_bytes() for name in ("report.json", "report.html", "sample.parquet")}
    report = json.loads(genuine["report.json"])
    assert report["status"] == "warn"
    forged = {
        "report.json": json.dumps({**report, "status": "pass", "summary": "QA PASS"}).encode(),
        "report.html": genuine["report.html"].replace(b"WARN", b"PASS"),
        "sample.parquet": flipped(genuine["sample.parquet"]),
    }
    for name, body in forged.items():
        assert body != genuine[name]
        (qa / name).write_bytes(body)
        with pytest.raises(AirflowFailException, match=rf"qa/{name} is not the file the sealed qa/_QA.json names"):
            VllmPublishOperator(task_id="publish", spec=spec).execute(context())
        assert not (tmp_path / "out" / "_SUCCESS.json").exists()
        (qa / name).write_bytes(genuine[name])
    record_malicious("forged_qa_report_files", len(forged), len(forged))
    event = VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    marker = json.loads((tmp_path / "out" / "_SUCCESS.json").read_text())
    assert event["qa_status"] == marker["qa"]["status"] == "warn" and marker["qa"]["summary"].startswith("QA WARN")


@pytest.mark.reliability
def test_a_qa_record_of_another_run_or_spec_or_merge_publishes_nothing(tmp_path, fake_engine_factory):
    """qa/ copied whole from another run (a genuine sealed _QA.json, its files matching) is refused by its seal's
    scope; a record this deployment sealed for this folder but for another spec, or an earlier merge, is refused."""
    spec = checked_job(tmp_path / "a", fake_engine_factory)
    checked_job(tmp_path / "b", fake_engine_factory)
    out, other_qa = tmp_path / "a" / "out", tmp_path / "b" / "out" / "qa"
    own = {p.name: p.read_bytes() for p in (out / "qa").iterdir()}
    for p in other_qa.iterdir():
        (out / "qa" / p.name).write_bytes(p.read_bytes())
    with pytest.raises(AirflowFailException, match=r"qa/_QA.json: its seal does not match.*run the QA task again"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    for name, body in own.items():
        (out / "qa" / name).write_bytes(body)
    from airflow_provider_vllm.core.records import QARecord

    keyring, scope = Keyring.from_env(), seals.scope_of(str(out))
    record = QARecord.model_validate_json(own["_QA.json"])
    for change, refusal in (
        ({"spec_hash": "0" * 64}, "on a run of another spec"),
        ({"merged_mac": "0" * 64}, "earlier merge"),
    ):
        resealed = seals.seal_record(keyring, seals.QA, scope, record.model_copy(update=change))
        (out / "qa" / "_QA.json").write_bytes(seals.record_bytes(resealed))
        with pytest.raises(AirflowFailException, match=refusal):
            VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    record_malicious("qa_record_of_another_run_spec_or_merge", 3, 3)


def merge_and_qa_again(spec, plan, out, factory) -> dict:
    """A shard run again, then merge and QA again (cleared tasks): a merge that differs from the one before, so a
    verdict with another seal. QA's XCom."""
    rerun_a_shard(spec, plan, out, factory)
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    return VllmQAOperator(task_id="qa", spec=spec).execute(context())


def test_an_earlier_merge_and_qa_put_back_are_not_published_as_this_runs(tmp_path, fake_engine_factory):
    """Every record of an earlier merge and QA of this folder is genuine and sealed for it: put back after the merge
    and QA ran again, they passed every check and the earlier state was published. The QA task's XCom (Airflow's
    metadata database, which the bucket's writers cannot touch) names the verdict it wrote."""
    import shutil

    spec, plan = committed_job(tmp_path, fake_engine_factory, n=60)
    out = tmp_path / "out"
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    first = VllmQAOperator(task_id="qa", spec=spec).execute(context())
    earlier = tmp_path / "earlier"
    shutil.copytree(out, earlier, symlinks=True)
    now = merge_and_qa_again(spec, plan, out, fake_engine_factory)  # cleared tasks, run again
    assert first["record_mac"] != now["record_mac"]  # another merge: another sealed verdict
    for rel in ("_MERGED.json", "results", "errors", "qa", "shards"):  # the earlier state put back, whole
        shutil.rmtree(out / rel) if (out / rel).is_dir() else (out / rel).unlink()
        (shutil.copytree if (earlier / rel).is_dir() else shutil.copy2)(earlier / rel, out / rel)
    with pytest.raises(AirflowFailException, match=r"qa/_QA.json is not the verdict this run's QA task wrote"):
        VllmPublishOperator(task_id="publish", spec=spec, qa_result=now).execute(context())
    for told in ({"status": "pass"}, None):  # None: no XCom (QA marked success by hand), where one is required
        with pytest.raises(AirflowFailException, match="the QA task's result names no sealed verdict"):
            VllmPublishOperator(task_id="publish", spec=spec, qa_result=told, require_qa_result=True).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    event = VllmPublishOperator(task_id="publish", spec=spec, qa_result=first).execute(context())  # what QA said
    assert event["rows"] == 60
    record_malicious("earlier_merge_and_qa_put_back", 2, 2)


def _put_back(earlier: dict[str, bytes], folder) -> None:
    for name, body in earlier.items():
        (folder / name).write_bytes(body)


@pytest.mark.reliability
def test_a_stale_change_set_put_back_is_not_published_with_a_later_verdict(tmp_path, fake_engine_factory):
    """QA ran before the previous run was merged (every id 'added'), then again after: the earlier change set is
    genuine and sealed for this folder. Put back over the later one, it was published with the later verdict, and
    _SUCCESS.json sealed its sha256. QA's verdict names the change set it wrote; publish takes no other."""
    prev_spec, _ = committed_job(tmp_path / "prev", fake_engine_factory, n=60)  # committed, not merged yet
    spec, _ = committed_job(
        tmp_path / "now", fake_engine_factory, n=60, changes={"previous_uri": str(tmp_path / "prev" / "out")}
    )
    out = tmp_path / "now" / "out"
    merge = VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    VllmQAOperator(task_id="qa", spec=spec, merge_result=merge).execute(context())
    earlier = {p.name: p.read_bytes() for p in (out / "changes").iterdir()}
    assert json.loads(earlier["_changes.json"])["previous_state"] == "incomplete"
    VllmMergeOperator(task_id="merge", spec=prev_spec, plan=plan_xcom(prev_spec)).execute(
        context()
    )  # the previous run completes
    now = VllmQAOperator(task_id="qa", spec=spec, merge_result=merge).execute(context())  # QA cleared, run again
    later = {p.name: p.read_bytes() for p in (out / "changes").iterdir()}
    assert json.loads(later["_changes.json"])["previous_state"] == "complete"
    _put_back(earlier, out / "changes")
    for qa_result in (now, None):  # through the QA task's XCom, or the sealed verdict alone
        with pytest.raises(AirflowFailException, match=r"changes/_changes.json is not the change set QA's sealed"):
            VllmPublishOperator(task_id="publish", spec=spec, qa_result=qa_result).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    _put_back(later, out / "changes")
    VllmPublishOperator(task_id="publish", spec=spec, qa_result=now).execute(context())
    marker = json.loads((out / "_SUCCESS.json").read_text())
    for name, body in later.items():  # the summary too: a consumer reads previous_state from it
        assert marker["checksums"][f"changes/{name}"] == hashlib.sha256(body).hexdigest()
    _put_back(earlier, out / "changes")
    with pytest.raises(CommitError, match=r"changes/_changes.json is not the file _SUCCESS.json names"):
        verify_published(str(out), success_sha256=hashlib.sha256((out / "_SUCCESS.json").read_bytes()).hexdigest())
    record_malicious("stale_change_set_put_back", 3, 3)


@pytest.mark.reliability
def test_a_change_set_of_an_earlier_merge_or_without_its_bindings_is_not_published(tmp_path, fake_engine_factory):
    """A change set of an earlier merge of this folder (a shard ran again, merge and QA again) put back is refused
    naming the merge; a change set or a verdict sealed before they named their merge / change set fails closed."""
    prev_spec, _ = committed_job(tmp_path / "prev", fake_engine_factory, n=60)
    VllmMergeOperator(task_id="merge", spec=prev_spec, plan=plan_xcom(prev_spec)).execute(context())
    spec, plan = committed_job(
        tmp_path / "now", fake_engine_factory, n=60, changes={"previous_uri": str(tmp_path / "prev" / "out")}
    )
    out = tmp_path / "now" / "out"
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    earlier = {p.name: p.read_bytes() for p in (out / "changes").iterdir()}
    merge_and_qa_again(spec, plan, out, fake_engine_factory)
    later = {p.name: p.read_bytes() for p in (out / "changes").iterdir()}
    _put_back(earlier, out / "changes")
    with pytest.raises(AirflowFailException, match=r"is the change set of another merge of this folder"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    from airflow_provider_vllm.core.records import ChangesSummary, QARecord

    keyring, scope = Keyring.from_env(), seals.scope_of(str(out))
    summary = ChangesSummary.model_validate_json(later["_changes.json"])
    old = ChangesSummary.model_validate(summary.model_dump(exclude={"merged_mac", "previous_merged_mac", "seal"}))
    _put_back(
        {**later, "_changes.json": seals.record_bytes(seals.seal_record(keyring, seals.CHANGES, scope, old))},
        out / "changes",
    )
    with pytest.raises(AirflowFailException, match=r"_changes.json names no merge .*run the QA task again"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    _put_back(later, out / "changes")
    record = QARecord.model_validate_json((out / "qa" / "_QA.json").read_bytes())
    assert record.changes_mac == summary.seal.mac
    old_qa = QARecord.model_validate(record.model_dump(exclude={"changes_mac", "seal"}))
    (out / "qa" / "_QA.json").write_bytes(seals.record_bytes(seals.seal_record(keyring, seals.QA, scope, old_qa)))
    with pytest.raises(AirflowFailException, match=r"verdict names no change set .*run the QA task again"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    record_malicious("change_set_of_an_earlier_merge_put_back", 1, 1)


def reviewed(spec, qa_result, **kw) -> dict:
    """The review task run on the run's sealed verdict in DAG run d / r1 (a 'pass', or a 'warn' with ``ask``
    false, decides without asking): its XCom; its decision is sealed into ``qa/_REVIEW.json``."""
    from airflow_provider_vllm.operators.review import VllmQAReviewOperator

    return VllmQAReviewOperator(task_id="review", spec=spec, qa_result=qa_result, **kw).execute(context())


def asked_and_answered(spec, qa_result, option: str, monkeypatch) -> dict:
    """The review asks a person about a 'warn' and resumes with their answer (``option``), as Airflow resumes it:
    its XCom on Approve; AirflowFailException on Reject."""
    from datetime import UTC, datetime

    import airflow.providers.standard.operators.hitl as hitl

    from airflow_provider_vllm.operators.review import VllmQAReviewOperator

    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **kw: None)
    op = VllmQAReviewOperator(task_id="review", spec=spec, qa_result=qa_result)
    waits = context()
    waits["ti"].id, waits["ti"].task_id = "ti-1", "job.review"  # what the HITL request names
    waits["task_instance"] = waits["ti"]
    with pytest.raises(hitl.TaskAwaitingInput) as waiting:
        op.execute(waits)
    event = {
        "chosen_options": [option],
        "params_input": {},
        "responded_at": datetime.now(UTC),
        "responded_by_user": {"id": "alice", "name": "alice"},
    }
    return op.execute_complete(context(), event, **waiting.value.kwargs)


def publish_reviewed(spec, qa_result, review_result=None, **kw) -> dict:
    """Publish as ``vllm_batch_job`` wires it with the review on."""
    kw = {"require_qa_result": True, "require_review_result": True, **kw}
    op = VllmPublishOperator(task_id="publish", spec=spec, qa_result=qa_result, review_result=review_result, **kw)
    return op.execute(context())


def test_an_approval_of_another_verdict_does_not_publish_this_one(tmp_path, fake_engine_factory):
    """The review approved QA's verdict; QA then ran again alone (a cleared task, the review left approved) and wrote
    another verdict. The sealed review decision names the verdict it approved: publish takes no other, whatever the
    review task's XCom says, until the review decides again."""
    spec, plan = committed_job(tmp_path, fake_engine_factory, n=60)
    out = tmp_path / "out"
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    approved = VllmQAOperator(task_id="qa", spec=spec).execute(context())
    review = reviewed(spec, approved)
    now = merge_and_qa_again(spec, plan, out, fake_engine_factory)  # another sealed verdict, not reviewed
    assert now["record_mac"] != approved["record_mac"]
    for told in (review, {**review, "record_mac": now["record_mac"]}, None):  # the XCom changed, or none at all
        with pytest.raises(
            AirflowFailException, match=r"_REVIEW.json is on another QA verdict .*clear the review task"
        ):
            publish_reviewed(spec, now, told)
    with pytest.raises(AirflowFailException, match="on another QA verdict"):  # checked without qa_result too
        VllmPublishOperator(task_id="publish", spec=spec, review_result=review).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    again = reviewed(spec, now)  # the review cleared: it decides on the verdict QA wrote last
    assert publish_reviewed(spec, now, again)["rows"] == 60
    marker = json.loads((out / "_SUCCESS.json").read_text())
    assert marker["review"] == {"asked": False, "by": None, "at": None, "review_mac": again["review_mac"]}


@pytest.mark.reliability
def test_publish_decides_from_the_sealed_review_never_the_review_tasks_xcom(tmp_path, fake_engine_factory, monkeypatch):
    """QA warned (1 of 60 rows an error). Whoever may write XCom (the REST API's XCom endpoints) and mark a task
    success made publish publish a verdict a person rejected, or one nobody was asked about: publish took the review
    task's XCom (``record_mac``, ``asked``, ``qa_status``) as the decision. It now decides from the review's sealed
    ``qa/_REVIEW.json`` alone; the XCom is a cross-check."""
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=60, empty=(0,))
    out = tmp_path / "out"
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    told = VllmQAOperator(task_id="qa", spec=spec).execute(context())
    assert told["status"] == "warn"
    mac = told["record_mac"]
    approval = {"chosen_options": ["Approve"], "approved": True, "record_mac": mac}
    unasked = {"approved": True, "asked": False, "qa_status": "warn", "record_mac": mac}
    # the review never ran (marked success): no decision in the folder, whatever its XCom says
    for forged in (approval, unasked, {**unasked, "qa_status": "pass"}, None):
        with pytest.raises(AirflowFailException, match=r"no sealed review decision \S+qa/_REVIEW.json"):
            publish_reviewed(spec, told, forged)
    # a person rejected: the task failed; its XCom written to an approval, the task marked success
    with pytest.raises(AirflowFailException, match="rejected by alice"):
        asked_and_answered(spec, told, "Reject", monkeypatch)
    for forged in (approval, unasked, None):
        with pytest.raises(AirflowFailException, match=r"publish: alice rejected publication .*_REVIEW.json"):
            publish_reviewed(spec, told, forged)
    # a decision copied from another run's folder (genuine, sealed for that folder)
    other, _ = committed_job(tmp_path / "b", fake_engine_factory, n=60)
    VllmMergeOperator(task_id="merge", spec=other, plan=plan_xcom(other)).execute(context())
    reviewed(other, VllmQAOperator(task_id="qa", spec=other).execute(context()))
    (out / "qa" / "_REVIEW.json").write_bytes((tmp_path / "b" / "out" / "qa" / "_REVIEW.json").read_bytes())
    with pytest.raises(AirflowFailException, match=r"_REVIEW.json: its seal does not match.*clear the review task"):
        publish_reviewed(spec, told, approval)
    assert not (out / "_SUCCESS.json").exists()
    record_malicious("publish_on_a_review_xcom_not_its_sealed_decision", 8, 8)
    # a person approved: published; a result that names another decision fails, none at all (the review killed
    # after its record, then marked success) does not, since the sealed decision is the approval
    result = asked_and_answered(spec, told, "Approve", monkeypatch)
    with pytest.raises(
        AirflowFailException, match=r"review task's result does not match .* \(review_mac: the result was changed"
    ):
        publish_reviewed(spec, told, {**result, "review_mac": "0" * 64})
    assert publish_reviewed(spec, told, None)["qa_status"] == "warn"
    marker = json.loads((out / "_SUCCESS.json").read_text())
    assert marker["review"]["asked"] is True and marker["review"]["by"] == "alice"


def test_a_warned_run_is_not_published_unasked_on_a_qa_result_changed_to_pass(tmp_path, fake_engine_factory):
    """QA warned (1 of 60 rows an error: error_rate above 1 %). Whoever may write XCom rewrote the QA task's result
    to 'pass' before the review task read it: the review approved without asking anyone. The review decides on the
    sealed verdict and refuses; publish holds QA's result to the sealed verdict too, and takes a decision made
    without asking on a 'warn' only where the review was off (the DAG file's ``ask=False``)."""
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=60, empty=(0,))
    out = tmp_path / "out"
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    told = VllmQAOperator(task_id="qa", spec=spec).execute(context())
    assert told["status"] == "warn"
    forged = {**told, "status": "pass"}
    with pytest.raises(AirflowFailException, match=r"result says 'pass', but its sealed verdict .* is 'warn'"):
        reviewed(spec, forged)
    off = reviewed(spec, told, ask=False)
    with pytest.raises(AirflowFailException, match=r"the QA task's result says 'pass'.* is 'warn'"):
        publish_reviewed(spec, forged, off)
    assert not (out / "_SUCCESS.json").exists()
    assert publish_reviewed(spec, told, off)["qa_status"] == "warn"


@pytest.mark.reliability
def test_a_verdict_or_decision_of_another_dag_run_publishes_nothing(tmp_path, fake_engine_factory):
    """Whoever may write the plan task's ``spec`` XCom and the QA and review tasks' pointed publish at another run's
    folder of this deployment (its genuine verdict and decision, sealed for that folder: they verified), and that
    run's answers were published as this run's. Each record names the DAG run that made it: publish takes only its
    own run's, and a verdict of an earlier version that names none is refused, asking for QA again."""
    from airflow_provider_vllm.core.records import QARecord, ReviewRecord
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.qa.store import read_review

    older = context(run_id="scheduled__older")
    spec, _ = committed_job(tmp_path, fake_engine_factory, n=60)
    out = tmp_path / "out"
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(older)
    theirs = VllmQAOperator(task_id="qa", spec=spec).execute(older)
    from airflow_provider_vllm.operators.review import VllmQAReviewOperator

    decision = VllmQAReviewOperator(task_id="review", spec=spec, qa_result=theirs).execute(older)
    for publish in (
        lambda: publish_reviewed(spec, theirs, decision),
        lambda: VllmPublishOperator(task_id="publish", spec=spec).execute(context()),
    ):
        with pytest.raises(
            AirflowFailException, match=r"made by DAG run 'd' / 'scheduled__older', not by this DAG run 'd' / 'r1'"
        ):
            publish()
    # this run's QA on the folder, the other run's decision left there: refused by its run too
    mine = VllmQAOperator(task_id="qa", spec=spec).execute(context())
    keyring, scope = Keyring.from_env(), seals.scope_of(str(out))
    stale = read_review(Storage(str(out)), keyring).model_copy(update={"qa_record_mac": mine["record_mac"]})
    (out / "qa" / "_REVIEW.json").write_bytes(
        seals.record_bytes(seals.seal_record(keyring, seals.REVIEW, scope, stale))
    )
    with pytest.raises(AirflowFailException, match=r"review decision .* made by DAG run 'd' / 'scheduled__older'"):
        publish_reviewed(spec, mine, None)
    # records of the earlier version, which name no DAG run
    genuine = (out / "qa" / "_QA.json").read_bytes()
    unbound = QARecord.model_validate_json(genuine).model_copy(update={"dag_run": None})
    (out / "qa" / "_QA.json").write_bytes(seals.record_bytes(seals.seal_record(keyring, seals.QA, scope, unbound)))
    with pytest.raises(AirflowFailException, match=r"_QA.json names no DAG run .*run the QA task again"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    (out / "qa" / "_QA.json").write_bytes(genuine)
    assert ReviewRecord.model_fields["dag_run"].is_required()  # a review record always names its run
    assert not (out / "_SUCCESS.json").exists()
    record_malicious("publish_of_a_verdict_or_decision_of_another_dag_run", 4, 4)
    assert VllmPublishOperator(task_id="publish", spec=spec).execute(context())["rows"] == 60


def test_an_earlier_approval_put_back_after_a_rejection_publishes_nothing(tmp_path, fake_engine_factory, monkeypatch):
    """A person approved a 'warn'; the review was cleared and asked again, and this time they rejected. A writer of
    the prefix put the first attempt's sealed approval back (same verdict, same DAG run: it verifies) and the review
    task was marked success: publish took the approval. The rejected attempt returned nothing, and the job wires the
    review task's result into publish: a missing result now fails, asking to clear the review task."""
    spec = warned_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    told = VllmQAOperator(task_id="qa", spec=spec).execute(context())
    first = asked_and_answered(spec, told, "Approve", monkeypatch)
    approval = (out / "qa" / "_REVIEW.json").read_bytes()
    with pytest.raises(AirflowFailException, match="rejected by alice"):
        asked_and_answered(spec, told, "Reject", monkeypatch)
    (out / "qa" / "_REVIEW.json").write_bytes(approval)
    wired = {"require_qa_result": True, "require_review_result": True}
    op = VllmPublishOperator(
        task_id="publish", spec=spec, qa_result=told, review_result="{{ ti.xcom_pull('r') }}", **wired
    )
    op.review_result = None  # as rendered: the rejected attempt pushed no result
    with pytest.raises(AirflowFailException, match=r"review task's result is missing, .*clear the review task"):
        op.execute(context())
    assert not (out / "_SUCCESS.json").exists()
    record_malicious("publish_on_an_earlier_approval_put_back_after_a_rejection", 1, 1)
    # the approving attempt's own result (as if it had been the last): published
    op.review_result = first
    assert op.execute(context())["qa_status"] == "warn"


def two_jobs(spec, qa_result=None):
    """The QA, review and publish tasks of two jobs of one DAG (``vllm_batch_job`` groups ``a`` and ``b``), all
    pointed at one folder (``spec``): job ``b``'s review approves a 'warn' without asking (its DAG file's ``ask``
    literal ``"false"``), job ``a``'s publish needs a review."""
    from airflow.sdk import DAG, TaskGroup

    from airflow_provider_vllm.operators.review import VllmQAReviewOperator

    with DAG("d", schedule=None):
        with TaskGroup("a"):
            qa_a = VllmQAOperator(task_id="qa", spec=spec)
            review_a = VllmQAReviewOperator(task_id="review", spec=spec, qa_result=qa_result, ask="false")
            publish_a = VllmPublishOperator(
                task_id="publish", spec=spec, qa_result=qa_result, require_qa_result=True, require_review_result=True
            )
        with TaskGroup("b"):
            review_b = VllmQAReviewOperator(task_id="review", spec=spec, qa_result=qa_result, ask="false")
    return qa_a, review_a, publish_a, review_b


def test_a_verdict_or_decision_of_another_job_of_the_same_dag_run_publishes_nothing(tmp_path, fake_engine_factory):
    """One DAG run holds two jobs (two ``vllm_batch_job`` groups; or one group mapped over jobs). Job ``a`` QA'd
    'warn' and needs a person's answer; job ``b``'s review approves a 'warn' unasked. Whoever may write the ``spec``
    XCom of job ``b``'s plan and its QA result pointed ``b``'s review at ``a``'s folder: it sealed an approval there,
    in the same DAG run, and ``a``'s publish (its review marked success) published the 'warn' nobody was asked
    about. The records name the task group and map index of the task that made them: review and publish take only
    their own job's, and one of an earlier version that names none is refused."""
    from airflow_provider_vllm.core.records import QARecord, ReviewRecord

    spec = checked_job(tmp_path, fake_engine_factory, empty=(3,), qa={"warn_error_rate": 0.0, "fail_error_rate": 0.5})
    out = tmp_path / "out"
    verdict = two_jobs(spec)[0].execute(context())  # job a's QA
    assert verdict["status"] == "warn"
    _, review_a, publish_a, review_b = two_jobs(spec, verdict)
    with pytest.raises(
        AirflowFailException, match=r"made by the job in task group 'a', not by this one in task group 'b'"
    ):
        review_b.execute(context())
    assert not (out / "qa" / "_REVIEW.json").exists()
    with pytest.raises(AirflowFailException, match=r"no sealed review decision"):
        publish_a.execute(context())
    # the same job mapped: another map index's verdict
    with pytest.raises(AirflowFailException, match=r"task group 'a', not by this one in task group 'a' \(map index 1"):
        review_a.execute(context(map_index=1))
    # a decision of job b on a's verdict, sealed for a's folder in this DAG run (as the review did before it checked);
    # a verdict of job b's QA there; either of the earlier version, which names no group
    review_a.execute(context())
    keyring, scope = Keyring.from_env(), seals.scope_of(str(out))
    for name, domain, model in (("_REVIEW.json", seals.REVIEW, ReviewRecord), ("_QA.json", seals.QA, QARecord)):
        genuine = (out / "qa" / name).read_bytes()
        record = model.model_validate_json(genuine)
        for other in (record.task_group.model_copy(update={"group_id": "b"}), None):
            forged = record.model_copy(update={"task_group": other})
            (out / "qa" / name).write_bytes(seals.record_bytes(seals.seal_record(keyring, domain, scope, forged)))
            with pytest.raises(
                AirflowFailException, match=rf"{name} (was made by the job in task group 'b'|names no task group)"
            ):
                publish_a.execute(context())
        (out / "qa" / name).write_bytes(genuine)
    assert not (out / "_SUCCESS.json").exists()
    record_malicious("publish_of_a_verdict_or_decision_of_another_job_of_the_dag_run", 7, 7)
    assert publish_a.execute(context())["qa_status"] == "warn"  # job a's own decision (its DAG file's ask off)
    assert json.loads((out / "_SUCCESS.json").read_bytes())["review"]["asked"] is False


def test_whether_a_review_is_needed_is_the_dag_files_choice_not_an_xcoms(tmp_path, fake_engine_factory):
    """A DAG file that wires the review's result into publish needs the review's sealed decision even when that
    result renders to nothing (its XCom deleted); one that wires no review (``human_review=False``) publishes a
    'warn' without one, as before."""
    spec = warned_job(tmp_path, fake_engine_factory)
    op = VllmPublishOperator(task_id="publish", spec=spec, review_result="{{ ti.xcom_pull('job.review') }}")
    op.review_result = None  # as rendered, the XCom gone
    with pytest.raises(AirflowFailException, match=r"no sealed review decision \S+qa/_REVIEW.json"):
        op.execute(context())
    assert not (tmp_path / "out" / "_SUCCESS.json").exists()
    assert VllmPublishOperator(task_id="publish", spec=spec).execute(context())["qa_status"] == "warn"


def test_a_run_without_a_sealed_qa_verdict_publishes_nothing(tmp_path, fake_engine_factory):
    """A run whose QA wrote no _QA.json (QA of a version before it, or the record removed): fail closed, asking for
    QA to run again, even though report.json says 'pass'."""
    spec = checked_job(tmp_path, fake_engine_factory)
    (tmp_path / "out" / "qa" / "_QA.json").unlink()
    assert json.loads((tmp_path / "out" / "qa" / "report.json").read_text())["status"] == "pass"
    with pytest.raises(AirflowFailException, match=r"no sealed QA verdict .*qa/_QA.json.*run the QA task again"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert not (tmp_path / "out" / "_SUCCESS.json").exists()


@pytest.mark.parametrize("name", ["report.json", "report.html", "sample.parquet"])
def test_verify_published_catches_a_qa_file_changed_after_publishing(tmp_path, fake_engine_factory, name):
    spec = checked_job(tmp_path, fake_engine_factory)
    event = VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    out = tmp_path / "out"
    marker = json.loads((out / "_SUCCESS.json").read_text())
    assert {"qa/report.json", "qa/report.html", "qa/sample.parquet"} <= set(marker["checksums"])
    path = out / "qa" / name
    path.write_bytes(flipped(path.read_bytes()))
    for check in ({"success_sha256": event["success_sha256"]}, {"keyring": Keyring.from_env()}):
        with pytest.raises(CommitError, match=rf"qa/{name} is not the file _SUCCESS.json names"):
            verify_published(str(out), **check)
    path.unlink()
    with pytest.raises(CommitError, match=rf"qa/{name} is missing"):
        verify_published(str(out), success_sha256=event["success_sha256"])


def _openai_batch_job(tmp_path, factory) -> tuple[dict, dict]:
    """A merged and QA-checked ``io.output_format=openai_batch`` run of 12 requests: (spec, QA result)."""
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import openai_batch_spec

    spec = openai_batch_spec(tmp_path)
    for s in plan_job(spec).shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    doc = spec.model_dump(mode="json")
    VllmMergeOperator(task_id="merge", spec=doc, plan=plan_xcom(doc)).execute(context())
    return doc, VllmQAOperator(task_id="qa", spec=doc).execute(context())


def test_openai_batch_files_changed_after_the_merge_are_refused_by_publish_and_by_verify_published(
    tmp_path, fake_engine_factory
):
    """Merge seals the sha256 of the openai/*.jsonl bytes it wrote; publish refuses other bytes, names the
    sealed digests in _SUCCESS.json, and ``verify_published`` checks them."""
    doc, qa = _openai_batch_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    f = out / "openai" / "output.jsonl"
    good = f.read_bytes()
    merged = json.loads((out / "_MERGED.json").read_text())
    want = {
        p: hashlib.sha256((out / p).read_bytes()).hexdigest() for p in ("openai/output.jsonl", "openai/errors.jsonl")
    }
    assert {k: merged["checksums"][k] for k in want} == want
    lines = good.decode().splitlines()
    first = json.loads(lines[0])
    first["response"]["body"]["choices"][0]["message"]["content"] = "FORGED"
    f.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    with pytest.raises(AirflowFailException, match=r"openai/output\.jsonl is not the file the sealed _MERGED\.json"):
        VllmPublishOperator(task_id="publish", spec=doc, qa_result=qa).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    f.write_bytes(good)
    event = VllmPublishOperator(task_id="publish", spec=doc, qa_result=qa).execute(context())
    assert {k: json.loads((out / "_SUCCESS.json").read_text())["checksums"][k] for k in want} == want
    assert verify_published(str(out), success_sha256=event["success_sha256"])["rows"] == 12
    f.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")  # changed after publishing
    with pytest.raises(CommitError, match=r"openai/output\.jsonl is not the file _SUCCESS.json names"):
        verify_published(str(out), success_sha256=event["success_sha256"])


def test_extra_files_are_checksummed_into_the_marker_and_checked_by_verify_published(tmp_path, fake_engine_factory):
    spec = checked_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    (out / "embeddings").mkdir()
    (out / "embeddings" / "table.parquet").write_bytes(b"a table the DAG wrote")
    (tmp_path / "elsewhere.txt").write_text("outside the run")
    for bad in ("../elsewhere.txt", "embeddings/"):
        with pytest.raises(AirflowFailException, match=r"extra_files: .* is not a file of the run"):
            VllmPublishOperator(task_id="publish", spec=spec, extra_files={"x": bad}).execute(context())
    # an extra entry in the name or the place of a file publish vouches for itself: its checksum (or the listed
    # path consumers read) would be the extra entry's
    for clash in (
        {"qa_report_json": "embeddings/table.parquet"},
        {"x": "qa/report.json"},
        {"y": "results/_manifest.json"},
    ):
        with pytest.raises(AirflowFailException, match=r"name a file publish lists itself"):
            VllmPublishOperator(task_id="publish", spec=spec, extra_files=clash).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    event = VllmPublishOperator(
        task_id="publish", spec=spec, extra_files={"embedding_table": "embeddings/table.parquet"}
    ).execute(context())
    marker = json.loads((out / "_SUCCESS.json").read_text())
    assert marker["checksums"]["embeddings/table.parquet"] == hashlib.sha256(b"a table the DAG wrote").hexdigest()
    assert verify_published(str(out), success_sha256=event["success_sha256"])["rows"] == 60
    (out / "embeddings" / "table.parquet").write_bytes(b"another table")
    with pytest.raises(CommitError, match=r"embeddings/table\.parquet is not the file _SUCCESS.json names"):
        verify_published(str(out), success_sha256=event["success_sha256"])


def test_qa_run_again_on_a_published_run_never_replaces_what_publish_vouched_for(tmp_path, fake_engine_factory):
    """QA cleared on a published run computes other bytes, here because the previous run it compares with was
    merged (and QA'd) since: QA fails naming the file, before it writes anything, and the published run still
    verifies. The code before replaced the change set and the report: verify_published failed, and the next
    nights' qa.previous_published told the user to restore a report QA had overwritten. QA again with the same
    bytes (a cleared DAG run) goes on."""
    from tests.support.data import files_under

    for name, match in (
        ("changes", r"changes/changes\.parquet: .* and QA would replace that file"),
        ("report", r"qa/report\.(html|json): .* and QA would replace that file with other bytes"),
    ):
        prev = tmp_path / f"prev_{name}"
        prev_spec, _ = committed_job(prev, fake_engine_factory, n=60)  # committed, not merged yet
        over = (
            {"changes": {"previous_uri": str(prev / "out")}}
            if name == "changes"
            else {"qa": {"previous_report_uri": str(prev / "out" / "qa" / "report.json")}}
        )
        spec, _ = committed_job(tmp_path / name, fake_engine_factory, n=60, **over)
        out = tmp_path / name / "out"
        VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
        qa = VllmQAOperator(task_id="qa", spec=spec).execute(context())
        event = VllmPublishOperator(task_id="publish", spec=spec, qa_result=qa).execute(context())
        success = {"success_sha256": event["success_sha256"]}
        again = VllmQAOperator(task_id="qa", spec=spec).execute(context())  # the same bytes: nothing refused
        assert again["report_sha256"] == qa["report_sha256"]
        verify_published(str(out), **success)
        before = files_under(out)
        # the previous run completes after this one was published
        VllmMergeOperator(task_id="merge", spec=prev_spec, plan=plan_xcom(prev_spec)).execute(context())
        VllmQAOperator(task_id="qa", spec=prev_spec).execute(context())
        with pytest.raises(AirflowFailException, match=rf"{match}.*Nothing was written\. Merge into a new output"):
            VllmQAOperator(task_id="qa", spec=spec).execute(context())
        assert files_under(out) == before
        verify_published(str(out), **success)
    record_malicious("qa_again_replaces_published_files", 2, 2)


def test_files_the_marker_vouches_for_are_read_no_further_than_their_recorded_size(tmp_path, fake_engine_factory):
    """Merge records the size of each file it seals beside its sha256 (the manifests, the OpenAI batch files),
    publish puts every file's size beside its checksum in ``_SUCCESS.json`` (QA's files, the extra files too), and
    publish and ``verify_published`` read no more of a file than that: a sparse terabyte planted in its place (free
    on local disk, or a lying object store) is refused unread. The code before hashed it whole (hours)."""
    from tests.support.security import counted_reads

    doc, qa = _openai_batch_job(tmp_path, fake_engine_factory)
    out = tmp_path / "out"
    merged = json.loads((out / "_MERGED.json").read_text())
    assert merged["sizes"] == {rel: (out / rel).stat().st_size for rel in merged["checksums"]}
    (out / "embeddings").mkdir()
    (out / "embeddings" / "table.parquet").write_bytes(b"a table the DAG wrote")
    good = (out / "openai" / "output.jsonl").read_bytes()

    def planted(rel: str) -> None:
        with open(out / rel, "wb") as f:
            f.truncate(1 << 40)

    planted("openai/output.jsonl")
    read = counted_reads(monkeypatch := pytest.MonkeyPatch())
    try:
        with pytest.raises(AirflowFailException, match=r"openai/output\.jsonl is not the file the sealed _MERGED"):
            VllmPublishOperator(task_id="publish", spec=doc, qa_result=qa).execute(context())
        assert sum(read) < 1 << 20 and not (out / "_SUCCESS.json").exists()
        (out / "openai" / "output.jsonl").write_bytes(good)
        extra = {"embedding_table": "embeddings/table.parquet"}
        event = VllmPublishOperator(task_id="publish", spec=doc, qa_result=qa, extra_files=extra).execute(context())
        marker = json.loads((out / "_SUCCESS.json").read_text())
        assert set(marker["sizes"]) == set(marker["checksums"])
        assert marker["sizes"] == {rel: (out / rel).stat().st_size for rel in marker["checksums"]}
        assert verify_published(str(out), success_sha256=event["success_sha256"])["rows"] == 12
        for rel in ("openai/errors.jsonl", "qa/report.html", "embeddings/table.parquet", "results/_manifest.json"):
            keep = (out / rel).read_bytes()
            planted(rel)
            read.clear()
            with pytest.raises(CommitError, match=rf"{rel} (is not the file _SUCCESS.json names|is larger than)"):
                verify_published(str(out), success_sha256=event["success_sha256"])
            assert sum(read) < 1 << 20, rel
            (out / rel).write_bytes(keep)
        # a marker whose sizes are not byte counts is refused, not read as no sizes
        marker["sizes"] = {"openai/output.jsonl": -1}
        (out / "_SUCCESS.json").write_bytes(json.dumps(marker).encode())
        with pytest.raises(CommitError, match="sizes are not a map of paths to byte counts"):
            verify_published(str(out), success_sha256=hashlib.sha256((out / "_SUCCESS.json").read_bytes()).hexdigest())
    finally:
        monkeypatch.undo()


def test_publish_checks_the_plan_the_run_was_merged_under_without_changes_or_a_table(tmp_path, fake_engine_factory):
    """Publish read the plan, and so checked that it is the one the sealed _MERGED.json names (``plan_mac``), only
    when the change set or a table commit used it: a run with neither was published over an earlier plan of its
    folder put back. It checks the plan always now, as QA does, and refuses with QA's message; a sealed merge
    summary that names no plan is refused as QA refuses it."""
    import shutil

    from airflow_provider_vllm.core.plan import PLAN_FILE
    from airflow_provider_vllm.core.records import MergeSummary
    from airflow_provider_vllm.core.storage import Storage
    from airflow_provider_vllm.steps.merge.merger import MERGED

    out = tmp_path / "out"
    committed_job(tmp_path, fake_engine_factory, n=40)
    earlier = (out / PLAN_FILE).read_bytes()  # a genuine plan of this folder, sealed for it
    shutil.rmtree(out)  # the folder emptied, the run planned again
    spec = checked_job(tmp_path, fake_engine_factory)
    assert "changes" not in spec or not spec["changes"].get("previous_uri")
    assert spec["io"].get("output_table") is None
    plan = (out / PLAN_FILE).read_bytes()
    (out / PLAN_FILE).write_bytes(earlier)  # put back after QA
    with pytest.raises(AirflowFailException, match=r"_plan.json is not the plan .* merged under"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    record_malicious("publish: an earlier plan of the folder put back after QA, no change set or table", 1, 1)

    (out / PLAN_FILE).write_bytes(plan)
    genuine = (out / MERGED).read_bytes()
    merged = MergeSummary.model_validate_json(genuine)
    older = seals.seal_record(
        Keyring.from_env(),
        seals.MERGED,
        seals.scope_of(Storage(spec["io"]["output_uri"]).uri()),
        merged.model_copy(update={"plan_mac": None, "seal": None}),
    )
    (out / MERGED).write_bytes(seals.record_bytes(older))  # sealed by this deployment, but naming no plan
    with pytest.raises(AirflowFailException, match="names no plan .* run the merge task again"):
        VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert not (out / "_SUCCESS.json").exists()
    (out / MERGED).write_bytes(genuine)
    assert VllmPublishOperator(task_id="publish", spec=spec).execute(context())["rows"] == 60


# ---- the result cache: a run's entry serves later runs only once publish vouched for it ------------------------------
CACHE_IDS = [f"t{i:04d}" for i in range(60)]
CACHE_TEXTS = [f"ticket number {i}: I was charged twice, please refund" for i in range(60)]


def _cached_run(tmp_path, factory, run: str, empty=(), **over) -> dict:
    """A run with the result cache under ``tmp_path/out-<run>``: planned, its shards committed, merged (the merge files
    its entry); the spec as the plan task pushes it."""
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import cached_job_spec

    texts = ["" if i in empty else t for i, t in enumerate(CACHE_TEXTS)]
    spec = cached_job_spec(tmp_path, run, CACHE_IDS, texts, **over)
    for s in plan_job(spec, engine_identity=local_engine_identity()).shards:
        run_shard(shard_task(spec=spec, shard_id=s.shard_id), engine_factory=factory)
    doc = spec.model_dump(mode="json")
    VllmMergeOperator(task_id="merge", spec=doc, plan=plan_xcom(doc)).execute(context())
    return doc


def _hits(tmp_path, run: str) -> int:
    """The cache hits of a run of the same texts planned now."""
    from airflow_provider_vllm.core.engine_identity import local_engine_identity
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from tests.support.data import cached_job_spec

    spec = cached_job_spec(tmp_path, run, CACHE_IDS, CACHE_TEXTS)
    plan = plan_job(spec, engine_identity=local_engine_identity())
    assert plan.cache is not None
    return plan.cache.hits


def test_a_run_that_failed_qa_serves_no_later_run_and_a_published_one_does(tmp_path, fake_engine_factory):
    """The merge files a run's answers before QA: a run whose QA fails is never published, and its answers must
    serve no later run (before, the next plan was served every ok row of it). Publish vouches for the entry of the run
    it publishes: then it serves."""
    failed = _cached_run(tmp_path, fake_engine_factory, "a", empty=(3, 4), qa={"fail_error_rate": 0.01})
    with pytest.raises(VllmQAFailed):
        VllmQAOperator(task_id="qa", spec=failed).execute(context())
    with pytest.raises(AirflowFailException, match="QA failed"):
        VllmPublishOperator(task_id="publish", spec=failed).execute(context())
    assert _hits(tmp_path, "x") == 0  # its 58 ok rows were filed, and serve nothing

    good = _cached_run(tmp_path, fake_engine_factory, "b")
    VllmQAOperator(task_id="qa", spec=good).execute(context())
    assert _hits(tmp_path, "y") == 0  # merged and checked, not published yet
    VllmPublishOperator(task_id="publish", spec=good).execute(context())
    assert _hits(tmp_path, "z") == 60
    VllmPublishOperator(task_id="publish", spec=good).execute(context())  # published again: the same
    assert _hits(tmp_path, "w") == 60


@pytest.mark.reliability
@pytest.mark.parametrize("action", ["raise", "kill"])
@pytest.mark.parametrize("point", ["cache.before_vouch", "cache.mid_vouch"])
def test_publish_stopped_before_its_vouch_is_whole_serves_nothing_until_its_retry(
    tmp_path, fake_engine_factory, set_faults, point, action
):
    """Publish writes ``_SUCCESS.json``, then the vouch record for the run's cache entry. Stopped between the two or
    while the record's temp file is half written (kill -9 of a real process: no clean-up), the entry serves nothing;
    the task's retry writes both again and it serves."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from airflow_provider_vllm.core import faults

    spec = _cached_run(tmp_path, fake_engine_factory, "a")
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    if action == "raise":
        set_faults(f"{point}=raise")
        with pytest.raises(faults.InjectedFault):
            VllmPublishOperator(task_id="publish", spec=spec).execute(context())
        set_faults("")
    else:
        code = (
            "import json, sys; from airflow_provider_vllm.operators.publish import VllmPublishOperator; "
            "from tests.support.task_context import context; "
            "VllmPublishOperator(task_id='publish', spec=json.loads(sys.argv[1])).execute(context())"
        )
        root = Path(__file__).resolve().parents[3]
        env = {**os.environ, faults.ENV: f"{point}=kill", "PYTHONPATH": str(root)}
        p = subprocess.run(
            [sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=300
        )
        assert p.returncode == -9, p.stderr[-2000:]
        if point == "cache.mid_vouch":  # the record's half-written temp file is there, and ignored
            assert list((tmp_path / "cache" / "published").glob("*/*.tmp-*"))
    assert (tmp_path / "out-a" / "_SUCCESS.json").exists()
    assert not list((tmp_path / "cache" / "published").glob("*/*.json"))
    assert _hits(tmp_path, "x") == 0
    VllmPublishOperator(task_id="publish", spec=spec).execute(context())  # the task's retry
    assert _hits(tmp_path, "y") == 60


def test_a_publish_after_its_entry_was_swept_writes_no_vouch_record(tmp_path, fake_engine_factory, caplog):
    """An entry not published within ``UNPUBLISHED_KEEP`` is removed by a later merge's sweep; a publish after that
    (a slow review) wrote a vouch record for the commit that was gone: it vouched for nothing and stayed in the
    folder of records forever (nothing removes a record of an entry no longer there), counted by every plan's
    bounded listing of that folder. It writes none now, with a warning; the run is published all the same."""
    import shutil

    spec = _cached_run(tmp_path, fake_engine_factory, "a")
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    (commit,) = (tmp_path / "cache" / "commits").glob("*/*.json")
    commit.unlink()  # as CacheStore.drop removes it: the commit first, then the part
    shutil.rmtree(tmp_path / "cache" / "entries" / commit.stem)
    VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    assert (tmp_path / "out-a" / "_SUCCESS.json").exists()
    assert not list((tmp_path / "cache" / "published").glob("*/*.json"))
    assert f"entry {commit.stem} is not vouched for: its commit is gone" in caplog.text


@pytest.mark.reliability
def test_the_temp_file_of_a_publish_killed_mid_vouch_is_swept_by_a_later_merge(tmp_path, fake_engine_factory):
    """A publish killed -9 while writing its vouch record left ``<entry>.json.tmp-<32 hex>`` in the cache's folder of
    records for good: nothing removed it, and it counted toward the folder's bounded listing. A later merge of the key
    config (its sweep) removes such a file once older than ``TEMP_KEEP``; a recent one (a publish writing it now) is
    left, and the retried publish still vouches."""
    import os
    import subprocess
    import sys
    import time
    import uuid
    from pathlib import Path

    from airflow_provider_vllm.core import faults

    spec = _cached_run(tmp_path, fake_engine_factory, "a")
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    code = (
        "import json, sys; from airflow_provider_vllm.operators.publish import VllmPublishOperator; "
        "from tests.support.task_context import context; "
        "VllmPublishOperator(task_id='publish', spec=json.loads(sys.argv[1])).execute(context())"
    )
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, faults.ENV: "cache.mid_vouch=kill", "PYTHONPATH": str(root)}
    p = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == -9, p.stderr[-2000:]
    (left,) = (tmp_path / "cache" / "published").glob("*/*.tmp-*")
    old = time.time() - 2 * 86400  # two days: older than TEMP_KEEP (an hour)
    os.utime(left, (old, old))
    recent = left.parent / f"{'0' * 32}.json.tmp-{uuid.uuid4().hex}"
    recent.write_bytes(b"{")
    _cached_run(tmp_path, fake_engine_factory, "b")  # another run of the key config: its merge sweeps
    assert not left.exists() and recent.exists()
    VllmPublishOperator(task_id="publish", spec=spec).execute(context())  # the killed task's retry
    assert _hits(tmp_path, "y") == 60


def test_a_commit_temp_file_of_a_merge_killed_mid_commit_is_swept_by_a_later_merge(tmp_path, fake_engine_factory):
    """A merge killed -9 while creating its entry's commit (``create_only``: a temp file, then a link) leaves
    ``<entry>.json.tmp-<32 hex>`` in ``commits/<key>/``, which counts toward the folder's bounded listing. A later
    merge of the key config (its sweep) removes such a file once older than ``TEMP_KEEP``; a recent one (a merge
    writing it now) is left."""
    import os
    import time
    import uuid

    _cached_run(tmp_path, fake_engine_factory, "a")
    (commit,) = (tmp_path / "cache" / "commits").glob("*/*.json")
    left = commit.parent / f"{'1' * 32}.json.tmp-{uuid.uuid4().hex}"
    left.write_bytes(b"{")
    old = time.time() - 2 * 86400  # two days: older than TEMP_KEEP (an hour)
    os.utime(left, (old, old))
    recent = commit.parent / f"{'2' * 32}.json.tmp-{uuid.uuid4().hex}"
    recent.write_bytes(b"{")
    _cached_run(tmp_path, fake_engine_factory, "b")  # not published before: b infers its rows and files an entry
    assert not left.exists() and recent.exists() and commit.exists()
