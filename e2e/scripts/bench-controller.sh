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
export RUN_DIR="${BENCH_RUN_DIR:-$repo/bench-results/run-controller}"
export ETCD_PORT="${BENCH_ETCD_PORT:-23990}" ETCD_PEER_PORT="${BENCH_ETCD_PEER_PORT:-24000}"
export API_PORT="${BENCH_API_PORT:-16643}" SCHEDULER_PORT="${BENCH_SCHEDULER_PORT:-16659}"
export CONTROLLER_MANAGER_PORT="${BENCH_CONTROLLER_MANAGER_PORT:-16657}"
export NODES=0 SKIP_DRIVER=1 SKIP_EXAMPLES=1 POLICY=none
source "$here/common.sh"

cleanup() {
  if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then
    "$here/down.sh" > /dev/null || echo "warning: stopping the bench cluster in $RUN_DIR failed" >&2
  else
    echo "bench cluster left running: KUBECONFIG=$RUN_DIR/pki/admin.kubeconfig; RUN_DIR=$RUN_DIR make down stops it"
  fi
}
"$here/down.sh" > /dev/null 2>&1 || true
trap cleanup EXIT
"$here/up.sh"
step "build: bench-controller"
(cd "$E2E_DIR/k8s" && GOFLAGS="-buildvcs=false -modfile=$K8S_MODFILE" CGO_ENABLED=0 go build -trimpath -o "$BIN_DIR/bench-controller" ./cmd/bench-controller)
step "bench-controller $*"
"$BIN_DIR/bench-controller" -kubeconfig "$ADMIN_KUBECONFIG" -controller "$CONTROLLER_BIN" -plugin "$PLUGIN_BIN" \
  -apiserver-pid-file "$PID_DIR/kube-apiserver.pid" -log-dir "$LOG_DIR" "$@"
