#!/usr/bin/env bash
# Resolve the base images in docker/images.lock to digests and write them back (tag@sha256:...).
#
#   docker/pin-digests.sh           resolve every entry's tag, rewrite images.lock and the Dockerfile defaults
#   docker/pin-digests.sh --check   only compare: exit 1 when a pinned digest is not what the tag points to now
#
# Needs registry access and one of: crane (go-containerregistry), or docker with buildx.
# The digest recorded is the tag's manifest-list (index) digest, so every architecture is pinned.
set -euo pipefail
cd "$(dirname "$0")"
check=0
[[ "${1:-}" == "--check" ]] && check=1

digest_of() {  # $1: image reference (tag form)
  if command -v crane >/dev/null 2>&1; then
    crane digest "$1"
  elif docker buildx version >/dev/null 2>&1; then
    docker buildx imagetools inspect "$1" --format '{{json .Manifest}}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["digest"])'
  else
    echo "pin-digests.sh: install crane or docker buildx" >&2
    exit 2
  fi
}

status=0
tmp=$(mktemp)
while IFS= read -r line; do
  if [[ -z "$line" || "$line" == \#* ]]; then echo "$line" >>"$tmp"; continue; fi
  name=${line%%=*}
  ref=${line#*=}
  tag=${ref%@*}
  pinned=""
  [[ "$ref" == *@sha256:* ]] && pinned=${ref#*@}
  now=$(digest_of "$tag")
  if [[ "$now" != sha256:* ]]; then echo "cannot resolve $tag: $now" >&2; exit 2; fi
  if [[ -n "$pinned" && "$pinned" != "$now" ]]; then
    echo "$name: $tag now points to $now, images.lock pins $pinned" >&2
    status=1
  fi
  [[ -z "$pinned" ]] && echo "$name: $tag -> $now (newly pinned)" >&2
  echo "$name=$tag@$now" >>"$tmp"
done <images.lock

if [[ $check == 1 ]]; then rm -f "$tmp"; exit $status; fi
mv "$tmp" images.lock
# Keep the worker Dockerfile's default base in step with the lock.
vllm=$(grep '^VLLM_IMAGE=' images.lock | cut -d= -f2-)
sed -i.bak "s|^ARG VLLM_IMAGE=.*|ARG VLLM_IMAGE=${vllm}|" Dockerfile.worker && rm -f Dockerfile.worker.bak
echo "images.lock updated; review with: git diff docker/" >&2
