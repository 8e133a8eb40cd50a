"""The change in accuracy compares like with like (steps/qa/yardstick.py, through ``evaluate`` and ``qa_run``): each
report records what each source of known labels scored against; a golden set replaced between two runs (rows
relabelled, other ids, a harder or an easier set) is compared paired on the ids both share with the same label, or
not compared (a warning naming both), never judged as if it were the same yardstick; a previous report that did not
record it warns once; an edited record is refused with the report (the seal)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa.evaluate import evaluate
from tests.support.qa_rows import check, ok_row, split

LAB = ["billing", "bug", "account", "other", "feature_request"]


def _truth(i: int) -> str:
    return LAB[i % 5]


def _other(i: int) -> str:
    return LAB[(i + 1) % 5]


def _rows(ids: list[str], right: set[str]) -> list[dict]:
    """The model's answers: the true label (``_truth`` of the id's number) for the ids in ``right``, another for the
    rest."""
    return [
        ok_row(0, id=i, label=_truth(int(i[1:])) if i in right else _other(int(i[1:])), confidence=0.9) for i in ids
    ]


def _golden(ids: list[str], relabelled: set[str] = frozenset()) -> pa.Table:  # type: ignore[assignment]
    """Known labels: each id's true label, or another one for the ids ``relabelled``."""
    return pa.table({"id": ids, "label": [_other(int(i[1:])) if i in relabelled else _truth(int(i[1:])) for i in ids]})


def _ids(prefix: str, n: int, start: int = 0) -> list[str]:
    return [f"{prefix}{k}" for k in range(start, start + n)]


def _qa(rows: list[dict], golden: pa.Table, previous=None, source="golden_set", **kw):
    kw.setdefault("spec", QASpec())
    if source == "ride_along":
        kw["ride_along"] = (*split(rows), golden)
        rows = []
    else:
        kw.update(reference=golden, reference_source=source)
    return evaluate(*split(rows), labels=LAB, structured=True, previous=previous, **kw)


# ---- a golden set replaced between two runs ---------------------------------------------------------------------
@pytest.mark.parametrize("source", ["golden_set", "ride_along"])
def test_relabelled_rows_are_compared_on_the_ids_whose_label_did_not_change(source):
    """The same 300 ids, the same answers; 60 rows relabelled since (the labellers corrected them, and the model's
    answers no longer match): pooled, a 20-point "real drop" failed a run whose model did not change. Compared on
    the 240 ids whose label is the same in both, paired: no change, a pass, and the detail says what changed."""
    ids = _ids("g", 300)
    rows = _rows(ids, set(ids[:270]))
    before = _qa(rows, _golden(ids), source=source).to_dict()
    rep = _qa(rows, _golden(ids, set(ids[200:260])), before, source=source)
    src = rep.metrics["quality"]["sources"][source]
    assert src["value"] == pytest.approx(210 / 300)  # the accuracy itself is the new set's
    c = check(rep, "accuracy_drop")
    assert c["status"] == "pass" and c["value"] == 0, c
    assert src["compared"]["basis"] == "shared" and src["compared"]["shared"] == 240
    assert src["vs_previous"]["method"] == "newcombe-paired" and src["vs_previous"]["previous_labelled"] == 240
    assert (
        "changed since the previous report" in c["detail"] and "60 id(s) relabelled, 0 added, 0 removed" in c["detail"]
    )
    assert src["yardstick"]["ids_sha256"] == before["metrics"]["quality"]["sources"][source]["yardstick"]["ids_sha256"]
    assert (
        src["yardstick"]["pairs_sha256"] != before["metrics"]["quality"]["sources"][source]["yardstick"]["pairs_sha256"]
    )


