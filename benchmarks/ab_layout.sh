#!/bin/bash
# A/B of the data-plane benchmark: the tree before the layout change (cc3f54d) vs main, alternated.
export VLLM_BATCH_MODEL_CACHE=${VLLM_BATCH_MODEL_CACHE:-$PWD/.cache/models} AIRFLOW__VLLM_BATCH__ALLOW_ANY_LOCATION=True VLLM_BATCH_ALLOW_ANY_LOCATION=1
PY=${PY:-$PWD/.venv/bin/python}  # run from the repository root
# Worktrees first: git worktree add /tmp/wt-old cc3f54d; git worktree add /tmp/wt-new main
ROWS=${ROWS:-10000000}
for side in old new new old; do
  if [ $side = old ]; then dir=/tmp/wt-old; else dir=/tmp/wt-new; fi
  echo "=== $side $(date -u +%H:%M:%S)"
  (cd $dir && PYTHONPATH=$dir $PY benchmarks/bench_dataplane.py --rows $ROWS --repeat 3 --workdir /tmp/ab/work-$side 2>&1 | tail -8)
done
echo DONE
