"""Quality over the labelled rows, in DuckDB: the view of every scored row and what it gives.

``labelled_view(con, ...)`` builds the table ``labelled(source, id, truth, pred, confidence)`` on a
connection that has the run's ``r`` (results: id, label, valid, confidence) and ``e`` (errors:
id), plus the reference relations the QA step set up (``stage``/``reference``):

* ``ref(id, label)``: known labels of this run's rows (``qa.reference.input_column`` or
  ``golden_uri``), source ``input_column`` / ``golden_set``;
* ``gr``, ``ge``, ``gref``: the ride-along golden rows' results, errors and known labels
  (``qa.reference.ride_along_uri``), source ``ride_along``.

A known id in the results is scored by its ``label`` (an invalid structured answer has none), an
id in the errors is scored with no answer; a known id in neither is not scored (counted as
``unmatched``). ``quality(con, ...)`` then runs two small aggregates over the view: the
(source, known, predicted) counts (``accuracy.classification`` does the rest) and the
confidence buckets (the reliability table), plus one window over the rows with a confidence
for the most / least confident halves.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from airflow_provider_vllm.steps.qa.accuracy import classification, proportion, versus
from airflow_provider_vllm.steps.qa.report import previous_refusal
from airflow_provider_vllm.steps.qa.yardstick import judge
from airflow_provider_vllm.steps.qa.yardstick import measure as measure_yardstick

SOURCES = ("input_column", "golden_set", "ride_along")
BUCKETS = 10  # equal-width confidence buckets [0, 0.1), ..., [0.9, 1.0]
_PRED = "CASE WHEN x.valid IS NOT DISTINCT FROM false THEN NULL ELSE x.label END"
_EMPTY = (
    "SELECT NULL::VARCHAR AS source, NULL::VARCHAR AS id, NULL::VARCHAR AS truth, NULL::VARCHAR AS pred, "
    "NULL::FLOAT AS confidence WHERE false"
)


def labelled_view(con, *, run_source: str | None, ride_along: bool, results: str = "r") -> None:
    """Create the temp table ``labelled`` (see the module docstring); empty when there is no source.

    Materialised once (every quality figure reads it), the results read through a semi-join on the
    known ids (DuckDB builds the known ids' hash table and filters the scan of the results by it).
    ``results``: the relation of this run's results to read them from (default ``r``; the streamed QA
    passes a table of the rows it already read, known ids among them)."""
    parts = []
    sides = ([(run_source, "ref", results, "e")] if run_source else []) + (
        [("ride_along", "gref", "gr", "ge")] if ride_along else []
    )
    for source, ref, res, err in sides:
        assert source in SOURCES
        parts.append(
            f"SELECT '{source}' AS source, f.id, f.label AS truth, {_PRED} AS pred, "
            f"CAST(x.confidence AS FLOAT) AS confidence "
            f"FROM (SELECT id, label, valid, confidence FROM {res} WHERE id IN (SELECT id FROM {ref})) x "
            f"JOIN {ref} f ON x.id = f.id"
        )
        parts.append(
            f"SELECT '{source}', f.id, f.label, NULL::VARCHAR, NULL::FLOAT FROM {ref} f JOIN {err} x ON x.id = f.id"
        )
    con.execute("DROP VIEW IF EXISTS labelled")
    con.execute("CREATE OR REPLACE TEMP TABLE labelled AS " + (" UNION ALL ".join(parts) or _EMPTY))


def quality(
    con,
    *,
    labels: list[str] | None,
    previous: dict | None,
    known: dict[str, int],
    notes: list[str],
    yardsticks: dict[str, dict] | None = None,
) -> dict[str, Any] | None:
    """The ``quality`` metrics from the view ``labelled``; None when no reference source is configured.

    ``known``: source -> rows with a known label in that source (scored or not), from the stage.
    ``previous``: the previous run's report dict, for the change in accuracy. ``yardsticks``: per source, what the
    plan pinned it to (``yardstick.plan_identities``), recorded with what was scored (``yardstick.measure``).
    """
    if not known:
        return None
    rows = con.execute("SELECT source, truth, pred, count(*) FROM labelled GROUP BY ALL").fetchall()
    overall: dict[tuple[str, str | None], int] = {}
    by_source: dict[str, dict[tuple[str, str | None], int]] = {}
    for source, truth, pred, n in rows:
        overall[(truth, pred)] = overall.get((truth, pred), 0) + n
        by_source.setdefault(source, {})[(truth, pred)] = n
    q = classification(overall, labels)
    q["majority"] = _majority(overall, labels)
    q["only_label"] = _only_label(q["majority"], sum(overall.values()))
    q["sources"] = {}
    for source, n_known in known.items():
        counts = by_source.get(source, {})
        scored = sum(counts.values())
        correct = sum(k for (t, p), k in counts.items() if t == p)
        q["sources"][source] = (
            {"known": int(n_known), "unmatched": int(n_known) - scored}
            | proportion(correct, scored)
            | {"majority": (m := _majority(counts, labels)), "only_label": _only_label(m, scored)}
        )
        if n_known > scored:
            notes.append(
                f"quality: {n_known - scored} of {n_known} known labels ({source}) name ids that are not in this run"
            )
    outside = [c for c in q["classes"] if labels is not None and c not in set(labels)]
    if outside:
        shown = ", ".join(repr(c) for c in outside[:10])
        notes.append(f"quality: {len(outside)} label(s) outside the job's label set: {shown}")
        # labels are compared exactly: a golden set spelled 'Bug' or with a decomposed accent scores every such
        # row wrong; say which label it nearly is, escaped (a repr of NFC and NFD text looks the same)
        for c, near in _near_misses(outside[:10], labels or []):
            notes.append(
                f"quality: label {ascii(c)} differs from the job's label {ascii(near)} only in case, spacing or "
                "Unicode form; labels are compared exactly, so rows with it are scored as wrong"
            )
    prev_q = ((previous or {}).get("metrics") or {}).get("quality") if isinstance(previous, dict) else None
    for source, v in q["sources"].items():
        v["yardstick"] = measure_yardstick(con, source, v["of"], (yardsticks or {}).get(source))
    q["vs_previous"] = None
    if isinstance(prev_q, dict) and isinstance(previous, dict):
        # each source against the same source of the previous report, when both scored the same yardstick (the
        # accuracy_drop check judges these and the pooled change): a pooled figure mixes sources whose shares change
        # from run to run, so a fall of the golden rows that ride along can vanish in the pool beside a large night
        # of the run's own labelled rows; and a golden set replaced since moves the accuracy by itself
        prev_sources: dict = prev_q["sources"] if isinstance(prev_q.get("sources"), dict) else {}
        # a report from before the per-source figures: its pooled figure stands for each source (not compared: it
        # records no yardstick; the check warns)
        pooled = None if prev_sources else {"count": prev_q.get("correct"), "of": prev_q.get("labelled")}
        for source, v in q["sources"].items():
            pv = prev_sources.get(source, pooled)
            v["vs_previous"], v["compared"] = judge(source, v, pv, previous) if isinstance(pv, dict) else (None, None)
        if set(prev_sources) == set(q["sources"]) and all(
            (v["compared"] or {}).get("basis") == "same" for v in q["sources"].values()
        ):
            # pooled over the same sources, each on the same yardstick: not a mix of a changed one
            q["vs_previous"] = versus(q, prev_q)
    if previous is not None and prev_q is None and q["labelled"] and previous_refusal(previous) is None:
        notes.append("quality: the previous report has no accuracy; no change in accuracy to report")
    q["reliability"] = reliability(con)
    q["halves"] = halves(con)
    return q


def _only_label(majority: dict[str, Any] | None, scored: int) -> str | None:
    """The known label of every one of the ``scored`` rows, when ``majority`` (``_majority``) is all of them: such
    rows cannot tell a model that answers it to every row from a good one (the accuracy check does not pass on
    them). None for a job whose label set is that one label, as ``_majority``."""
    return majority["label"] if majority is not None and majority["count"] == scored else None


def _majority(counts: dict[tuple[str, str | None], int], labels: list[str] | None) -> dict[str, Any] | None:
    """``{label, count}``: the most common known label of the scored rows and how many rows have it (ties: the first
    by name), or None when nothing was scored or the job's label set is that one label. A model answering it to
    every row scores count / scored: the accuracy check does not pass a run that is not above that."""
    by_label: dict[str, int] = {}
    for (truth, _), n in counts.items():
        by_label[truth] = by_label.get(truth, 0) + int(n)
    if not any(by_label.values()):
        return None
    label, count = min(by_label.items(), key=lambda kv: (-kv[1], kv[0]))
    return None if labels is not None and set(labels) <= {label} else {"label": label, "count": count}


def _near_misses(outside: list[str], labels: list[str]) -> list[tuple[str, str]]:
    """(label, job label) for each label of ``outside`` equal to a job label once case-folded, NFKC-normalised and
    with its spaces collapsed."""

    def key(x: str) -> str:
        return " ".join(unicodedata.normalize("NFKC", x).casefold().split())

    by_key: dict[str, str] = {}
    for x in labels:
        by_key.setdefault(key(x), x)
    return [(c, by_key[key(c)]) for c in outside if key(c) in by_key]


def reliability(con) -> dict[str, Any]:
    """Accuracy by confidence bucket over the scored rows that have a confidence, the expected calibration
    error (ECE: the rows' share-weighted |accuracy - mean confidence| of each bucket), and for each
    bucket edge t: the share of those rows at or above t and their accuracy (what a review threshold keeps)."""
    rows = con.execute(
        f"SELECT greatest(0, least(CAST(floor(confidence * {BUCKETS}) AS INTEGER), {BUCKETS - 1})) AS b, count(*), "
        "sum(confidence), count(*) FILTER (WHERE pred = truth) FROM labelled "
        "WHERE confidence IS NOT NULL AND isfinite(confidence) GROUP BY 1 ORDER BY 1"
    ).fetchall()
    found = {int(b): (int(n), float(s), int(k)) for b, n, s, k in rows}
    total = sum(n for n, _, _ in found.values())
    buckets = []
    for b in range(BUCKETS):
        n, s, k = found.get(b, (0, 0.0, 0))
        buckets.append(
            {
                "low": b / BUCKETS,
                "high": (b + 1) / BUCKETS,
                "rows": n,
                "mean_confidence": s / n if n else None,
            }
            | {f"accuracy_{key}": v for key, v in proportion(k, n).items() if key in ("value", "low", "high")}
            | {"correct": k}
        )
    ece = sum(x["rows"] / total * abs(x["accuracy_value"] - x["mean_confidence"]) for x in buckets if x["rows"])
    thresholds = []
    kept_n = kept_k = 0
    for x in reversed(buckets):
        kept_n += x["rows"]
        kept_k += x["correct"]
        thresholds.append(
            {
                "at_least": x["low"],
                "kept": kept_n,
                "kept_share": kept_n / total if total else None,
                "kept_accuracy": kept_k / kept_n if kept_n else None,
                "to_review": total - kept_n,
            }
        )
    return {"rows": total, "buckets": buckets, "ece": ece if total else None, "thresholds": thresholds[::-1]}


def halves(con) -> dict[str, Any] | None:
    """Accuracy of the most and the least confident half of the scored rows with a confidence
    (ordered by confidence, ties by a hash of the id; an odd row goes to the most confident half)."""
    rows = con.execute(
        "SELECT h, count(*), count(*) FILTER (WHERE pred = truth), min(confidence), max(confidence), "
        "avg(confidence) FROM (SELECT *, ntile(2) OVER (ORDER BY confidence DESC, hash(id), id) AS h FROM labelled "
        "WHERE confidence IS NOT NULL AND isfinite(confidence)) GROUP BY h ORDER BY h"
    ).fetchall()
    if len(rows) < 2:
        return None
    out = {}
    for name, (_, n, k, lo, hi, mean) in zip(("most", "least"), rows):
        out[name] = {"confidence_min": lo, "confidence_max": hi, "confidence_mean": mean} | proportion(k, n)
    return out
