"""Quality over labelled rows in QA (steps/qa/labelled.py through ``evaluate``), against pandas and
scikit-learn computed here from the same rows: accuracy and its interval, macro-F1, the confusion
matrix, the reliability table, the confident halves, the change against a previous report, on
both QA paths (in memory, streamed over files)."""

from __future__ import annotations

import random

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

from airflow_provider_vllm.core.spec import QASpec
from airflow_provider_vllm.steps.qa.accuracy import NO_ANSWER, wilson
from airflow_provider_vllm.steps.qa.evaluate import evaluate, evaluate_stream
from airflow_provider_vllm.steps.qa.reference import References
from tests.support.qa_rows import err_row, ok_row, split

LABELS = ["billing", "bug", "account", "other"]


def _run(n=3000, n_err=60, seed=5, acc=0.55):
    """Results and errors of a labelled job, the known labels (for 70% of the ids, some outside the run),
    and the confidence roughly calibrated: right answers are more confident."""
    rnd = random.Random(seed)
    truth, recs = {}, []
    for i in range(n):
        t = rnd.choice(LABELS)
        right = rnd.random() < acc
        label = t if right else rnd.choice(LABELS)
        conf = min(0.999, max(0.05, rnd.gauss(0.75 if right else 0.45, 0.18)))
        valid = rnd.random() > 0.02
        recs.append(ok_row(i, label=label if valid else None, valid=valid, confidence=conf, prompt_hash=i % 2500))
        if rnd.random() < 0.7:
            truth[f"r{i}"] = t
    for i in range(n_err):
        recs.append(err_row(i))
        if i % 2:
            truth[f"e{i}"] = rnd.choice(LABELS)
    truth.update({f"gone{i}": "bug" for i in range(25)})  # known ids not in this run
    truth["r1"] = "  "  # a blank label is no label
    results, errors = split(recs)
    ref = pa.table({"id": list(truth), "label": list(truth.values())})
    return results, errors, ref


def _expected(results, errors, ref):
    """What QA should say, from pandas and scikit-learn."""
    r = results.to_pandas()
    r["pred"] = r["label"].where(r["valid"] != False, None)  # noqa: E712 (pandas)
    known = ref.to_pandas()
    known["label"] = known["label"].str.strip().replace("", None)
    known = known.dropna()
    ok = known.merge(r[["id", "pred", "confidence"]], on="id")
    er = known.merge(errors.to_pandas()[["id"]], on="id").assign(pred=None, confidence=None)
    scored = pd.concat([ok, er], ignore_index=True)
    scored["y_pred"] = scored["pred"].fillna(NO_ANSWER)
    return known, scored


def _kw(**over):
    kw = dict(spec=QASpec(sample_size=30, least_confident=7), labels=LABELS, structured=True)
    kw.update(over)
    return kw


def test_quality_equals_pandas_and_scikit_learn():
    results, errors, ref = _run()
    rep = evaluate(results, errors, reference=ref, **_kw())
    q = rep.metrics["quality"]
    known, scored = _expected(results, errors, ref)
    assert q["labelled"] == len(scored) and q["sources"]["golden_set"]["known"] == len(known)
    assert q["sources"]["golden_set"]["unmatched"] == len(known) - len(scored) >= 25
    assert q["accuracy"]["value"] == pytest.approx(accuracy_score(scored["label"], scored["y_pred"]))
    assert (q["accuracy"]["low"], q["accuracy"]["high"]) == wilson(
        int((scored.label == scored.y_pred).sum()), len(scored)
    )
    classes = q["classes"]
    assert classes == LABELS
    assert q["macro_f1"] == pytest.approx(
        f1_score(scored["label"], scored["y_pred"], labels=classes, average="macro", zero_division=0)
    )
    cm = confusion_matrix(scored["label"], scored["y_pred"], labels=classes + [NO_ANSWER])
    cells = {(c["true"], c["pred"]): c["count"] for c in q["confusion"]}
    assert all(
        cells.get((t, p), 0) == cm[i, j] for i, t in enumerate(classes) for j, p in enumerate(classes + [NO_ANSWER])
    )
    assert q["no_answer"] == int(scored["pred"].isna().sum()) > 30  # errors and invalid answers are wrong answers


