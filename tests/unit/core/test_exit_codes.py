"""The one exit-code table: every code's outcome, the worker's errors carry codes from it, the ADR links it."""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core import errors
from airflow_provider_vllm.core.exit_codes import OUTCOMES, ExitCode, Outcome, failure_text, outcome
from tests.support import ROOT


def test_every_exit_code_has_an_outcome():
    assert set(OUTCOMES) == set(ExitCode)
    assert [outcome(c) for c in ExitCode] == [Outcome.SUCCESS, Outcome.FAIL, Outcome.RETRY]
    assert (ExitCode.OK, ExitCode.TERMINAL, ExitCode.TRANSIENT) == (0, 2, 75)


@pytest.mark.parametrize("code", [1, 3, 137, 255, -9, -15, None])
def test_any_other_end_is_retried(code):
    assert outcome(code) is Outcome.RETRY


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (2, "terminal worker error (exit 2, not retried): SpecError: bad"),
        (75, "transient worker failure (exit 75, retried): SpecError: bad"),
        (137, "worker exited 137 (retried): SpecError: bad"),
        (-9, "worker killed by signal 9 (retried)"),
        (None, "pod failed before the worker exited (retried)"),
    ],
)
def test_failure_text_names_the_code_and_whether_it_is_retried(code, text):
    assert failure_text(code, "s1", "SpecError: bad") == f"shard s1: {text}"


def test_error_classes_exit_with_codes_of_the_table():
    assert errors.SpecError("x").exit_code is ExitCode.TERMINAL and outcome(errors.SpecError.exit_code) is Outcome.FAIL
    assert errors.EngineError("x").exit_code is ExitCode.TRANSIENT
    assert outcome(errors.TransientError.exit_code) is Outcome.RETRY
    assert (errors.EXIT_OK, errors.EXIT_TERMINAL, errors.EXIT_TRANSIENT) == tuple(ExitCode)


def test_the_adr_links_the_table():
    adr = (ROOT / "docs" / "adr" / "0003-exit-codes.md").read_text()
    assert "airflow_provider_vllm/core/exit_codes.py" in adr
