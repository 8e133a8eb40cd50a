"""``airflow vllm-batch dry-run``: the provider's command in Airflow's own CLI, in a sandboxed Airflow home."""

from __future__ import annotations

import json

from tests.support.airflow_env import tail
from tests.support.data import make_spec, write_parquet


def test_airflow_vllm_batch_dry_run_prints_the_report_and_one_line_errors(airflow_sandbox, tmp_path):
    box = airflow_sandbox
    src = box.data / "cli" / "in"
    write_parquet(src / "part-0.parquet", [f"t{i:03d}" for i in range(40)], [f"ticket {i}" for i in range(40)])
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(make_spec(src, box.data / "cli" / "out").model_dump(mode="json")))

    p = box.run("vllm-batch", "dry-run", str(spec), "--json", "--set", "sharding.target_rows=10", timeout=300)
    assert p.returncode == 0, tail(p)
    report = json.loads(p.stdout[p.stdout.index("{") :])  # stdout: the report (Airflow may log above it)
    assert report["rows"] == 40 and report["shards"] == 4 and report["job"] == "job"

    p = box.run("vllm-batch", "dry-run", str(spec), "--set", "sampling.max_tokens=0", timeout=300)
    assert p.returncode == 2, tail(p)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("dry run failed")]
    assert len(errors) == 1 and "sampling.max_tokens" in errors[0] and "Traceback" not in p.stderr
