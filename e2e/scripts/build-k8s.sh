#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kubectl from the Go module proxy
# (no containers, no release downloads), then the harness: mini-kubelet (kubelet stand-in), clusterctl
# and the compiled e2e test binary. The upstream binaries are relinked only when the module versions
# they are built from change (a cold build takes 20+ minutes on 2 cores); the harness is rebuilt every
# time, which go's build cache makes cheap.
set -euo pipefail

# K8S_VERSION=1.36 builds from e2e/k8s/go.136.mod into e2e/bin/1.36 (common.sh).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MOD_DIR="$E2E_DIR/k8s"
SELF="$E2E_DIR/scripts/$(basename "${BASH_SOURCE[0]}")"
export GOTOOLCHAIN="$K8S_TOOLCHAIN" GOFLAGS="-mod=mod -buildvcs=false -modfile=$K8S_MODFILE" CGO_ENABLED=0

if ! command -v go >/dev/null 2>&1; then
  echo "error: go not found in PATH; install Go >= 1.26.0 (the Kubernetes 1.36 and 1.37 modules need it)" >&2
  exit 2
fi

# K8S_PATCH=counter-cache: 1.38's own build first, then only kube-scheduler from the patched module file
# (common.sh); the other binaries and the harness are linked from 1.38's bin dir.
if [[ -n "$K8S_PATCH" ]]; then
  K8S_PATCH="" E2E_BIN_DIR="$K8S_BASE_BIN" "$SELF"
  "$E2E_DIR/scripts/countercache-module.sh"
fi

KUBE_VERSION="$(cd "$MOD_DIR" && go list -m -f '{{.Version}}' k8s.io/kubernetes)" || {
  echo "error: cannot resolve k8s.io/kubernetes in $MOD_DIR/$K8S_MODFILE (go list -m failed)" >&2
  exit 2
}
MINOR="$(echo "$KUBE_VERSION" | cut -d. -f2)"
[[ "$KUBE_VERSION" == "v$K8S_VERSION."* ]] || {
  echo "error: $MOD_DIR/$K8S_MODFILE requires k8s.io/kubernetes $KUBE_VERSION, not a $K8S_VERSION release (K8S_VERSION=$K8S_VERSION)" >&2
  exit 2
}
CMDS=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl)
ETCD_PKG=go.etcd.io/etcd/server/v3
ETCD_VERSION="$(cd "$MOD_DIR" && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)"
BINS=(etcd kube-apiserver kube-scheduler kube-controller-manager kubectl)
PATCH_SUM=""
if [[ -n "$K8S_PATCH" ]]; then
  CMDS=(k8s.io/kubernetes/cmd/kube-scheduler) BINS=(kube-scheduler) SKIP_HARNESS=1 ETCD_PKG=""
  PATCH_SUM="$(cat "$MOD_DIR/countercache/dra-counter-cache.patch" | sha256sum)"
  mkdir -p "$BIN_DIR"
  for b in etcd kube-apiserver kube-controller-manager kubectl mini-kubelet clusterctl e2e.test; do
    ln -f "$K8S_BASE_BIN/$b" "$BIN_DIR/$b"
  done
fi

mkdir -p "$BIN_DIR"
STAMP="$BIN_DIR/.k8s-stamp"
# The exact module versions the five binaries are compiled from (and the patch, if any), plus Go and this script.
want="$( { cd "$MOD_DIR" && go list -deps -f '{{with .Module}}{{.Path}}@{{.Version}}{{end}}' "${CMDS[@]}" $ETCD_PKG | sort -u; echo "$PATCH_SUM"; go env GOVERSION; cat "$SELF"; } | sha256sum | cut -d' ' -f1)"
have_all=1
for b in "${BINS[@]}"; do
  [[ -x "$BIN_DIR/$b" ]] || have_all=0
done

if [[ $have_all == 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "control plane $KUBE_VERSION (etcd $ETCD_VERSION) up to date in $BIN_DIR"
else
  echo "building ${BINS[*]} $KUBE_VERSION${K8S_PATCH:+ ($K8S_PATCH)} into $BIN_DIR (cold: 20-30 min on 2 cores)"
  start=$(date +%s)
  LDF="-s -w"
  LDF+=" -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION"
  LDF+=" -X k8s.io/component-base/version.gitMajor=1"
  LDF+=" -X k8s.io/component-base/version.gitMinor=$MINOR"
  LDF+=" -X k8s.io/component-base/version.gitTreeState=clean"
  LDF+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBE_VERSION"
  LDF+=" -X k8s.io/client-go/pkg/version.gitMajor=1"
  LDF+=" -X k8s.io/client-go/pkg/version.gitMinor=$MINOR"
  (cd "$MOD_DIR" && go build -trimpath -ldflags "$LDF" -o "$BIN_DIR/" "${CMDS[@]}")
  [[ -z "$ETCD_PKG" ]] || (cd "$MOD_DIR" && go build -trimpath -ldflags "-s -w" -o "$BIN_DIR/etcd" "$ETCD_PKG")
  echo "$want" > "$STAMP"
  echo "control plane built in $(( $(date +%s) - start ))s"
fi

if [[ "${SKIP_HARNESS:-0}" != 1 ]]; then
  start=$(date +%s)
  (cd "$MOD_DIR" && go build -trimpath -o "$BIN_DIR/" ./cmd/mini-kubelet ./cmd/clusterctl)
  (cd "$MOD_DIR" && go test -trimpath ${K8S_TEST_TAGS:+-tags "$K8S_TEST_TAGS"} -c -o "$BIN_DIR/e2e.test" ./e2etest)
  echo "harness (mini-kubelet, clusterctl, e2e.test) built in $(( $(date +%s) - start ))s"
fi
