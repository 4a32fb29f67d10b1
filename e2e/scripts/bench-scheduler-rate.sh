#!/usr/bin/env bash
# `make bench-scheduler-rate`: kube-scheduler's pods/s on tessera's slices, Kubernetes versions side by side.
# For each entry of RATE_VERSIONS (default "1.37 1.38") it builds that version's control plane (K8S_VERSION,
# e2e/bin, e2e/bin/1.38 or e2e/bin/1.36), starts it with no nodes on the bench's own ports and run dir
# (bench-scheduler.sh), and runs e2e/bench in rate mode: for every cluster size in RATE_NODES (default
# "100,300,1000") and every policy in RATE_POLICIES (default "whole,mig,lean-mig"), fake nodes × 8 H100 with
# the slices `tessera-controller render` publishes, pods in bursts, pods/s from the first create to the last
# bind, each cell time-boxed (RATE_TIME_BOX, default 120s). An entry `1.38:hints-off` (or `1.37:hints-on`)
# runs that version with the SchedulerPreQueueingHints gate set (alpha, off in 1.37; beta, on in 1.38) and
# its own columns. `1.38:counter-cache` runs 1.38 with a kube-scheduler built against the counter-validation
# cache proposed upstream (K8S_PATCH, e2e/k8s/countercache, e2e/bench/results/upstream-dra-counter-cache.md;
# its own bin dir e2e/bin/1.38-counter-cache and its own columns). Dynamic MIG stops at RATE_MIG_MAX_NODES (default 1000): 1,000 such nodes are 9,000 slices
# of 208 devices, which took the API server past 8.9 GB half-way on a 24 GB machine
# (e2e/bench/results/scheduler-rate.md). Then one table of all entries is printed and written to RATE_OUT
# (default e2e/bench/results/scheduler-rate.md). Extra bench flags: RATE_ARGS.
#
# kube-scheduler runs with --kube-api-qps 1000 --kube-api-burst 2000 (its defaults, 50/100, cap any
# scheduler at ~20 DRA pods/s: each pod costs a claim status write and a bind), plus SCHEDULER_ARGS.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
versions="${RATE_VERSIONS:-1.37 1.38}"
out_dir="${RATE_RESULTS_DIR:-$repo/bench-results/scheduler-rate}"
out_md="${RATE_OUT:-$repo/e2e/bench/results/scheduler-rate.md}"
mkdir -p "$out_dir"
# pprof stays reachable for profiling a cell: curl -k https://127.0.0.1:16559/debug/pprof/profile?seconds=30
export SCHEDULER_ARGS="--kube-api-qps=1000 --kube-api-burst=2000 --authorization-always-allow-paths=/healthz,/readyz,/livez,/debug/pprof/profile ${SCHEDULER_ARGS:-}"
export SKIP_CONTROLLER_MANAGER=1
FEATURE_GATES_BASE="${FEATURE_GATES:-}"
files=()
for entry in $versions; do
  v="${entry%%:*}" gates="$FEATURE_GATES_BASE" note="" tag="$v" patch=""
  case "$entry" in
    *:hints-on) gates+="${gates:+,}SchedulerPreQueueingHints=true" note="PreQueueingHints on" tag="$v-hints-on" ;;
    *:hints-off) gates+="${gates:+,}SchedulerPreQueueingHints=false" note="PreQueueingHints off" tag="$v-hints-off" ;;
    1.38:counter-cache) patch=counter-cache note="counter cache" tag="$v-counter-cache" ;;
    *:*) echo "error: RATE_VERSIONS entry $entry: want VERSION, VERSION:hints-on, VERSION:hints-off or 1.38:counter-cache" >&2; exit 2 ;;
  esac
  echo "==== Kubernetes $v ${note:+($note)} ===="
  FEATURE_GATES="$gates" K8S_VERSION="$v" K8S_PATCH="$patch" "$here/bench-scheduler.sh" \
    -controller "${CONTROLLER_BIN:-$repo/target/debug/tessera-controller}" -plugin "${PLUGIN_BIN:-$repo/target/debug/tessera-kubelet-plugin}" \
    -policies "${RATE_POLICIES:-whole,mig,lean-mig}" -out "$out_dir/$tag" \
    -rate-nodes "${RATE_NODES:-100,300,1000}" -rate-mig-max-nodes "${RATE_MIG_MAX_NODES:-1000}" \
    -rate-time-box "${RATE_TIME_BOX:-120s}" -rate-server-note "$note" \
    -rate-scheduler-pid-file "${BENCH_RUN_DIR:-$repo/.run-bench}/pids/kube-scheduler.pid" \
    -rate-json "$out_dir/rate-$tag.json" ${RATE_ARGS:-}
  files+=("$out_dir/rate-$tag.json")
done
cd "$repo/e2e/bench"
GOTOOLCHAIN=local go run . -rate-report "$(IFS=,; echo "${files[*]}")" -rate-markdown "$out_dir/table.md"
echo
echo "table: $out_dir/table.md (copy it into $out_md with the run's notes)"
