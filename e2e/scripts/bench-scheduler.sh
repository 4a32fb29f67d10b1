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
source "$here/bench-cluster.sh"
bench_cluster_env "$repo/.run-bench" 23890 23900 16543 16559 16557

source "$here/common.sh"
fresh_cluster
cd "$repo/e2e/bench"
GOTOOLCHAIN=local go run . -kubeconfig "$RUN_DIR/pki/admin.kubeconfig" "$@"
