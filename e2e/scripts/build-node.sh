#!/usr/bin/env bash
# Builds what the real node (e2e/scripts/real-node.sh) runs, with no release downloads and no registry:
#   - kubelet from the e2e/k8s module (the control plane's release, K8S_VERSION picks 1.37 or 1.36) into $BIN_DIR;
#   - containerd 2.x, containerd-shim-runc-v2, ctr, runc (cgo, seccomp), crictl and the CNI plugins bridge,
#     host-local, loopback and portmap from e2e/tools/node/go.mod into e2e/bin/node/ (cni/ for the plugins);
#   - CoreDNS (e2e/tools/coredns: upstream's server with the plugins the local cluster uses) into e2e/bin/node/;
#   - the pause image (Kubernetes' own build/pause/linux/pause.c, gcc -static), a busybox image (Debian's
#     busybox-static) and the glibc cuda-probe image (e2e/images/cuda-probe.c, gcc, dynamically linked) as
#     OCI archives in e2e/bin/node/images/, which real-node.sh imports with ctr.
# Each part is relinked only when what it is built from changes (module versions, Go, this script).
# Debian packages it needs (gcc, libseccomp-dev, busybox-static, iptables): e2e/scripts/node-packages.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SELF="$E2E_DIR/scripts/$(basename "${BASH_SOURCE[0]}")"
K8S_MOD="$E2E_DIR/k8s"
NODE_MOD="$E2E_DIR/tools/node"
NODE_BIN="${NODE_BIN_DIR:-$E2E_DIR/bin/node}"
export GOTOOLCHAIN="$K8S_TOOLCHAIN"

command -v go >/dev/null 2>&1 || { echo "error: go not found in PATH; install Go >= 1.26.0" >&2; exit 2; }
"$E2E_DIR/scripts/node-packages.sh" --check

mkdir -p "$NODE_BIN/cni" "$NODE_BIN/images" "$BIN_DIR"

# kubelet: the same module, replace block and version stamp as the control plane (build-k8s.sh), so the
# node reports the API server's release.
KUBELET_PKG=k8s.io/kubernetes/cmd/kubelet
KUBE_VERSION="$(cd "$K8S_MOD" && GOFLAGS="-mod=mod -modfile=$K8S_MODFILE" go list -m -f '{{.Version}}' k8s.io/kubernetes)"
want="$( { GOFLAGS="-mod=mod -modfile=$K8S_MODFILE" mods_of "$K8S_MOD" "$KUBELET_PKG"; go env GOVERSION; cat "$SELF"; } | sha256sum | cut -d' ' -f1)"
if stamp_ok "$NODE_BIN" "kubelet-$K8S_VERSION" "$want" "$BIN_DIR/kubelet"; then
  echo "kubelet $KUBE_VERSION up to date in $BIN_DIR"
else
  start=$(date +%s)
  minor="$(echo "$KUBE_VERSION" | cut -d. -f2)"
  ldf="-s -w -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1"
  ldf+=" -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  (cd "$K8S_MOD" && CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false -modfile=$K8S_MODFILE" \
    go build -trimpath -ldflags "$ldf" -o "$BIN_DIR/kubelet" "$KUBELET_PKG")
  echo "$want" > "$NODE_BIN/.kubelet-$K8S_VERSION-stamp"
  echo "kubelet $KUBE_VERSION built in $(( $(date +%s) - start ))s"
fi

# The node's own tools build with the machine's Go whatever the Kubernetes release needs.
export GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false"
RUNTIME_PKGS=(github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
  github.com/containerd/containerd/v2/cmd/ctr sigs.k8s.io/cri-tools/cmd/crictl)
CNI_PKGS=(github.com/containernetworking/plugins/plugins/main/bridge github.com/containernetworking/plugins/plugins/main/loopback
  github.com/containernetworking/plugins/plugins/ipam/host-local github.com/containernetworking/plugins/plugins/meta/portmap)
RUNC_PKG=github.com/opencontainers/runc
v() { (cd "$NODE_MOD" && go list -m -f '{{.Version}}' "$1"); }
CONTAINERD_VERSION="$(v github.com/containerd/containerd/v2)"
RUNC_VERSION="$(v github.com/opencontainers/runc)"
want="$( { mods_of "$NODE_MOD" "${RUNTIME_PKGS[@]}" "${CNI_PKGS[@]}" "$RUNC_PKG"; go env GOVERSION; cat "$SELF"; } | sha256sum | cut -d' ' -f1)"
if stamp_ok "$NODE_BIN" runtime "$want" "$NODE_BIN"/{containerd,containerd-shim-runc-v2,ctr,crictl,runc} "$NODE_BIN"/cni/{bridge,loopback,host-local,portmap}; then
  echo "containerd $CONTAINERD_VERSION, runc $RUNC_VERSION, CNI plugins up to date in $NODE_BIN"
