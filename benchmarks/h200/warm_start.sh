#!/bin/bash
# Device side (after the ../shared/gpu recipe installed vLLM 0.25.0 into /tmp/site and built /tmp/models):
# shard pods' engine start with and without the shared compile cache, and batch-invariant execution's cost.
#   bash benchmarks/h200/warm_start.sh warm [PODS]       pods in sequence, default empty,populated,off,populated
#   bash benchmarks/h200/warm_start.sh invariance [ROWS] 16,000 classify rows with and without batch_invariant
# Lives in a folder holding airflow_provider_vllm/ and benchmarks/ of the commit under test (carried to the device,
# e.g. .gpu-wt/), with an optional COMMIT file naming that commit for the JSON lines; docs/BENCHMARKS.md section 11.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} VLLM_ALLREDUCE_USE_SYMM_MEM=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
SHARED=/tmp/vllm-batch-shared-compile-cache   # the compile-cache PVC: kept between the two stages
common=(--model /tmp/models/llama3-8b-dummy --shared "$SHARED" --commit "$COMMIT" --results "$OUT/warm_start.jsonl")
case "${1:-}" in
warm)
  t0=$(date +%s); python3 -m compileall -q -j 16 /tmp/site "$PWD/airflow_provider_vllm" >/dev/null 2>&1
  echo "compileall (so that no pod pays for writing .pyc files): $(( $(date +%s) - t0 )) s"
  python3 benchmarks/bench_warm_start.py "${common[@]}" --pods "${2:-empty,populated,off,populated}" \
    --workdir /tmp/bench_warm 2>&1 | tee "$OUT/warm.log" | grep -vE '^\s*$' ;;
invariance)
  python3 benchmarks/bench_warm_start.py "${common[@]}" --pods "" --batch-invariance "${2:-16000}" \
    --workdir /tmp/bench_bi 2>&1 | tee "$OUT/invariance.log" | grep -vE '^\s*$' ;;
*) echo "usage: $0 warm|invariance"; exit 2 ;;
esac
