#!/usr/bin/env bash
# `make bench-controller`: tessera's controller against a real kube-apiserver at cluster scale. A control
# plane of its own (etcd, kube-apiserver, kube-scheduler, kube-controller-manager from e2e/bin; CRDs and
# DeviceClasses applied, no nodes, no GpuPolicy), then e2e/k8s/cmd/bench-controller with -kubeconfig,
# -controller, -plugin, -apiserver-pid-file and the arguments given here (-nodes, -shapes, -steady, -out, ...),
# then teardown. The bench registers the Nodes and NodeInventories and starts the controller itself.
# Own run dir and ports, so it runs beside `make up` and `make bench-scheduler`: BENCH_RUN_DIR,
# BENCH_ETCD_PORT, BENCH_API_PORT, ... KEEP_CLUSTER=1 leaves it running.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
source "$here/bench-cluster.sh"
bench_cluster_env "$repo/bench-results/run-controller" 23990 24000 16643 16659 16657
source "$here/common.sh"

fresh_cluster
step "build: bench-controller"
(cd "$E2E_DIR/k8s" && GOTOOLCHAIN="$K8S_TOOLCHAIN" GOFLAGS="-buildvcs=false -modfile=$K8S_MODFILE" CGO_ENABLED=0 go build -trimpath -o "$BIN_DIR/bench-controller" ./cmd/bench-controller)
step "bench-controller $*"
"$BIN_DIR/bench-controller" -kubeconfig "$ADMIN_KUBECONFIG" -controller "$CONTROLLER_BIN" -plugin "$PLUGIN_BIN" \
  -apiserver-pid-file "$PID_DIR/kube-apiserver.pid" -log-dir "$LOG_DIR" "$@"
