#!/usr/bin/env bash
# Tidepool end-to-end on kind, for users WITH Docker. NOT RUN ON THE PROJECT'S MACHINES:
# they have no Docker engine (CI tests against e2e/controlplane/ + KWOK instead), so this
# script is written against the documented kind/helm/kubectl behaviour, not verified here.
#
# Steps: create the kind cluster (kind-config.yaml), build the engine and operator images
# (docker/Dockerfile, targets engine and operator), `kind load` them, `helm install` the chart,
# apply examples/inferenceservice-unified.yaml with the local engine image, wait for the
# InferenceService to be Ready, port-forward the router and send one completion request with curl.
#
# Needs: docker, kind, kubectl, helm, curl on PATH. Env: CLUSTER (default tidepool),
# TAG (default dev), KEEP=1 to leave the cluster running afterwards.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
CLUSTER="${CLUSTER:-tidepool}"
TAG="${TAG:-dev}"
ENGINE_IMAGE="tidepool/engine:$TAG"
OPERATOR_IMAGE="tidepool/operator:$TAG"
SAMPLE=examples/inferenceservice-unified.yaml

die() { echo "error: $*" >&2; exit 1; }
for tool in docker kind kubectl helm curl; do
  command -v "$tool" >/dev/null || die "$tool not found on PATH"
done
docker info >/dev/null 2>&1 || die "no Docker engine reachable (docker info failed)"
for f in docker/Dockerfile charts/tidepool/Chart.yaml "$SAMPLE"; do
  [[ -e "$f" ]] || die "$f is missing; it lands with a later issue, so this script cannot run yet"
done

if ! kind get clusters | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --config e2e/kind/kind-config.yaml --wait 120s
fi
kubectl config use-context "kind-$CLUSTER"
cleanup() { [[ "${KEEP:-0}" == 1 ]] || kind delete cluster --name "$CLUSTER"; }
trap cleanup EXIT

docker build -f docker/Dockerfile --target engine -t "$ENGINE_IMAGE" .
docker build -f docker/Dockerfile --target operator -t "$OPERATOR_IMAGE" .
kind load docker-image --name "$CLUSTER" "$ENGINE_IMAGE" "$OPERATOR_IMAGE"

helm upgrade --install tidepool charts/tidepool --namespace tidepool-system --create-namespace \
  --set image.repository=tidepool/operator --set image.tag="$TAG" \
  --set engineImage.repository=tidepool/engine --set engineImage.tag="$TAG" --wait --timeout 5m

kubectl apply -f "$SAMPLE"
name="$(kubectl get -f "$SAMPLE" -o jsonpath='{.metadata.name}')"
ns="$(kubectl get -f "$SAMPLE" -o jsonpath='{.metadata.namespace}')"
ns="${ns:-default}"
# kind nodes have no GPUs: run the sample on CPU (gpusPerReplica 0) with the locally built engine image.
kubectl -n "$ns" patch inferenceservice "$name" --type merge \
  -p "{\"spec\":{\"engine\":{\"image\":\"$ENGINE_IMAGE\"},\"resources\":{\"gpusPerReplica\":0}}}"
kubectl -n "$ns" wait --for=condition=Ready "inferenceservice/$name" --timeout=15m

svc="$(kubectl -n "$ns" get inferenceservice "$name" -o jsonpath='{.status.url}')"
svc="${svc:-$name}"; svc="${svc#http://}"; svc="${svc%%.*}"; svc="${svc%%:*}"
kubectl -n "$ns" port-forward "svc/$svc" 18000:80 >/tmp/tidepool-port-forward.log 2>&1 &
pf=$!
trap 'kill $pf 2>/dev/null || true; cleanup' EXIT
for _ in $(seq 50); do curl -sf localhost:18000/health >/dev/null && break; sleep 0.2; done

model="$(curl -sf localhost:18000/v1/models | sed -n 's/.*"id" *: *"\([^"]*\)".*/\1/p' | head -1)"
curl -sf localhost:18000/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"${model:-$name}\", \"prompt\": \"Hello, my name is\", \"max_tokens\": 16}"
echo
echo "e2e on kind: OK"
