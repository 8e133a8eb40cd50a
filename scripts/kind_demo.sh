#!/usr/bin/env bash
# The nightly reclassification DAG with runner=kubernetes on a local kind cluster: every shard
# runs as a pod (vLLM's CPU build, no GPU needed), Airflow runs on this machine.
#
#   scripts/kind_demo.sh            # create the cluster, build and load the image, run the DAG
#   scripts/kind_demo.sh --delete   # remove the cluster and the S3 stand-in
#
# Needs: Docker, kind, kubectl, and this repo's venv (make venv). About 10 GB of images and
# 15-30 minutes the first time. It CANNOT run on this project's CI machines (no Docker engine,
# no cluster there) and is not part of `make test`; the tests cover the pod spec without a cluster.
#
# What it sets up:
#   - kind cluster "vllm-batch-demo", namespace vllm-batch labelled
#     pod-security.kubernetes.io/enforce=restricted (a pod that is not hardened is refused)
#   - docker/Dockerfile.worker built on vLLM's CPU release image (as docker/build.sh --cpu does), loaded into kind
#   - a model-cache PVC holding the tiny test model (airflow_provider_vllm.testing.local_models tiny)
#   - an S3 stand-in (moto_server) on the kind Docker network's gateway address (Linux hosts only: on
#     Docker Desktop that address is not the host's); its dummy keys reach the pods only as a Secret reference
#   - Airflow (SQLite, project-local AIRFLOW_HOME=.airflow-kind/) running `airflow dags test`
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CLUSTER=vllm-batch-demo
NS=vllm-batch
PORT=${KIND_DEMO_S3_PORT:-9123}
DAY=${KIND_DEMO_DAY:-2026-11-28}
PY=$ROOT/.venv/bin/python
export AIRFLOW_HOME=$ROOT/.airflow-kind
STATE=$ROOT/.cache/kind-demo
mkdir -p "$STATE"

if [[ "${1:-}" == "--delete" ]]; then
  kind delete cluster --name "$CLUSTER" || true
  [[ -f $STATE/moto.pid ]] && kill "$(cat "$STATE/moto.pid")" 2>/dev/null || true
  exit 0
fi

for tool in docker kind kubectl; do
  command -v $tool >/dev/null || { echo "kind_demo.sh needs $tool on PATH" >&2; exit 2; }
done
[[ -x $PY ]] || { echo "run 'make venv' first" >&2; exit 2; }

echo "== cluster"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
kind get kubeconfig --name "$CLUSTER" >"$STATE/kubeconfig"
export KUBECONFIG=$STATE/kubeconfig
kubectl get ns "$NS" >/dev/null 2>&1 || kubectl create namespace "$NS"
kubectl label --overwrite namespace "$NS" pod-security.kubernetes.io/enforce=restricted \
  pod-security.kubernetes.io/enforce-version=latest

echo "== worker image (vLLM CPU build)"
cpu_ref=$(grep '^VLLM_CPU_IMAGE=' docker/images.lock | cut -d= -f2-)
if [[ "$cpu_ref" != *@sha256:* ]]; then  # pin the CPU base for this build from what the registry serves now
  docker pull -q "$cpu_ref" >/dev/null
  cpu_ref="$cpu_ref@$(docker inspect -f '{{index .RepoDigests 0}}' "$cpu_ref" | cut -d@ -f2)"
  echo "   CPU base pinned for this build: $cpu_ref"
fi
IMAGE=kind.local/airflow-provider-vllm-worker:demo-cpu
docker build -q -f docker/Dockerfile.worker --build-arg "VLLM_IMAGE=$cpu_ref" -t "$IMAGE" . >/dev/null
kind load docker-image "$IMAGE" --name "$CLUSTER"

echo "== S3 stand-in on the kind network"
GATEWAY=$(docker network inspect kind -f '{{range .IPAM.Config}}{{if .Gateway}}{{.Gateway}} {{end}}{{end}}' \
  | tr ' ' '\n' | grep -E '^[0-9.]+$' | head -1)
ENDPOINT=http://$GATEWAY:$PORT
if ! curl -fs "$ENDPOINT" >/dev/null 2>&1; then
  "$ROOT/.venv/bin/moto_server" -H "$GATEWAY" -p "$PORT" >"$STATE/moto.log" 2>&1 &
  echo $! >"$STATE/moto.pid"
  sleep 3
fi
export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo-secret AWS_DEFAULT_REGION=us-east-1
kubectl -n "$NS" create secret generic s3-demo --from-literal=access_key_id=demo \
  --from-literal=secret_access_key=demo-secret --dry-run=client -o yaml | kubectl apply -f -

echo "== tickets for $DAY -> s3://demo/support/tickets/dt=$DAY/"
PYTHONPATH=$ROOT:$ROOT/scripts "$PY" - "$ENDPOINT" "$DAY" "$STATE" <<'EOF'
import sys, s3fs
from sample_tickets import write_tickets
endpoint, day, state = sys.argv[1:]
paths = write_tickets(f"{state}/tickets", 300)
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
if not fs.exists("demo"):
    fs.mkdir("demo")
