#!/usr/bin/env bash
# The test command (README.md): lint, then every test tier that runs on this machine.
#
# The control-plane binaries (Kubernetes from Go modules) build in the background, cached
# outside the clone, while the engine tests run; the control-plane tests run once they are there.
# Extra arguments go to both pytest runs (e.g. -x, -k expr).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$TIDEPOOL_ROOT"
mkdir -p "$TIDEPOOL_CACHE/logs"
build_log="$TIDEPOOL_CACHE/logs/controlplane-build.log"
if bash e2e/controlplane/build.sh --check; then
  build_pid=""
else
  echo "== building control-plane binaries in the background (log: $build_log)"
  # SCHED_IDLE: the Go build only gets CPU the tests leave free. A merely niced build still
  # preempts torch's OpenMP workers often enough to stall every parallel region by milliseconds.
  chrt --idle 0 bash e2e/controlplane/build.sh >"$build_log" 2>&1 &
  build_pid=$!
fi

echo "== ruff"
ruff check .
echo "== pytest: engine, kernels, models (not control plane)"
pytest -m "not controlplane" "$@"

if [[ -n "$build_pid" ]]; then
  echo "== waiting for the control-plane build"
  if ! wait "$build_pid"; then
    tail -n 40 "$build_log"
    echo "control-plane build failed (full log: $build_log)" >&2
    exit 1
  fi
fi
TIDEPOOL_K8S_BIN_DIR="$(bash e2e/controlplane/build.sh --print-bin-dir)"
export TIDEPOOL_K8S_BIN_DIR
echo "== pytest: real control plane ($TIDEPOOL_K8S_BIN_DIR)"
pytest -m controlplane "$@"
