#!/usr/bin/env bash
# Build, once, the binaries of Tidepool's local Kubernetes control plane from Go modules
# and cache them outside the clone, keyed on every pinned version:
#
#   ${TIDEPOOL_CACHE:-$HOME/.cache/tidepool}/k8s-<key>/bin/
#     etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm     (control plane)
#     kubelet kube-proxy coredns pause lws-controller                                  (the real node, LWS)
#   ${TIDEPOOL_CACHE:-$HOME/.cache/tidepool}/k8s-<key>/manifests/
#     lws/ (CRDs, webhook configurations)  inference-extension/ (InferencePool CRDs)
#
# Usage:
#   bash e2e/controlplane/build.sh                  build what is missing; last stdout line = bin dir
#   bash e2e/controlplane/build.sh --print-bin-dir  print the bin dir only (builds nothing)
#   bash e2e/controlplane/build.sh --check          exit 0 only if the cache is complete
#
# With a complete cache (all binaries + the stamp file) it does nothing and takes well under
# a second. Go module and build caches live in ${TIDEPOOL_CACHE}/go/{mod,build} so repeated
# runs on one machine reuse downloads and compiled packages. Concurrent runs serialize on a
# lock file. Environment: TIDEPOOL_CACHE, TIDEPOOL_BUILD_P (go build -p, default 2),
# GOTOOLCHAIN (default "local": Go 1.26 satisfies every pinned module).
set -euo pipefail

K8S_VERSION=v1.36.3      # k8s.io/kubernetes; staging modules k8s.io/* at v0.36.3
ETCD_VERSION=v3.6.16     # go.etcd.io/etcd/server/v3
KWOK_VERSION=v0.8.0      # sigs.k8s.io/kwok
HELM_VERSION=v3.22.0     # helm.sh/helm/v3
LWS_VERSION=v0.7.0       # sigs.k8s.io/lws (LeaderWorkerSet controller + CRDs)
COREDNS_VERSION=v1.14.7  # github.com/coredns/coredns (our own main: e2e/controlplane/coredns)
GAIE_VERSION=v1.0.0      # sigs.k8s.io/gateway-api-inference-extension (InferencePool CRDs only)
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm
  kubelet kube-proxy coredns pause lws-controller)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Go sources of our own that are built here; their content is part of the cache key.
OWN_SOURCES=("$HERE/coredns/main.go" "$HERE/../images/pause/main.go")

export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
CACHE_ROOT="${TIDEPOOL_CACHE:-$HOME/.cache/tidepool}"
GO_VERSION="$(go env GOVERSION)"
SRC_HASH="$(cat "${OWN_SOURCES[@]}" | sha256sum | cut -c1-8)"
KEY="${K8S_VERSION}-etcd${ETCD_VERSION}-kwok${KWOK_VERSION}-helm${HELM_VERSION}-lws${LWS_VERSION}"
KEY+="-coredns${COREDNS_VERSION}-gaie${GAIE_VERSION}-${GO_VERSION}-${SRC_HASH}"
KEY_DIR="$CACHE_ROOT/k8s-$KEY"
BIN_DIR="$KEY_DIR/bin"
MANIFEST_DIR="$KEY_DIR/manifests"
STAMP="$BIN_DIR/.complete"

is_complete() {
  [[ -f "$STAMP" ]] || return 1
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$BIN_DIR/$b" ]] || return 1; done
  [[ -d "$MANIFEST_DIR/lws" && -d "$MANIFEST_DIR/inference-extension" ]]
}

case "${1:-}" in
  --print-bin-dir) echo "$BIN_DIR"; exit 0 ;;
  --check) is_complete; exit $? ;;
  "") ;;
  *) echo "usage: $0 [--print-bin-dir|--check]" >&2; exit 2 ;;
esac

if is_complete; then
  echo "control-plane binaries cached (key $KEY)"
  echo "$BIN_DIR"
  exit 0
fi

mkdir -p "$KEY_DIR" "$BIN_DIR"
exec 9>"$KEY_DIR/.lock"
if ! flock -n 9; then
  echo "another build holds $KEY_DIR/.lock; waiting for it" >&2
  flock 9
fi
if is_complete; then  # built by the run we waited for
  echo "$BIN_DIR"
  exit 0
fi

export GOMODCACHE="$CACHE_ROOT/go/mod"
export GOCACHE="$CACHE_ROOT/go/build"
export GOFLAGS="-mod=mod -buildvcs=false"
export GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}"
export CGO_ENABLED=0
PAR="${TIDEPOOL_BUILD_P:-2}"
SRC="$KEY_DIR/src"
mkdir -p "$SRC"
TOTAL_START=$SECONDS

step() {  # step NAME CMD...: run, report duration, fail loudly
  local name="$1"; shift
  local t0=$SECONDS
  echo "==> $name" >&2
  if ! "$@"; then
    echo "FAILED: $name (after $((SECONDS - t0))s)" >&2
    exit 1
  fi
  echo "    $name: $((SECONDS - t0))s" >&2
}

