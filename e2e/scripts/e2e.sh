#!/usr/bin/env bash
# `make e2e`: fresh cluster (`make up` without the examples), the e2e scenarios (e2e/k8s/e2etest,
# compiled to e2e/bin/e2e.test), then `make down`. KEEP_CLUSTER=1 leaves the cluster running;
# E2E_RUN='regexp' selects scenarios (go test -run). Without it the fault suite's TestFaults* scenarios are
# skipped here: `make test-faults` runs them on a cluster of their own (E2E_RUN=Faults runs them here).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start=$(date +%s)

# A failed start is torn down too, after up.sh has printed the failing step and its log.
# The real node (kubelet + containerd + runc) runs in every make e2e: the TestRealNode* scenarios install the
# chart on it (REAL_NODE=0 leaves it out, and those scenarios fail saying so).
export REAL_NODE="${REAL_NODE:-1}"
# Prometheus and KEDA (autoscaling.sh) for the TestAutoscaling* scenarios, Kueue (kueue.sh) for TestKueue*;
# ADDONS= leaves them out.
export ADDONS="${ADDONS-autoscaling,kueue}"
SKIP_EXAMPLES=1 fresh_cluster
# The chart scenarios run helm; build it (or find it up to date) before the scenarios' own timeout starts.
"$E2E_DIR/scripts/build-helm.sh"
up_done=$(date +%s)

step "e2e scenarios (log: $LOG_DIR/e2e.log)"
if [[ -n "${E2E_RUN:-}" ]]; then select=(-test.run "$E2E_RUN"); else select=(-test.skip '^TestFaults'); fi
run_scenarios "$LOG_DIR/e2e.log" -test.timeout "${E2E_TIMEOUT:-35m}" "${select[@]}"
end=$(date +%s)

echo
echo "==== e2e summary ===="
grep -E '^(=== RUN|--- (PASS|FAIL|SKIP)|    --- (PASS|FAIL|SKIP))' "$LOG_DIR/e2e.log" | grep -v '=== RUN' || true
echo "make up: $((up_done - start))s   scenarios: $((end - up_done))s   total: $((end - start))s"
if [[ $rc == 0 ]]; then echo "E2E PASS"; else echo "E2E FAIL (exit $rc; logs in $LOG_DIR)"; fi
exit $rc
