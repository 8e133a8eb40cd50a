#!/bin/bash
# Device side (nvidia-h200-x2, after the ../shared/gpu recipe): N workers on N GPUs vs one worker,
# Llama-3-8B dummy shape, classification, 20,000 rows per shard (~30 s of inference per worker).
#   bash benchmarks/h200/scaleout.sh MODES [ROWS]      e.g.  one,two,two,one   two,pinned,pinned,two   tp,one,tp
set -u
export PYTHONPATH=$PWD VLLM_ALLREDUCE_USE_SYMM_MEM=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ENGINE='{"max_num_seqs": 256, "gpu_memory_utilization": 0.9, "enable_prefix_caching": true, "engine_kwargs": {"load_format": "dummy"}}'
modes=$1; rows=${2:-20000}; tag=${modes//,/-}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; nproc; nvidia-smi topo -m | head -4
bash .gpu/dev.sh run python3 benchmarks/bench_scaleout.py --model /tmp/models/llama3-8b-dummy --engine "$ENGINE" \
  --rows "$rows" --gpus 2 --modes "$modes" --results "$OUT/scaleout.jsonl" --workdir /tmp/bench_scaleout \
  > "$OUT/scaleout-$tag.log" 2>&1
rc=$?
grep -E '^(one|two|pinned|tp) |bench_scaleout|appended|Traceback|Error' "$OUT/scaleout-$tag.log" | cut -c1-400 | head -30
[ $rc -ne 0 ] && { tail -20 "$OUT/scaleout-$tag.log" | cut -c1-300; for f in /tmp/bench_scaleout/*.log; do echo "--- $f"; tail -15 "$f" | cut -c1-300; done; }
exit $rc
