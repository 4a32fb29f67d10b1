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
source "$here/bench-cluster.sh"
bench_cluster_env "$repo/bench-results/run-prepare" 24090 24100 16743 16759 16757
source "$here/common.sh"

fresh_cluster
step "build: bench-prepare"
(cd "$E2E_DIR/k8s" && GOTOOLCHAIN="$K8S_TOOLCHAIN" GOFLAGS="-buildvcs=false -modfile=$K8S_MODFILE" CGO_ENABLED=0 go build -trimpath -o "$BIN_DIR/bench-prepare" ./cmd/bench-prepare)
step "bench-prepare $*"
"$BIN_DIR/bench-prepare" -kubeconfig "$ADMIN_KUBECONFIG" -plugin "$PLUGIN_BIN" -work-dir "$RUN_DIR/bench-node" "$@" 2> >(tee "$LOG_DIR/bench-prepare.log" >&2)
