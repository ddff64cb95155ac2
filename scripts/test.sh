#!/usr/bin/env bash
# The test command (README.md): lint, then every test tier that runs on this machine.
#
#   1. engine, kernels, models, operator units        (needs only the Python environment)
#   2. helm chart (offline) + real control plane      (needs e2e/controlplane/build.sh's binaries)
#   3. real pods on the dev cluster's real node       (also needs root and the Debian packages of
#                                                       e2e/node/install-deps.sh, and the dev image)
#
# What tiers 2 and 3 need is prepared in the background while tier 1 runs, all cached outside the
# clone: the Go build (Kubernetes, LWS, CoreDNS from Go modules; ~40 min cold on 2 cores) under
# SCHED_IDLE, so it only gets CPU the tests leave free; the node's Debian packages and the dev
# image's root filesystem (debootstrap, ~3 min cold). Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
logs="$(mktemp -d /tmp/tidepool-test.XXXXXX)"

build_pid=""
if ! bash e2e/controlplane/build.sh --check; then
  echo "== building control-plane binaries in the background (log: $logs/controlplane-build.log)"
  # SCHED_IDLE: a merely niced build still preempts torch's OpenMP workers often enough to stall
  # every parallel region by milliseconds.
  chrt --idle 0 bash e2e/controlplane/build.sh >"$logs/controlplane-build.log" 2>&1 &
  build_pid=$!
fi
echo "== preparing the real node in the background (log: $logs/node-prep.log)"
# (+ the node's NetworkPolicy implementation, its own small Go build: e2e/controlplane/build_netpol.sh)
(bash e2e/node/install-deps.sh && nice -n 10 python3 e2e/images/build.py base \
  && chrt --idle 0 bash e2e/controlplane/build_netpol.sh) >"$logs/node-prep.log" 2>&1 &
prep_pid=$!

source scripts/env.sh
echo "== ruff"
ruff check .
echo "== pytest 1/3: engine, kernels, models, operator units"
pytest -m "not controlplane and not k8sbin and not realpods" "$@"

wait_for() {  # wait_for PID LOG WHAT: a background job's failure stops the run with its log tail
  if ! wait "$1"; then
    tail -n 40 "$2"
    echo "$3 failed (full log: $2)" >&2
    exit 1
  fi
}
if [[ -n "$build_pid" ]]; then
  echo "== waiting for the control-plane build"
  wait_for "$build_pid" "$logs/controlplane-build.log" "control-plane build"
fi
TIDEPOOL_K8S_BIN_DIR="$(bash e2e/controlplane/build.sh --print-bin-dir)"
export TIDEPOOL_K8S_BIN_DIR
echo "== pytest 2/3: helm chart and real control plane ($TIDEPOOL_K8S_BIN_DIR)"
pytest -m "k8sbin or controlplane" "$@"

echo "== waiting for the real node's packages and image"
wait_for "$prep_pid" "$logs/node-prep.log" "real node preparation"
echo "== pytest 3/3: real pods on the dev cluster's real node"
pytest -m realpods "$@"
rm -rf "$logs"
