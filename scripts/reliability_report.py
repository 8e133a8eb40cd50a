#!/usr/bin/env python
"""Re-run the reliability suite and rewrite the measured figures in docs/RELIABILITY.md.

    python scripts/reliability_report.py                 # every test marked `reliability`
    python scripts/reliability_report.py -- -m "reliability and not vllm"   # pytest args after --

Runs ``pytest -m reliability`` with ``RELIABILITY_LEDGER`` pointing at a fresh file; each
fault, bad-input and security test appends what it checked (tests/ledger.py). The script sums
the records and replaces the block between the figure markers in docs/RELIABILITY.md with the
headline sentence and per-kind tables. Exits with pytest's exit status (figures are written
either way, with the outcome stated, so a failing run cannot pass for a clean one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "RELIABILITY.md"
START, END = "<!-- reliability-figures:start -->", "<!-- reliability-figures:end -->"


def run_suite(ledger: Path, pytest_args: list[str]) -> tuple[int, str]:
    env = {**os.environ, "RELIABILITY_LEDGER": str(ledger), "PYTHONPATH": str(ROOT)}
    args = pytest_args or ["-m", "reliability"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *args]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(p.stdout[-6000:])
    lines = [x for x in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", x)]
    return p.returncode, (lines[-1].strip("= ") if lines else "no summary")


def summarise(records: list[dict]) -> dict:
    faults: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    bad: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    mal: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        if r["type"] == "fault":
            for k in ("faults", "rows", "lost", "duplicates", "partial_visible"):
                faults[r["kind"]][k] += int(r.get(k, 0))
        elif r["type"] == "bad_rows":
            bad[r["kind"]]["planted"] += int(r["planted"])
            bad[r["kind"]]["right"] += int(r["reported_right"])
        elif r["type"] == "malicious":
            mal[r["kind"]]["tried"] += int(r["tried"])
            mal[r["kind"]]["rejected"] += int(r["rejected"])
    tot = lambda d, k: sum(v[k] for v in d.values())  # noqa: E731
    return {
        "N": tot(faults, "faults"), "K": sum(1 for v in faults.values() if v["faults"]), "D": tot(faults, "rows"),
        "lost": tot(faults, "lost"), "dups": tot(faults, "duplicates"), "partial": tot(faults, "partial_visible"),
        "B": tot(bad, "planted"), "B_right": tot(bad, "right"), "M": tot(mal, "tried"), "M_rej": tot(mal, "rejected"),
        "faults": faults, "bad": bad, "mal": mal,
    }


def sentence(s: dict) -> str:
    return (f"{s['N']} faults across {s['K']} types on {s['D']} rows: {s['lost']} lost, {s['dups']} duplicates, "
            f"{s['partial']} partial files visible; {s['B']} bad rows planted, {s['B_right']} reported with the "
            f"right code; {s['M']} malicious params, {s['M_rej']} rejected")


def block(s: dict, outcome: str, code: int, args: list[str]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    out = [START, "", f"**{sentence(s)}.**", "",
           f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at commit `{commit}` by "
           f"`python scripts/reliability_report.py{' -- ' + ' '.join(args) if args else ''}`; "
           f"pytest: {outcome} (exit {code}).", ""]
    out += ["| fault kind | injected | rows | lost | duplicates | partial visible |", "|---|---:|---:|---:|---:|---:|"]
    out += [f"| {k} | {v['faults']} | {v['rows']} | {v['lost']} | {v['duplicates']} | {v['partial_visible']} |"
            for k, v in sorted(s["faults"].items())]
    out += ["", "| bad input kind | planted | reported with the right code |", "|---|---:|---:|"]
    out += [f"| {k} | {v['planted']} | {v['right']} |" for k, v in sorted(s["bad"].items())]
    out += ["", "| malicious param kind | tried | rejected |", "|---|---:|---:|"]
    out += [f"| {k} | {v['tried']} | {v['rejected']} |" for k, v in sorted(s["mal"].items())]
    return "\n".join(out + ["", END])


def rewrite(doc: Path, new_block: str) -> None:
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{doc} has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + new_block + tail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ledger", help="sum this existing ledger file instead of running the suite")
    ap.add_argument("pytest_args", nargs="*", help="pytest arguments (after --); default: -m reliability")
    a = ap.parse_args(argv)
    if a.ledger:
        ledger, code, outcome = Path(a.ledger), 0, "not re-run (summed an existing ledger)"
    else:
        ledger = Path(tempfile.mkdtemp(prefix="reliability-")) / "ledger.jsonl"
        code, outcome = run_suite(ledger, a.pytest_args)
    records = [json.loads(x) for x in ledger.read_text().splitlines() if x.strip()] if ledger.exists() else []
    s = summarise(records)
    rewrite(DOC, block(s, outcome, code, a.pytest_args))
    print(sentence(s))
    print(f"ledger: {ledger} ({len(records)} records); wrote {DOC.relative_to(ROOT)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
