"""GPU benchmark run lengths: >= 20 s of inference per side on an H200 by default (issue 17, item 5)."""

from __future__ import annotations

import importlib.util
import re
import subprocess

from tests.support import ROOT  # noqa: E402

# The fastest worker-or-raw rows/s measured on one H200 (docs/BENCHMARKS.md section 4 and appendix; Llama-3-8B).
H200_FASTEST_ROWS_PER_S = {"classify": 901.3, "generate": 38.07}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_worker_vs_raw", ROOT / "benchmarks" / "bench_worker_vs_raw.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_defaults_give_20_s_of_inference_and_cpu_defaults_stay_short():
    w = _bench().WORKLOADS
    for name, fastest in H200_FASTEST_ROWS_PER_S.items():
        assert w[name]["gpu_rows"] / fastest >= 20, name
    assert (w["classify"]["rows"], w["generate"]["rows"]) == (600, 60)  # the CPU build is slow


def test_gpu_bench_script_defaults_match_and_pass_gpu():
    w = _bench().WORKLOADS
    script = (ROOT / "benchmarks" / "h200" / "gpu_bench.sh").read_text()
    defaults = dict(re.findall(r"(\w+)\) rows=\$\{2:-(\d+)\}", script))
    assert defaults == {"classify": str(w["classify"]["gpu_rows"]), "generate": str(w["generate"]["gpu_rows"])}
    assert "--gpu " in script and "order=${4:-abba}" in script
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "h200" / "gpu_bench.sh")], check=True)
    docs = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert "bash .gpu/gpu_bench.sh classify     #" in docs and "classify 4000 2 abba      #" not in docs
