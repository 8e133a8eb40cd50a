"""``python -m airflow_provider_vllm.cli.vouch_published``: run once after the upgrade, the cache entries of runs
published before it serve again (the checks themselves: tests/unit/steps/cache/test_vouch_runs.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from airflow_provider_vllm.cli import vouch_published
from airflow_provider_vllm.core.errors import EXIT_TERMINAL
from airflow_provider_vllm.steps.merge.merger import SUCCESS
from tests.support import ROOT
from tests.support.data import files_under
from tests.support.ledger import record_malicious
from tests.unit.steps.cache.test_vouch_runs import cached_run, hits, vouches


def reports(stdout: str, tmp_path) -> list[str]:
    """The report lines (in process, the steps' logs reach pytest's capture of stdout too)."""
    return [line for line in stdout.splitlines() if line.startswith(str(tmp_path))]


def test_it_reports_each_run_and_exits_zero_when_none_was_refused(tmp_path, fake_engine_factory, capfd):
    published = cached_run(tmp_path, fake_engine_factory, "a")
    merged_only = cached_run(tmp_path, fake_engine_factory, "b", publish=False)
    before = files_under(tmp_path / "cache")
    capfd.readouterr()
    assert vouch_published.main([str(published), str(merged_only), "--dry-run"]) == 0
    lines = reports(capfd.readouterr().out, tmp_path)
    assert lines[0].startswith(f"{published}: would vouch entry ") and "not published" in lines[1], lines
    assert files_under(tmp_path / "cache") == before

    assert vouch_published.main([str(published), str(merged_only)]) == 0
    lines = reports(capfd.readouterr().out, tmp_path)
    assert lines[0].startswith(f"{published}: vouched entry ") and lines[1].startswith(f"{merged_only}: skipped")
    assert hits(tmp_path, "a") == 40 and hits(tmp_path, "b") == 0
    capfd.readouterr()
    assert vouch_published.main([str(published)]) == 0
    entry = lines[0].split()[3]
    assert reports(capfd.readouterr().out, tmp_path) == [
        f"{published}: already vouched entry {entry} in {tmp_path / 'cache'}"
    ]


def test_no_signing_key_fails_on_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__SIGNING_KEY", "")
    assert vouch_published.main([str(tmp_path)]) == EXIT_TERMINAL
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and "signing_key" in err


def test_it_runs_as_a_module_and_exits_non_zero_when_a_run_was_refused(tmp_path, fake_engine_factory):
    published = cached_run(tmp_path, fake_engine_factory, "a")
    forged = cached_run(tmp_path, fake_engine_factory, "b", publish=False)
    doc = json.loads((published / SUCCESS).read_bytes())
    doc.pop("seal")
    (forged / SUCCESS).write_text(json.dumps(dict(doc, output_uri=str(forged))))  # unsealed
    p = subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.cli.vouch_published", str(published), str(forged)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert p.returncode == vouch_published.EXIT_REFUSED, p.stderr[-2000:]
    lines = p.stdout.splitlines()  # nothing else on stdout: the logs go to stderr
    assert len(lines) == 2, p.stdout
    assert lines[0].startswith(f"{published}: vouched entry "), p.stdout
    assert lines[1].startswith(f"{forged}: refused: {SUCCESS}") and "no seal" in lines[1], p.stdout
    assert len(vouches(tmp_path)) == 1
    assert hits(tmp_path, "a") == 40 and hits(tmp_path, "b") == 0


def test_it_keeps_to_the_deployments_locations_as_publish_does(tmp_path, fake_engine_factory, monkeypatch, capfd):
    """What publish refuses of a spec (``check_spec_allowed``), the command refuses of a run: an output prefix
    outside ``[vllm_batch] allowed_uri_prefixes``, a cache folder outside ``cache_uri_prefixes`` (a deployment that
    moved its caches, or a team's cache it no longer allows), a URI with credentials (shown masked, never printed);
    with neither an allow-list nor ``allow_any_location`` it does not start (fail closed). Nothing is vouched for."""
    published = cached_run(tmp_path, fake_engine_factory, "a")
    here, elsewhere = json.dumps([str(tmp_path)]), json.dumps([str(tmp_path / "elsewhere")])
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", elsewhere)
    capfd.readouterr()
    assert vouch_published.main([str(published)]) == vouch_published.EXIT_REFUSED
    (line,) = reports(capfd.readouterr().out, tmp_path)
    assert line.startswith(f"{published}: refused: ") and "outside the allowed prefixes" in line, line

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", here)
    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", elsewhere)
    assert vouch_published.main([str(published)]) == vouch_published.EXIT_REFUSED
    (line,) = reports(capfd.readouterr().out, tmp_path)
    assert line.startswith(f"{published}: refused entry ") and "cache_uri_prefixes" in line, line

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES", here)
    secret = "wJalrXUtnFEMI/K7MDENG"
    with_credentials = f"file://AKIAEXAMPLE:{secret}@localhost{published}"
    assert vouch_published.main([with_credentials]) == vouch_published.EXIT_REFUSED
    out, err = capfd.readouterr()
    assert secret not in out + err and "credentials" in out and "***" in out, out
    assert not vouches(tmp_path)

    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES")
    monkeypatch.delenv("AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION", raising=False)
    assert vouch_published.main([str(published)]) == EXIT_TERMINAL
    out, err = capfd.readouterr()
    assert not out and err.count("\n") == 1 and "allowed_uri_prefixes" in err, err
    assert not vouches(tmp_path) and hits(tmp_path, "a") == 0
    record_malicious("vouch_published_outside_the_deployments_locations", 3, 3)

    monkeypatch.setenv("AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES", here)
    assert vouch_published.main([str(published)]) == 0
    assert hits(tmp_path, "a") == 40
