#!/usr/bin/env bash
# Build docker/Dockerfile's targets with buildah (no Docker engine here) and run each image the way the
# operator's pods run it: as the image's non-root user, on a read-only root filesystem, /tmp a tmpfs.
#
#   bash e2e/images/check-dockerfile.sh [engine|operator ...]    (default: both; needs root)
#
# There is no registry to pull python:3.11-slim from, so the first FROM is replaced (`buildah bud --from`)
# by a local stand-in built from Debian's packages (e2e/images/build.py python-standin: python3.11 + pip,
# and, like the official image, no compiler). Checked in each image: `tidepool <cmd> --help` answers; in
# the engine image also `cc` and `g++` (Triton's launcher is compiled at first use), `import torch, triton`
# and that every CPU op loads prebuilt (`tidepool build-ops` at image build) for this machine's CPU. The engine build downloads PyTorch with its CUDA libraries from PyPI (GBs).
# RUN steps see the host's CA bundle ($SSL_CERT_FILE, else Debian's) at Debian's bundle path, so pip in
# the build trusts what pip on the host trusts (e.g. a TLS-inspecting proxy); nothing of it is copied
# into the image.
set -euo pipefail
cd "$(dirname "$0")/../.."
if (( $# )); then targets=("$@"); else targets=(engine operator); fi
for tool in buildah runc jq; do
  command -v "$tool" >/dev/null || { echo "needs $tool: apt-get install buildah runc jq" >&2; exit 1; }
done

ca_bundle="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
mapfile -t standin < <(python3 e2e/images/build.py python-standin)
archive="${standin[0]}" base="${standin[1]}"
buildah images --quiet "$base" >/dev/null 2>&1 || buildah pull --quiet "oci-archive:$archive" >/dev/null
echo "== stand-in base: $base"

image_config() {  # image_config IMAGE JQ-PATH: a field of the image's OCI config
  buildah inspect --type image "$1" | jq -c -r ".OCIv1.config$2"
}

run_as_pod() {  # run_as_pod IMAGE CMD...: non-root (the image's USER), read-only rootfs, tmpfs /tmp
  local image="$1"; shift
  local ctr rootfs bundle user env_json args_json rc=0
  ctr="$(buildah from --quiet "$image")"
  rootfs="$(buildah mount "$ctr")"
  bundle="$(mktemp -d)"
  user="$(image_config "$image" .User)"
  env_json="$(image_config "$image" .Env)"
  args_json="$(printf '%s\n' "$@" | jq -R . | jq -s .)"
  (cd "$bundle" && runc spec)
  jq --arg root "$rootfs" --arg user "$user" --argjson env "$env_json" --argjson args "$args_json" '
      .root = {path: $root, readonly: true}
      | .process.terminal = false
      | .process.user = {uid: ($user | split(":")[0] | tonumber), gid: ($user | split(":")[1] | tonumber)}
      | .process.env = $env + ["HOME=/tmp"]
      | .process.cwd = "/tmp"
      | .process.args = $args
      | .mounts += [{destination: "/tmp", type: "tmpfs", source: "tmpfs", options: ["nosuid", "nodev", "mode=1777"]}]
    ' "$bundle/config.json" >"$bundle/config.tmp"
  mv "$bundle/config.tmp" "$bundle/config.json"
  runc run --bundle "$bundle" "check-$$-$RANDOM" || rc=$?
  buildah umount "$ctr" >/dev/null
  buildah rm "$ctr" >/dev/null
  rm -rf "$bundle"
  return "$rc"
}

for target in "${targets[@]}"; do
  image="localhost/tidepool-$target:check"
  echo "== buildah bud --target $target"
  start=$SECONDS
  buildah bud --quiet --layers --from "$base" --target "$target" -f docker/Dockerfile -t "$image" \
    --volume "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro" . >/dev/null
  echo "   built in $((SECONDS - start))s"
  cmd=serve; [[ "$target" == operator ]] && cmd=operator
  echo "== $image: tidepool $cmd --help, as $(image_config "$image" .User), read-only root"
  run_as_pod "$image" tidepool "$cmd" --help | head -n 3
  if [[ "$target" == engine ]]; then
    run_as_pod "$image" sh -c 'cc --version | head -n1 && g++ --version | head -n1 && id && touch /probe 2>&1 | tail -n1'
    run_as_pod "$image" python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    # the prebuilt CPU ops: every op has a library for the best ISA this CPU runs, loaded without compiling
    run_as_pod "$image" python -c 'import sys
from tidepool.engine.cpu_ops import build_ops, prebuilt
for op in build_ops.op_names():
    lib, why = prebuilt.find_prebuilt(op)
    sys.exit(f"{op}: {why}") if lib is None else print(op, lib.prebuilt, lib.path)'
  fi
done
echo "== all checks passed"