def test_a_golden_set_of_other_ids_is_not_compared_but_warns_naming_both():
    """Another golden set (other ids, a harder one: 50 % where the old one had 90 %): the old check failed a good run
    on a 40-point "drop". Nothing can be paired: not compared, a warning (a person looks), never a pass nor a fail."""
    old, new = _ids("g", 300), _ids("h", 300)
    before = _qa(_rows(old, set(old[:270])), _golden(old)).to_dict()
    rep = _qa(_rows(new, set(new[:150])), _golden(new), before)
    c = check(rep, "accuracy_drop")
    assert c["status"] == "warn" and c["value"] is None, c
    assert "the golden set changed since the previous report" in c["detail"]
    assert "0 id(s) relabelled, 300 added, 300 removed" in c["detail"] and "accuracy not compared" in c["detail"]
    was = before["metrics"]["quality"]["sources"]["golden_set"]["yardstick"]["pairs_sha256"]
    now = rep.metrics["quality"]["sources"]["golden_set"]["yardstick"]["pairs_sha256"]
    assert was[:16] in c["detail"] and now[:16] in c["detail"]  # both identities named
    assert rep.metrics["quality"]["sources"]["golden_set"]["vs_previous"] is None
    assert rep.status == "warn"


def test_a_harder_golden_set_does_not_fail_a_good_run():
    """300 hard rows added to the golden set (the model gets 30 % of them): pooled, 90 % fell to 60 %, a real drop
    and a fail. On the 300 ids of the old set the model answers as before: a pass; the new rows are counted."""
    old, hard = _ids("g", 300), _ids("g", 300, start=300)
    before = _qa(_rows(old, set(old[:270])), _golden(old)).to_dict()
    rep = _qa(
        _rows(old + hard, set(old[:270] + hard[:90])),
        _golden(old + hard),
        before,
        spec=QASpec(warn_accuracy_below=0.5, fail_accuracy_below=0.4),
    )
    c = check(rep, "accuracy_drop")
    assert c["status"] == "pass" and "0 id(s) relabelled, 300 added, 0 removed" in c["detail"], c
    assert rep.status == "pass"


def test_an_easier_golden_set_does_not_hide_a_real_drop():
    """The model really got worse on the 300 old golden ids (270 right, now 200), while 3,000 easy rows joined the
    set: pooled, 90 % rose to 97 %, a "real gain", and the run was published. Paired on the old ids: a real drop of
    23 points, a fail (the model's drop, measured on the labels both sets share)."""
    old, easy = _ids("g", 300), _ids("g", 3000, start=300)
    before = _qa(_rows(old, set(old[:270])), _golden(old)).to_dict()
    rep = _qa(_rows(old + easy, set(old[:200] + easy)), _golden(old + easy), before)
    assert rep.metrics["quality"]["accuracy"]["value"] > 0.9  # the pooled figure went up
    c = check(rep, "accuracy_drop")
    assert c["status"] == "fail" and c["value"] == pytest.approx(70 / 300) and "a real drop" in c["detail"], c
    paired = rep.metrics["quality"]["sources"]["golden_set"]["vs_previous"]["paired"]
    assert paired == {"both": 200, "now_only": 0, "before_only": 70, "neither": 30}


def test_a_few_shared_ids_do_not_pass_the_check():
    """Of a replaced golden set only 10 ids are left with their label: a change on them within noise is no
    evidence that nothing dropped: a warning, not a pass."""
    old, new = _ids("g", 300), _ids("g", 300, start=290)
    before = _qa(_rows(old, set(old)), _golden(old)).to_dict()
    rep = _qa(_rows(new, set(new)), _golden(new), before)
    c = check(rep, "accuracy_drop")
    assert c["status"] == "warn" and "only 10 shared id(s), fewer than qa.min_labelled 30" in c["detail"], c


def test_the_same_golden_file_joined_to_each_nights_own_rows_is_the_same_yardstick():
    """``qa.reference.golden_uri`` is a labels file joined by id to the run's rows: a night of other tickets scores
    other ids of the same pinned file. Those nights were taken for a replaced golden set: the detail said the golden
    set changed (its files had not), nothing could be paired, and accuracy_drop warned every night (a person asked
    every night), a real drop included. The same pinned files are the same labels: two samples of them, compared as
    independent, as each night's own ``input_column`` rows are."""
    pins = {"golden_set": {"uri": "s3://b/labels", "files_sha256": "1" * 64}}
    night1, night2 = _ids("g", 300), _ids("g", 300, start=300)
    before = _qa(_rows(night1, set(night1[:270])), _golden(night1), yardsticks=pins).to_dict()
    quiet = _qa(_rows(night2, set(night2[:268])), _golden(night2), before, yardsticks=pins)
    c = check(quiet, "accuracy_drop")
    assert c["status"] == "pass" and "changed" not in c["detail"], c
    assert quiet.metrics["quality"]["sources"]["golden_set"]["compared"]["basis"] == "same"
    assert "each run scored the ids of its own rows the set holds" in c["detail"]
    assert quiet.metrics["quality"]["vs_previous"] is not None  # the pooled change: the same yardstick
    dropped = _qa(_rows(night2, set(night2[:180])), _golden(night2), before, yardsticks=pins)
    c = check(dropped, "accuracy_drop")
    assert c["status"] == "fail" and c["value"] == pytest.approx(0.3) and "a real drop" in c["detail"], c
    # another pinned file with other ids: still a replaced golden set, not compared (a warning naming both)
    other = {"golden_set": {"uri": "s3://b/labels", "files_sha256": "2" * 64}}
    replaced = _qa(_rows(night2, set(night2[:268])), _golden(night2), before, yardsticks=other)
    assert check(replaced, "accuracy_drop")["status"] == "warn"
    assert replaced.metrics["quality"]["sources"]["golden_set"]["compared"]["basis"] == "not compared"


