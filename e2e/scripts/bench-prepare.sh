#!/usr/bin/env bash
# `make bench-prepare`: prepare latency and the plugin's footprint. A control plane of its own (etcd,
# kube-apiserver, kube-scheduler, kube-controller-manager from e2e/bin; CRDs and DeviceClasses applied,
# no nodes), then e2e/k8s/cmd/bench-prepare, which runs kubelet's own DRA manager and plugin manager
# in-process, starts tessera-kubelet-plugin (simulated backend) beside it, and drives prepares of claims
# it creates in that API server. Arguments go to the bench (-claims, -concurrency, -kinds, -out, ...).
# Own run dir and ports: BENCH_RUN_DIR, BENCH_ETCD_PORT, BENCH_API_PORT, ... KEEP_CLUSTER=1 leaves it running.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export RUN_DIR="${BENCH_RUN_DIR:-$repo/bench-results/run-prepare}"
export ETCD_PORT="${BENCH_ETCD_PORT:-24090}" ETCD_PEER_PORT="${BENCH_ETCD_PEER_PORT:-24100}"
export API_PORT="${BENCH_API_PORT:-16743}" SCHEDULER_PORT="${BENCH_SCHEDULER_PORT:-16759}"
export CONTROLLER_MANAGER_PORT="${BENCH_CONTROLLER_MANAGER_PORT:-16757}"
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
step "build: bench-prepare"
(cd "$E2E_DIR/k8s" && GOFLAGS="-buildvcs=false -modfile=$K8S_MODFILE" CGO_ENABLED=0 go build -trimpath -o "$BIN_DIR/bench-prepare" ./cmd/bench-prepare)
step "bench-prepare $*"
"$BIN_DIR/bench-prepare" -kubeconfig "$ADMIN_KUBECONFIG" -plugin "$PLUGIN_BIN" -work-dir "$RUN_DIR/bench-node" "$@" 2> >(tee "$LOG_DIR/bench-prepare.log" >&2)