fs.put(str(paths["tickets"]), f"demo/support/tickets/dt={day}/tickets.parquet")
EOF

echo "== model-cache PVC with the tiny test model"
PYTHONPATH=$ROOT "$PY" -m airflow_provider_vllm.testing.local_models tiny --dest "$STATE/tiny-llama" >/dev/null
kubectl -n "$NS" apply -f - <<'EOF'
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: models}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 1Gi}}}
EOF
# A restricted pod that mounts the claim writable, to copy the model in once.
kubectl -n "$NS" delete pod model-loader --ignore-not-found >/dev/null
kubectl -n "$NS" apply -f - <<EOF
apiVersion: v1
kind: Pod
metadata: {name: model-loader}
spec:
  securityContext: {runAsNonRoot: true, runAsUser: 1000, runAsGroup: 1000, fsGroup: 1000,
                    seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: loader
    image: $IMAGE
    imagePullPolicy: Never
    command: [sleep, "3600"]
    securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}, readOnlyRootFilesystem: true}
    volumeMounts: [{name: models, mountPath: /models}]
  volumes: [{name: models, persistentVolumeClaim: {claimName: models}}]
EOF
kubectl -n "$NS" wait --for=condition=Ready pod/model-loader --timeout=300s
kubectl -n "$NS" cp "$STATE/tiny-llama" model-loader:/models/tiny-llama
kubectl -n "$NS" delete pod model-loader --wait=true >/dev/null

echo "== Airflow: the nightly DAG with runner=kubernetes"
export AIRFLOW__CORE__DAGS_FOLDER=$ROOT/dags AIRFLOW__CORE__LOAD_EXAMPLES=False PYTHONPATH=$ROOT
export AIRFLOW_CONN_KUBERNETES_DEFAULT="{\"conn_type\": \"kubernetes\", \"extra\": {\"kube_config_path\": \"$KUBECONFIG\", \"namespace\": \"$NS\"}}"
export AIRFLOW_VAR_VLLM_BATCH_RUNNER=kubernetes
export AIRFLOW_VAR_VLLM_BATCH_DATA_ROOT=s3://demo/support
export AIRFLOW_VAR_VLLM_BATCH_MODEL=/models/tiny-llama
export AIRFLOW_VAR_VLLM_BATCH_SHARD_ROWS=100
export AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES="{\"sampling.max_tokens\": 32}"
# The deployment (docs/security.md): where jobs may read and write; the Airflow side (plan, merge, QA,
# publish, the report page) reaches S3 through this Connection only; the pods get keys from the Secret
# and the endpoint from the deployment's pod env, never from the job spec; the pod settings that decide
# what runs and as whom come from the deployment's config.
export AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES="s3://demo/support,/models"
export AIRFLOW_CONN_AWS_DEFAULT="{\"conn_type\": \"aws\", \"login\": \"demo\", \"password\": \"demo-secret\",
  \"extra\": {\"endpoint_url\": \"$ENDPOINT\", \"region_name\": \"us-east-1\"}}"
export AIRFLOW__VLLM_BATCH__KUBERNETES_DEFAULTS="{\"image\": \"$IMAGE\", \"image_pull_policy\": \"Never\",
  \"namespace\": \"$NS\", \"model_cache_pvc\": \"models\",
  \"secret_env\": {\"AWS_ACCESS_KEY_ID\": {\"name\": \"s3-demo\", \"key\": \"access_key_id\"},
                 \"AWS_SECRET_ACCESS_KEY\": {\"name\": \"s3-demo\", \"key\": \"secret_access_key\"}},
  \"env\": {\"AWS_DEFAULT_REGION\": \"us-east-1\", \"AWS_ENDPOINT_URL\": \"$ENDPOINT\",
           \"VLLM_CPU_KVCACHE_SPACE\": \"1\"}}"
export AIRFLOW_VAR_VLLM_BATCH_KUBERNETES="{\"gpus\": 0, \"cpu\": \"1\", \"memory\": \"6Gi\"}"
"$ROOT/.venv/bin/airflow" db migrate >/dev/null
"$ROOT/.venv/bin/airflow" dags reserialize >/dev/null
echo "-- shard 0's pod, as it will be created:"
"$PY" -m airflow_provider_vllm.cli.pod_dry_run vllm_nightly_reclassification "$DAY" 2>/dev/null | head -40
"$ROOT/.venv/bin/airflow" dags test vllm_nightly_reclassification "$DAY" | tee "$STATE/dags-test.log" | \
  grep -E "shard_kubernetes|Building pod|QA (PASS|WARN|FAIL)|published" || true
echo "== outputs"
"$PY" - "$ENDPOINT" "$DAY" <<'EOF'
import json, sys, s3fs
endpoint, day = sys.argv[1:]
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
prefix = f"demo/support/reclassification/dt={day}"
print(json.dumps(json.loads(fs.cat(f"{prefix}/_SUCCESS.json")), indent=1)[:2000])
EOF
echo "kubectl --kubeconfig $KUBECONFIG -n $NS get events   # the shard pods' story"