def test_reliability_table_and_halves_equal_pandas():
    results, errors, ref = _run()
    q = evaluate(results, errors, reference=ref, **_kw()).metrics["quality"]
    _, scored = _expected(results, errors, ref)
    s = scored.dropna(subset=["confidence"]).copy()
    s["correct"] = s["label"] == s["pred"]
    s["b"] = (s["confidence"].astype("float32").astype(float) * 10).astype(int).clip(upper=9)
    g = s.groupby("b").agg(rows=("correct", "size"), acc=("correct", "mean"), conf=("confidence", "mean"))
    rel = q["reliability"]
    assert rel["rows"] == len(s)
    for b in rel["buckets"]:
        i = round(b["low"] * 10)
        if i in g.index:
            assert b["rows"] == g.loc[i, "rows"] and b["accuracy_value"] == pytest.approx(g.loc[i, "acc"])
            assert b["mean_confidence"] == pytest.approx(g.loc[i, "conf"], rel=1e-5)
        else:
            assert b["rows"] == 0 and b["accuracy_value"] is None
    ece = sum(g["rows"] / len(s) * (g["acc"] - g["conf"]).abs())
    assert rel["ece"] == pytest.approx(ece, rel=1e-4)
    top = rel["thresholds"][5]  # confidence >= 0.5
    kept = s[s["b"] >= 5]
    assert (
        top["at_least"] == 0.5
        and top["kept"] == len(kept)
        and top["kept_accuracy"] == pytest.approx(kept.correct.mean())
    )
    ordered = s.sort_values("confidence", ascending=False, kind="stable")
    half = (len(ordered) + 1) // 2
    h = q["halves"]
    assert h["most"]["of"] == half and h["least"]["of"] == len(ordered) - half
    assert h["most"]["confidence_min"] >= h["least"]["confidence_max"]
    most_acc = ordered.iloc[:half]["correct"].mean()  # ties at the cut are broken by id hash: same count
    assert h["most"]["value"] == pytest.approx(most_acc, abs=2 / half)
    assert h["most"]["value"] > h["least"]["value"]  # the synthetic confidence is informative


def test_the_change_in_accuracy_against_the_previous_report():
    results, errors, ref = _run(acc=0.8, seed=1)
    before = evaluate(results, errors, reference=ref, **_kw()).to_dict()
    worse_r, worse_e, _ = _run(acc=0.5, seed=1)
    q = evaluate(worse_r, worse_e, reference=ref, previous=before, **_kw()).metrics["quality"]
    v = q["vs_previous"]
    assert v["previous"] == pytest.approx(before["metrics"]["quality"]["accuracy"]["value"])
    assert v["delta"] == pytest.approx(q["accuracy"]["value"] - v["previous"]) and v["real_drop"] and v["high"] < 0
    same = evaluate(results, errors, reference=ref, previous=before, **_kw()).metrics["quality"]["vs_previous"]
    assert same["delta"] == 0 and not same["real_drop"]