def test_a_changed_golden_set_too_large_to_pair_warns(monkeypatch):
    from airflow_provider_vllm.steps.qa import yardstick

    monkeypatch.setattr(yardstick, "MAX_ITEMS", 100)
    ids = _ids("g", 300)
    rows = _rows(ids, set(ids[:270]))
    pins = {"golden_set": {"uri": "s3://b/golden/v1", "files_sha256": "1" * 64}}
    before = _qa(rows, _golden(ids), yardsticks=pins).to_dict()
    assert before["metrics"]["quality"]["sources"]["golden_set"]["yardstick"]["items"] is None
    # the same pinned files: the same labels, compared as before
    same = _qa(rows, _golden(ids), before, yardsticks=pins)
    assert check(same, "accuracy_drop")["status"] == "pass"
    assert same.metrics["quality"]["sources"]["golden_set"]["compared"]["basis"] == "same"
    other = {"golden_set": {"uri": "s3://b/golden/v2", "files_sha256": "2" * 64}}
    rep = _qa(rows, _golden(ids, set(ids[:100])), before, yardsticks=other)
    c = check(rep, "accuracy_drop")
    assert c["status"] == "warn" and c["value"] is None, c
    assert "s3://b/golden/v2: files sha256 2222222222222222…" in c["detail"]
    assert "s3://b/golden/v1: files sha256 1111111111111111…" in c["detail"]
    assert "kept no per-id results to pair" in c["detail"]


def test_the_pooled_change_does_not_mix_a_source_whose_yardstick_changed():
    """Two sources: the ride-along rows the same, the golden set replaced. The pooled change would mix the two; it is
    not computed, and the check judges each source on its own basis."""
    ids, gids = _ids("g", 300), [f"_vllm_golden:x{k}" for k in range(200)]
    ride_rows = [ok_row(0, id=i, label=LAB[k % 5], confidence=0.9) for k, i in enumerate(gids)]
    ride = (*split(ride_rows), pa.table({"id": gids, "label": [LAB[k % 5] for k in range(200)]}))
    rows = _rows(ids, set(ids[:270]))
    kw = dict(labels=LAB, structured=True, spec=QASpec(), reference_source="golden_set", ride_along=ride)
    before = evaluate(*split(rows), reference=_golden(ids), **kw).to_dict()
    same = evaluate(*split(rows), reference=_golden(ids), previous=before, **kw)
    assert same.metrics["quality"]["vs_previous"] is not None
    rep = evaluate(*split(rows), reference=_golden(ids, set(ids[:50])), previous=before, **kw)
    q = rep.metrics["quality"]
    assert q["vs_previous"] is None
    assert q["sources"]["ride_along"]["compared"]["basis"] == "same"
    assert q["sources"]["golden_set"]["compared"]["basis"] == "shared"
    assert "all sources" not in check(rep, "accuracy_drop")["detail"]


# ---- a previous report written before the yardstick ---------------------------------------------------------------
def _legacy(report: dict) -> dict:
    """``report`` as the previous version wrote it: no yardstick, no compared basis."""
    old = json.loads(json.dumps(report))
    for v in old["metrics"]["quality"]["sources"].values():
        v.pop("yardstick", None)
        v.pop("compared", None)
    return old


