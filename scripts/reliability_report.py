#!/usr/bin/env python
"""Re-run the reliability suite and rewrite the measured figures in docs/RELIABILITY.md.

    python scripts/reliability_report.py                 # every test marked `reliability` (make reliability)
    python scripts/reliability_report.py -- -m "reliability and not vllm"   # pytest args after --
    python scripts/reliability_report.py --ledger FILE   # re-sum an existing ledger, run nothing

With ``--ledger``, ``FILE.outcome.json`` beside it (if any) says how the ledger was made: ``code``, ``outcome``,
``commit``, ``when``, ``args`` and ``command`` (e.g. a fresh clone's ``RELIABILITY_LEDGER=FILE bash .ci/run``).

Runs ``pytest -m reliability`` with ``RELIABILITY_LEDGER`` pointing at a fresh file; each
fault, bad-input and security test appends what it checked (tests/support/ledger.py), with the pytest
node id of the test that checked it. The script sums the records and replaces the block
between the figure markers in docs/RELIABILITY.md: the current figures first, one table row per
kind of evidence (process-level faults, object-store faults, in-process faults, hypothesis
state-machine steps, bad rows, malicious params; never added together) with when, at which commit
and by which command they were measured, then one table per kind, each row naming the test(s)
behind it. The figures the block held before, when they came from another run, move to the top of
the history block (between the history markers, in the document's appendix). Duplicates are the
ones the tests counted before merge's dedupe (tests/support/reconcile.py). Exits with pytest's exit
status (figures are written either way, with the outcome stated, so a failing run cannot pass for a
clean one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "RELIABILITY.md"
START, END = "<!-- reliability-figures:start -->", "<!-- reliability-figures:end -->"
HISTORY_START, HISTORY_END = "<!-- reliability-history:start -->", "<!-- reliability-history:end -->"
SUMMARY_HEADER = "| figure | measured | commit | command |"

# fault levels (tests/support/ledger.py), in the order they are reported
LEVELS = {
    "process": "Process-level faults (a real worker, engine core or merge process killed, stopped, crashed or hung)",
    "store": "Object-store faults (requests of a real run faulted on the wire; stores that overwrite)",
    "in_process": "In-process faults (raised inside one process by the fault harness or the fake engine)",
}
FAULT_KEYS = ("faults", "rows", "lost", "duplicates", "partial_visible")


def outcome_file(ledger: Path) -> Path:
    """Beside the ledger: how the run that wrote it ended (so --ledger can state it again)."""
    return ledger.with_name(ledger.name + ".outcome.json")


def run_suite(ledger: Path, pytest_args: list[str]) -> tuple[int, str]:
    env = {**os.environ, "RELIABILITY_LEDGER": str(ledger), "PYTHONPATH": str(ROOT)}
    args = pytest_args or ["-m", "reliability"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *args]
    print("$", shlex.join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(p.stdout[-6000:])
    lines = [x for x in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", x)]
    return p.returncode, (lines[-1].strip("= ") if lines else "no summary")


def _new_row() -> dict:
    return {"tests": set(), "rows_by_test": defaultdict(int), **{k: 0 for k in FAULT_KEYS}, "examples": 0, "steps": 0}


def summarise(records: list[dict]) -> dict:
    """Per level -> kind -> sums (faults), per kind (bad rows, malicious); each with its test node ids."""
    faults: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(_new_row))
    bad: dict[str, dict] = defaultdict(lambda: {"tests": set(), "planted": 0, "right": 0})
    mal: dict[str, dict] = defaultdict(lambda: {"tests": set(), "tried": 0, "rejected": 0})
    for r in records:
        test = r.get("test") or "(unknown test)"
        if r["type"] == "fault":
            # records written before levels existed count as in-process: never promoted to a stronger claim
            row = faults[r.get("level") or "in_process"][r["kind"]]
            for k in FAULT_KEYS:
                row[k] += int(r.get(k, 0))
            row["examples"] += int(r.get("examples", 0))
            row["steps"] += int(r.get("steps", 0))
            row["tests"].add(test)
            row["rows_by_test"][test] = max(row["rows_by_test"][test], int(r.get("rows", 0)))
        elif r["type"] == "bad_rows":
            bad[r["kind"]]["planted"] += int(r["planted"])
            bad[r["kind"]]["right"] += int(r["reported_right"])
            bad[r["kind"]]["tests"].add(test)
        elif r["type"] == "malicious":
            mal[r["kind"]]["tried"] += int(r["tried"])
            mal[r["kind"]]["rejected"] += int(r["rejected"])
            mal[r["kind"]]["tests"].add(test)
    return {"faults": faults, "bad": bad, "mal": mal}


def _total(rows: dict[str, dict], key: str) -> int:
    return sum(v[key] for v in rows.values())


def run_rows(rows: dict[str, dict]) -> int:
    """Input rows of the reconciled runs, each run once: a test that injects several fault kinds
    into one run records that run's rows with each kind, so the per-kind rows are not summed."""
    per_test: dict[str, int] = defaultdict(int)
    for v in rows.values():
        for t, n in v["rows_by_test"].items():
            per_test[t] = max(per_test[t], n)
    return sum(per_test.values())