# ---- Kubernetes: a scratch module; replace lines generated from k8s.io/kubernetes' go.mod
k8s_module() {
  local dir="$SRC/kubernetes" gomod staging
  rm -rf "$dir"; mkdir -p "$dir"
  gomod="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | jq -r .GoMod)"
  staging="v0.${K8S_VERSION#v1.}"   # v1.36.3 -> v0.36.3
  {
    echo "module tidepool.local/k8sbuild"
    echo
    go mod edit -json "$gomod" | jq -r '"go " + .Go'
    go mod edit -json "$gomod" | jq -r '(.Godebug // [])[] | "godebug " + .Key + "=" + .Value'
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    # every k8s.io/* module the release requires at v0.0.0 or replaces with ./staging
    go mod edit -json "$gomod" | jq -r --arg v "$staging" '
      [ (.Require[] | select(.Path | startswith("k8s.io/")) | select(.Version == "v0.0.0") | .Path),
        ((.Replace // [])[] | select(.New.Path | startswith("./staging/")) | .Old.Path) ]
      | unique[] | "\t" + . + " => " + . + " " + $v'
    echo ")"
  } > "$dir/go.mod"
  echo "    generated $(grep -c '=>' "$dir/go.mod") replace lines" >&2
  (cd "$dir" && go get \
    "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kube-controller-manager@$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kube-scheduler@$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kubectl@$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kubelet@$K8S_VERSION" \
    "k8s.io/kubernetes/cmd/kube-proxy@$K8S_VERSION")
}

k8s_ldflags() {
  local ver="$K8S_VERSION" major minor commit date flags pkg
  major="${ver#v}"; major="${major%%.*}"
  minor="${ver#v*.}"; minor="${minor%%.*}"
  commit="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | jq -r '.Origin.Hash // ""')"
  date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  flags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$ver -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
    [[ -n "$commit" ]] && flags+=" -X $pkg.gitCommit=$commit"
  done
  echo "$flags"
}

build_k8s_cmd() {  # build_k8s_cmd NAME
  (cd "$SRC/kubernetes" && go build -p "$PAR" -trimpath -tags selinux,notest,grpcnotrace \
    -ldflags "$(k8s_ldflags)" -o "$BIN_DIR/$1.tmp" "k8s.io/kubernetes/cmd/$1") \
    && mv -f "$BIN_DIR/$1.tmp" "$BIN_DIR/$1"
}

# ---- etcd: its go.mod has replace directives, so also a scratch module
etcd_module() {
  local dir="$SRC/etcd"
  rm -rf "$dir"; mkdir -p "$dir"
  printf 'module tidepool.local/etcdbuild\n\ngo 1.26.0\n' > "$dir/go.mod"
  (cd "$dir" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION")
}

build_etcd() {
  (cd "$SRC/etcd" && go build -p "$PAR" -trimpath -ldflags "-s -w" \
    -o "$BIN_DIR/etcd.tmp" go.etcd.io/etcd/server/v3) && mv -f "$BIN_DIR/etcd.tmp" "$BIN_DIR/etcd"
}

# ---- KWOK and Helm: no replace directives, so plain `go install pkg@version`
go_install() {  # go_install NAME PKG@VERSION LDFLAGS
  local gobin="$SRC/gobin-$1"
  rm -rf "$gobin"; mkdir -p "$gobin"
  GOBIN="$gobin" GOFLAGS="-buildvcs=false" go install -p "$PAR" -trimpath -ldflags "$3" "$2" \
    && mv -f "$gobin/$1" "$BIN_DIR/$1"
}

# ---- LWS: `go install ...@v0.7.0` asks the proxy for the module's version list (to look for a
# deprecation notice), which the proxy refuses for sigs.k8s.io/lws (403); a scratch module that
# requires the exact version never lists.
module_build() {  # module_build NAME MODULE VERSION PACKAGE GO-VERSION LDFLAGS
  local dir="$SRC/$1"
  rm -rf "$dir"; mkdir -p "$dir"
  printf 'module tidepool.local/%sbuild\n\ngo %s\n\nrequire %s %s\n' "$1" "$5" "$2" "$3" > "$dir/go.mod"
  (cd "$dir" && go build -p "$PAR" -trimpath -ldflags "$6" -o "$BIN_DIR/$1.tmp" "$4") \
    && mv -f "$BIN_DIR/$1.tmp" "$BIN_DIR/$1"
}

# ---- our own mains (CoreDNS with a chosen plugin set, the pause container): scratch modules
own_main() {  # own_main NAME MAIN.GO GO-VERSION [MODULE@VERSION]
  local dir="$SRC/$1"
  rm -rf "$dir"; mkdir -p "$dir"
  cp "$2" "$dir/main.go"
  printf 'module tidepool.local/%sbuild\n\ngo %s\n' "$1" "$3" > "$dir/go.mod"
  if [[ -n "${4:-}" ]]; then (cd "$dir" && go get "$4") || return 1; fi
  (cd "$dir" && go build -p "$PAR" -trimpath -ldflags "-s -w" -o "$BIN_DIR/$1.tmp" .) \
    && mv -f "$BIN_DIR/$1.tmp" "$BIN_DIR/$1"
}

# ---- manifests shipped inside Go modules (CRDs, webhook configurations)
module_dir() {  # module_dir MODULE@VERSION: download it, print its source folder
  go mod download -json "$1" | jq -er .Dir
}

copy_manifests() {
  local lws gaie
  lws="$(module_dir "sigs.k8s.io/lws@$LWS_VERSION")" || return 1
  gaie="$(module_dir "sigs.k8s.io/gateway-api-inference-extension@$GAIE_VERSION")" || return 1
  rm -rf "$MANIFEST_DIR"; mkdir -p "$MANIFEST_DIR/lws" "$MANIFEST_DIR/inference-extension"
  cp "$lws"/config/crd/bases/*.yaml "$MANIFEST_DIR/lws/"
  cp "$lws/config/webhook/manifests.yaml" "$MANIFEST_DIR/lws/webhooks.yaml"
  cp "$lws/config/webhook/mutating-patch.yaml" "$lws/config/webhook/validating-patch.yaml" "$MANIFEST_DIR/lws/"
  cp "$gaie"/config/crd/bases/*.yaml "$MANIFEST_DIR/inference-extension/"
  chmod -R u+w "$MANIFEST_DIR"  # the module cache is read-only
}

echo "building control-plane binaries into $BIN_DIR ($GO_VERSION, -p $PAR)" >&2
rm -f "$STAMP"
[[ -x "$BIN_DIR/etcd" ]] || { step "etcd module $ETCD_VERSION" etcd_module; step "etcd" build_etcd; }
need_k8s=0
K8S_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)
for b in "${K8S_CMDS[@]}"; do
  [[ -x "$BIN_DIR/$b" ]] || need_k8s=1
done
if (( need_k8s )); then
  step "k8s.io/kubernetes module $K8S_VERSION" k8s_module
  for b in "${K8S_CMDS[@]}"; do
    [[ -x "$BIN_DIR/$b" ]] || step "$b" build_k8s_cmd "$b"
  done
fi
[[ -x "$BIN_DIR/kwok" ]] || step "kwok $KWOK_VERSION" \
  go_install kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "-s -w"
[[ -x "$BIN_DIR/helm" ]] || step "helm $HELM_VERSION" \
  go_install helm "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" \
  "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
[[ -x "$BIN_DIR/lws-controller" ]] || step "lws-controller $LWS_VERSION" \
  module_build lws-controller sigs.k8s.io/lws "$LWS_VERSION" sigs.k8s.io/lws/cmd 1.24.0 \
  "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION"
[[ -x "$BIN_DIR/coredns" ]] || step "coredns $COREDNS_VERSION" \
  own_main coredns "$HERE/coredns/main.go" 1.25.0 "github.com/coredns/coredns@$COREDNS_VERSION"
[[ -x "$BIN_DIR/pause" ]] || step "pause" own_main pause "$HERE/../images/pause/main.go" 1.26.0
step "manifests (LWS $LWS_VERSION, inference extension $GAIE_VERSION)" copy_manifests

# smoke-check: every binary runs and reports the pinned version (no `| head`: with pipefail
# the writer's SIGPIPE would fail the build)
check_version() {  # check_version EXPECTED CMD...
  local expected="$1" out; shift
  out="$("$@" 2>&1)" || { echo "FAILED: $* -> $out" >&2; return 1; }
  grep -qF -- "$expected" <<<"$out" || { echo "FAILED: $* does not report $expected: $out" >&2; return 1; }
  echo "    ${out%%$'\n'*}" >&2
}
echo "==> version check" >&2
check_version "$K8S_VERSION" "$BIN_DIR/kube-apiserver" --version
check_version "$K8S_VERSION" "$BIN_DIR/kube-controller-manager" --version
check_version "$K8S_VERSION" "$BIN_DIR/kube-scheduler" --version
check_version "$K8S_VERSION" "$BIN_DIR/kubectl" version --client
check_version "${ETCD_VERSION#v}" "$BIN_DIR/etcd" --version
check_version "$KWOK_VERSION" "$BIN_DIR/kwok" --version
check_version "$HELM_VERSION" "$BIN_DIR/helm" version --short
check_version "$K8S_VERSION" "$BIN_DIR/kubelet" --version
check_version "$K8S_VERSION" "$BIN_DIR/kube-proxy" --version
check_version "CoreDNS-${COREDNS_VERSION#v}" "$BIN_DIR/coredns" -version
check_version $'mod\tsigs.k8s.io/lws\t'"$LWS_VERSION" go version -m "$BIN_DIR/lws-controller"
check_version "tidepool.local/pausebuild" go version -m "$BIN_DIR/pause"
printf '%s\n' "$KEY" > "$STAMP"
echo "built all in $((SECONDS - TOTAL_START))s" >&2
echo "$BIN_DIR"
