#!/usr/bin/env bash
# `make test-faults`: a fresh cluster (`make up` without the examples), the fault suite
# (e2e/k8s/e2etest/faults_test.go, the TestFaults* scenarios of bin/e2e.test), then `make down`.
# FAULT_ROUNDS sizes it (kill rounds of the plugin scenario; the other scenarios repeat more from 100 on).
# The table goes to FAULTS_OUT (default e2e/bench/results/faults.md for FAULT_ROUNDS >= 100, else
# $RUN_DIR/logs/faults.md, which make down keeps), its rows as JSON beside it: rows of scenarios a run leaves
# out are kept from there, so FAULTS_RUN=TestFaultsRealNode FAULT_ROUNDS=100 re-measures the real-node rows of the
# committed table alone. KEEP_CLUSTER=1 leaves the cluster running; FAULTS_RUN selects scenarios.
# The cluster has the real node (REAL_NODE=1, root only): TestFaultsRealNode installs the chart on it.
set -euo pipefail
# A cluster of its own (run dir and ports), like the scheduler benchmark's, so a `make up` cluster or a
# running `make e2e` is never torn down by this script's `make down`.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export RUN_DIR="${FAULTS_RUN_DIR:-$(cd "$here/../.." && pwd)/.run-faults}"
export ETCD_PORT="${FAULTS_ETCD_PORT:-24190}" ETCD_PEER_PORT="${FAULTS_ETCD_PEER_PORT:-24200}" API_PORT="${FAULTS_API_PORT:-16843}"
export SCHEDULER_PORT="${FAULTS_SCHEDULER_PORT:-16859}" CONTROLLER_MANAGER_PORT="${FAULTS_CONTROLLER_MANAGER_PORT:-16857}"
source "$here/common.sh"
rounds="${FAULT_ROUNDS:-5}"
export REAL_NODE="${REAL_NODE:-1}"
mkdir -p "$LOG_DIR"
if [[ -z "${FAULTS_OUT:-}" ]]; then
  if (( rounds >= 100 )); then FAULTS_OUT="$E2E_DIR/bench/results/faults.md"; else FAULTS_OUT="$LOG_DIR/faults.md"; fi
fi
start=$(date +%s)

SKIP_EXAMPLES=1 fresh_cluster
up_done=$(date +%s)

step "fault suite, FAULT_ROUNDS=$rounds (log: $LOG_DIR/faults.log, table: $FAULTS_OUT)"
export FAULT_ROUNDS="$rounds" FAULTS_OUT
run_scenarios "$LOG_DIR/faults.log" -test.timeout 120m -test.run "${FAULTS_RUN:-^TestFaults}"
end=$(date +%s)

echo
echo "==== fault suite ===="
[[ -f "$FAULTS_OUT" ]] && cat "$FAULTS_OUT"
grep -E '^(--- (PASS|FAIL|SKIP))' "$LOG_DIR/faults.log" || true
echo "make up: $((up_done - start))s   faults: $((end - up_done))s   total: $((end - start))s"
if [[ $rc == 0 ]]; then echo "FAULTS PASS"; else echo "FAULTS FAIL (exit $rc; logs in $LOG_DIR)"; fi
exit $rc
