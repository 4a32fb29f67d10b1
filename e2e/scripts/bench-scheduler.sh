#!/usr/bin/env bash
# The packing benchmark against the real kube-scheduler: a control plane of its own (etcd, kube-apiserver,
# kube-scheduler, kube-controller-manager from e2e/bin; no nodes and no tessera processes: the benchmark
# registers the sampled nodes itself and publishes the slices tessera's controller renders for them), then
# `go run .` in e2e/bench with -kubeconfig and the arguments given here, then teardown.
# Own run dir and ports, so it runs beside `make up`: BENCH_RUN_DIR, BENCH_ETCD_PORT, BENCH_API_PORT, ...
# KEEP_CLUSTER=1 leaves it running.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export RUN_DIR="${BENCH_RUN_DIR:-$repo/.run-bench}"
export ETCD_PORT="${BENCH_ETCD_PORT:-23890}" ETCD_PEER_PORT="${BENCH_ETCD_PEER_PORT:-23900}"
export API_PORT="${BENCH_API_PORT:-16543}" SCHEDULER_PORT="${BENCH_SCHEDULER_PORT:-16559}"
export CONTROLLER_MANAGER_PORT="${BENCH_CONTROLLER_MANAGER_PORT:-16557}"
export NODES=0 SKIP_DRIVER=1 SKIP_EXAMPLES=1 POLICY=none

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
cd "$repo/e2e/bench"
GOTOOLCHAIN=local go run . -kubeconfig "$RUN_DIR/pki/admin.kubeconfig" "$@"