def test_a_previous_report_without_a_yardstick_warns_once():
    """The upgrade: the previous report does not say which known labels it scored. Not a silent pass that could
    hide a drop (nor a fail): a warning, with the unjudged change for information; the next run compares with the
    report this one writes."""
    ids = _ids("g", 300)
    rows = _rows(ids, set(ids[:270]))
    old = _legacy(_qa(rows, _golden(ids)).to_dict())
    rep = _qa(rows, _golden(ids), old)
    c = check(rep, "accuracy_drop")
    assert c["status"] == "warn" and c["value"] is None, c
    assert "does not record which known labels its golden set scored" in c["detail"]
    assert "for information, +0.0 pt vs 90.0% of 300" in c["detail"] and "the next run compares" in c["detail"]
    assert rep.metrics["quality"]["vs_previous"] is None
    nxt = _qa(rows, _golden(ids), rep.to_dict())  # the night after: new with new
    assert check(nxt, "accuracy_drop")["status"] == "pass"


def test_a_legacy_report_that_names_the_pinned_golden_files_is_compared_when_they_are_the_same():
    """A report of the previous version names the golden set's pinned files (``run.golden_set``): the same files are
    the same labels (compared as before); other files are a changed golden set, not compared (a warning)."""
    from airflow_provider_vllm.steps.qa.yardstick import files_digest

    ids = _ids("g", 300)
    rows = _rows(ids, set(ids[:270]))
    files = [{"path": "g.parquet", "bytes": 10, "sha256": "a" * 64}]
    info = {"golden_set": {"uri": "s3://b/golden", "files": files}}
    old = _legacy(_qa(rows, _golden(ids), run_info=info).to_dict())
    pins = {"golden_set": {"uri": "s3://b/golden", "files_sha256": files_digest(files)}}
    rep = _qa(_rows(ids, set(ids[:200])), _golden(ids), old, yardsticks=pins)
    c = check(rep, "accuracy_drop")
    assert c["status"] == "fail" and "a real drop" in c["detail"], c
    other = {"golden_set": {"uri": "s3://b/golden", "files_sha256": files_digest([{"sha256": "b" * 64}])}}
    c = check(_qa(rows, _golden(ids), old, yardsticks=other), "accuracy_drop")
    assert c["status"] == "warn" and "kept no per-id results to pair" in c["detail"], c


# ---- the run's own labelled rows ---------------------------------------------------------------------------------
def test_input_column_labels_compare_only_the_same_column_and_say_the_rows_are_each_runs_own():
    ids = _ids("g", 300)
    rows = _rows(ids, set(ids[:270]))
    col = {"input_column": {"uri": "s3://b/in", "column": "truth"}}
    before = _qa(rows, _golden(ids), source="input_column", yardsticks=col).to_dict()
    c = check(_qa(rows, _golden(ids), before, source="input_column", yardsticks=col), "accuracy_drop")
    assert c["status"] == "pass" and "each run's own labelled rows (column 'truth')" in c["detail"], c
    other = {"input_column": {"uri": "s3://b/in", "column": "truth_v2"}}
    c = check(_qa(rows, _golden(ids), before, source="input_column", yardsticks=other), "accuracy_drop")
    assert c["status"] == "warn" and "column 'truth_v2'" in c["detail"] and "column 'truth'" in c["detail"], c


# ---- units ---------------------------------------------------------------------------------------------------------
def test_items_are_compact_sorted_and_decode_to_each_ids_result():
    import base64

    from airflow_provider_vllm.steps.qa import yardstick

    ids = _ids("g", 50)
    y = _qa(_rows(ids, set(ids[:20])), _golden(ids)).metrics["quality"]["sources"]["golden_set"]["yardstick"]
    raw = base64.b64decode(y["items"])
    assert len(raw) == 50 * yardstick.ITEM_BYTES and y["scored"] == 50
    recs = [raw[k : k + yardstick.ITEM_BYTES] for k in range(0, len(raw), yardstick.ITEM_BYTES)]
    assert recs == sorted(recs)
    items = yardstick._items(y)
    assert items is not None and sum(right for _, right in items.values()) == 20
    assert yardstick._items({**y, "items": "not base64!"}) is None
    assert yardstick._items({**y, "items_format": "other"}) is None


# ---- the whole QA step: recorded, and under the seal ---------------------------------------------------------------
N = 60
IDS = [f"t{i:03d}" for i in range(N)]


