"""What each source of known labels scored against (its yardstick), and whether the change in accuracy since the
previous report compares like with like (``labelled.quality``, the ``accuracy_drop`` check).

A golden set replaced between two runs (harder or easier rows, rows relabelled, another file) moves the accuracy by
itself: Newcombe's interval for two independent samples of one population does not hold, and a harder set failed a
good run while an easier one hid a real drop. Each report therefore records, per source,
``metrics.quality.sources.<source>.yardstick``:

* ``golden_set``: ``uri`` and ``files_sha256``, a digest of the sha256 of the files the plan pinned (``GoldenSetPin``,
  ``files_digest``); ``ride_along``: ``uri`` and ``input_sha256``, the sha256 of the golden rows' input file the plan
  wrote (``GoldenPlan.input_file``: ids, the template's columns, labels); ``input_column``: ``uri`` (the input) and
  ``column``;
* ``scored``: the rows scored; for the two golden sources, when at most ``MAX_ITEMS`` rows were scored,
  ``ids_sha256`` and ``pairs_sha256`` (sha256 of the sorted scored ids, and of the sorted (id, known label) pairs)
  and ``items``: per scored id a 64-bit hash of the id, a 32-bit hash of its known label and whether it was answered
  right (``ITEM_BYTES`` bytes each, sorted, base64; 10,000 golden rows take 173 kB of report.json).

A previous report's yardstick is under the same seal as its figures (report.json's sha256 is in its run's sealed
``qa/_QA.json``, or in the ``_SUCCESS.json`` the plan pinned): an edited one is refused with the report.

``judge`` compares a source with the previous report's (``compared.basis``):

* ``same``: the same yardstick (golden sources: the same pinned files, whichever of their ids each run's rows held,
  or the same scored (id, label) pairs whatever the files' bytes; ``input_column``: the same column, each run's own
  rows being two samples): Newcombe's interval for two independent samples (``accuracy.versus``), as before;
* ``shared``: the golden set changed and both reports kept their items: the paired change on the ids scored in both
  with the same known label (``accuracy.versus_paired``); ids relabelled, added or removed are counted, not compared;
* ``not compared``: the yardstick changed and no paired comparison is possible (more than ``MAX_ITEMS`` rows, no id
  shared with its label, another label column): not judged (the check warns, naming both);
* ``unrecorded``: a previous report written before the yardstick was recorded: not judged (the check warns; the next
  run compares with this run's report). Such a report of a golden set names the pinned files (``run.golden_set``):
  ``same`` when they are this run's, else ``not compared``.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from airflow_provider_vllm.core.plan import GoldenSetPin, Plan
from airflow_provider_vllm.steps.qa.accuracy import versus, versus_paired

MAX_ITEMS = 100_000
"""Scored rows of a golden source up to which a report keeps each id's result (and the digests): the paired
comparison when the golden set changes. Above it only the pinned files identify the set."""
ITEMS_FORMAT = "sha256(id)[:8] sha256(label)[:4] right[1]"
ITEM_BYTES = 13
GOLDEN = ("golden_set", "ride_along")
_IDENTITY = {"golden_set": "files_sha256", "ride_along": "input_sha256", "input_column": "column"}
_NAMES = {"golden_set": "golden set", "ride_along": "ride-along golden rows", "input_column": "input column"}


def files_digest(files: Iterable[Any]) -> str:
    """One sha256 naming a golden set's contents: of the sorted sha256 of its files (``PinnedFile`` or their dumps;
    names and folders left out: the same bytes moved are the same labels)."""
    shas = sorted(str(f["sha256"] if isinstance(f, Mapping) else f.sha256) for f in files)
    return hashlib.sha256("\n".join(shas).encode()).hexdigest()


def plan_identities(plan: Plan, pin: GoldenSetPin | None, column: str | None, input_name: str) -> dict[str, dict]:
    """Per source, what the plan pinned it to (the QA step passes it on to ``measure``)."""
    out: dict[str, dict] = {}
    if pin is not None:
        out["golden_set"] = {"uri": pin.uri, "files_sha256": files_digest(pin.files)}
    if plan.golden is not None:
        out["ride_along"] = {"uri": plan.golden.uri, "input_sha256": plan.golden.input_file.sha256}
    if column is not None:
        out["input_column"] = {"uri": input_name, "column": column}
    return out


def measure(con, source: str, scored: int, identity: Mapping[str, Any] | None) -> dict[str, Any]:
    """The yardstick of ``source`` (see the module docstring) from the ``labelled`` table on ``con``: ``identity``
    (``plan_identities``), the rows scored, and for a golden source of at most ``MAX_ITEMS`` scored rows the digests
    and the items. Reads the labelled rows of that source only (never the results)."""
    y: dict[str, Any] = {k: None for k in (_IDENTITY[source], "uri")} | dict(identity or {}) | {"scored": int(scored)}
    if source not in GOLDEN:
        return y
    y.update(ids_sha256=None, pairs_sha256=None, items=None, items_format=ITEMS_FORMAT)
    if scored > MAX_ITEMS:
        return y
    rows = con.execute(
        "SELECT id, truth, coalesce(pred = truth, false) FROM labelled WHERE source = $s", {"s": source}
    ).fetchall()
    rows.sort()  # by id (then label and result: a repeated id, were there one, in a fixed order)
    ids, pairs = hashlib.sha256(), hashlib.sha256()
    items = []
    for i, label, right in rows:
        ids.update(json.dumps(i).encode() + b"\n")
        pairs.update(json.dumps([i, label]).encode() + b"\n")
        items.append(_hash(i, 8) + _hash(label, 4) + (b"\x01" if right else b"\x00"))
    items.sort()
    y.update(
        ids_sha256=ids.hexdigest(),
        pairs_sha256=pairs.hexdigest(),
        items=base64.b64encode(b"".join(items)).decode("ascii"),
    )
    return y


def _hash(text: str, size: int) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:size]


def _items(y: Mapping[str, Any]) -> dict[bytes, tuple[bytes, bool]] | None:
    """A yardstick's items as id hash -> (label hash, right); None when it kept none (or they do not decode)."""
    raw = y.get("items")
    if not isinstance(raw, str) or y.get("items_format") != ITEMS_FORMAT:
        return None
    try:
        data = base64.b64decode(raw, validate=True)
    except ValueError:
        return None
    if len(data) % ITEM_BYTES:
        return None
    return {data[k : k + 8]: (data[k + 8 : k + 12], data[k + 12] == 1) for k in range(0, len(data), ITEM_BYTES)}