def headlines(s: dict) -> list[str]:
    """One line per kind of evidence; counts of different kinds are never added together."""
    out = []
    for level, title in LEVELS.items():
        rows = s["faults"].get(level) or {}
        if not rows:
            continue
        kinds = sum(1 for v in rows.values() if v["faults"])
        out.append(
            f"{title.split(' (')[0]}: {_total(rows, 'faults')} injected across {kinds} kinds into runs of "
            f"{run_rows(rows)} input rows in all, each reconciled: {_total(rows, 'lost')} lost, "
            f"{_total(rows, 'duplicates')} duplicates (counted before merge's dedupe), "
            f"{_total(rows, 'partial_visible')} partial files visible"
        )
    hyp = s["faults"].get("hypothesis") or {}
    if hyp:
        examples = max(v["examples"] for v in hyp.values())  # every kind of one state machine saw the same run
        steps = max(v["steps"] for v in hyp.values())
        crashes = hyp.get("commit_protocol_crash", _new_row())
        dup_commits = hyp.get("commit_protocol_duplicate_commit", _new_row())
        out.append(
            f"Hypothesis state machine over the commit protocol (simulated in one process, not process "
            f"faults): {examples} examples, {steps} steps, {crashes['faults']} simulated crashes and "
            f"{dup_commits['faults']} duplicate commits; {run_rows(hyp)} rows merged: "
            f"{_total(hyp, 'lost')} lost, {_total(hyp, 'duplicates')} duplicates (counted before merge's "
            f"dedupe), {_total(hyp, 'partial_visible')} partial files visible"
        )
    if s["bad"]:
        out.append(
            f"Bad inputs: {_total(s['bad'], 'planted')} planted, {_total(s['bad'], 'right')} reported with "
            "the right code (or refused by the plan with the right message)"
        )
    if s["mal"]:
        out.append(
            f"Malicious params and forged files: {_total(s['mal'], 'tried')} tried, "
            f"{_total(s['mal'], 'rejected')} rejected"
        )
    return out


def _tests(names: set[str]) -> str:
    """Node ids, parametrisations of one test folded into one entry."""
    folded: dict[str, int] = defaultdict(int)
    for n in names:
        folded[re.sub(r"\[.*\]$", "", n)] += 1
    return "<br>".join(f"`{t}`" + (f" ({k} params)" if k > 1 else "") for t, k in sorted(folded.items()))


def git_commit() -> str:
    return (
        subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        or "unknown"
    )


