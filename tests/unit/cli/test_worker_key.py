"""``python -m airflow_provider_vllm.cli.worker_key``: the worker key a deployment puts in the shard pods' Secret."""

from __future__ import annotations

import io
import subprocess
import sys

from airflow_provider_vllm.cli import worker_key
from airflow_provider_vllm.core.errors import EXIT_TERMINAL
from airflow_provider_vllm.core.seal import Keyring, worker_key_of
from tests.conftest import TEST_SIGNING_KEY, TEST_WORKER_KEY
from tests.support import ROOT


def test_it_prints_the_worker_key_of_the_configured_signing_key(capsys):
    assert worker_key.main([]) == 0
    out, err = capsys.readouterr()
    assert out == TEST_WORKER_KEY + "\n" and not err
    assert TEST_SIGNING_KEY not in out
    Keyring.worker_from_env({"VLLM_BATCH_WORKER_KEY": out.strip()})  # what the worker takes


def test_rotation_prints_every_worker_key_in_order(monkeypatch, capsys):
    new, old = "n" * 40, "o" * 40
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", f"{new} , {old}")
    assert worker_key.main([]) == 0
    assert capsys.readouterr().out.strip().split(",") == [worker_key_of(k.encode()).decode() for k in (new, old)]


def test_from_stdin(monkeypatch, capsys):
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY")
    monkeypatch.setattr(sys, "stdin", io.StringIO(TEST_SIGNING_KEY + "\n"))
    assert worker_key.main(["--from-stdin"]) == 0
    assert capsys.readouterr().out == TEST_WORKER_KEY + "\n"


def test_no_key_or_a_worker_key_fails_on_one_line_and_prints_nothing(monkeypatch, capsys):
    for value in ("", "short", TEST_WORKER_KEY):
        monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", value)
        assert worker_key.main([]) == EXIT_TERMINAL
        out, err = capsys.readouterr()
        assert not out and err.count("\n") == 1 and "signing_key" in err


def test_it_runs_as_a_module():
    p = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.cli.worker_key"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == TEST_WORKER_KEY + "\n"  # nothing else on stdout: it goes into a Secret as it is