def judge(
    source: str, now: Mapping[str, Any], before: Mapping[str, Any], previous_report: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(``vs_previous``, ``compared``) of one source: ``now`` and ``before`` are its figures in this report and the
    previous one (``count``, ``of``, ``yardstick``); ``previous_report``: the previous report (its
    ``run.golden_set``, for a report written before the yardstick). (None, None) when a side scored no row."""
    unpaired = versus(
        {"correct": now.get("count"), "labelled": now.get("of")},
        {"correct": before.get("count"), "labelled": before.get("of")},
    )
    if unpaired is None:
        return None, None
    y = now.get("yardstick") or {}
    prev = before.get("yardstick")
    if not isinstance(prev, Mapping):
        files = _legacy_files(previous_report) if source == "golden_set" else None
        if files is None:
            return None, _compared(
                "unrecorded",
                f"the previous report does not record which known labels its {_NAMES[source]} scored (written before "
                "QA recorded them): not compared (for information, "
                f"{100 * unpaired['delta']:+.1f} pt vs {100 * unpaired['previous']:.1f}% of "
                f"{unpaired['previous_labelled']}); the next run compares with this run's report",
                None,
            )
        prev = files
    if _same(source, y, prev):
        return unpaired, _compared("same", _same_note(source, y, prev), prev)
    what = (
        f"the {_NAMES[source]} changed since the previous report (now {_describe(source, y)}; before "
        f"{_describe(source, prev)})"
    )
    if source == "input_column":
        return None, _compared("not compared", f"{what}: accuracy not compared", prev)
    mine, theirs = _items(y), _items(prev)
    if mine is None or theirs is None:
        why = (
            f"{'this run' if mine is None else 'the previous report'} kept no per-id results to pair (more than "
            f"{MAX_ITEMS} scored rows, or written before QA kept them)"
        )
        return None, _compared("not compared", f"{what}, and {why}: accuracy not compared", prev)
    counts = {"both": 0, "now_only": 0, "before_only": 0, "neither": 0}
    relabelled = 0
    for key, (label, right) in mine.items():
        other = theirs.get(key)
        if other is None:
            continue
        if other[0] != label:
            relabelled += 1
            continue
        counts["both" if right and other[1] else "now_only" if right else "before_only" if other[1] else "neither"] += 1
    shared = sum(counts.values())
    added, removed = len(mine) - shared - relabelled, len(theirs) - shared - relabelled
    changes = f"{relabelled} id(s) relabelled, {added} added, {removed} removed"
    if not shared:
        return None, _compared(
            "not compared", f"{what}: {changes}; no id scored in both with the same label: accuracy not compared", prev
        )
    paired = versus_paired(**counts)
    assert paired is not None
    detail = f"{what}: {changes}; compared paired on the {shared} id(s) scored in both with the same known label"
    return paired, _compared("shared", detail, prev) | {"shared": shared, "relabelled": relabelled}


def _compared(basis: str, detail: str, prev: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "basis": basis,
        "detail": detail,
        "previous_yardstick": None if prev is None else {k: v for k, v in prev.items() if k != "items"},
    }


def _legacy_files(report: Mapping[str, Any]) -> dict[str, Any] | None:
    """The golden set a report written before the yardstick names (``run.golden_set``: the files the plan pinned),
    as a yardstick; None when it names none."""
    g = (report.get("run") or {}).get("golden_set") if isinstance(report, Mapping) else None
    if not isinstance(g, Mapping) or not isinstance(g.get("files"), list) or not g["files"]:
        return None
    try:
        return {"uri": g.get("uri"), "files_sha256": files_digest(g["files"]), "scored": None}
    except (KeyError, TypeError):
        return None


def _same(source: str, y: Mapping[str, Any], prev: Mapping[str, Any]) -> bool:
    if source == "input_column":
        return y.get("column") == prev.get("column")
    key = _IDENTITY[source]
    if y.get(key) is not None and y.get(key) == prev.get(key):
        # the same pinned files are the same labels, whichever of its ids each run's rows held (a golden set joined
        # to each night's own rows scores other ids each night: two samples of one set of labels, as input_column's)
        return True
    a, b = y.get("pairs_sha256"), prev.get("pairs_sha256")
    return a is not None and b is not None and a == b


def _same_note(source: str, y: Mapping[str, Any], prev: Mapping[str, Any]) -> str:
    if source == "input_column":
        return (
            f"each run's own labelled rows (column {y.get('column')!r}): two samples, compared as independent; the "
            "rows differ from run to run"
        )
    key = _IDENTITY[source]
    if y.get(key) is not None and prev.get(key) is not None and y.get(key) != prev.get(key):
        return (
            f"the {_NAMES[source]}'s files changed since the previous report (now {_describe(source, y)}; before "
            f"{_describe(source, prev)}), but the rows scored and their known labels are the same"
        )
    a, b = y.get("pairs_sha256"), prev.get("pairs_sha256")
    if a is not None and b is not None and a != b:
        return (
            f"the same {_NAMES[source]} ({_describe(source, y)}; before {_describe(source, prev)}): each run scored "
            "the ids of its own rows the set holds, two samples of its labels, compared as independent"
        )
    return ""


def _describe(source: str, y: Mapping[str, Any]) -> str:
    """A yardstick, for a message: where, which bytes, how many rows scored and which (id, label) pairs."""
    if source == "input_column":
        return f"column {y.get('column')!r}"
    key = _IDENTITY[source]
    parts = [f"{'files' if key == 'files_sha256' else 'input'} sha256 {_short(y.get(key))}"]
    if y.get("scored") is not None:
        parts.append(f"{y['scored']} rows scored")
    if y.get("pairs_sha256"):
        parts.append(f"(id, label) pairs sha256 {_short(y['pairs_sha256'])}")
    return f"{y.get('uri') or '(no location recorded)'}: " + ", ".join(parts)


def _short(digest: Any) -> str:
    return f"{digest[:16]}…" if isinstance(digest, str) else "(not recorded)"
