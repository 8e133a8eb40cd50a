"""scripts/reliability_report.py keeps kinds of evidence apart, names the tests behind each
figure, and docs/RELIABILITY.md names tests that exist."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.support import ROOT  # noqa: E402

DOC = ROOT / "docs" / "RELIABILITY.md"


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("reliability_report", ROOT / "scripts" / "reliability_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LEDGER = [
    {
        "type": "fault",
        "kind": "kill9.commit.mid_marker",
        "level": "process",
        "faults": 1,
        "rows": 240,
        "lost": 0,
        "duplicates": 0,
        "partial_visible": 0,
        "test": "tests/vllm/test_reliability_worker.py::test_one",
    },
    {
        "type": "fault",
        "kind": "sigterm",
        "level": "process",
        "faults": 1,
        "rows": 240,
        "lost": 0,
        "duplicates": 1,
        "partial_visible": 0,
        "test": "tests/vllm/test_reliability_worker.py::test_one",
    },
    {
        "type": "fault",
        "kind": "s3_drop",
        "level": "store",
        "faults": 8,
        "rows": 120,
        "lost": 0,
        "duplicates": 0,
        "partial_visible": 0,
        "test": "tests/s3/test_s3_faults.py::test_pipeline_survives_faults[drop]",
    },
    {
        "type": "fault",
        "kind": "s3_drop",
        "level": "store",
        "faults": 2,
        "rows": 0,
        "lost": 0,
        "duplicates": 0,
        "partial_visible": 0,
        "test": "tests/s3/test_s3_faults.py::test_pipeline_survives_faults[slowdown]",
    },
    {
        "type": "fault",
        "kind": "engine_death",
        "faults": 2,
        "rows": 120,
        "lost": 0,
        "duplicates": 0,
        "partial_visible": 0,
        "test": "tests/unit/worker/test_guard.py::test_death",
    },  # no level: an older record
    {
        "type": "fault",
        "kind": "commit_protocol_crash",
        "level": "hypothesis",
        "faults": 254,
        "rows": 742,
        "lost": 0,
        "duplicates": 0,
        "partial_visible": 0,
        "examples": 500,
        "steps": 5712,
        "test": "tests/unit/core/test_commit.py::test_sm",
    },
    {
        "type": "fault",
        "kind": "commit_protocol_duplicate_commit",
        "level": "hypothesis",
        "faults": 1199,
        "rows": 0,
        "lost": 0,
        "duplicates": 0,
        "partial_visible": 0,
        "examples": 500,
        "steps": 5712,
        "test": "tests/unit/core/test_commit.py::test_sm",
    },
    {"type": "bad_rows", "kind": "jsonl_rows", "planted": 16, "reported_right": 16, "test": "tests/t.py::test_b"},
    {"type": "malicious", "kind": "uri_dotdot", "tried": 12, "rejected": 11, "test": "tests/t.py::test_m"},
]


def test_levels_are_reported_on_separate_lines_and_never_summed(report):
    s = report.summarise(LEDGER)
    lines = report.headlines(s)
    # two kinds injected into one run of 240 rows: the run's rows count once
    assert lines[0].startswith(
        "Process-level faults: 2 injected across 2 kinds into runs of 240 input rows in all, "
        "each reconciled: 0 lost, 1 duplicates (counted before merge's dedupe)"
    )
    assert lines[1].startswith("Object-store faults: 10 injected across 1 kinds into runs of 120 input rows")
    assert lines[2].startswith("In-process faults: 2 injected")  # the record without a level: the weakest claim
    assert "500 examples, 5712 steps, 254 simulated crashes and 1199 duplicate commits" in lines[3]
    assert "not process faults" in lines[3]
    assert lines[4] == (
        "Bad inputs: 16 planted, 16 reported with the right code (or refused by the plan with the right message)"
    )
    assert lines[5] == "Malicious params and forged files: 12 tried, 11 rejected"
    assert not any("1467" in x or "1456" in x for x in lines)  # hypothesis steps never join the fault count


def test_every_table_row_names_its_tests(report, tmp_path):
    doc = tmp_path / "R.md"
    doc.write_text(f"# x\n\n{report.START}\nold\n{report.END}\n\ntail\n")
    report.rewrite(doc, report.block(report.summarise(LEDGER), "9 passed", 0, []))
    text = doc.read_text()
    assert "old" not in text and text.endswith("tail\n")
    row = next(x for x in text.splitlines() if x.startswith("| s3_drop |"))
    assert row == (
        "| s3_drop | 10 | 120 | 0 | 0 | 0 | `tests/s3/test_s3_faults.py::test_pipeline_survives_faults` (2 params) |"
    )
    hyp = next(x for x in text.splitlines() if x.startswith("| commit_protocol_crash |"))
    assert hyp == (
        "| commit_protocol_crash | 500 | 5712 | 254 | 742 | 0 | 0 | 0 | `tests/unit/core/test_commit.py::test_sm` |"
    )
    assert "| uri_dotdot | 12 | 11 | `tests/t.py::test_m` |" in text
    # the process table and the hypothesis table are separate tables
    assert (
        text.index("**Process-level faults (")
        < text.index("| kill9.commit.mid_marker |")
        < text.index("**Object-store faults (")
        < text.index("| s3_drop |")
        < text.index("**In-process faults (")
        < text.index("| engine_death |")
        < text.index("**Hypothesis state machine (")
    )


def test_the_block_leads_with_the_current_figures_and_when_which_commit_and_command_measured_them(report):
    block = report.block(report.summarise(LEDGER), "9 passed", 0, ["-m", "a"], "abc1234", "2026-01-01 00:00 UTC")
    lines = block.splitlines()
    assert lines[:4] == [report.START, "", report.SUMMARY_HEADER, "|---|---|---|---|"]
    rows = lines[4:10]
    assert [r.split(" | ")[0] for r in rows] == [f"| **{h}**" for h in report.headlines(report.summarise(LEDGER))]
    assert all(
        r.endswith("| 2026-01-01 00:00 UTC | `abc1234` | `python scripts/reliability_report.py -- -m a` |")
        for r in rows
    )
    assert lines[10:12] == [
        "",
        "Measured 2026-01-01 00:00 UTC at commit `abc1234` by `python scripts/reliability_report.py -- -m a`; "
        "pytest: 9 passed (exit 0).",
    ]
    assert (
        block.index("**Bad inputs**")
        < block.index("| jsonl_rows |")
        < block.index("**Malicious params and forged files**")
    )


def test_a_new_run_moves_the_figures_it_replaces_to_the_history(report, tmp_path):
    doc = tmp_path / "R.md"
    history = f"## History\n\n{report.HISTORY_START}\n{report.HISTORY_END}\n"
    doc.write_text(f"# x\n\n{report.START}\n{report.END}\n\n{history}")
    s = report.summarise(LEDGER)
    report.rewrite(doc, report.block(s, "9 passed", 0, [], "aaa1111", "2026-01-01 00:00 UTC"))
    assert "aaa1111" not in doc.read_text().split(report.HISTORY_START)[1]  # an empty block had nothing to move
    report.rewrite(doc, report.block(s, "9 passed", 0, [], "bbb2222", "2026-02-01 00:00 UTC"))
    report.rewrite(doc, report.block(s, "9 passed", 0, [], "bbb2222", "2026-02-01 00:00 UTC"))  # the same run again
    report.rewrite(doc, report.block(s, "8 passed", 0, [], "ccc3333", "2026-03-01 00:00 UTC"))
    text = doc.read_text()
    figures, hist = text.split(report.END)[0], text.split(report.HISTORY_START)[1].split(report.HISTORY_END)[0]
    assert "`ccc3333`" in figures and "`bbb2222`" not in figures
    assert hist.index("`bbb2222`") < hist.index("`aaa1111`")  # newest first, each run once
    assert hist.count("Measured 2026-02-01 00:00 UTC at commit `bbb2222`") == 1
    assert hist.count(report.SUMMARY_HEADER) == 2 and "| s3_drop |" not in hist  # the summaries, not the tables
    assert text.startswith("# x\n") and text.rstrip().endswith(report.HISTORY_END)


def test_the_script_sums_an_existing_ledger_into_a_document(report, tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("\n".join(json.dumps(r) for r in LEDGER) + "\n")
    doc = tmp_path / "R.md"
    doc.write_text(f"{report.START}\n{report.END}\n")
    assert report.main(["--ledger", str(ledger), "--doc", str(doc)]) == 0
    assert "**Process-level faults: 2 injected" in doc.read_text()
    assert "not re-run (summed an existing ledger)" in doc.read_text()
    # the outcome of the run that wrote the ledger is stated again when it is known
    report.outcome_file(ledger).write_text(
        json.dumps(
            {
                "code": 1,
                "outcome": "1 failed, 8 passed",
                "commit": "abc1234",
                "when": "2026-01-01 00:00 UTC",
                "args": ["-m", "a and b"],
            }
        )
    )
    assert report.main(["--ledger", str(ledger), "--doc", str(doc)]) == 1
    text = doc.read_text()
    assert (
        "Measured 2026-01-01 00:00 UTC at commit `abc1234` by `python scripts/reliability_report.py -- -m "
        "'a and b'`; pytest: 1 failed, 8 passed (exit 1)."
    ) in text


def test_the_ledger_refuses_an_unknown_level(monkeypatch, tmp_path):
    from tests.support import ledger

    monkeypatch.setenv(ledger.ENV, str(tmp_path / "l.jsonl"))
    with pytest.raises(ValueError, match="level 'proces'"):
        ledger.record_fault("x", 1, level="proces")
    ledger.record_fault("y", 3, level="process")
    (rec,) = [json.loads(x) for x in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert rec["level"] == "process" and rec["test"].startswith("tests/unit/test_reliability_report.py::")


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_the_document_names_exists():
    """Claims in docs/RELIABILITY.md name their tests by node id; each must be a real test function."""
    text = DOC.read_text()
    named = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?`", text))
    assert len(named) >= 20, "the document should name the tests behind its claims"
    missing = [f"{f}::{t}" for f, t in sorted(named) if not (ROOT / f).exists() or t not in _test_functions(ROOT / f)]
    assert missing == []
