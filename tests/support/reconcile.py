"""The reconciliation every reliability test ends with.

``reconcile(out, input_ids)`` checks a run's output prefix:

* every input id is in results + errors exactly once, and no other id is there (merged
  outputs when ``results/_manifest.json`` exists: every ``*.parquet`` in ``results/`` and
  ``errors/``, as a glob reader sees them, which must be exactly the parts the manifests name
  with their sizes and sha256; else the ok and error parts named by the shards' commit markers);
* duplicates are counted *before* merge's dedupe: an id named twice across the committed
  chunks counts even when merge dropped the copy (and so does ``duplicates.ids`` of
  ``_MERGED.json``), as well as an id twice in the merged outputs;
* every committed file opens: each file a commit marker names exists with its recorded size
  and sha256 and reads as Parquet, and every other visible file (not an attempt's temp file
  ``*.tmp-*``) opens as what its name says (Parquet, JSON), so no partial file is visible.

``check(...)`` reconciles, records the result in the reliability ledger, then asserts.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from tests.support.ledger import record_fault

MARKER = "_COMMITTED.json"


@dataclass
class Reconciliation:
    rows: int
    lost: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    partial_visible: list[str] = field(default_factory=list)
    ok_ids: set[str] = field(default_factory=set)
    error_codes: dict[str, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicates or self.unknown or self.partial_visible)

    def __str__(self) -> str:
        return (
            f"{self.rows} input rows: {len(self.lost)} lost {self.lost[:5]}, {len(self.duplicates)} duplicated "
            f"{self.duplicates[:5]}, {len(self.unknown)} unknown {self.unknown[:5]}, "
            f"{len(self.partial_visible)} partial files visible {self.partial_visible[:5]}"
        )


def reconcile(out: str | Path, input_ids: Iterable[str], committed_only: bool = False) -> Reconciliation:
    """Reconcile ``out`` against ``input_ids`` (see the module docstring).

    ``committed_only``: count the chunks that commit markers name even when merged outputs exist.
    """
    out = Path(out)
    inputs = list(input_ids)
    rec = Reconciliation(rows=len(inputs))
    rec.partial_visible = _unreadable_visible_files(out)
    ids: list[str] = []
    merged = (out / "results" / "_manifest.json").exists() and not committed_only
    if merged:
        rec.partial_visible += _manifest_mismatches(out)
        res = [
            i
            for p in sorted((out / "results").glob("*.parquet"))
            for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()
        ]
        err = [
            e
            for p in sorted((out / "errors").glob("*.parquet"))
            for e in pq.read_table(p, columns=["id", "error_code"]).to_pylist()
        ]
        ids = res + [e["id"] for e in err]
        rec.ok_ids = set(res)
        rec.error_codes = {e["id"]: e["error_code"] for e in err}
    else:
        for marker_path in sorted(out.glob(f"shards/*/{MARKER}")):
            marker = json.loads(marker_path.read_text())
            for f in marker["files"]:
                res = pq.read_table(out / f["path"], columns=["id"]).column("id").to_pylist()
                err = pq.read_table(out / f["errors"]["path"], columns=["id", "error_code"]).to_pylist()
                ids += res + [e["id"] for e in err]
                rec.ok_ids |= set(res)
                rec.error_codes.update({e["id"]: e["error_code"] for e in err})
    counts = collections.Counter(ids)
    want = set(inputs)
    dup = {i for i, n in counts.items() if n > 1}
    if merged:
        # merge drops identical copies: count them where they were committed, before that dedupe
        committed = collections.Counter(_committed_ids(out))
        dup |= {i for i, n in committed.items() if n > 1}
        merged = out / "_MERGED.json"
        if merged.exists():
            reported = (json.loads(merged.read_text()).get("duplicates") or {}).get("examples") or []
            dup |= set(reported)
    rec.duplicates = sorted(dup)
    rec.lost = sorted(want - set(counts))
    rec.unknown = sorted(set(counts) - want)
    return rec


def _committed_ids(out: Path) -> list[str]:
    """Ids of every row in the chunks that commit markers name (as written, before any dedupe)."""
    ids: list[str] = []
    for marker_path in sorted(out.glob(f"shards/*/{MARKER}")):
        try:
            files = json.loads(marker_path.read_text())["files"]
        except (ValueError, KeyError):
            continue  # counted as a partial/unreadable file
        for f in files:
            for rel in (f["path"], (f.get("errors") or {}).get("path")):
                if rel and (out / rel).exists():
                    ids += pq.read_table(out / rel, columns=["id"]).column("id").to_pylist()
    return ids


def _manifest_mismatches(out: Path) -> list[str]:
    """What a glob reader of results/ and errors/ would see beyond (or short of) the manifests' parts."""
    bad = []
    for kind in ("results", "errors"):
        try:
            manifest = json.loads((out / kind / "_manifest.json").read_text())
        except (OSError, ValueError):
            return [f"{kind}/_manifest.json"]
        named = {p["name"]: p for p in manifest["parts"]}
        on_disk = {p.name for p in (out / kind).glob("*.parquet")}
        bad += [f"{kind}/{n} (not in the manifest)" for n in sorted(on_disk - set(named))]
        bad += [f"{kind}/{n} (in the manifest, missing)" for n in sorted(set(named) - on_disk)]
        for n in sorted(on_disk & set(named)):
            p = out / kind / n
            if p.stat().st_size != named[n]["bytes"] or _sha256(p) != named[n]["sha256"]:
                bad.append(f"{kind}/{n} (size or sha256 differs from the manifest)")
    return bad


def _unreadable_visible_files(out: Path) -> list[str]:
    bad = []
    for marker_path in out.glob(f"shards/*/{MARKER}"):
        try:
            marker = json.loads(marker_path.read_text())
        except ValueError:
            bad.append(str(marker_path.relative_to(out)))
            continue
        for f in marker["files"]:
            for part in (f, f.get("errors") or {"path": f["path"] + " (no errors part)", "bytes": -1, "sha256": ""}):
                p = out / part["path"]
                if not p.exists() or p.stat().st_size != part["bytes"] or _sha256(p) != part["sha256"]:
                    bad.append(part["path"])
    for p in sorted(out.rglob("*")):
        if not p.is_file() or ".tmp-" in p.name:
            continue  # temp files of killed writers: never named by a marker, never read
        try:
            if p.suffix == ".parquet":
                pq.read_table(p)
            elif p.suffix == ".json":
                json.loads(p.read_text())
            elif p.suffix == ".jsonl":
                [json.loads(line) for line in p.read_text().splitlines() if line]
        except Exception:
            bad.append(str(p.relative_to(out)))
    return sorted(set(bad))


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def check(
    out: str | Path,
    input_ids: Iterable[str],
    kind: str | None = None,
    faults: int = 1,
    committed_only: bool = False,
    level: str = "in_process",
) -> Reconciliation:
    """Reconcile, record ``faults`` faults of ``kind`` at ``level`` in the ledger (when given), then assert clean."""
    rec = reconcile(out, input_ids, committed_only=committed_only)
    if kind is not None:
        record_fault(
            kind,
            rec.rows,
            faults=faults,
            lost=len(rec.lost),
            duplicates=len(rec.duplicates),
            partial_visible=len(rec.partial_visible),
            level=level,
        )
    assert rec.clean, str(rec)
    return rec


def check_no_partial(out: str | Path) -> None:
    """Mid-run check (after a kill): every visible file opens; nothing is counted yet."""
    bad = _unreadable_visible_files(Path(out))
    assert not bad, f"partial files visible: {bad}"
