#!/usr/bin/env bash
# `make bench-coldstart`: a fresh cluster whose real node's simulated driver spends hardware-like time in
# MIG reconfiguration, MPS daemon starts and first CUDA contexts (e2e/bench/hardware-like-latencies.yaml:
# estimates, kubelet-plugin/sim-driver/README.md#latencies), the cold-start scenario (TestColdStart: whole GPU, MIG and
# MPS Deployments scaled 0 → N → 0 → N, cold and warm) at COLDSTART_REPLICAS (default 4), then `make down`.
# The table goes to COLDSTART_OUT (default e2e/bench/results/coldstart.md). Root only (the real node).
set -euo pipefail
# A cluster of its own (run dir and ports), as the fault suite's, so `make up`'s is never torn down.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export RUN_DIR="${COLDSTART_RUN_DIR:-$(cd "$here/../.." && pwd)/.run-coldstart}"
export ETCD_PORT="${COLDSTART_ETCD_PORT:-24290}" ETCD_PEER_PORT="${COLDSTART_ETCD_PEER_PORT:-24300}" API_PORT="${COLDSTART_API_PORT:-16943}"
export SCHEDULER_PORT="${COLDSTART_SCHEDULER_PORT:-16959}" CONTROLLER_MANAGER_PORT="${COLDSTART_CONTROLLER_MANAGER_PORT:-16957}"
source "$here/common.sh"
export REAL_NODE=1
export REAL_NODE_LATENCIES="${REAL_NODE_LATENCIES:-$(cat "$E2E_DIR/bench/hardware-like-latencies.yaml")}"
replicas="${COLDSTART_REPLICAS:-4}"
out="${COLDSTART_OUT:-$E2E_DIR/bench/results/coldstart.md}"
mkdir -p "$LOG_DIR"
start=$(date +%s)

SKIP_EXAMPLES=1 fresh_cluster
up_done=$(date +%s)

step "cold starts, $replicas replicas (log: $LOG_DIR/coldstart.log, table: $out)"
export COLDSTART_REPLICAS="$replicas" COLDSTART_OUT="$out"
run_scenarios "$LOG_DIR/coldstart.log" -test.timeout 30m -test.run '^TestColdStart$'
end=$(date +%s)

echo
echo "==== cold starts ===="
[[ -f "$out" ]] && cat "$out"
echo "make up: $((up_done - start))s   benchmark: $((end - up_done))s   total: $((end - start))s"
if [[ $rc == 0 ]]; then echo "COLDSTART PASS"; else echo "COLDSTART FAIL (exit $rc; logs in $LOG_DIR)"; fi
exit $rc