def test_ride_along_rows_are_a_source_of_their_own():
    results, errors, ref = _run(n=400)
    g_res, g_err = split([ok_row(i, label=LABELS[i % 4], confidence=0.9) for i in range(40)] + [err_row(0)])
    g_ref = pa.table({"id": [f"r{i}" for i in range(40)] + ["e0"], "label": [LABELS[(i // 2) % 4] for i in range(41)]})
    q = evaluate(results, errors, reference=ref, ride_along=(g_res, g_err, g_ref), **_kw()).metrics["quality"]
    ride = q["sources"]["ride_along"]
    right = sum(LABELS[i % 4] == LABELS[(i // 2) % 4] for i in range(40))
    assert ride["of"] == 41 and ride["count"] == right and ride["unmatched"] == 0
    run = q["sources"]["golden_set"]
    assert q["labelled"] == run["of"] + 41 and q["correct"] == run["count"] + right


def test_no_reference_no_quality_and_no_known_id_in_the_run():
    results, errors, _ = _run(n=100)
    assert evaluate(results, errors, **_kw()).metrics["quality"] is None
    q = evaluate(results, errors, reference=pa.table({"id": ["x"], "label": ["bug"]}), **_kw()).metrics["quality"]
    assert q["labelled"] == 0 and q["accuracy"]["value"] is None and q["sources"]["golden_set"]["unmatched"] == 1


def test_confidence_metrics_and_the_least_confident_rows_in_the_sample():
    results, errors, ref = _run(n=800)
    rep = evaluate(results, errors, reference=ref, **_kw())
    c = rep.metrics["confidence"]
    conf = results.column("confidence").to_pylist()
    ids = results.column("id").to_pylist()
    assert c["rows"] == 800 and c["low_rate"]["count"] == sum(x < 0.5 for x in conf)
    least = sorted(zip(conf, ids))[:7]
    assert c["least_confident_ids"] == [i for _, i in least]
    sample = rep.sample.to_pylist()
    tagged = [r["id"] for r in sample if r["qa_stratum"] == "least_confident"]
    in_sample = {r["id"] for r in sample}
    assert set(c["least_confident_ids"]) <= in_sample and set(tagged) <= set(c["least_confident_ids"])
    assert len(sample) == len(in_sample)  # no row twice
    assert rep.metrics["sample"]["least_confident"] == len(tagged)


def test_consistency_counts_prompts_answered_differently():
    recs = [ok_row(i, label="bug", prompt_hash=1) for i in range(3)]  # consistent
    recs += [ok_row(3, label="bug", prompt_hash=2), ok_row(4, label="billing", prompt_hash=2)]  # inconsistent
    recs += [
        ok_row(5, label=None, valid=False, prompt_hash=3),
        ok_row(6, label="bug", prompt_hash=3),
    ]  # no answer vs one
    recs += [ok_row(7 + i, label="bug", prompt_hash=100 + i) for i in range(10)]  # sent once
    results, errors = split(recs)
    c = evaluate(results, errors, **_kw()).metrics["consistency"]
    assert (c["repeated_prompts"], c["inconsistent_prompts"], c["repeated_rows"], c["inconsistent_rows"]) == (
        3,
        2,
        7,
        4,
    )
    assert c["inconsistency_rate"]["value"] == pytest.approx(2 / 3)
    assert {tuple(x["ids"]) for x in c["examples"]} == {("r3", "r4"), ("r5", "r6")}
    assert evaluate(*split([ok_row(0)]), **_kw()).metrics["consistency"] is None  # no prompt hashes: not measured


# sample_size 0: no ranking scan of the results, so the known ids' and the examples' rows are read by a scan
# of their own (sample.Ride.read); otherwise they ride along the ranking scan
@pytest.mark.parametrize("sample_size", [30, 0])
def test_streamed_quality_equals_in_memory(tmp_path, sample_size):
    results, errors, ref = _run()
    g_res, g_err = split([ok_row(i, label=LABELS[i % 4], confidence=0.6 + i / 100) for i in range(30)])
    g_ref = pa.table({"id": [f"r{i}" for i in range(30)], "label": [LABELS[(i + 1) % 4] for i in range(30)]})
    kw = _kw(spec=QASpec(sample_size=sample_size, least_confident=7))
    mem = evaluate(results, errors, reference=ref, ride_along=(g_res, g_err, g_ref), **kw)
    for name, t in (("r", results), ("e", errors), ("gr", g_res), ("ge", g_err)):
        pq.write_table(t, tmp_path / f"{name}.parquet", row_group_size=300)
    con = duckdb.connect()
    try:
        for name in ("r", "e", "gr", "ge"):
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{tmp_path / name}.parquet')")
        con.register("ref_arrow", ref)
        con.register("gref_arrow", g_ref)
        con.execute(
            "CREATE TABLE ref AS SELECT id, nullif(trim(label), '') AS label FROM ref_arrow "
            "WHERE nullif(trim(label), '') IS NOT NULL"
        )
        con.execute("CREATE TABLE gref AS SELECT * FROM gref_arrow")
        refs = References(run_source="golden_set", ride_along=True, known={"golden_set": 0, "ride_along": 30})
        refs.known["golden_set"] = con.execute("SELECT count(*) FROM ref").fetchall()[0][0]
        got = evaluate_stream(con, result_rows=results.num_rows, refs=refs, batch_rows=500, **kw)
    finally:
        con.close()
    for key in ("quality", "confidence", "consistency"):
        assert got.metrics[key] == mem.metrics[key], key
    assert got.sample.column("id").to_pylist() == mem.sample.column("id").to_pylist()


def test_labels_that_differ_only_in_case_spacing_or_unicode_form_are_named():
    """Labels are compared exactly (a golden set in another spelling scores its rows wrong: the gate fails rather
    than guessing); the note says which job label each nearly is, escaped, since NFC and NFD text print alike."""
    import unicodedata

    nfd = unicodedata.normalize("NFD", "café")
    recs = [ok_row(i, label="café") for i in range(40)] + [ok_row(40 + i, label="bug") for i in range(40)]
    truth = [nfd] * 40 + ["Bug "] * 20 + ["BUG"] * 20
    ref = pa.table({"id": [f"r{i}" for i in range(80)], "label": truth})
    rep = evaluate(*split(recs), reference=ref, **_kw(labels=["café", "bug"]))
    assert rep.metrics["quality"]["correct"] == 0 and rep.status == "fail"
    near = [n for n in rep.notes if "only in case, spacing or Unicode form" in n]
    assert any("'cafe\\u0301'" in n and "'caf\\xe9'" in n for n in near), near
    assert {n.split("'")[1] for n in near} == {"cafe\\u0301", "Bug", "BUG"}  # 'Bug ' stripped, as an answer is
