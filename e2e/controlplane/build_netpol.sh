#!/usr/bin/env bash
# Build, once, the dev cluster's NetworkPolicy implementation from its Go module and cache it in its
# OWN key dir, beside (never inside) build.sh's control-plane cache:
#
#   ${TIDEPOOL_CACHE:-$HOME/.cache/tidepool}/netpol-<key>/bin/kube-network-policies
#
# kubernetes-sigs/kube-network-policies $KNP_VERSION, patched at build time with
# kube-network-policies.patch (why: see the patch's header; in short, the nftables `queue`
# expression needs CONFIG_NFT_QUEUE, which this project's kernels lack, so packets go to the NFQUEUE
# through nft_compat's xt NFQUEUE target instead; plus a --kubeconfig flag, the node runs it outside
# any pod). The key covers the version, the Go version and the patch's content.
#
# Why a separate key dir: build.sh's key names every component it builds, so adding one there
# would re-key its cache and relink every Kubernetes binary (measured: e2e/README.md, "NetworkPolicies")
# while other runs use the existing bin dir. This component depends on nothing else built there.
#
# Usage:
#   bash e2e/controlplane/build_netpol.sh                  build if missing; last stdout line = bin dir
#   bash e2e/controlplane/build_netpol.sh --print-bin-dir  print the bin dir only (builds nothing)
#   bash e2e/controlplane/build_netpol.sh --check          exit 0 only if the binary is built
# Environment: TIDEPOOL_CACHE, TIDEPOOL_BUILD_P (go build -p, default 2), GOTOOLCHAIN (default local).
set -euo pipefail

KNP_VERSION=v0.8.0   # sigs.k8s.io/kube-network-policies
MODULE=sigs.k8s.io/kube-network-policies
NAME=kube-network-policies
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH="$HERE/kube-network-policies.patch"

export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
CACHE_ROOT="${TIDEPOOL_CACHE:-$HOME/.cache/tidepool}"
GO_VERSION="$(go env GOVERSION)"
KEY="knp${KNP_VERSION}-${GO_VERSION}-$(sha256sum "$PATCH" | cut -c1-8)"
KEY_DIR="$CACHE_ROOT/netpol-$KEY"
BIN_DIR="$KEY_DIR/bin"
STAMP="$BIN_DIR/.complete"

is_complete() { [[ -f "$STAMP" && -x "$BIN_DIR/$NAME" ]]; }

case "${1:-}" in
  --print-bin-dir) echo "$BIN_DIR"; exit 0 ;;
  --check) is_complete; exit $? ;;
  "") ;;
  *) echo "usage: $0 [--print-bin-dir|--check]" >&2; exit 2 ;;
esac

if is_complete; then
  echo "$NAME cached (key $KEY)" >&2
  echo "$BIN_DIR"
  exit 0
fi

mkdir -p "$BIN_DIR"
exec 9>"$KEY_DIR/.lock"
if ! flock -n 9; then
  echo "another build holds $KEY_DIR/.lock; waiting for it" >&2
  flock 9
fi
if is_complete; then  # built by the run we waited for
  echo "$BIN_DIR"
  exit 0
fi

# the same module and build caches as build.sh: shared downloads, compiled packages reused
export GOMODCACHE="$CACHE_ROOT/go/mod"
export GOCACHE="$CACHE_ROOT/go/build"
export GOFLAGS="-mod=mod -buildvcs=false"
export GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}"
export CGO_ENABLED=0
PAR="${TIDEPOOL_BUILD_P:-2}"
T0=$SECONDS

# The module cache is read-only: build a patched copy of the module (its own go.mod and go.sum).
SRC="$KEY_DIR/src/$NAME"
MOD_DIR="$(go mod download -json "$MODULE@$KNP_VERSION" | jq -er .Dir)"
rm -rf "$SRC"; mkdir -p "$(dirname "$SRC")"
cp -r "$MOD_DIR" "$SRC"
chmod -R u+w "$SRC"
echo "==> patch $(basename "$PATCH")" >&2
patch -d "$SRC" -p1 --forward --batch < "$PATCH" >&2
echo "==> $NAME $KNP_VERSION (-p $PAR)" >&2
(cd "$SRC" && go build -p "$PAR" -trimpath -ldflags "-s -w" -o "$BIN_DIR/$NAME.tmp" ./cmd)
mv -f "$BIN_DIR/$NAME.tmp" "$BIN_DIR/$NAME"

# smoke-check: it runs, knows the patched flag, and is the module's main
# (no `| grep -q`: with pipefail the writer's SIGPIPE would fail the build)
help="$("$BIN_DIR/$NAME" --help 2>&1 || true)"
grep -q -- "-kubeconfig" <<<"$help" \
  || { echo "FAILED: $NAME --help does not list -kubeconfig (patch not applied?): $help" >&2; exit 1; }
info="$(go version -m "$BIN_DIR/$NAME")"
grep -qF "$MODULE/cmd" <<<"$info" || { echo "FAILED: $NAME is not built from $MODULE/cmd: $info" >&2; exit 1; }
printf '%s\n' "$KEY" > "$STAMP"
echo "built $NAME in $((SECONDS - T0))s" >&2
echo "$BIN_DIR"
