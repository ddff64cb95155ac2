#!/usr/bin/env bash
# Install, from Debian's packages, what the dev cluster's real node needs beside the binaries that
# e2e/controlplane/build.sh builds: containerd + runc (the container runtime), the CNI plugins
# (bridge, host-local, loopback, portmap), iptables + conntrack (kube-proxy), debootstrap (the dev
# image's root filesystem, e2e/images/build.py). Idempotent: does nothing when all are present.
#
#   bash e2e/node/install-deps.sh           install what is missing (needs root: apt-get)
#   bash e2e/node/install-deps.sh --check   exit 0 only if everything is installed
#
# Nothing is started: the dev cluster runs its own containerd with its own state (e2e/README.md).
set -euo pipefail
PACKAGES=(containerd runc containernetworking-plugins iptables conntrack debootstrap)
# Files that prove each package's part is there (a package name alone may be "rc": removed, config left).
NEEDED=(/usr/bin/containerd /usr/bin/containerd-shim-runc-v2 /usr/bin/ctr /usr/sbin/runc
  /usr/lib/cni/bridge /usr/lib/cni/host-local /usr/lib/cni/loopback /usr/lib/cni/portmap
  /usr/sbin/iptables /usr/sbin/conntrack /usr/sbin/debootstrap)

missing() {
  local f
  for f in "${NEEDED[@]}"; do [[ -x "$f" ]] || echo "$f"; done
}

if [[ -z "$(missing)" ]]; then
  [[ "${1:-}" == "--check" ]] || echo "node packages installed"
  exit 0
fi
if [[ "${1:-}" == "--check" ]]; then
  echo "missing: $(missing | tr '\n' ' ')" >&2
  exit 1
fi
if [[ "$(id -u)" != 0 ]]; then
  echo "the real node's packages are missing ($(missing | tr '\n' ' ')) and installing them needs root:" >&2
  echo "  sudo apt-get install -y --no-install-recommends ${PACKAGES[*]}" >&2
  exit 1
fi
echo "== apt-get install ${PACKAGES[*]}"
export DEBIAN_FRONTEND=noninteractive
# Debian's containerd unit must not be started by the package scripts: policy-rc.d says "no".
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e "$policy" ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; created_policy=1
fi
trap '(( created_policy )) && rm -f "$policy"' EXIT
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
if [[ -n "$(missing)" ]]; then
  echo "still missing after apt-get install: $(missing | tr '\n' ' ')" >&2
  exit 1
fi
echo "node packages installed"
