"""The QA report as one self-contained HTML page: inline CSS, inline SVG charts, no scripts.

Everything from the data (labels, ids, model outputs, error messages, run info) is untrusted
and goes through ``html.escape``; a Content-Security-Policy that allows no scripts and no
external resources backs that up. All numbers, including histogram bins, come from the
report dict (``evaluate.evaluate`` computes them); this module only renders.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from typing import Any

from airflow_provider_vllm.steps.qa.html_quality import (
    accuracy_cards,
    confidence_section,
    consistency_section,
    least_confident_section,
    quality_section,
)

COLORS = {"pass": "#1a7f37", "warn": "#b35900", "fail": "#cf222e", "skip": "#6e7781"}
BG = {"pass": "#dafbe1", "warn": "#fff1cc", "fail": "#ffebe9", "skip": "#f0f2f4"}
GAUGE = {"pass": "#a8e6b8", "warn": "#f6d67a", "fail": "#f7a8a2"}
BAR = "#3b6fd4"
BAR_PREV = "#b7c1cc"
BAR_ERR = "#d1495b"
BAR_ALT = "#7a5cc2"
MAX_BARS = 40
MAX_MATRIX = 20  # labels per side of the churn matrix shown (the largest); the JSON has up to 10,000 cells
EXCERPT = 200

_CSS = """
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 -apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#1f2328;
  background:#f6f8fa}
