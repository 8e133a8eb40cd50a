"""The dry run's command line: every error is one line on stderr naming the field, option or setting.

The report's figures: tests/unit/steps/test_dry_run.py. ``airflow vllm-batch dry-run`` through
Airflow's own CLI: tests/airflow/test_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from airflow_provider_vllm.cli.dry_run import describe, main, parser
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.spec_guard import check_deployment, local_model_path
from tests.support import ROOT
from tests.support.airflow_home import throwaway_airflow_home
from tests.support.data import make_spec, write_parquet

throwaway_airflow_home()
EXAMPLE = ROOT / "examples" / "job.yaml"


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("dry run failed: ") and "Traceback" not in err
    return lines[0]


@pytest.fixture
def spec_file(tmp_path):
    write_parquet(tmp_path / "in" / "part-0.parquet", [f"t{i}" for i in range(20)], [f"ticket {i}" for i in range(20)])
    path = tmp_path / "job.json"
    path.write_text(json.dumps(make_spec(tmp_path / "in", tmp_path / "out").model_dump(mode="json")))
    return path


@pytest.mark.parametrize(
    "extra, names",
    [
        (["--set", "sampling.max_tokens=-1"], "sampling.max_tokens"),
        (["--set", "sampling.max_tokens"], "--set 'sampling.max_tokens': expected KEY=VALUE"),
        (["--set", "io.input_uri=/no/such/folder"], "/no/such/folder"),
        (["--set", "io.input_uri=ftp://host/x"], "io.input_uri"),
        (["--model-config", "/no/such/config.json"], "--model-config /no/such/config.json"),
    ],
)
def test_each_bad_input_is_one_line_naming_what_to_change(spec_file, capfd, extra, names):
    assert main([str(spec_file), *extra]) == 2
    out, err = capfd.readouterr()
    assert out == "" and names in _one_error_line(err)


def test_a_missing_spec_file_and_a_bad_option_are_one_line(tmp_path, capfd):
    assert main([str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in _one_error_line(capfd.readouterr().err)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nope.yaml"), "--gpus", "0"])
    assert e.value.code == 2 and "argument --gpus: must be >= 1" in _one_error_line(capfd.readouterr().err)


def test_an_unreachable_s3_location_is_one_line_naming_the_field_and_the_connection(spec_file):
    """Real botocore against a closed loopback port, in a process of its own as a user runs it: no
    traceback, and the providers' log lines (a missing Connection) stay off stdout, which carries the report."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
    }
    p = _cli([str(spec_file), "--json", "--set", "io.input_uri=s3://in-bucket/tickets/"], env)
    assert p.returncode == 2 and p.stdout == ""
    line = _one_error_line(p.stderr)
    assert line.startswith("dry run failed: io.input_uri=s3://in-bucket/tickets/: ")
    assert "Airflow Connection" in line and "aws_conn_id" in line


def test_missing_cloud_credentials_name_the_connection_and_the_option():
    from botocore.exceptions import NoCredentialsError

    spec = make_spec("s3://in-bucket/tickets/", "s3://out-bucket/labels/")
    args = parser().parse_args(["job.yaml"])
    text = describe(NoCredentialsError(), spec, "s3://out-bucket/labels/_plan.json", args)
    assert text.startswith("io.output_uri=s3://out-bucket/labels/_plan.json: no AWS credentials")
    assert "[vllm_batch] aws_conn_id" in text and "--aws-conn-id" in text and "\n" not in text
    args = parser().parse_args(["job.yaml", "--aws-conn-id", "batch_s3"])
    assert "Airflow Connection batch_s3" in describe(NoCredentialsError(), spec, "s3://in-bucket/tickets/x", args)


def test_the_command_line_prints_one_line_without_a_traceback():
    p = _cli([str(EXAMPLE), "--set", "io.input_uri=/no/dir"], {**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and p.stdout == ""
    assert "/no/dir" in _one_error_line(p.stderr)


def _cli(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "airflow_provider_vllm.cli.dry_run", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_the_example_spec_is_one_the_worker_accepts_and_the_dry_run_sizes(tmp_path, capfd):
    spec = JobSpec.from_yaml(EXAMPLE)
    assert local_model_path(spec.model.name) is None  # a hub id, not a path relative to some folder
    check_deployment(spec, [], allow_any=True)  # the worker's own checks, with any location allowed
    write_parquet(tmp_path / "in" / "part-0.parquet", ["a", "b", "c"], ["x", "y", "z"])
    assert main([str(EXAMPLE), "--set", f"io.input_uri={tmp_path / 'in'}", "--set", f"io.output_uri={tmp_path}/o"]) == 0
    out = capfd.readouterr().out
    assert "dry run: job ticket-triage (chat), model HuggingFaceTB/SmolLM2-135M-Instruct" in out and "rows   " in out
