"""``changes.previous_published``: a run's change set compares with the run its job last published, as the job's
Asset event in Airflow's metadata database names it (the plan pins it), never with what the bucket shows."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk import Asset
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.plan import LastPublished, load_plan
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.operators.merge import VllmMergeOperator
from airflow_provider_vllm.operators.plan import VllmPlanOperator
from airflow_provider_vllm.operators.publish import VllmPublishOperator
from airflow_provider_vllm.operators.qa import VllmQAOperator
from airflow_provider_vllm.steps.merge.changes import read_changes
from airflow_provider_vllm.steps.merge.merger import MERGED, SUCCESS
from airflow_provider_vllm.steps.publish import pin_last_published
from airflow_provider_vllm.utils.published import last_published, newest_events
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import make_spec, plan_xcom, shard_task, write_parquet
from tests.support.ledger import record_malicious
from tests.support.task_context import context

pytestmark = pytest.mark.unit

ASSET = Asset(uri="x-vllm-batch://nightly", name="nightly")
DAG, PUBLISH = "d", "job.publish"


class Events:
    """What ``inlet_events[asset]`` gives (Airflow's ``InletEventsAccessor``): the Asset's events ordered by
    timestamp (oldest first unless ``ascending(False)``), only those at or before ``before`` (inclusive, as Airflow's
    query), at most ``limit``; each setter returns the accessor itself. ``queries``: how many were made."""

    def __init__(self, events):
        self._all, self._ascending, self._before, self._limit = list(events), True, None, None
        self._got: list | None = None  # one query per setting, as Airflow's accessor caches it
        self.queries = 0

    def ascending(self, ascending: bool = True):
        self._ascending, self._got = ascending, None
        return self

    def before(self, before):
        self._before, self._got = before, None
        return self

    def limit(self, limit: int):
        self._limit, self._got = limit, None
        return self

    def _events(self) -> list:
        if self._got is None:
            self.queries += 1
            got = [e for e in self._all if self._before is None or e.timestamp <= self._before]
            got.sort(key=lambda e: e.timestamp, reverse=not self._ascending)
            self._got = got[: self._limit] if self._limit else got
        return self._got

    def __iter__(self):
        return iter(self._events())

    def __len__(self) -> int:
        return len(self._events())

    def __getitem__(self, key):
        return self._events()[key]


def event(i: int, extra: dict, dag: str = DAG, task: str = PUBLISH) -> SimpleNamespace:
    stamp = dt.datetime(2026, 12, 1, tzinfo=dt.UTC) + dt.timedelta(hours=i)
    return SimpleNamespace(id=i, timestamp=stamp, extra=extra, source_dag_id=dag, source_task_id=task)


def night(root: Path, texts: list[str], **changes) -> tuple[dict, object]:
    """Input and spec of one night under ``root`` (ids t0000..), not yet planned."""
    write_parquet(root / "in" / "part-0.parquet", [f"t{i:04d}" for i in range(len(texts))], texts)
    spec = make_spec(
        root / "in", root / "out", sharding={"target_rows": 20}, **({"changes": changes} if changes else {})
    )
    return spec.model_dump(mode="json"), spec


def run_rest(spec: dict, factory) -> None:
    """Shards, merge and QA of a planned night, as the operators run them."""
    for s in load_plan(make_spec_of(spec)).shards:
        run_shard(shard_task(spec=make_spec_of(spec), shard_id=s.shard_id), engine_factory=factory)
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())


def make_spec_of(doc: dict):
    from airflow_provider_vllm.core.spec import JobSpec

    return JobSpec.load(doc)


def plan_op(spec: dict, inlets=(ASSET,)) -> VllmPlanOperator:
    return VllmPlanOperator(
        task_id="plan", spec=spec, inlets=list(inlets), published_asset=ASSET, publish_task_id=PUBLISH
    )


def ctx_with(events: list) -> dict:
    c = context()
    c["inlet_events"] = {ASSET: Events(events)}
    c["dag"] = SimpleNamespace(dag_id=DAG)
    return c


def test_the_change_set_compares_with_the_run_the_asset_event_names(tmp_path, fake_engine_factory):
    """Night A is published (its event names it); night B's plan pins A and the merge A published, and B's QA
    compares with it. Events another DAG or task emitted, or the REST API, are not this job's publishes."""
    texts = [f"ticket number {i}: I was charged twice, please refund" for i in range(60)]
    a, _ = night(tmp_path / "a", texts)
    VllmPlanOperator(task_id="plan", spec=a).execute(context())
    run_rest(a, fake_engine_factory)
    VllmQAOperator(task_id="qa", spec=a).execute(context())
    published = VllmPublishOperator(task_id="publish", spec=a, outlets=[ASSET]).execute(context())
    b, spec_b = night(tmp_path / "b", texts[:50] + ["a new ticket"] * 3, previous_published=True)
    events = [
        event(9, {"output_uri": str(tmp_path / "x"), "success_sha256": "0" * 64}, task="other.publish"),
        event(8, {"output_uri": str(tmp_path / "y"), "success_sha256": "0" * 64}, dag=None, task=None),  # the API
        event(7, {"rows": 1}),  # no output_uri
        event(5, published),
    ]
    plan_op(b).execute(ctx_with(events))
    pinned = load_plan(spec_b).changes_from
    assert (pinned.source, pinned.previous_uri, pinned.event_id) == ("published", published["output_uri"], 5)
    assert (
        pinned.results_manifest_sha256
        == json.loads((tmp_path / "a" / "out" / SUCCESS).read_bytes())["checksums"]["results/_manifest.json"]
    )
    run_rest(b, fake_engine_factory)
    VllmQAOperator(task_id="qa", spec=b).execute(context())
    summary = read_changes(Storage(spec_b.io.output_uri))
    assert summary.previous_uri == published["output_uri"] and summary.previous_state == "complete"
    c = summary.counts  # t0050-t0052 have new texts, t0053-t0059 are gone
    assert (c.removed, c.added, c.unchanged + c.changed) == (7, 0, 53) and c.unchanged >= 50


def test_a_first_run_has_nothing_to_compare_and_the_plan_needs_the_assets_events(tmp_path, fake_engine_factory):
    texts = [f"ticket {i}" for i in range(20)]
    b, spec_b = night(tmp_path / "b", texts, previous_published=True)
    with pytest.raises(
        AirflowFailException,
        match=r"changes.previous_published .* the spec as a dict with changes.previous_published true\. Set there, "
        r"not in YAML/JSON text or a template, the overrides, a Variable or a trigger",
    ):
        plan_op(b, inlets=()).execute(ctx_with([]))
    plan_op(b).execute(ctx_with([event(1, {"output_uri": str(tmp_path / "b" / "out"), "success_sha256": "1" * 64})]))
    pinned = load_plan(spec_b).changes_from
    assert pinned.source == "published" and pinned.previous_uri is None  # its own earlier event is no baseline
    run_rest(b, fake_engine_factory)
    VllmQAOperator(task_id="qa", spec=b).execute(context())
    assert not (tmp_path / "b" / "out" / "changes").exists()  # nothing published before: no change set


@pytest.mark.reliability
def test_a_baseline_the_bucket_changed_is_refused_not_compared(tmp_path, fake_engine_factory):
    """A writer of the previous run's folder puts back an earlier genuine merge of it, removes or rewrites its
    _SUCCESS.json: the plan (marker) or QA (merge) fails naming the event, never a change set against answers
    that were not the ones published. An event naming a folder outside the allow-list is refused by the plan."""
    texts = [f"ticket number {i}: I was charged twice, please refund" for i in range(60)]
    a, spec_a = night(tmp_path / "a", texts)
    plan_a = VllmPlanOperator(task_id="plan", spec=a)
    plan_a.execute(context())
    run_rest(a, fake_engine_factory)
    out_a = tmp_path / "a" / "out"
    earlier = tmp_path / "a-first-merge"
    shutil.copytree(out_a, earlier)
    first = load_plan(spec_a).shards[0].shard_id  # run again from nothing: its parts get other bytes
    shutil.rmtree(out_a / "shards" / first)
    run_shard(shard_task(spec=spec_a, shard_id=first), engine_factory=fake_engine_factory)
    VllmMergeOperator(task_id="merge", spec=a, plan=plan_xcom(a)).execute(
        context()
    )  # merged again: another results manifest
    VllmQAOperator(task_id="qa", spec=a).execute(context())
    published = VllmPublishOperator(task_id="publish", spec=a, outlets=[ASSET]).execute(context())
    good = tmp_path / "a-published"
    shutil.copytree(out_a, good)

    def plan_b(name: str, ev: dict):
        doc, spec = night(tmp_path / name, texts, previous_published=True)
        plan_op(doc).execute(ctx_with([event(3, ev)]))
        return doc, spec

    # the earlier merge put back (sealed for that folder too): the plan pins the published merge, QA refuses
    b, spec_b = plan_b("b", published)
    shutil.copytree(earlier, out_a, dirs_exist_ok=True)
    assert (out_a / MERGED).read_bytes() != (good / MERGED).read_bytes()
    run_rest(b, fake_engine_factory)
    with pytest.raises(
        AirflowFailException, match=r"Asset x-vllm-batch://nightly event 3 .* not the merge that was publ"
    ):
        VllmQAOperator(task_id="qa", spec=b).execute(context())
    (out_a / MERGED).unlink()
    with pytest.raises(AirflowFailException, match="which now has no _MERGED.json"):
        VllmQAOperator(task_id="qa", spec=b).execute(context())
    record_malicious("changes.previous_published: an earlier merge of the published run put back, or removed", 2, 2)
    shutil.rmtree(out_a)
    shutil.copytree(good, out_a)
    VllmQAOperator(task_id="qa", spec=b).execute(context())
    assert read_changes(Storage(spec_b.io.output_uri)).counts.unchanged == 60

    # the marker rewritten (another sha256), removed, or an event outside the allow-list: the plan fails
    (out_a / SUCCESS).write_bytes((good / SUCCESS).read_bytes() + b" ")
    with pytest.raises(AirflowFailException, match="not the marker that publish wrote"):
        plan_b("c", published)
    (out_a / SUCCESS).unlink()
    with pytest.raises(AirflowFailException, match="has no _SUCCESS.json now"):
        plan_b("d", published)
    with pytest.raises(AirflowFailException, match="outside the allowed prefixes"):
        plan_b("e", {**published, "output_uri": "s3://elsewhere/run/"})
    record_malicious("changes.previous_published: the published marker changed or removed, a foreign prefix", 3, 3)


def test_pinning_checks_the_markers_bytes_and_seal(tmp_path, fake_engine_factory):
    """The step alone: the event's sha256 must be the marker's, the marker this deployment's seal for that
    prefix (a marker of another deployment with a matching sha256 is refused); the prefix not this run's own."""
    from tests.support.task_context import committed_job

    spec, _ = committed_job(tmp_path, fake_engine_factory, n=20)
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    ev = VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    last = LastPublished(asset=ASSET.uri, event_id=1, output_uri=ev["output_uri"], success_sha256=ev["success_sha256"])
    keyring = Keyring.from_env()
    assert pin_last_published(last, str(tmp_path / "next"), keyring=keyring).previous_uri == ev["output_uri"]
    other = Keyring.from_text("another-deployment-" + "x" * 40)
    with pytest.raises(CommitError, match="seal"):
        pin_last_published(last, str(tmp_path / "next"), keyring=other)
    with pytest.raises(SpecError, match="this run's own output prefix"):
        pin_last_published(last, ev["output_uri"], keyring=keyring)
    bad = last.model_copy(update={"success_sha256": hashlib.sha256(b"x").hexdigest()})
    with pytest.raises(CommitError, match="sha256 differs"):
        pin_last_published(bad, str(tmp_path / "next"), keyring=keyring)
    with pytest.raises(CommitError, match="without a success_sha256"):
        pin_last_published(last.model_copy(update={"success_sha256": None}), str(tmp_path / "next"), keyring=keyring)


def test_only_the_jobs_own_publish_events_are_read_latest_date_before_this_run():
    """The job's own publish task's events only; by logical date: the latest date before this run's (its newest
    publish when the date was published twice), never a later date (a backfill of old dates next to tonight's
    run); a run without a logical date (a manual run) takes the newest publish."""

    def ev(i, uri, day, **kw):
        extra = {"output_uri": uri, "success_sha256": f"{i:064x}", "logical_date": day}
        return event(i, extra, **kw)

    d = lambda day: f"2026-11-{day:02d}T02:00:00+00:00"  # noqa: E731
    newest_first = [
        ev(10, "/runs/c/", d(19), dag=None, task=None),  # made through the REST API (no source task)
        event(11, {"output_uri": "/runs/d/", "success_sha256": "e" * 64, "logical_date": d(19), "from_rest_api": True}),
        ev(9, "/runs/b/", d(30), task="other.publish"),  # another task of the DAG
        ev(8, "/runs/dt=30/", d(30)),  # tonight's run, later than the backfilled date below
        ev(7, "/runs/own/", d(20)),  # this run's own folder, published before
        ev(6, ["not", "text"], d(19)),
        ev(5, "/runs/dt=18/", d(18)),  # dt=18 published again (a re-run): the newer publish wins
        ev(4, "/runs/dt=19/", None),  # no logical date: not ordered
        ev(3, "/runs/dt=18-old/", d(18)),
        ev(2, "/runs/dt=17/", d(17)),
    ]
    own = dt.datetime(2026, 11, 20, 2, tzinfo=dt.UTC)
    got = last_published(newest_first, ASSET.uri, DAG, PUBLISH, "/runs/own", own)
    assert (got.event_id, got.output_uri, got.logical_date) == (5, "/runs/dt=18/", d(18))
    assert got.success_sha256 == f"{5:064x}"
    # no logical date of its own: the newest publish of the job
    assert last_published(newest_first, ASSET.uri, DAG, PUBLISH, "/runs/own").event_id == 8
    # nothing of this job before the date: nothing to compare
    early = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    assert last_published(newest_first, ASSET.uri, DAG, PUBLISH, "/runs/own", early).output_uri is None
    assert last_published(newest_first[:1], ASSET.uri, DAG, PUBLISH, "/runs/own").output_uri is None


@pytest.mark.reliability
def test_a_flood_of_other_events_does_not_hide_the_jobs_last_publish(tmp_path, fake_engine_factory):
    """Events made through the REST API (no source DAG) or by another DAG's task, newer than the job's last
    publish and more than one query returns, still leave that publish the baseline: the plan reads on, page by
    page, and never takes 'no event' (no change set, the churn check skipped) from a window someone else filled."""
    from tests.support.task_context import committed_job

    spec, _ = committed_job(tmp_path / "a", fake_engine_factory, n=20)
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    published = VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    flood = [
        event(i, {"output_uri": str(tmp_path / f"x{i}"), "success_sha256": "0" * 64}, dag=None, task=None)
        for i in range(2, 1300)
    ]
    flood += [event(i, {"output_uri": "/elsewhere"}, task="other.publish") for i in range(1300, 1320)]
    b, spec_b = night(tmp_path / "b", [f"ticket {i}" for i in range(20)], previous_published=True)
    plan_op(b).execute(ctx_with([event(1, published), *flood]))
    pinned = load_plan(spec_b).changes_from
    assert (pinned.previous_uri, pinned.event_id) == (published["output_uri"], 1)
    record_malicious("changes.previous_published: the job's last publish buried under newer foreign events", 1, 1)


def test_events_are_read_page_by_page_and_a_window_full_of_others_fails_the_plan():
    """Newest first, ``page`` per query, each before the last one's oldest (inclusive: an event read again is not
    given twice). More foreign events than the plan reads past, or a page that shares one timestamp, before any
    publish of the job: CommitError naming the Asset and the publish task, never 'nothing was published'."""
    api = [event(i, {"output_uri": f"/x{i}", "success_sha256": "0" * 64}, dag=None, task=None) for i in range(2, 30)]
    own = event(1, {"output_uri": "/runs/a/", "success_sha256": "a" * 64, "logical_date": "2026-11-18T02:00:00+00:00"})
    same = event(0, {"output_uri": "/runs/z/", "success_sha256": "f" * 64}, task="other.publish")
    same.timestamp = api[0].timestamp  # read again by the next page's inclusive `before`
    events = Events([own, same, *api])
    got = list(newest_events(events, page=5, most=100))
    assert sorted(e.id for e in got) == list(range(30))  # each once, the one at a page's boundary too
    assert [e.timestamp for e in got] == sorted((e.timestamp for e in got), reverse=True)
    assert events.queries == 8  # 5 fresh, then 4 a page (the boundary read again), the last one short

    tonight = dt.datetime(2026, 11, 20, 2, tzinfo=dt.UTC)
    for date in (None, tonight):
        got = last_published(newest_events(Events([own, *api]), page=5), ASSET.uri, DAG, PUBLISH, "/runs/own", date)
        assert (got.event_id, got.output_uri) == (1, "/runs/a/")
        with pytest.raises(
            CommitError,
            match=r"Asset x-vllm-batch://nightly: read the newest 20 events .* 20 of them not emitted by "
            r"d\.job\.publish .* none names a run .*\(changes\.previous_uri",
        ):
            events = newest_events(Events([own, *api]), page=5, most=20)
            last_published(events, ASSET.uri, DAG, PUBLISH, "/runs/own", date)
    # a publish of the job found before the limit: the best of the newest publishes
    newer = event(
        40, {"output_uri": "/runs/b/", "success_sha256": "b" * 64, "logical_date": "2026-11-19T02:00:00+00:00"}
    )
    got = last_published(
        newest_events(Events([own, *api, newer]), page=5, most=10), ASSET.uri, DAG, PUBLISH, "/o", tonight
    )
    assert got.output_uri == "/runs/b/"
    stuck = [event(2, {}, dag=None, task=None) for _ in range(5)]
    for i, e in enumerate(stuck):
        e.id = 100 + i
    with pytest.raises(CommitError, match="5 events of the Asset share the timestamp"):
        last_published(newest_events(Events([own, *stuck]), page=5), ASSET.uri, DAG, PUBLISH, "/runs/own")
    # the events run out: nothing was published (a first run)
    assert last_published(newest_events(Events(api), page=5), ASSET.uri, DAG, PUBLISH, "/x").output_uri is None


def test_a_retried_plan_keeps_its_pin_and_logs_that_one(tmp_path, fake_engine_factory, capsys):
    """The plan task run again once its plan is written (a retry, a cleared task) keeps the baseline that plan
    pinned, even when the Asset now names a newer publish, and its log names the pinned run, not the newer one."""
    from tests.support.task_context import committed_job

    spec, _ = committed_job(tmp_path / "a", fake_engine_factory, n=20)
    VllmMergeOperator(task_id="merge", spec=spec, plan=plan_xcom(spec)).execute(context())
    VllmQAOperator(task_id="qa", spec=spec).execute(context())
    published = VllmPublishOperator(task_id="publish", spec=spec).execute(context())
    b, spec_b = night(tmp_path / "b", [f"ticket {i}" for i in range(20)], previous_published=True)
    plan_op(b).execute(ctx_with([event(1, published)]))
    newer = event(5, {"output_uri": str(tmp_path / "c"), "success_sha256": "c" * 64})  # not pinned: never read
    capsys.readouterr()
    plan_op(b).execute(ctx_with([newer, event(1, published)]))
    assert load_plan(spec_b).changes_from.previous_uri == published["output_uri"]
    log = "".join(capsys.readouterr())  # the operator's log (Airflow's structlog writes it out)
    assert (
        "x-vllm-batch://nightly event 1 (2026-12-01T01:00:00+00:00): the change set compares with "
        f"{published['output_uri']}" in log
    )
    assert f"compares with {tmp_path / 'c'}" not in log and f"comparing with {tmp_path / 'c'}" not in log
    # the retry does not read the events at all: a flood of others' events, which fails a new plan, fails no retry
    flood = Events([event(100 + i, {"rows": 1}, dag=None, task=None) for i in range(10_050)])
    retry = ctx_with([])
    retry["inlet_events"] = {ASSET: flood}
    plan_op(b).execute(retry)
    assert flood.queries == 0 and load_plan(spec_b).changes_from.previous_uri == published["output_uri"]
    c, _ = night(tmp_path / "c", [f"ticket {i}" for i in range(20)], previous_published=True)
    fresh = ctx_with([])
    fresh["inlet_events"] = {ASSET: flood}
    with pytest.raises(AirflowFailException, match="read the newest 10000 events of the Asset"):
        plan_op(c).execute(fresh)


def _night_qa(root: Path, texts: list[str], labels: list[str], **qa) -> tuple[dict, object]:
    """A night whose model answers only with ``labels`` (a broken deployment answers with one), its change set and,
    with ``qa``, its QA baseline as given."""
    write_parquet(root / "in" / "part-0.parquet", [f"t{i:04d}" for i in range(len(texts))], texts)
    spec = make_spec(
        root / "in",
        root / "out",
        sharding={"target_rows": 20},
        sampling={"max_tokens": 8, "structured": {"choice": labels}},
        changes={"previous_published": True},
        qa=qa,
    )
    return spec.model_dump(mode="json"), spec


def _published_night(root: Path, texts: list[str], factory) -> dict:
    """A night of the full label set planned (nothing published before it), run, QA'd and published: its event."""
    from tests.support.data import LABELS

    a, _ = _night_qa(root, texts, LABELS)
    plan_op(a).execute(ctx_with([]))
    run_rest(a, factory)
    VllmQAOperator(task_id="qa", spec=a).execute(context())
    return VllmPublishOperator(task_id="publish", spec=a, outlets=[ASSET]).execute(context())


def _report(root: Path) -> dict:
    return json.loads((root / "out" / "qa" / "report.json").read_bytes())


@pytest.mark.reliability
def test_qa_judges_drift_against_the_last_published_run_not_a_night_that_failed(tmp_path, fake_engine_factory):
    """Night A is published. Night B answers every ticket 'other' (a broken deployment): its label drift against A
    fails QA, so it is never published. Night C is as broken. Compared with whatever dt=D-1 holds (B's report,
    vouched for by B's own sealed QA record) C shows no drift and passes; with qa.previous_published its baseline
    is A, the run that was published, and C fails. The published report changed in the bucket fails QA."""
    from airflow_provider_vllm.operators.qa import VllmQAFailed

    texts = [f"ticket number {i}: I was charged twice, please refund" for i in range(60)]
    published = _published_night(tmp_path / "a", texts, fake_engine_factory)  # nothing published before it
    events = [event(5, published)]

    b, _ = _night_qa(tmp_path / "b", texts, ["other"], previous_published=True)
    plan_op(b).execute(ctx_with(events))
    run_rest(b, fake_engine_factory)
    with pytest.raises(VllmQAFailed, match="label_drift"):
        VllmQAOperator(task_id="qa", spec=b).execute(context())
    assert _report(tmp_path / "b")["metrics"]["previous"]["run"]["output_uri"] == published["output_uri"]

    # what the nightly did before: dt=D-1's report, sealed by its own QA, though that night was never published
    c_old, _ = _night_qa(
        tmp_path / "c-old", texts, ["other"], previous_report_uri=str(tmp_path / "b" / "out" / "qa" / "report.json")
    )
    plan_op(c_old).execute(ctx_with(events))
    run_rest(c_old, fake_engine_factory)
    VllmQAOperator(task_id="qa", spec=c_old).execute(context())
    assert _report(tmp_path / "c-old")["metrics"]["label_drift"]["tvd"] == 0  # the broken night passed

    c, spec_c = _night_qa(tmp_path / "c", texts, ["other"], previous_published=True)
    plan_op(c).execute(ctx_with(events))
    pin = load_plan(spec_c).changes_from
    report_a = tmp_path / "a" / "out" / "qa" / "report.json"
    assert pin.report_sha256 == hashlib.sha256(report_a.read_bytes()).hexdigest()
    run_rest(c, fake_engine_factory)
    with pytest.raises(VllmQAFailed, match="label_drift"):
        VllmQAOperator(task_id="qa", spec=c).execute(context())
    got = _report(tmp_path / "c")
    assert got["metrics"]["previous"]["run"]["output_uri"] == published["output_uri"]
    assert got["metrics"]["label_drift"]["tvd"] > 0.3

    # A's report changed after it was published (B's report copied over it): QA fails, it
    # never falls back to a report the published marker does not name
    original = report_a.read_bytes()
    report_a.write_bytes((tmp_path / "b" / "out" / "qa" / "report.json").read_bytes())
    with pytest.raises(
        AirflowFailException, match=r"qa.previous_published: .*report.json is not the report .* event 5"
    ):
        VllmQAOperator(task_id="qa", spec=c).execute(context())
    report_a.unlink()
    with pytest.raises(AirflowFailException, match=r"qa.previous_published: .*report.json is missing"):
        VllmQAOperator(task_id="qa", spec=c).execute(context())
    record_malicious("qa.previous_published: the published report replaced or removed", 2, 2)
    report_a.write_bytes(original)
    with pytest.raises(VllmQAFailed, match="label_drift"):
        VllmQAOperator(task_id="qa", spec=c).execute(context())


def test_qa_with_nothing_published_before_notes_it_and_a_marker_without_a_report_warns(tmp_path, fake_engine_factory):
    from tests.support.data import LABELS

    texts = [f"ticket {i}" for i in range(30)]
    a, _ = _night_qa(tmp_path / "a", texts, LABELS, previous_published=True)
    plan_op(a).execute(ctx_with([]))
    run_rest(a, fake_engine_factory)
    VllmQAOperator(task_id="qa", spec=a).execute(context())
    got = _report(tmp_path / "a")
    assert got["metrics"]["label_drift"] is None
    assert any("published nothing before this run (qa.previous_published)" in n for n in got["notes"])
    assert {c["name"]: c["status"] for c in got["checks"]}["label_drift"] == "skip"

    # a pin whose marker names no report (a plan written before the pin recorded it): not used, the check warns
    from airflow_provider_vllm.core.plan import ChangesFrom
    from airflow_provider_vllm.steps.qa.store import load_pinned_report

    pin = ChangesFrom(
        source="published", identifier=ASSET.uri, snapshot_id=None, previous_uri=str(tmp_path / "a" / "out")
    )
    previous, uri = load_pinned_report(pin)
    assert uri.endswith("qa/report.json") and "names no qa/report.json" in previous["refused"]["why"]
    with pytest.raises(CommitError, match="pinned no published run"):
        load_pinned_report(None)
    previous, _ = load_pinned_report(pin.model_copy(update={"source": "table"}))  # changes.previous_table's pin
    assert "_PUBLISHING.json names no qa/report.json" in previous["refused"]["why"]


@pytest.mark.reliability
def test_qa_takes_its_baseline_only_from_the_plan_the_run_was_merged_under(tmp_path, fake_engine_factory):
    """An earlier plan of the same folder is sealed for it too: one made before anything was published (the folder
    was emptied and planned again since, e.g. to recover a run) pins no baseline. Put back after the merge, QA would
    judge a broken night against nothing (label drift skipped: a pass). QA takes only the plan whose seal the
    sealed _MERGED.json names (plan_mac), and fails naming the plan otherwise."""
    from airflow_provider_vllm.core.plan import PLAN_FILE
    from airflow_provider_vllm.operators.qa import VllmQAFailed

    texts = [f"ticket number {i}: I was charged twice, please refund" for i in range(60)]
    published = _published_night(tmp_path / "a", texts, fake_engine_factory)

    c, spec_c = _night_qa(tmp_path / "c", texts, ["other"], previous_published=True)
    plan_op(c).execute(ctx_with([]))  # planned before A's publish was seen: nothing to compare with
    assert load_plan(spec_c).changes_from.previous_uri is None
    plan_file = tmp_path / "c" / "out" / PLAN_FILE
    earlier = plan_file.read_bytes()
    shutil.rmtree(tmp_path / "c" / "out")  # the folder emptied, the run planned again
    plan_op(c).execute(ctx_with([event(5, published)]))
    assert load_plan(spec_c).changes_from.previous_uri == published["output_uri"]
    run_rest(c, fake_engine_factory)
    with pytest.raises(VllmQAFailed, match="label_drift"):
        VllmQAOperator(task_id="qa", spec=c).execute(context())

    plan_file.write_bytes(earlier)  # the earlier genuine plan put back after the merge
    with pytest.raises(AirflowFailException, match=r"_plan.json is not the plan .* merged under"):
        VllmQAOperator(task_id="qa", spec=c).execute(context())
    record_malicious("qa: an earlier plan of the folder put back after the merge", 1, 1)


@pytest.mark.reliability
def test_publish_takes_the_change_set_of_the_plan_the_run_was_merged_under(tmp_path, fake_engine_factory):
    """As QA: an earlier plan of the folder put back after QA (one that pinned nothing to compare with) must not make
    publish leave the run's change set out of _SUCCESS.json; publish refuses it, naming the plan."""
    from airflow_provider_vllm.core.plan import PLAN_FILE
    from tests.support.data import LABELS

    texts = [f"ticket number {i}" for i in range(40)]
    published = _published_night(tmp_path / "a", texts, fake_engine_factory)

    c, _ = _night_qa(tmp_path / "c", texts, LABELS, previous_published=True)
    plan_op(c).execute(ctx_with([]))
    plan_file = tmp_path / "c" / "out" / PLAN_FILE
    earlier = plan_file.read_bytes()
    shutil.rmtree(tmp_path / "c" / "out")
    plan_op(c).execute(ctx_with([event(5, published)]))
    run_rest(c, fake_engine_factory)
    VllmQAOperator(task_id="qa", spec=c).execute(context())
    assert (tmp_path / "c" / "out" / "changes").exists()
    plan_file.write_bytes(earlier)
    with pytest.raises(AirflowFailException, match=r"_plan.json is not the plan .* merged under"):
        VllmPublishOperator(task_id="publish", spec=c, outlets=[ASSET]).execute(context())
    assert not (tmp_path / "c" / "out" / SUCCESS).exists()
    record_malicious("publish: an earlier plan of the folder put back after QA", 1, 1)


@pytest.mark.reliability
def test_qa_refuses_a_merge_that_names_no_plan(tmp_path, fake_engine_factory):
    """A sealed merge summary without plan_mac (written before merge recorded it) says nothing about which of the
    folder's sealed plans the run was made with: QA and publish fail closed, asking for the merge again, instead
    of taking whatever plan is in the folder (publish checks the plan first, as QA does, with QA's message)."""
    from airflow_provider_vllm.core import seal as seals
    from airflow_provider_vllm.core.records import MergeSummary
    from tests.support.data import LABELS

    texts = [f"ticket number {i}" for i in range(40)]
    c, spec_c = _night_qa(tmp_path / "c", texts, LABELS)
    plan_op(c).execute(ctx_with([]))
    run_rest(c, fake_engine_factory)
    out = tmp_path / "c" / "out"
    merged = MergeSummary.model_validate_json((out / MERGED).read_bytes())
    assert merged.plan_mac is not None
    older = seals.seal_record(
        Keyring.from_env(),
        seals.MERGED,
        seals.scope_of(Storage(spec_c.io.output_uri).uri()),
        merged.model_copy(update={"plan_mac": None, "seal": None}),
    )
    (out / MERGED).write_bytes(seals.record_bytes(older))  # sealed by this deployment, but naming no plan
    with pytest.raises(AirflowFailException, match="names no plan .* run the merge task again"):
        VllmQAOperator(task_id="qa", spec=c).execute(context())
    with pytest.raises(AirflowFailException, match="names no plan .* run the merge task again"):
        VllmPublishOperator(task_id="publish", spec=c, outlets=[ASSET]).execute(context())
    assert not (out / SUCCESS).exists()
    record_malicious("qa: a sealed merge summary that names no plan", 1, 1)


def test_the_runs_own_folder_under_its_other_store_name_is_no_baseline_to_pick():
    """A run that published before under ``s3a://`` (the data root's Variable since spelled ``s3://``) is this run's
    own folder: publish's own-prefix check compares the two names as one store and refuses it, so picking it failed
    the plan of a run without a logical date instead of skipping to the publish before it."""

    def ev(i, uri):
        return event(i, {"output_uri": uri, "success_sha256": f"{i:064x}", "logical_date": None})

    newest_first = [ev(2, "s3a://lake/runs/own/"), ev(1, "gcs://lake/runs/old/")]
    got = last_published(newest_first, ASSET.uri, DAG, PUBLISH, "s3://lake/runs/own")
    assert (got.event_id, got.output_uri) == (1, "gcs://lake/runs/old/")
    got = last_published(
        [ev(2, "gs://lake/runs/own"), *newest_first[1:]], ASSET.uri, DAG, PUBLISH, "gcs://lake/runs/own/"
    )
    assert got.event_id == 1