main{max-width:1120px;margin:0 auto;padding:24px}
header{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:20px 24px;margin-bottom:18px}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:0 0 12px}
h3{font-size:14px;margin:14px 0 6px;color:#57606a}
section{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:18px 24px;margin-bottom:18px}
.top{display:flex;align-items:center;gap:16px;flex-wrap:wrap}
.badge{display:inline-block;padding:4px 14px;border-radius:999px;font-weight:700;font-size:15px;
  letter-spacing:.04em;color:#fff}
.pill{display:inline-block;padding:1px 9px;border-radius:999px;font-weight:600;font-size:12px}
.meta{color:#57606a;font-size:13px;margin-top:6px}
.meta span{margin-right:14px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px;margin-top:16px}
.card{border:1px solid #d0d7de;border-radius:6px;padding:8px 12px;background:#f6f8fa}
.card .k{font-size:12px;color:#57606a}
.card .v{font-size:19px;font-weight:600}
.card .s{font-size:12px;color:#57606a}
.summary{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;color:#57606a;margin-top:12px;
  word-break:break-word}
.notes{background:#fff8c5;border:1px solid #d4a72c;border-radius:6px;padding:8px 14px 8px 30px;margin:14px 0 0}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:6px 8px;border-bottom:1px solid #eaeef2;vertical-align:top}
th{font-size:12px;color:#57606a;font-weight:600;background:#f6f8fa}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.desc{font-size:12px;color:#57606a}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:18px}
@media (max-width:900px){.grid2{grid-template-columns:1fr}}
.stats{font-size:12px;color:#57606a;font-variant-numeric:tabular-nums}
.muted{color:#6e7781}
.sample td,.least td{font-size:12.5px}
.sample td.out,.least td.out{white-space:pre-wrap;word-break:break-word;max-width:460px}
.sample td.id,.least td.id{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;min-width:9em;
  max-width:240px;overflow-wrap:anywhere}
.sample td.err{color:#8c1d18}
table.matrix{width:auto}
table.matrix td,table.matrix th{border:1px solid #eaeef2;text-align:right;min-width:4.5em}
table.matrix th.lab{text-align:left;max-width:14em;overflow-wrap:anywhere}
table.matrix td.same{background:#f0f2f4;color:#57606a}
svg{max-width:100%;height:auto}
svg text{font-family:-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif}
"""


# ---- formatting ---------------------------------------------------------------------------


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _int(n: Any) -> str:
    return f"{int(n):,}" if isinstance(n, (int, float)) and math.isfinite(n) else "–"


def _pct(v: Any, digits: int = 2) -> str:
    return f"{100 * v:.{digits}f}%" if isinstance(v, (int, float)) and math.isfinite(v) else "–"


def _num(v: Any) -> str:
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "–"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if float(v).is_integer():
        return f"{v:.0f}"
    return f"{v:.2f}"


def _check_value(c: dict) -> str:
    v = c.get("value")
    if v is None:
        return "n/a"
    return f"{v:.3f}" if c.get("name") == "label_drift" else _pct(v)


def _check_threshold(c: dict, key: str) -> str:
    v = c.get(key)
    if v is None:
        return "–"
    side = "<" if c.get("direction") == "below" else ">"
    return f"{side} " + (f"{v:.3f}" if c.get("name") == "label_drift" else _pct(v, 1))


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _pill(status: str) -> str:
    st = status if status in COLORS else "skip"
    return f'<span class="pill" style="background:{BG[st]};color:{COLORS[st]}">{_e(status.upper())}</span>'


# ---- SVG charts -------------------------------------------------------------------------


def hbar_chart(
    rows: list[tuple[str, list[float], list[str]]],
    *,
    series: list[str] | None = None,
    colors: Iterable[str] = (BAR, BAR_PREV),
    width: int = 720,
    label_width: int = 190,
    chart: str = "",
) -> str:
    """Horizontal bars: rows of (label, values per series, value texts per series).

    Each bar is a ``rect.bar`` with ``data-series`` (index) and ``data-label``; ``chart`` names
    the SVG (``data-chart``) so that tests and readers can find it."""
    colors = list(colors)
    if not rows:
        return '<p class="muted">No data.</p>'
    nser = max(len(v) for _, v, _ in rows)
    bar_h, gap, row_gap = 13, 2, 9
    text_w = 150
    plot_w = width - label_width - text_w
    row_h = nser * bar_h + (nser - 1) * gap
    legend_h = 22 if series and nser > 1 else 0
    height = legend_h + len(rows) * (row_h + row_gap) + 4
    vmax = max((v for _, vals, _ in rows for v in vals if v is not None), default=0) or 1
    out = [
        f'<svg role="img" data-chart="{_e(chart)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
    ]
    if legend_h:
        x = label_width
        for j, name in enumerate(series or []):
            out.append(f'<rect x="{x}" y="4" width="12" height="12" rx="2" fill="{colors[j % len(colors)]}"/>')
            out.append(f'<text x="{x + 17}" y="14" font-size="12" fill="#57606a">{_e(name)}</text>')
            x += 26 + 7 * len(name)
    y = legend_h
    for label, vals, texts in rows:
        mid = y + row_h / 2 + 4
        out.append(
            f'<text x="{label_width - 8}" y="{mid:.1f}" font-size="12.5" text-anchor="end" fill="#1f2328">'
            f"<title>{_e(label)}</title>{_e(_cut(str(label), max(8, (label_width - 12) // 7)))}</text>"
        )
        for j, v in enumerate(vals):
            by = y + j * (bar_h + gap)
            w = 0.0 if v is None else max(0.0, v) / vmax * plot_w
            if v:
                w = max(w, 1.5)
            color = colors[j % len(colors)]
            out.append(
                f'<rect class="bar" data-series="{j}" data-label="{_e(label)}" x="{label_width}" y="{by}" '
                f'width="{w:.1f}" height="{bar_h}" rx="2" fill="{color}"/>'
            )
            t = texts[j] if j < len(texts) else ""
            out.append(
                f'<text x="{label_width + w + 5:.1f}" y="{by + bar_h - 2}" font-size="11.5" '
                f'fill="#57606a">{_e(t)}</text>'
            )
        y += row_h + row_gap
    out.append("</svg>")
    return "".join(out)


def histogram_svg(hist: dict | None, *, width: int = 520, height: int = 190, unit: str = "", chart: str = "") -> str:
    """Vertical bars over equal-width bins (edges/counts/overflow from the report)."""
    if not hist or not hist.get("counts"):
        return '<p class="muted">No data.</p>'
    counts = [int(c) for c in hist["counts"]]
    edges = hist["edges"]
    overflow = int(hist.get("overflow") or 0)
    integer = bool(hist.get("integer"))
    bins = counts + ([overflow] if overflow else [])
    ml, mr, mt, mb = 52, 12, 10, 34
    pw, ph = width - ml - mr, height - mt - mb
    n = len(bins)
    bw = pw / n
    ymax = max(bins) or 1
    out = [
        f'<svg role="img" data-chart="{_e(chart)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
    ]
    for frac in (0.5, 1.0):
        gy = mt + ph - frac * ph
        out.append(f'<line x1="{ml}" y1="{gy:.1f}" x2="{ml + pw}" y2="{gy:.1f}" stroke="#eaeef2"/>')
        out.append(
            f'<text x="{ml - 6}" y="{gy + 4:.1f}" font-size="11" text-anchor="end" fill="#57606a">'
            f"{_e(_int(ymax * frac))}</text>"
        )
    out.append(f'<text x="{ml - 6}" y="{mt + ph + 4}" font-size="11" text-anchor="end" fill="#57606a">0</text>')

    def edge_txt(x: float) -> str:
        return _int(x) if integer else _num(x)

    for i, c in enumerate(bins):
        h = c / ymax * ph
        x = ml + i * bw
        is_over = overflow and i == n - 1
        if is_over:
            tip = f"> {edge_txt(edges[-1])}{unit}: {c:,}"
        elif integer and edges[i + 1] - edges[i] == 1:
            tip = f"{edge_txt(edges[i])}{unit}: {c:,}"
        else:
            tip = f"[{edge_txt(edges[i])}, {edge_txt(edges[i + 1])}){unit}: {c:,}"
        color = BAR_PREV if is_over else BAR
        out.append(
            f'<rect class="bar" x="{x + 0.5:.1f}" y="{mt + ph - h:.1f}" width="{max(bw - 1, 0.5):.1f}" '
            f'height="{h:.1f}" '
            f'fill="{color}"><title>{_e(tip)}</title></rect>'
        )
    out.append(f'<line x1="{ml}" y1="{mt + ph}" x2="{ml + pw}" y2="{mt + ph}" stroke="#8c959f"/>')
    nb = len(counts)
    unit_bins = integer and len(edges) > 1 and edges[1] - edges[0] == 1  # one bin per value: label centres
    ticks = sorted({0, nb // 4, nb // 2, (3 * nb) // 4, nb - 1 if unit_bins else nb})
    for t in ticks:
        x = ml + (t + 0.5 if unit_bins else t) * bw
        out.append(f'<line x1="{x:.1f}" y1="{mt + ph}" x2="{x:.1f}" y2="{mt + ph + 4}" stroke="#8c959f"/>')
        out.append(
            f'<text x="{x:.1f}" y="{mt + ph + 16}" font-size="11" text-anchor="middle" fill="#57606a">'
            f"{_e(edge_txt(edges[t]))}</text>"
        )
    if overflow:
        x = ml + (n - 0.5) * bw
        out.append(
            f'<text x="{x:.1f}" y="{mt + ph + 16}" font-size="11" text-anchor="middle" fill="#57606a">&gt;</text>'
        )
    if unit:
        out.append(
            f'<text x="{ml + pw}" y="{height - 2}" font-size="11" text-anchor="end" '
            f'fill="#57606a">{_e(unit.strip())}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def gauge_svg(
    value: float | None, warn: float, fail: float, *, width: int = 150, height: int = 14, below: bool = False
) -> str:
    """A threshold strip: green up to warn, amber up to fail, red beyond; a tick at the value.
    ``below`` (accuracy): a scale from 0 to 1, red below fail, amber below warn, green above."""
    top = 1.0 if below else max(fail * 1.25, (value or 0) * 1.05, warn * 1.5, 1e-9)

    def x(v: float) -> float:
        return min(width, max(0.0, v / top * width))

    zones = (
        [("fail", 0.0, fail), ("warn", fail, warn), ("pass", warn, top)]
        if below
        else [("pass", 0.0, warn), ("warn", warn, fail), ("fail", fail, top)]
    )
    parts = [f'<svg role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'] + [
        f'<rect x="{x(a):.1f}" y="3" width="{max(0.0, (x(b) if b < top else width) - x(a)):.1f}" height="8" '
        f'fill="{GAUGE[z]}"/>'
        for z, a, b in zones
    ]
    if value is not None:
        parts.append(f'<rect x="{max(0.0, x(value) - 1.5):.1f}" y="0" width="3" height="{height}" fill="#1f2328"/>')
    parts.append("</svg>")
    return "".join(parts)


# ---- sections ---------------------------------------------------------------------------


def _golden_set_line(g: object) -> str:
    """The golden set QA measured against, each file with its size and sha256 (``run.golden_set``)."""
    if not isinstance(g, dict):
        return ""
    files = [f for f in g.get("files") or [] if isinstance(f, dict)]
    listed = "; ".join(
        f"{_e(f.get('path'))} ({_e(f.get('bytes'))} bytes, sha256 <code>{_e(f.get('sha256'))}</code>)" for f in files
    )
    return f"<span><b>golden_set</b>: {_e(g.get('uri'))}: {listed}</span>"


def _header(d: dict) -> str:
    m = d.get("metrics") or {}
    status = str(d.get("status", "skip"))
    run = d.get("run") or {}
    title = run.get("job") or run.get("name") or "QA report"
    rates = m.get("rates") or {}
    err = (rates.get("error_rate") or {}).get("value")
    thr = m.get("throughput") or {}
    sample = m.get("sample") or {}
    tokens = m.get("tokens") or {}
    models = m.get("models") or []
    meta = "".join(
        f"<span><b>{_e(k)}</b>: {_e(v)}</span>" for k, v in run.items() if k not in ("job", "name", "golden_set")
    ) + _golden_set_line(run.get("golden_set"))
    model_txt = ", ".join(
        f"{x.get('model')}" + (f"@{str(x.get('revision'))[:12]}" if x.get("revision") else "") for x in models[:3]
    )
    cards = [
        ("Rows", _int(m.get("total", 0)), ""),
        ("OK", _int(m.get("ok", 0)), ""),
        ("Errors", _int(m.get("errors", 0)), _pct(err) if err is not None else ""),
        *accuracy_cards(m),
        ("Sample", _int(sample.get("rows", 0)), f"seed {sample.get('seed', '–')}"),
        *(
            [("Duplicate ids", _int(dup.get("ids", 0)), f"{_int(dup.get('rows_dropped', 0))} rows dropped at merge")]
            if (dup := m.get("duplicates")) is not None
            else []
        ),
        ("Prompt tokens", _int(tokens.get("prompt_total", 0)), ""),
        ("Completion tokens", _int(tokens.get("completion_total", 0)), ""),
    ]
    if thr.get("rows_per_s") is not None:
        cards.append(("Rows / shard-s", _num(thr["rows_per_s"]), f"{_int(thr.get('n_shards'))} shards"))
    if thr.get("tokens_per_s") is not None:
        cards.append(("Tokens / shard-s", _num(thr["tokens_per_s"]), ""))
    cache = m.get("cache") or {}
    if cache.get("rows") is not None:
        cards.append(
            (
                "Cache hits",
                _pct(cache.get("hit_rate"), 1),
                f"{_int(cache.get('hits'))} of {_int(cache.get('rows'))} rows not inferred",
            )
        )
    dd = m.get("dedupe") or {}
    if dd.get("rows") is not None:
        cards.append(
            (
                "Repeated prompts",
                _pct(dd.get("duplicate_rate"), 1),
                f"{_int(dd.get('followers'))} rows took a twin's answer; {_int(dd.get('inferred'))} inferred",
            )
        )
    ch = m.get("changes") or {}
    if ch.get("counts"):
        cards.append(
            (
                "Changed",
                _int(ch["counts"].get("changed", 0)),
                f"churn {_pct(ch.get('churn_rate'))}" if ch.get("churn_rate") is not None else "no previous run",
            )
        )
    prev = m.get("previous") or {}
    if prev:
        cards.append(("Previous run", str(prev.get("status") or "?").upper(), f"{_int(prev.get('total'))} rows"))
    card_html = "".join(
        f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div><div class="s">{_e(s)}</div></div>'
        for k, v, s in cards
    )
    st = status if status in COLORS else "skip"
    notes = d.get("notes") or []
    notes_html = '<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>" if notes else ""
    return (
        "<header>"
        f'<div class="top"><h1>{_e(title)}</h1>'
        f'<span class="badge" style="background:{COLORS[st]}">{_e(status.upper())}</span></div>'
        + (f'<div class="meta">{meta}</div>' if meta else "")
        # the models the shards ran (with their revisions), unless the run's own model says the same
        + (
            f'<div class="meta"><span><b>model</b>: {_e(model_txt)}</span></div>'
            if model_txt and model_txt != str(run.get("model"))
            else ""
        )
        + f'<div class="cards">{card_html}</div>'
        + f'<div class="summary">{_e(d.get("summary", ""))}</div>'
        + notes_html
        + "</header>"
    )


def _checks(d: dict) -> str:
    rows = []
    for c in d.get("checks") or []:
        st = str(c.get("status", "skip"))
        color = BG.get(st, "#fff") if st in ("warn", "fail") else "#fff"
        gauge = (
            gauge_svg(
                c.get("value"),
                float(c.get("warn") or 0),
                float(c.get("fail") or 0),
                below=c.get("direction") == "below",
            )
            if c.get("value") is not None
            else ""
        )
        rows.append(
            f'<tr style="background:{color}">'
            f'<td><b>{_e(c.get("name"))}</b><div class="desc">{_e(c.get("description", ""))}</div></td>'
            f'<td class="num"><b>{_e(_check_value(c))}</b><div class="desc">{_e(c.get("detail", ""))}</div></td>'
            f"<td>{gauge}</td>"
            f'<td class="num">{_e(_check_threshold(c, "warn"))}</td>'
            f'<td class="num">{_e(_check_threshold(c, "fail"))}</td>'
            f"<td>{_pill(st)}</td></tr>"
        )
    return (
        '<section><h2>Checks</h2><table><thead><tr><th>Check</th><th class="num">Value</th><th>Scale</th>'
        '<th class="num">Warn</th><th class="num">Fail</th><th>Status</th></tr></thead><tbody>'
        + "".join(rows)
        + "</tbody></table></section>"
    )


def _labels(d: dict) -> str:
    m = d.get("metrics") or {}
    ld = m.get("label_distribution")
    if not ld:
        return ""
    counts = ld.get("counts") or {}
    fr = ld.get("fractions") or {}
    drift = m.get("label_drift") or {}
    pf = drift.get("previous_fractions") or {}
    delta = drift.get("delta") or {}
    keys = list(counts) + [k for k in pf if k not in counts]
    note = ""
    if len(keys) > MAX_BARS:
        keys = sorted(keys, key=lambda k: -max(fr.get(k, 0), pf.get(k, 0)))[:MAX_BARS]
        note = f'<p class="muted">Showing the {MAX_BARS} largest of {len(counts)} labels.</p>'
    rows = []
    for k in keys:
        vals = [float(fr.get(k, 0.0))]
        texts = [f"{_pct(fr.get(k, 0.0), 1)}  ({_int(counts.get(k, 0))})"]
        if pf:
            vals.append(float(pf.get(k, 0.0)))
            dv = delta.get(k, 0.0)
            texts.append(f"{_pct(pf.get(k, 0.0), 1)}  (Δ {'+' if dv >= 0 else ''}{100 * dv:.1f} pt)")
        rows.append((k, vals, texts))
    title = "Label distribution"
    sub = f"{_int(ld.get('labelled', 0))} labelled ok rows"
    if ld.get("unlabelled"):
        sub += f", {_int(ld['unlabelled'])} without a label"
    if drift:
        sub += f" · drift vs previous run (TVD): <b>{drift.get('tvd', 0):.3f}</b>"
    chart = hbar_chart(rows, series=["this run", "previous run"] if pf else None, chart="labels")
    return f'<section><h2>{title}</h2><p class="desc">{sub}</p>{chart}{note}</section>'


def _changes(d: dict) -> str:
    """Counts per change kind and the old x new label matrix (steps/merge/changes.py's summary)."""
    ch = (d.get("metrics") or {}).get("changes")
    if not ch:
        return ""
    counts = ch.get("counts") or {}
    kinds = [
        ("unchanged", "same answer"),
        ("changed", "answer moved"),
        ("added", "new ids"),
        ("removed", "ids gone"),
        ("recovered", "error before, answer now"),
        ("error", "error now"),
    ]
    cards = "".join(
        f'<div class="card" data-change="{_e(k)}"><div class="k">{_e(k)}</div><div class="v">{_int(counts.get(k, 0))}'
        f'</div><div class="s">{_e(t)}</div></div>'
        for k, t in kinds
    )
    prev = ch.get("previous_uri")
    sub = (
        f"vs <b>{_e(prev)}</b> ({_e(ch.get('previous_state'))}) · compared: {_e(ch.get('compared'))} · "
        f"churn {_e(_pct(ch.get('churn_rate')))} of {_int(ch.get('in_both'))} ids answered in both runs · "
        "rows in changes/changes.parquet"
    )
    reasons = ch.get("reasons") or {}
    why = {
        "settings": "another model, adapter weights, prompt or settings",
        "input": "the text was edited",
        "unified": "an inconsistent earlier answer made one",
        "engine": "same request and settings: the engine's numerics",
        "unknown": "the previous run did not record its requests or adapters",
    }
    if any(reasons.values()):
        sub += "<br>Why answers moved: " + " · ".join(
            f'<span data-reason="{_e(k)}"><b>{_int(n)}</b> {_e(why.get(k, k))}</span>' for k, n in reasons.items() if n
        )
    return (
        f'<section data-section="changes"><h2>What changed since the last run</h2><p class="desc">{sub}</p>'
        f'<div class="cards">{cards}</div>{_matrix(ch)}</section>'
    )


def _matrix(ch: dict) -> str:
    cells = ch.get("matrix")
    if not cells:
        return ""
    old_tot: dict[Any, int] = {}
    new_tot: dict[Any, int] = {}
    grid: dict[tuple[Any, Any], int] = {}
    for c in cells:
        o, n, k = c.get("old"), c.get("new"), int(c.get("count") or 0)
        grid[(o, n)] = grid.get((o, n), 0) + k
        old_tot[o] = old_tot.get(o, 0) + k
        new_tot[n] = new_tot.get(n, 0) + k
    labels = sorted(
        {x for x in (*old_tot, *new_tot) if x is not None},
        key=lambda x: (-(old_tot.get(x, 0) + new_tot.get(x, 0)), str(x)),
    )
    note = ""
    if len(labels) > MAX_MATRIX:
        note = f'<p class="muted">Showing the {MAX_MATRIX} largest of {len(labels)} labels.</p>'
        labels = labels[:MAX_MATRIX]
    rows_keys = labels + ([None] if None in old_tot else [])
    cols_keys = labels + ([None] if None in new_tot else [])
    peak = max((k for (o, n), k in grid.items() if o != n), default=0) or 1

    def name(x: Any, side: str) -> str:
        return f'<i class="muted">{"(new id)" if side == "old" else "(removed)"}</i>' if x is None else _e(x)

    head = "".join(f'<th class="lab" title="{_e(x)}">{name(x, "new")}</th>' for x in cols_keys)
    body = []
    for o in rows_keys:
        tds = []
        for n in cols_keys:
            k = grid.get((o, n), 0)
            if o == n and o is not None:
                tds.append(f'<td class="same" data-old="{_e(o)}" data-new="{_e(n)}">{_int(k) if k else ""}</td>')
            elif k:
                a = 0.12 + 0.6 * k / peak
                rgb = "59,111,212" if o is None or n is None else "207,34,46"  # blue: added / removed; red: moved
                tds.append(
                    f'<td data-old="{_e(o)}" data-new="{_e(n)}" style="background:rgba({rgb},{a:.2f})">'
                    f"<b>{_int(k)}</b></td>"
                )
            else:
                tds.append('<td class="muted"></td>')
        body.append(f'<tr><th class="lab" title="{_e(o)}">{name(o, "old")}</th>{"".join(tds)}</tr>')
    if ch.get("matrix_cells") and ch["matrix_cells"] > len(cells):
        note += (
            f'<p class="muted">{_int(ch["matrix_cells"])} cells in all; the largest {_int(len(cells))} are listed.</p>'
        )
    return (
        "<h3>Churn matrix: previous label (rows) x this run's label (columns); "
        "the grey diagonal did not move, blue cells are new or gone ids</h3>"
        f'<table class="matrix" data-chart="churn"><thead><tr><th class="lab">previous \\ now</th>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>{note}"
    )


def _errors(d: dict) -> str:
    m = d.get("metrics") or {}
    by = m.get("errors_by_code") or {}
    fin = m.get("finish_reasons") or {}
    total = m.get("total") or 0
    err_rows = [
        (k, [float(v.get("count", 0))], [f"{_int(v.get('count', 0))}  ({_pct(v.get('rate', 0))})"])
        for k, v in by.items()
    ]
    ok = m.get("ok") or 0
    fin_rows = [(k, [float(n)], [f"{_int(n)}  ({_pct(n / ok if ok else 0)})"]) for k, n in fin.items()]
    err_html = (
        hbar_chart(err_rows[:MAX_BARS], colors=[BAR_ERR], width=520, label_width=170, chart="errors")
        if err_rows
        else (f'<p class="muted">No error rows among {_int(total)}.</p>')
    )
    fin_html = (
        hbar_chart(fin_rows[:MAX_BARS], colors=[BAR_ALT], width=520, label_width=120, chart="finish")
        if fin_rows
        else ('<p class="muted">No ok rows.</p>')
    )
    return (
        '<section><div class="grid2">'
        f"<div><h2>Errors by code</h2>{err_html}</div>"
        f"<div><h2>Finish reasons</h2>{fin_html}</div>"
        "</div></section>"
    )


def _dist(name: str, stats: dict | None, unit: str, chart: str) -> str:
    if not stats:
        return f'<div><h3>{_e(name)}</h3><p class="muted">No data.</p></div>'
    line = " · ".join(f"{k} {_num(stats.get(k))}" for k in ("p50", "p90", "p99", "max", "mean"))
    hist = histogram_svg(stats.get("histogram"), unit=unit, chart=chart)
    return f'<div><h3>{_e(name)}</h3>{hist}<div class="stats">{_e(line)}</div></div>'


def _distributions(d: dict) -> str:
    m = d.get("metrics") or {}
    return (
        '<section><h2>Latency and tokens</h2><div class="grid2">'
        + _dist("Latency (ms)", m.get("latency_ms"), " ms", "latency")
        + _dist("Prompt tokens", m.get("prompt_tokens"), " tokens", "prompt_tokens")
        + _dist("Completion tokens", m.get("completion_tokens"), " tokens", "completion_tokens")
        + "</div></section>"
    )


def _shards(d: dict) -> str:
    thr = (d.get("metrics") or {}).get("throughput") or {}
    shards = thr.get("shards") or []
    if not shards:
        return ""
    note = ""
    shown = shards
    if len(shards) > MAX_BARS:
        shown = sorted(shards, key=lambda s: (s.get("rows_per_s") is None, s.get("rows_per_s") or 0))[:MAX_BARS]
        note = f'<p class="muted">Showing the {MAX_BARS} slowest of {len(shards)} shards.</p>'
    rps = [(s["shard_id"], [s.get("rows_per_s") or 0.0], [_num(s.get("rows_per_s")) + " rows/s"]) for s in shown]
    sec = [(s["shard_id"], [s.get("seconds") or 0.0], [_duration_text(s)]) for s in shown]
    mem = [(s["shard_id"], [s.get("peak_rss_mb") or 0.0], [_memory_text(s)]) for s in shown if s.get("peak_rss_mb")]
    summary = (
        f"{_int(thr.get('n_shards'))} shards, {_int(thr.get('rows'))} rows, "
        f"{_num(thr.get('shard_seconds'))} shard-seconds; "
        f"{_num(thr.get('rows_per_s'))} rows/s"
        + (f", {_num(thr.get('tokens_per_s'))} tokens/s" if thr.get("tokens_per_s") is not None else "")
        + " per shard (sum rows / sum seconds)"
    )
    return (
        f'<section><h2>Shards</h2><p class="desc">{_e(summary)}</p><div class="grid2">'
        f"<div><h3>Throughput</h3>{hbar_chart(rps, width=520, label_width=160, chart='throughput')}</div>"
        f"<div><h3>Duration</h3>{hbar_chart(sec, colors=[BAR_ALT], width=520, label_width=160, chart='duration')}</div>"
        + (
            f"<div><h3>Peak memory</h3>{hbar_chart(mem, colors=[BAR_PREV], width=520, label_width=160, chart='memory')}"
            "</div>"
            if mem
            else ""
        )
        + f"</div>{note}</section>"
    )


def _duration_text(s: dict) -> str:
    parts = [f"{_num(s.get('seconds'))} s", f"{_int(s.get('rows'))} rows"]
    if isinstance(s.get("engine_start_s"), (int, float)) and s["engine_start_s"] > 0:
        parts.append(f"start {_num(s['engine_start_s'])} s")
    return " · ".join(parts)


def _memory_text(s: dict) -> str:
    text = f"{_num(s.get('peak_rss_mb'))} MB RSS"
    if isinstance(s.get("gpu_mem_peak_mb"), (int, float)):
        text += f" · GPU {_num(s['gpu_mem_peak_mb'])} MB"
    return text


def _sample(d: dict, rows: list[dict]) -> str:
    s = (d.get("metrics") or {}).get("sample") or {}
    by = s.get("stratified_by")
    sub = (
        f"{_int(len(rows))} rows (seed {_e(s.get('seed', '–'))}"
        + (f", stratified by {_e(by)}" if by else "")
        + f", {_int(s.get('error_rows', 0))} error rows). Outputs are cut at {EXCERPT} characters."
    )
    if not rows:
        return '<section><h2>Sample</h2><p class="muted">No rows sampled.</p></section>'
    has_input = any(r.get("input_excerpt") not in (None, "") for r in rows)
    head = (
        "<th>#</th><th>id</th><th>status</th><th>label</th>"
        + ("<th>input</th>" if has_input else "")
        + "<th>output / error</th>"
    )
    body = []
    for i, r in enumerate(rows, 1):
        is_err = r.get("status") == "error" or (r.get("error_code") not in (None, "") and r.get("output") is None)
        if is_err:
            code = r.get("error_code") or "error"
            status = f'<span class="pill" style="background:{BG["fail"]};color:{COLORS["fail"]}">{_e(code)}</span>'
            text = r.get("error_message") or ""
        else:
            st = "ok"
            if r.get("valid") is False:
                st = "invalid"
            tone = "pass" if st == "ok" else "warn"
            status = f'<span class="pill" style="background:{BG[tone]};color:{COLORS[tone]}">{_e(st)}</span>'
            if r.get("finish_reason") not in (None, "", "stop"):
                status += f'<div class="desc">{_e(r.get("finish_reason"))}</div>'
            text = r.get("output")
            if text is None:
                text = r.get("parsed_json")
        out_cell = (
            _e(_cut(str(text), EXCERPT))
            if text not in (None, "") and str(text).strip()
            else ('<span class="muted">(empty)</span>')
        )
        label = r.get("label")
        label_cell = _e(label) if label is not None else '<span class="muted">–</span>'
        if isinstance(r.get("confidence"), (int, float)) and math.isfinite(r["confidence"]):
            label_cell += f'<div class="desc">confidence {r["confidence"]:.3f}</div>'
        inp = ""
        if has_input:
            inp = f'<td class="out">{_e(_cut(str(r.get("input_excerpt") or ""), EXCERPT))}</td>'
        body.append(
            f'<tr><td class="num muted">{i}</td><td class="id">{_e(r.get("id"))}</td><td>{status}</td>'
            f'<td>{label_cell}</td>{inp}<td class="out{" err" if is_err else ""}">{out_cell}</td></tr>'
        )
    return (
        f'<section class="sample"><h2>Sample</h2><p class="desc">{sub}</p>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></section>"
    )


def render_report_html(report_dict: dict, sample_rows: list[dict]) -> str:
    """One self-contained page for a report dict (``QAReport.to_dict()``) and sample rows."""
    d = report_dict or {}
    run = d.get("run") or {}
    title = f"QA {str(d.get('status', '')).upper()} · {run.get('job') or run.get('name') or 'report'}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" '
        "content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>",
        _header(d),
        _checks(d),
        quality_section(d.get("metrics") or {}),
        confidence_section(d.get("metrics") or {}),
        consistency_section(d.get("metrics") or {}),
        _changes(d),
        _labels(d),
        _errors(d),
        _distributions(d),
        _shards(d),
        least_confident_section(d.get("metrics") or {}, list(sample_rows or [])),
        _sample(d, list(sample_rows or [])),
        "</main></body></html>",
    ]
    return "\n".join(p for p in parts if p)
