#!/usr/bin/env bash
# Build (and optionally push) the worker and Airflow images from the pinned bases in docker/images.lock.
#
#   docker/build.sh REGISTRY/PREFIX [TAG] [--push] [--cpu]
#     e.g. docker/build.sh registry.example.com/ml 0.1.0 --push
#   --cpu: build the worker on vLLM's CPU image (kind demo, laptops), tagged <TAG>-cpu
#
# Prints the pushed references with digests; put the worker's into the vllm_batch_kubernetes
# Variable ({"image": "REGISTRY/PREFIX/airflow-provider-vllm-worker:TAG@sha256:..."}).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:?usage: docker/build.sh REGISTRY/PREFIX [TAG] [--push] [--cpu]}
tag=${2:-$(python3 -c 'import re;print(re.search(r"__version__ = \"(.+)\"", open("airflow_provider_vllm/__init__.py").read())[1])')}
push=0; cpu=0
for a in "$@"; do [[ "$a" == --push ]] && push=1; [[ "$a" == --cpu ]] && cpu=1; done

lock() { grep "^$1=" docker/images.lock | cut -d= -f2-; }
pinned() {  # refuse a base without a digest
  local ref; ref=$(lock "$1")
  if [[ "$ref" != *@sha256:* ]]; then
    echo "docker/images.lock: $1=$ref has no digest; run docker/pin-digests.sh first" >&2; exit 2
  fi
  echo "$ref"
}

worker_base=$(pinned VLLM_IMAGE); worker_tag=$tag
if [[ $cpu == 1 ]]; then worker_base=$(pinned VLLM_CPU_IMAGE); worker_tag="$tag-cpu"; fi
worker="$prefix/airflow-provider-vllm-worker:$worker_tag"
airflow="$prefix/airflow-provider-vllm-airflow:$tag"

docker build -f docker/Dockerfile.worker --build-arg "VLLM_IMAGE=$worker_base" -t "$worker" .
docker build -f docker/Dockerfile.airflow --build-arg "AIRFLOW_IMAGE=$(pinned AIRFLOW_IMAGE)" -t "$airflow" .
# The image's entrypoint must be the worker command line the runners use.
test "$(docker inspect -f '{{json .Config.Entrypoint}}' "$worker")" = '["python3","-m","airflow_provider_vllm.worker"]'

if [[ $push == 1 ]]; then
  for img in "$worker" "$airflow"; do
    docker push "$img" >/dev/null
    echo "$img@$(docker inspect -f '{{index .RepoDigests 0}}' "$img" | cut -d@ -f2)"
  done
else
  echo "$worker"; echo "$airflow"
fi
