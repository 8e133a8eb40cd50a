"""Reliability ledger: what each fault/bad-input/security test injected and what it found.

Tests call the ``record_*`` functions after their reconciliation; when ``$RELIABILITY_LEDGER``
names a file, one JSON line per call is appended to it (otherwise the calls do nothing).
``scripts/reliability_report.py`` runs the suite with the variable set and sums the lines into
the figures stated in ``docs/RELIABILITY.md``.

A test records what it *checked*, so ``lost``/``duplicates``/``partial_visible`` come from the
reconciliation it just asserted (they are 0 when the test passes; a failing test's record is
still written before the assertion fails when the test records first, then asserts).
"""
from __future__ import annotations

import json
import os
import threading

ENV = "RELIABILITY_LEDGER"
_lock = threading.Lock()


def _append(doc: dict) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    doc = {**doc, "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    with _lock, open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(doc, sort_keys=True) + "\n")


def record_fault(kind: str, rows: int, *, faults: int = 1, lost: int = 0, duplicates: int = 0,
                 partial_visible: int = 0) -> None:
    """``faults`` injections of type ``kind`` over a job of ``rows`` input rows, and the reconciliation."""
    _append({"type": "fault", "kind": kind, "faults": faults, "rows": rows, "lost": lost,
             "duplicates": duplicates, "partial_visible": partial_visible})


def record_bad_rows(kind: str, planted: int, reported_right: int) -> None:
    """``planted`` bad rows of type ``kind``; ``reported_right`` came back as error rows with the right code."""
    _append({"type": "bad_rows", "kind": kind, "planted": planted, "reported_right": reported_right})


def record_malicious(kind: str, tried: int, rejected: int) -> None:
    """``tried`` malicious params/paths of type ``kind``; ``rejected`` were refused before any worker/pod spec."""
    _append({"type": "malicious", "kind": kind, "tried": tried, "rejected": rejected})
