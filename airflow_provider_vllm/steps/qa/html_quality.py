"""The report page's quality sections: accuracy against known labels (per-class table, confusion
matrix), the engine's confidence (reliability diagram as inline SVG, review thresholds, the confident
halves), the consistency of repeated prompts, and the least confident rows.

Like ``html``: everything from the data is escaped, every number comes from the report dict, no
scripts. Each section carries ``data-section`` and each chart ``data-chart`` for tests and readers.
"""

from __future__ import annotations

import html
import math
from typing import Any

NO_ANSWER = "(none)"  # accuracy.NO_ANSWER (the page renders a stored report; it imports no metric code)
MAX_MATRIX = 20  # labels per side of the confusion matrix shown
EXCERPT = 160
GOOD, BAD, MID, GRID, INK, MUTED = "#1a7f37", "#cf222e", "#3b6fd4", "#eaeef2", "#1f2328", "#57606a"


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _ok(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _pct(v: Any, digits: int = 1) -> str:
    return f"{100 * v:.{digits}f}%" if _ok(v) else "–"


def _int(n: Any) -> str:
    return f"{int(n):,}" if _ok(n) else "–"


def _f(v: Any, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if _ok(v) else "–"


def _interval(lo: Any, hi: Any) -> str:
    return f"{_pct(lo)}–{_pct(hi)}" if _ok(lo) and _ok(hi) else "–"


def _pts(v: Any) -> str:
    return f"{100 * v:+.1f} pt" if _ok(v) else "–"


SOURCE_NAMES = {"input_column": "input column", "golden_set": "golden set", "ride_along": "ride-along golden rows"}


def accuracy_cards(m: dict) -> list[tuple[str, str, str]]:
    """Header cards: accuracy with its interval, and its change since the previous report."""
    q = m.get("quality")
    if not q:
        return []
    acc = q.get("accuracy") or {}
    cards = [
        (
            "Accuracy",
            _pct(acc.get("value")),
            f"95% {_interval(acc.get('low'), acc.get('high'))} · {_int(q.get('labelled'))} labelled",
        )
    ]
    sources = {k: s for k, s in (q.get("sources") or {}).items() if isinstance(s, dict)}
    if len(sources) > 1:  # the accuracy check judges each source on its own rows: the pooled figure is not its value
        cards += [
            (
                f"Accuracy ({SOURCE_NAMES.get(k, k)})",
                _pct(s.get("value")),
                f"95% {_interval(s.get('low'), s.get('high'))} · {_int(s.get('of'))} labelled",
            )
            for k, s in sources.items()
        ]
    # with several sources compared each against its own (what the accuracy_drop check judges, with the pooled change
    # when both reports have the same sources), a card per source: the pooled change may sit within noise while one
    # source really dropped
    by_source = {
        k: s["vs_previous"] for k, s in (q.get("sources") or {}).items() if isinstance(s, dict) and s.get("vs_previous")
    }
    changes = (
        [(f"Accuracy change ({SOURCE_NAMES.get(k, k)})", v) for k, v in by_source.items()]
        + [("Accuracy change (all sources)", q.get("vs_previous"))]
        if len(by_source) > 1
        else [("Accuracy change", next(iter(by_source.values()), None) or q.get("vs_previous"))]
    )
    for title, v in changes:
        if v:
            verdict = "a real drop" if v.get("real_drop") else "a real gain" if v.get("real_gain") else "within noise"
            # a golden set changed since: the change on the ids both scored with the same label (yardstick.judge)
            on = f" · on the {_int(v.get('previous_labelled'))} ids both golden sets share" if v.get("paired") else ""
            cards.append(
                (title, _pts(v.get("delta")), f"{verdict} (95% {_pts(v.get('low'))} to {_pts(v.get('high'))}){on}")
            )
    return cards


def quality_section(m: dict) -> str:
    q = m.get("quality")
    if not q:
        return ""
    acc = q.get("accuracy") or {}
    sources = "; ".join(
        f"{_e(SOURCE_NAMES.get(k, k))}: {_int(s.get('of'))} scored"
        + (f" ({_int(s.get('unmatched'))} known ids not in this run)" if s.get("unmatched") else "")
        + f", {_pct(s.get('value'))}"
        for k, s in (q.get("sources") or {}).items()
    )
    sub = (
        f"<b>{_pct(acc.get('value'))}</b> of {_int(q.get('labelled'))} labelled rows answered with the known label "
        f"(95% Wilson interval {_interval(acc.get('low'), acc.get('high'))}) · macro-F1 <b>{_f(q.get('macro_f1'))}</b>"
        f" · no answer (errors, invalid): {_int(q.get('no_answer'))} · {sources}"
    )
    v = q.get("vs_previous")
    if v:
        sub += (
            f" · vs the previous run's {_pct(v.get('previous'))} of {_int(v.get('previous_labelled'))}: "
            f"<b>{_pts(v.get('delta'))}</b> (95% {_pts(v.get('low'))} to {_pts(v.get('high'))})"
        )
    return (
        f'<section data-section="quality"><h2>Quality against known labels</h2><p class="desc">{sub}</p>'
        f'<div class="grid2"><div><h3>Per class</h3>{_per_class(q)}</div>'
        f"<div><h3>Confusion matrix: known label (rows) x answer (columns)</h3>{_confusion(q)}</div></div></section>"
    )


def _per_class(q: dict) -> str:
    rows = []
    for label in q.get("classes") or []:
        c = (q.get("per_class") or {}).get(label) or {}
        rows.append(
            f'<tr data-label="{_e(label)}"><td>{_e(label)}</td><td class="num">{_int(c.get("support"))}</td>'
            f'<td class="num">{_int(c.get("predicted"))}</td><td class="num">{_f(c.get("precision"))}</td>'
            f'<td class="num">{_f(c.get("recall"))}</td><td class="num">{_f(c.get("f1"))}</td></tr>'
        )
    return (
        '<table data-table="per-class"><thead><tr><th>label</th><th class="num">known</th>'
        '<th class="num">answered</th><th class="num">precision</th><th class="num">recall</th>'
        '<th class="num">F1</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>"
    )


def _confusion(q: dict) -> str:
    cells = q.get("confusion") or []
    if not cells:
        return '<p class="muted">No labelled rows.</p>'
    grid: dict[tuple[str, str], int] = {}
    for c in cells:
        grid[(str(c.get("true")), str(c.get("pred")))] = int(c.get("count") or 0)
    classes = [str(x) for x in q.get("classes") or []]
    note = ""
    if len(classes) > MAX_MATRIX:
        support = {k: (q.get("per_class") or {}).get(k, {}).get("support", 0) for k in classes}
        classes = sorted(classes, key=lambda k: -support[k])[:MAX_MATRIX]
        note = f'<p class="muted">The {MAX_MATRIX} labels with the most known rows of {len(q["classes"])}.</p>'
    cols = classes + ([NO_ANSWER] if any(p == NO_ANSWER for _, p in grid) else [])
    peak = max((n for (t, p), n in grid.items() if t != p), default=0) or 1
    diag_peak = max((n for (t, p), n in grid.items() if t == p), default=0) or 1
    head = "".join(
        f'<th class="lab" title="{_e(c)}">{_e(c) if c != NO_ANSWER else "<i>no answer</i>"}</th>' for c in cols
    )
    body = []
    for t in classes:
        tds = []
        for p in cols:
            n = grid.get((t, p), 0)
            if not n:
                tds.append(f'<td class="muted" data-true="{_e(t)}" data-pred="{_e(p)}"></td>')
                continue
            rgb, a = ("26,127,55", 0.12 + 0.5 * n / diag_peak) if t == p else ("207,34,46", 0.12 + 0.6 * n / peak)
            tds.append(
                f'<td data-true="{_e(t)}" data-pred="{_e(p)}" style="background:rgba({rgb},{a:.2f})">'
                f"<b>{_int(n)}</b></td>"
            )
        body.append(f'<tr><th class="lab" title="{_e(t)}">{_e(t)}</th>{"".join(tds)}</tr>')
    return (
        f'<table class="matrix" data-chart="confusion"><thead><tr><th class="lab">known \\ answer</th>{head}</tr>'
        f"</thead><tbody>{''.join(body)}</tbody></table>{note}"
    )


def reliability_svg(rel: dict, *, width: int = 440, height: int = 300) -> str:
    """Accuracy per confidence bucket as bars (Wilson interval as a whisker), the diagonal of a calibrated
    model, the bucket's mean confidence as a dot; bars of empty buckets are absent."""
    buckets = rel.get("buckets") or []
    ml, mr, mt, mb = 46, 12, 12, 40
    pw, ph = width - ml - mr, height - mt - mb
    n = max(1, len(buckets))
    bw = pw / n

    def x(v: float) -> float:
        return ml + v * pw

    def y(v: float) -> float:
        return mt + (1 - v) * ph

    out = [
        f'<svg role="img" data-chart="reliability" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        "<title>Accuracy by confidence bucket</title>",
    ]
    for v in (0.0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line x1="{ml}" y1="{y(v):.1f}" x2="{ml + pw}" y2="{y(v):.1f}" stroke="{GRID}"/>')
        out.append(
            f'<text x="{ml - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end" fill="{MUTED}">'
            f"{int(v * 100)}%</text>"
        )
    out.append(
        f'<line x1="{x(0):.1f}" y1="{y(0):.1f}" x2="{x(1):.1f}" y2="{y(1):.1f}" stroke="#8c959f" '
        'stroke-dasharray="4 3"><title>a calibrated model: accuracy = confidence</title></line>'
    )
    biggest = max((b.get("rows") or 0 for b in buckets), default=0) or 1
    for i, b in enumerate(buckets):
        rows, acc = b.get("rows") or 0, b.get("accuracy_value")
        bx = ml + i * bw
        if rows and _ok(acc):
            op = 0.35 + 0.65 * rows / biggest
            tip = (
                f"confidence {b['low']:.1f}-{b['high']:.1f}: {rows:,} rows, accuracy {_pct(acc)} "
                f"(95% {_interval(b.get('accuracy_low'), b.get('accuracy_high'))}), "
                f"mean confidence {_f(b.get('mean_confidence'))}"
            )
            out.append(
                f'<rect class="bar" data-bucket="{i}" data-rows="{rows}" x="{bx + 2:.1f}" y="{y(acc):.1f}" '
                f'width="{bw - 4:.1f}" height="{max(y(0) - y(acc), 0.5):.1f}" fill="{MID}" fill-opacity="{op:.2f}">'
                f"<title>{_e(tip)}</title></rect>"
            )
            if _ok(b.get("accuracy_low")) and _ok(b.get("accuracy_high")):
                cx = bx + bw / 2
                out.append(
                    f'<line x1="{cx:.1f}" y1="{y(b["accuracy_low"]):.1f}" x2="{cx:.1f}" '
                    f'y2="{y(b["accuracy_high"]):.1f}" '
                    f'stroke="{INK}" stroke-width="1"/>'
                )
            if _ok(b.get("mean_confidence")):
                out.append(
                    f'<circle cx="{x(b["mean_confidence"]):.1f}" cy="{y(b["mean_confidence"]):.1f}" r="2.5" '
                    f'fill="{BAD}"/>'
                )
        out.append(
            f'<text x="{bx + bw / 2:.1f}" y="{y(0) + 14:.1f}" font-size="10" text-anchor="middle" '
            f'fill="{MUTED}">{_int(rows) if rows else ""}</text>'
        )
    for v in (0.0, 0.5, 1.0):
        out.append(
            f'<text x="{x(v):.1f}" y="{height - 8}" font-size="11" text-anchor="middle" fill="{MUTED}">{v:.1f}</text>'
        )
    out.append(
        f'<text x="{ml + pw}" y="{height - 22}" font-size="10" text-anchor="end" fill="{MUTED}">rows per bucket</text>'
    )
    out.append("</svg>")
    return "".join(out)


def _distribution_svg(c: dict, *, width: int = 440, height: int = 170) -> str:
    """Answers per confidence bucket (all ok rows, labelled or not)."""
    buckets = c.get("buckets") or []
    ml, mr, mt, mb = 46, 12, 10, 26
    pw, ph = width - ml - mr, height - mt - mb
    n = max(1, len(buckets))
    bw = pw / n
    top = max((b.get("rows") or 0 for b in buckets), default=0) or 1
    out = [f'<svg role="img" data-chart="confidence" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for i, b in enumerate(buckets):
        rows = b.get("rows") or 0
        h = rows / top * ph
        tip = f"{b['low']:.1f}-{b['high']:.1f}: {rows:,}"
        out.append(
            f'<rect class="bar" data-bucket="{i}" x="{ml + i * bw + 2:.1f}" y="{mt + ph - h:.1f}" width="{bw - 4:.1f}" '
            f'height="{h:.1f}" fill="{MID}"><title>{_e(tip)}</title></rect>'
        )
    out.append(f'<text x="{ml - 6}" y="{mt + 9}" font-size="11" text-anchor="end" fill="{MUTED}">{_int(top)}</text>')
    for v in (0.0, 0.5, 1.0):
        out.append(
            f'<text x="{ml + v * pw:.1f}" y="{height - 8}" font-size="11" text-anchor="middle" fill="{MUTED}">'
            f"{v:.1f}</text>"
        )
    out.append("</svg>")
    return "".join(out)


def confidence_section(m: dict) -> str:
    c = m.get("confidence")
    if not c:
        return ""
    q = m.get("quality") or {}
    rel = q.get("reliability") or {}
    halves = q.get("halves") or {}
    low = c.get("low_rate") or {}
    sub = (
        f"{_int(c.get('rows'))} answers with a confidence (the engine's probability of the answer) · mean "
        f"{_f(c.get('mean'))} · below {_f(c.get('low_threshold'), 2)}: <b>{_pct(low.get('value'))}</b> "
        f"({_int(low.get('count'))})"
    )
    if halves:
        sub += (
            f" · accuracy of the most confident half <b>{_pct(halves['most'].get('value'))}</b> "
            f"(confidence ≥ {_f(halves['most'].get('confidence_min'))}), of the least confident half "
            f"<b>{_pct(halves['least'].get('value'))}</b>"
        )
    if _ok(rel.get("ece")):
        sub += f" · expected calibration error {_f(rel['ece'])}"
    parts = [f'<section data-section="confidence"><h2>Confidence</h2><p class="desc">{sub}</p><div class="grid2">']
    if rel.get("rows"):
        parts.append(
            f"<div><h3>Reliability: accuracy by confidence, labelled rows</h3>{reliability_svg(rel)}"
            '<div class="desc">Bars: accuracy of the labelled rows in each confidence bucket (whiskers: 95% interval); '
            "dots: the bucket's mean confidence; dashed: a calibrated model.</div></div>"
            f"<div><h3>Review threshold: send rows below it to a person</h3>{_thresholds(rel)}</div>"
        )
    else:
        parts.append(
            f"<div><h3>Answers by confidence</h3>{_distribution_svg(c)}"
            '<div class="desc">No labelled rows: accuracy by confidence needs known labels (qa.reference).</div></div>'
        )
    parts.append("</div></section>")
    return "".join(parts)


def _thresholds(rel: dict) -> str:
    rows = []
    for t in rel.get("thresholds") or []:
        if not t.get("kept") and not t.get("to_review"):
            continue
        rows.append(
            f'<tr><td class="num">≥ {_f(t.get("at_least"), 1)}</td><td class="num">{_int(t.get("kept"))}'
            f' ({_pct(t.get("kept_share"))})</td><td class="num">{_pct(t.get("kept_accuracy"))}</td>'
            f'<td class="num">{_int(t.get("to_review"))}</td></tr>'
        )
    return (
        '<table data-table="thresholds"><thead><tr><th class="num">confidence</th><th class="num">kept</th>'
        '<th class="num">accuracy kept</th><th class="num">to review</th></tr></thead><tbody>'
        + "".join(rows)
        + "</tbody></table>"
    )


def consistency_section(m: dict) -> str:
    c = m.get("consistency")
    if not c or not c.get("repeated_prompts"):
        return ""
    r = c.get("inconsistency_rate") or {}
    ex = "".join(
        f"<li>{_e(', '.join(x.get('ids') or []))}: {_e(' / '.join(x.get('answers') or []))}{_more_answers(x)}</li>"
        for x in c.get("examples") or []
    )
    return (
        '<section data-section="consistency"><h2>Consistency</h2><p class="desc">'
        f"{_int(c.get('repeated_prompts'))} prompts were sent more than once ({_int(c.get('repeated_rows'))} rows); "
        f"<b>{_int(c.get('inconsistent_prompts'))}</b> ({_pct(r.get('value'))}) got different answers "
        f"({_int(c.get('inconsistent_rows'))} rows). Greedy decoding can still differ with what shares the batch; "
        "engine.batch_invariant asks vLLM for batch-invariant kernels where it has them.</p>"
        + (f'<ul class="desc">{ex}</ul>' if ex else "")
        + "</section>"
    )


def _more_answers(example: dict) -> str:
    """' (and N more)' when the example lists fewer answers than its prompt got (``answers_total``)."""
    shown, total = len(example.get("answers") or []), example.get("answers_total")
    return f" (and {_int(total - shown)} more)" if isinstance(total, int) and total > shown else ""


def least_confident_section(m: dict, rows: list[dict]) -> str:
    ids = set((m.get("confidence") or {}).get("least_confident_ids") or [])
    least = [r for r in rows if r.get("id") in ids and r.get("status", "ok") == "ok"]
    if not least:
        return ""
    least.sort(key=lambda r: (r.get("confidence") if _ok(r.get("confidence")) else 2.0, str(r.get("id"))))
    has_known = any(r.get("known_label") not in (None, "") for r in least)
    has_input = any(r.get("input_excerpt") not in (None, "") for r in least)
    body = []
    for r in least:
        known = r.get("known_label")
        mark = ""
        if has_known and known not in (None, ""):
            right = known == r.get("label")
            mark = f' <span style="color:{GOOD if right else BAD}">{"✓" if right else "✗"}</span>'
        text = str(r.get("input_excerpt") or "")
        body.append(
            f'<tr><td class="id">{_e(r.get("id"))}</td><td class="num">{_f(r.get("confidence"))}</td>'
            f"<td>{_e(r.get('label'))}{mark}</td>"
            + (f"<td>{_e(known)}</td>" if has_known else "")
            + (
                f'<td class="out">{_e(text if len(text) <= EXCERPT else text[: EXCERPT - 1] + "…")}</td>'
                if has_input
                else ""
            )
            + "</tr>"
        )
    head = (
        '<th>id</th><th class="num">confidence</th><th>answer</th>'
        + ("<th>known label</th>" if has_known else "")
        + ("<th>input</th>" if has_input else "")
    )
    return (
        '<section class="least" data-section="least-confident"><h2>Least confident answers</h2>'
        f'<p class="desc">The {len(least)} answers the engine was least sure of (also in the sample below, '
        "stratum 'least_confident'): where a person's look pays most.</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></section>"
    )