else
  start=$(date +%s)
  # containerd and ctr print their version from these (`containerd --version`, the CRI's RuntimeVersion).
  ldf="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
  (cd "$NODE_MOD" && CGO_ENABLED=0 go build -trimpath -ldflags "$ldf" -o "$NODE_BIN/" "${RUNTIME_PKGS[@]}")
  (cd "$NODE_MOD" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$NODE_BIN/cni/" "${CNI_PKGS[@]}")
  # runc needs cgo (nsenter) and libseccomp: containerd's CRI gives every sandbox a seccomp profile, and a
  # runc built without the tag refuses it ("seccomp: config provided but seccomp not supported").
  (cd "$NODE_MOD" && CGO_ENABLED=1 go build -trimpath -tags seccomp \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" -o "$NODE_BIN/runc" "$RUNC_PKG")
  echo "$want" > "$NODE_BIN/.runtime-stamp"
  echo "containerd $CONTAINERD_VERSION, runc $RUNC_VERSION, CNI plugins built in $(( $(date +%s) - start ))s"
fi

# CoreDNS, the cluster DNS real-node.sh runs on the node's bridge address, with the plugins its Corefile uses.
DNS_MOD="$E2E_DIR/tools/coredns"
want="$( { mods_of "$DNS_MOD" .; go env GOVERSION; cat "$DNS_MOD/main.go" "$SELF"; } | sha256sum | cut -d' ' -f1)"
DNS_VERSION="$(cd "$DNS_MOD" && go list -m -f '{{.Version}}' github.com/coredns/coredns)"
if stamp_ok "$NODE_BIN" coredns "$want" "$NODE_BIN/coredns"; then
  echo "CoreDNS $DNS_VERSION up to date in $NODE_BIN"
else
  start=$(date +%s)
  (cd "$DNS_MOD" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$NODE_BIN/coredns" .)
  echo "$want" > "$NODE_BIN/.coredns-stamp"
  echo "CoreDNS $DNS_VERSION built in $(( $(date +%s) - start ))s"
fi

PAUSE_C="$(cd "$K8S_MOD" && GOTOOLCHAIN="$K8S_TOOLCHAIN" GOFLAGS="-mod=mod -modfile=$K8S_MODFILE" go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
[[ -f "$PAUSE_C" ]] || { echo "error: $PAUSE_C missing (go mod download k8s.io/kubernetes in $K8S_MOD)" >&2; exit 2; }
# The cuda-probe image carries the glibc libraries the simulated driver's files need (their NEEDED entries,
# read with ldd), besides the probe's own: those built by cargo (up.sh builds them before this script).
DRIVER_FILES=()
for f in libnvidia_ml.so libcuda.so libnvidia_ptxjitcompiler.so libnvidia_nvvm.so nvidia-smi nvidia-cuda-mps-control nvidia-cuda-mps-server; do
  [[ -f "$CARGO_TARGET/debug/$f" ]] && DRIVER_FILES+=("$CARGO_TARGET/debug/$f")
done
# Contents only: the 1.36 and 1.37 modules hold the same pause.c at different paths. The driver files
# count by the libraries they need, so a Rust rebuild alone rewrites nothing.
want="$( { cat "$PAUSE_C" /bin/busybox "$E2E_DIR/images/node_images.py" "$E2E_DIR/images/cuda-probe.c" "$SELF"
  gcc --version | head -1; ldd --version | head -1
  for f in "${DRIVER_FILES[@]}"; do ldd "$f" | awk '{print $1}'; done; } | sha256sum | cut -d' ' -f1)"
if stamp_ok "$NODE_BIN" images "$want" "$NODE_BIN/images/pause.tar" "$NODE_BIN/images/busybox.tar" "$NODE_BIN/images/cuda-probe.tar"; then
  echo "pause, busybox and cuda-probe images up to date in $NODE_BIN/images"
else
  gcc -Os -static -Wall -Werror -DVERSION=tessera-e2e -o "$NODE_BIN/pause" "$PAUSE_C"
  # Dynamically linked against this machine's glibc, as a CUDA application is.
  gcc -O2 -Wall -Wextra -Werror -o "$NODE_BIN/cuda-probe" "$E2E_DIR/images/cuda-probe.c" -ldl
  [[ ${#DRIVER_FILES[@]} -gt 0 ]] || echo "warning: no simulated driver files in $CARGO_TARGET/debug yet: the cuda-probe image carries only the probe's libraries" >&2
  python3 "$E2E_DIR/images/node_images.py" --pause "$NODE_BIN/pause" --busybox /bin/busybox \
    --cuda-probe "$NODE_BIN/cuda-probe" "${DRIVER_FILES[@]/#/--driver-file=}" --out "$NODE_BIN/images"
  echo "$want" > "$NODE_BIN/.images-stamp"
  echo "pause, busybox and cuda-probe images written to $NODE_BIN/images"
fi