def block(
    s: dict,
    outcome: str,
    code: int,
    args: list[str],
    commit: str | None = None,
    when: str | None = None,
    command: str | None = None,
) -> str:
    """The figures block: the current figures (one row per kind of evidence, with when, at which commit and
    by which command), the run's pytest outcome, then one table per kind naming the tests behind each row.
    ``command``: how the ledger was made, when not by this script's own run (an outcome file's ``command``)."""
    commit = commit or git_commit()
    when = when or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = command or f"`python scripts/reliability_report.py{' -- ' + shlex.join(args) if args else ''}`"
    out = [START, "", SUMMARY_HEADER, "|---|---|---|---|"]
    out += [f"| **{h}** | {when} | `{commit}` | {command} |" for h in headlines(s)]
    out += ["", f"Measured {when} at commit `{commit}` by {command}; pytest: {outcome} (exit {code})."]
    for level, title in LEVELS.items():
        rows = s["faults"].get(level) or {}
        if not rows:
            continue
        out += [
            "",
            f"**{title}**",
            "",
            "| fault kind | injected | rows | lost | duplicates | partial visible | test |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        out += [
            f"| {k} | {v['faults']} | {run_rows({k: v})} | {v['lost']} | {v['duplicates']} | "
            f"{v['partial_visible']} | {_tests(v['tests'])} |"
            for k, v in sorted(rows.items())
        ]
    hyp = s["faults"].get("hypothesis") or {}
    if hyp:
        out += [
            "",
            "**Hypothesis state machine (simulated steps in one process)**",
            "",
            "| kind | examples | steps | simulated | rows merged | lost | duplicates | partial visible | test |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        out += [
            f"| {k} | {v['examples']} | {v['steps']} | {v['faults']} | {run_rows({k: v})} | {v['lost']} | "
            f"{v['duplicates']} | {v['partial_visible']} | {_tests(v['tests'])} |"
            for k, v in sorted(hyp.items())
        ]
    out += ["", "**Bad inputs**", "", "| bad input kind | planted | reported right | test |", "|---|---:|---:|---|"]
    out += [f"| {k} | {v['planted']} | {v['right']} | {_tests(v['tests'])} |" for k, v in sorted(s["bad"].items())]
    out += ["", "**Malicious params and forged files**", ""]
    out += ["| malicious param kind | tried | rejected | test |", "|---|---:|---:|---|"]
    out += [f"| {k} | {v['tried']} | {v['rejected']} | {_tests(v['tests'])} |" for k, v in sorted(s["mal"].items())]
    return "\n".join(out + ["", END])


def current(block_text: str) -> list[str]:
    """The current-figures part of a figures block (its summary table and its 'Measured ...' line); [] when the
    block has none (an empty block, or one written before the summary table)."""
    lines = block_text.splitlines()
    if SUMMARY_HEADER not in lines:
        return []
    i = lines.index(SUMMARY_HEADER)
    j = i
    while j < len(lines) and lines[j].startswith("|"):
        j += 1
    measured = next((x for x in lines[j:] if x.startswith("Measured ")), "")
    return lines[i:j] + ([measured] if measured else [])


def rewrite(doc: Path, new_block: str) -> None:
    """Replace the figures block; the figures it held, when another run measured them, go to the top of the
    history block (kept as it is when the document has no history markers)."""
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{doc} has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    old, tail = rest.split(END, 1)
    before, after = current(old), current(new_block)
    if before and before[-1:] != after[-1:] and HISTORY_START in tail and HISTORY_END in tail:
        mid, hist_rest = tail.split(HISTORY_START, 1)
        hist, end = hist_rest.split(HISTORY_END, 1)
        entry = "\n".join(["", *before, ""])
        tail = mid + HISTORY_START + "\n" + entry + hist.lstrip("\n") + HISTORY_END + end
    doc.write_text(head + new_block + tail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ledger", help="sum this existing ledger file instead of running the suite")
    ap.add_argument("--doc", default=str(DOC), help="the document to rewrite (default: docs/RELIABILITY.md)")
    ap.add_argument("pytest_args", nargs="*", help="pytest arguments (after --); default: -m reliability")
    a = ap.parse_args(argv)
    run: dict = {"args": a.pytest_args}
    if a.ledger:
        ledger = Path(a.ledger)
        side = outcome_file(ledger)
        run = (
            json.loads(side.read_text())
            if side.exists()
            else {"code": 0, "outcome": "not re-run (summed an existing ledger)", "args": a.pytest_args}
        )
    else:
        ledger = Path(tempfile.mkdtemp(prefix="reliability-")) / "ledger.jsonl"
        commit, when = git_commit(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        code, outcome = run_suite(ledger, a.pytest_args)
        run.update(code=code, outcome=outcome, commit=commit, when=when)
        outcome_file(ledger).write_text(json.dumps(run))
    code = int(run["code"])
    records = [json.loads(x) for x in ledger.read_text().splitlines() if x.strip()] if ledger.exists() else []
    s = summarise(records)
    doc = Path(a.doc)
    rewrite(
        doc,
        block(s, run["outcome"], code, run.get("args") or [], run.get("commit"), run.get("when"), run.get("command")),
    )
    print("\n".join(headlines(s)))
    print(f"ledger: {ledger} ({len(records)} records); wrote {doc}")
    return code


if __name__ == "__main__":
    sys.exit(main())
