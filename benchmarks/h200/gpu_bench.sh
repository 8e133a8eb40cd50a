#!/bin/bash
# Device side: worker vs raw vLLM in the same call on the Llama-3-8B dummy shape.
#   bash .gpu/gpu_bench.sh WORKLOAD [ROWS] [PAIRS] [ORDER]
# Defaults: GPU run lengths, >= 20 s of inference per side on an H200 (bench_worker_vs_raw.py --gpu):
# classify 20000 rows, generate 1000 rows; 2 pairs in abba order. Shorter runs (4000 classify rows,
# 5-7 s of inference) were too noisy to tell a regression from drift.
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ENGINE='{"max_num_seqs": 256, "gpu_memory_utilization": 0.9, "enable_prefix_caching": true, "engine_kwargs": {"load_format": "dummy"}}'
wl=$1; pairs=${3:-2}; order=${4:-abba}
case "$wl" in classify) rows=${2:-20000} ;; generate) rows=${2:-1000} ;; *) rows=${2:?ROWS needed for $wl} ;; esac
echo "== $wl rows=$rows pairs=$pairs order=$order"
bash .gpu/dev.sh run python3 benchmarks/bench_worker_vs_raw.py --workload "$wl" --gpu --rows "$rows" --pairs "$pairs" \
  --order "$order" --model /tmp/models/llama3-8b-dummy --max-model-len 1024 --engine "$ENGINE" \
  --results "$OUT/gpu_results.jsonl" --workdir /tmp/bench > "$OUT/$wl.log" 2>&1
rc=$?
grep -vE '^\s*$' "$OUT/$wl.log" | grep -E '^(raw|worker|side|ratio|per worker|identical|bench_worker|appended)|rows/s|Traceback|Error|error' | head -30
[ $rc -ne 0 ] && { echo "FAILED rc=$rc"; tail -30 "$OUT/$wl.log" | cut -c1-300; ls /tmp/bench/$wl/ 2>/dev/null; for f in /tmp/bench/$wl/*.log; do echo "--- $f"; tail -25 "$f" | cut -c1-300; done; }
exit $rc
