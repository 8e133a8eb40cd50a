"""Reliability ledger: what each fault/bad-input/security test injected and what it found.

Tests call the ``record_*`` functions after their reconciliation; when ``$RELIABILITY_LEDGER``
names a file, one JSON line per call is appended to it (otherwise the calls do nothing).
``scripts/reliability_report.py`` runs the suite with the variable set and sums the lines into
the figures stated in ``docs/RELIABILITY.md``.

A test records what it *checked*, so ``lost``/``duplicates``/``partial_visible`` come from the
reconciliation it just asserted (they are 0 when the test passes; a failing test's record is
still written before the assertion fails when the test records first, then asserts).
Duplicates are counted over the committed chunks *before* merge's dedupe (tests/support/reconcile.py).

Each fault record names its ``level``, and the report keeps the levels apart:

* ``process``: a real OS process was killed, stopped or crashed (kill -9, SIGTERM, an engine
  core that dies or hangs on real vLLM), and the run was then reconciled;
* ``store``: object-store requests of a real run were faulted on the wire (the fault proxy in
  front of the local S3 server) or a store misbehaved (overwrote a create-only write);
* ``in_process`` (the default): a fault raised inside one Python process by the fault harness
  or the fake engine (OOM, engine death, crash mid-shard), the run then reconciled;
* ``hypothesis``: steps of the hypothesis state machine over the commit protocol (simulated
  crashes and duplicate commits), recorded with the number of examples and steps.

Every record carries the pytest node id of the test that made it (``test``).
"""

from __future__ import annotations

import json
import os
import threading

ENV = "RELIABILITY_LEDGER"
LEVELS = ("process", "store", "in_process", "hypothesis")
_lock = threading.Lock()


def _append(doc: dict) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    doc = {**doc, "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    with _lock, open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(doc, sort_keys=True) + "\n")


def record_fault(
    kind: str,
    rows: int,
    *,
    faults: int = 1,
    lost: int = 0,
    duplicates: int = 0,
    partial_visible: int = 0,
    level: str = "in_process",
    examples: int = 0,
    steps: int = 0,
) -> None:
    """``faults`` injections of type ``kind`` over a job of ``rows`` input rows, and the reconciliation.

    ``level``: one of LEVELS (see the module docstring); ``examples``/``steps``: hypothesis only.
    """
    if level not in LEVELS:
        raise ValueError(f"level {level!r} is not one of {LEVELS}")
    doc = {
        "type": "fault",
        "kind": kind,
        "level": level,
        "faults": faults,
        "rows": rows,
        "lost": lost,
        "duplicates": duplicates,
        "partial_visible": partial_visible,
    }
    if level == "hypothesis":
        doc.update(examples=examples, steps=steps)
    _append(doc)


def record_bad_rows(kind: str, planted: int, reported_right: int) -> None:
    """``planted`` bad rows of type ``kind``; ``reported_right`` came back as error rows with the right code."""
    _append({"type": "bad_rows", "kind": kind, "planted": planted, "reported_right": reported_right})


def record_malicious(kind: str, tried: int, rejected: int) -> None:
    """``tried`` malicious params/paths of type ``kind``; ``rejected`` were refused before any worker/pod spec."""
    _append({"type": "malicious", "kind": kind, "tried": tried, "rejected": rejected})