def _write_golden(path, relabelled: int = 0) -> None:
    from tests.support.data import LABELS

    labels = [LABELS[(i + 1) % 5] if i < relabelled else LABELS[i % 5] for i in range(N)]
    pq.write_table(pa.table({"id": IDS, "label": labels}), path)


def _run(tmp_path, day: str, golden, previous: str | None = None):
    from airflow_provider_vllm.steps.plan.planner import plan_job
    from airflow_provider_vllm.steps.qa.stage import qa_run
    from airflow_provider_vllm.worker.shard import run_shard
    from tests.support.data import LABELS, make_spec, merge, shard_task, write_parquet
    from tests.support.fakes import FakeEngine

    write_parquet(tmp_path / "in" / "a.parquet", IDS, [f"{LABELS[i % 5]} ticket {i}" for i in range(N)])
    qa = {"reference": {"golden_uri": str(golden)}, "previous_report_uri": previous, "min_labelled": 10}
    spec = make_spec(tmp_path / "in", tmp_path / day, qa=qa)
    plan = plan_job(spec)
    for shard in plan.shards:
        run_shard(
            shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=lambda s: FakeEngine(s, real_vllm=False)
        )
    merge(spec)
    return spec, plan, qa_run(spec)[0]


@pytest.mark.reliability
def test_a_replaced_golden_file_is_compared_on_shared_ids_and_an_edited_record_is_refused(tmp_path):
    """Two nights of the same input and model; the golden file replaced in between (20 of its 60 rows relabelled).
    The report records the pinned files' digest and what it scored; the second night compares paired on the 40 ids
    whose label did not change (the same answers: no change). A bucket writer who edits the first night's recorded
    yardstick to the second's (so that the replaced set would pass as the same one) changes report.json's bytes:
    its run's sealed qa/_QA.json no longer vouches for it, the report is not used, and the check warns."""
    from airflow_provider_vllm.steps.qa.stage import qa_run
    from airflow_provider_vllm.steps.qa.yardstick import files_digest
    from tests.support.ledger import record_malicious

    golden = tmp_path / "golden.parquet"
    _write_golden(golden)
    _, plan1, day1 = _run(tmp_path, "day1", golden)
    y1 = day1.metrics["quality"]["sources"]["golden_set"]["yardstick"]
    assert plan1.golden_set is not None and y1["files_sha256"] == files_digest(plan1.golden_set.files)
    assert y1["uri"] == str(golden) and y1["scored"] == N
    _write_golden(golden, relabelled=20)  # the golden file replaced between the nights
    previous = str(tmp_path / "day1" / "qa" / "report.json")
    spec2, plan2, day2 = _run(tmp_path, "day2", golden, previous)
    src = day2.metrics["quality"]["sources"]["golden_set"]
    assert src["yardstick"]["files_sha256"] == files_digest(plan2.golden_set.files) != y1["files_sha256"]
    assert src["compared"]["basis"] == "shared" and src["compared"]["shared"] == 40
    assert src["compared"]["previous_yardstick"]["files_sha256"] == y1["files_sha256"]
    assert src["vs_previous"]["delta"] == 0 and src["vs_previous"]["paired"]["now_only"] == 0
    c = check(day2, "accuracy_drop")
    assert c["status"] == "pass" and "20 id(s) relabelled" in c["detail"], c
    stored = json.loads((tmp_path / "day2" / "qa" / "report.json").read_text())
    assert stored["metrics"]["quality"]["sources"]["golden_set"]["yardstick"] == src["yardstick"]

    was = json.loads((tmp_path / "day1" / "qa" / "report.json").read_text())
    was["metrics"]["quality"]["sources"]["golden_set"]["yardstick"] = src["yardstick"]  # "the same golden set"
    (tmp_path / "day1" / "qa" / "report.json").write_text(json.dumps(was, indent=2))
    again = qa_run(spec2)[0]
    c = check(again, "accuracy_drop")
    assert c["status"] == "warn" and c["value"] is None and previous in c["detail"], c
    assert "not the file the sealed qa/_QA.json names" in c["detail"]
    assert "vs_previous" not in again.metrics["quality"]["sources"]["golden_set"]
    record_malicious("forged_previous_qa_yardstick", 1, 1)
