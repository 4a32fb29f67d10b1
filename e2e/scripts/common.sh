# Shared settings and helpers for up.sh, down.sh, proc.sh and e2e.sh (sourced, not executed).
# Every process the harness starts has a launch script in $RUN_DIR/procs/<name>.sh, a pid file in
# $RUN_DIR/pids/<name>.pid and a log in $RUN_DIR/logs/<name>.log; the e2e tests restart components
# through proc.sh using the same launch scripts.

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO_ROOT="$(cd "$E2E_DIR/.." && pwd)"
RUN_DIR="${RUN_DIR:-$REPO_ROOT/.run}"
# K8S_VERSION picks the Kubernetes minor the control plane, the kubelet stand-in and the tests are built
# from: 1.37 (default, e2e/k8s/go.mod), 1.38 (e2e/k8s/go.138.mod, the next release) or 1.36
# (e2e/k8s/go.136.mod, the previous release kept runnable). Each version has its own bin dir, so the
# builds coexist and switching back relinks nothing.
K8S_VERSION="${K8S_VERSION:-1.37}"
# Kubernetes 1.38's modules say `go 1.27.0`; the machine's Go (1.26) fetches that toolchain from the Go
# module proxy like any module (K8S_TOOLCHAIN, for what is built from e2e/k8s); 1.36 and 1.37 and every
# other tool build with the machine's own Go.
K8S_TOOLCHAIN=local
# Build tags of the scenarios (e2etest): 1.36 builds the files written against its older APIs.
K8S_TEST_TAGS=""
case "$K8S_VERSION" in
  1.37) K8S_MODFILE=go.mod; _default_bin="$E2E_DIR/bin" ;;
  1.38) K8S_MODFILE=go.138.mod; _default_bin="$E2E_DIR/bin/1.38"; K8S_TOOLCHAIN=go1.27.3 ;;
  1.36) K8S_MODFILE=go.136.mod; _default_bin="$E2E_DIR/bin/1.36"; K8S_TEST_TAGS=k8s_1_36 ;;
  *) echo "error: K8S_VERSION=$K8S_VERSION is not supported: use 1.37 (the default), 1.38 or 1.36" >&2; exit 2 ;;
esac
# K8S_PATCH=counter-cache (1.38 only; `make bench-scheduler-rate`'s `1.38:counter-cache`): kube-scheduler
# built against k8s.io/dynamic-resource-allocation with the counter-validation cache proposed upstream
# (e2e/k8s/countercache, e2e/bench/results/upstream-dra-counter-cache.md), into its own bin dir; the other
# binaries are 1.38's own, linked. Never what users run.
K8S_PATCH="${K8S_PATCH:-}"
case "$K8S_PATCH" in
  "") ;;
  counter-cache)
    [[ "$K8S_VERSION" == 1.38 ]] || { echo "error: K8S_PATCH=counter-cache patches 1.38 only, not K8S_VERSION=$K8S_VERSION" >&2; exit 2; }
    K8S_BASE_BIN="$_default_bin" K8S_MODFILE=go.138-countercache.mod _default_bin="$E2E_DIR/bin/1.38-counter-cache" ;;
  *) echo "error: K8S_PATCH=$K8S_PATCH is not supported: leave it empty or use counter-cache" >&2; exit 2 ;;
esac
BIN_DIR="${E2E_BIN_DIR:-$_default_bin}"
LOG_DIR="$RUN_DIR/logs"
PID_DIR="$RUN_DIR/pids"
PROC_DIR="$RUN_DIR/procs"
PKI_DIR="$RUN_DIR/pki"

NODES="${NODES:-2}"
GPUS="${GPUS:-8}"
MODEL="${MODEL:-H100-SXM5-80GB}"
NODE_PREFIX="${NODE_PREFIX:-gpu-node-}"
ETCD_PORT="${ETCD_PORT:-23790}"
ETCD_PEER_PORT="${ETCD_PEER_PORT:-23800}"
API_PORT="${API_PORT:-16443}"
SCHEDULER_PORT="${SCHEDULER_PORT:-16459}"
CONTROLLER_MANAGER_PORT="${CONTROLLER_MANAGER_PORT:-16457}"
# Kubernetes 1.36 and 1.37 have DRA, partitionable devices, consumable capacity, device taints and
# DRA-backed extended resources on by default; extra gates go to every component.
FEATURE_GATES="${FEATURE_GATES:-}"
RUNTIME_CONFIG="${RUNTIME_CONFIG:-}"

CARGO_TARGET="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
PLUGIN_BIN="${PLUGIN_BIN:-$CARGO_TARGET/debug/tessera-kubelet-plugin}"
CONTROLLER_BIN="${CONTROLLER_BIN:-$CARGO_TARGET/debug/tessera-controller}"

ADMIN_KUBECONFIG="$PKI_DIR/admin.kubeconfig"

export GOTOOLCHAIN=local

node_name() { echo "${NODE_PREFIX}$1"; }
# The real node's pod subnet and its bridge's (the gateway's) address, derived from API_PORT so clusters of
# other run dirs get their own (real-node.sh; the autoscaling add-on's metrics adapter serves there).
RN_SUBNET="${REAL_NODE_SUBNET:-10.99.$((API_PORT % 256)).0/24}"
RN_GATEWAY="${RN_SUBNET%.*}.1"
node_dir() { echo "$RUN_DIR/nodes/$1"; }

_t0=$(date +%s)
step() { printf '==> [%3ss] %s\n' "$(( $(date +%s) - _t0 ))" "$*"; }
die() {
  printf '\nFAILED: %s\n' "$1" >&2
  if [[ -n "${2:-}" && -f "$2" ]]; then
    printf -- '--- last lines of %s ---\n' "$2" >&2
    tail -n 25 "$2" >&2
    printf -- '--- (full log: %s)\n' "$2" >&2
  fi
  if [[ -d "$PID_DIR" ]] && compgen -G "$PID_DIR/*.pid" >/dev/null; then
    printf 'processes started so far are still running for inspection; stop them with: make down\n' >&2
  fi
  exit 1
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# write_proc NAME [VAR=value ...] -- BINARY ARGS...: records how to (re)start a process.
write_proc() {
  local name="$1"; shift
  mkdir -p "$PROC_DIR"
  {
    echo '#!/usr/bin/env bash'
    while [[ $# -gt 0 && "$1" != "--" ]]; do printf 'export %q\n' "$1"; shift; done
    shift
    printf 'exec'; printf ' %q' "$@"; printf '\n'
  } > "$PROC_DIR/$name.sh"
  chmod +x "$PROC_DIR/$name.sh"
}

# proc_start PID: the process's start time (clock ticks since boot, field 22 of /proc/PID/stat, read after the
# command name's closing parenthesis, which may itself hold spaces or parentheses). With the pid it names one
# process for the machine's uptime: a pid the kernel hands out again gets another start time.
proc_start() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  # After "pid (comm) " the fields start at 3 (state); start time is field 22, the 20th of the rest.
  awk '{ print $20 }' <<< "$stat"
}

# ours PID: true if the process's command line or environment names this run dir (every process `make up`
# starts gets RUN_DIR in its environment or a path under it on its command line).
ours() {
  [[ -r "/proc/$1/cmdline" ]] || return 1
  tr '\0' '\n' < "/proc/$1/cmdline" | grep -qF -e "$RUN_DIR" && return 0
  tr '\0' '\n' < "/proc/$1/environ" 2>/dev/null | grep -qxF -e "TESSERA_E2E_RUN_DIR=$RUN_DIR"
}

# pid_of NAME: prints the pid if that process is alive and is the one this run dir started: the pid file holds
# "pid start-time", and both must match (pid reuse), as must the command line or environment (ours).
pid_of() {
  local f="$PID_DIR/$1.pid" pid started now
  [[ -f "$f" ]] || return 1
  read -r pid started < "$f" || [[ -n "${pid:-}" ]] || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  now="$(proc_start "$pid")" || return 1
  [[ -z "${started:-}" || "$started" == "$now" ]] || return 1
  ours "$pid" || return 1
  echo "$pid"
}

start_proc() {
  local name="$1"
  mkdir -p "$PID_DIR" "$LOG_DIR"
  if pid_of "$name" >/dev/null; then
    echo "$name already running" >&2
    return 0
  fi
  echo "---- start $(date -Is) ----" >> "$LOG_DIR/$name.log"
  TESSERA_E2E_RUN_DIR="$RUN_DIR" setsid "$PROC_DIR/$name.sh" >> "$LOG_DIR/$name.log" 2>&1 < /dev/null &
  echo "$! $(proc_start $!)" > "$PID_DIR/$name.pid"
  # setsid makes the process a session leader (sid = pid); helpers it spawns (the plugin's simulated MPS
  # control daemons, which deliberately outlive plugin restarts) stay in that session, so make down can
  # find them by session id.
  echo $! >> "$PID_DIR/sessions"
  grep -qxF "$name" "$PID_DIR/order" 2>/dev/null || echo "$name" >> "$PID_DIR/order"
}

stop_proc() {
  local name="$1" pid i
  pid="$(pid_of "$name")" || { rm -f "$PID_DIR/$name.pid"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
  fi
  rm -f "$PID_DIR/$name.pid"
}

# expect_alive NAME: fails with the process's log if it exited right after start.
expect_alive() {
  pid_of "$1" >/dev/null || die "$1 exited during startup" "$LOG_DIR/$1.log"
}

# stop_sessions: terminates, by pid, whatever is left in the sessions of processes this run dir started, and
# only what is ours (see ours): once every process of a session is gone its id can be handed out again, and
# on a shared machine the new session may be another cluster's.
stop_sessions() {
  [[ -f "$PID_DIR/sessions" ]] || return 0
  local sids pids=() pid skipped=()
  sids="$(sort -u "$PID_DIR/sessions" | tr '\n' ' ')"
  for pid in $(ps -eo pid=,sid= | awk -v s=" $sids" '{ if (index(s, " " $2 " ")) print $1 }'); do
    if ours "$pid"; then pids+=("$pid"); else skipped+=("$pid"); fi
  done
  [[ ${#skipped[@]} == 0 ]] || echo "left alone (same session id, not started from $RUN_DIR): ${skipped[*]}"
  [[ ${#pids[@]} -gt 0 ]] || return 0
  echo "stopping leftover helper processes: ${pids[*]}"
  kill -TERM "${pids[@]}" 2>/dev/null || true
  sleep 1
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

clusterctl() { "$BIN_DIR/clusterctl" "$@"; }

# stamp_ok DIR NAME WANT FILE...: true when every FILE exists and DIR/.NAME-stamp says WANT: what the files
# were built from is unchanged, so the build scripts skip relinking them.
stamp_ok() {
  local dir="$1" name="$2" want="$3" f; shift 3
  for f in "$@"; do [[ -e "$f" ]] || return 1; done
  [[ -f "$dir/.$name-stamp" && "$(cat "$dir/.$name-stamp")" == "$want" ]]
}
# mods_of MODULE_DIR PKG...: every module@version the packages are built from (with the build tags in TAGS).
mods_of() { (cd "$1" && go list -deps -tags "${TAGS:-}" -f '{{with .Module}}{{.Path}}@{{.Version}}{{end}}' "${@:2}" | sort -u); }

# fresh_cluster: stops whatever an earlier run left in RUN_DIR, starts the cluster `make up` starts (as the
# environment configures up.sh: ports, NODES, SKIP_EXAMPLES, ...), and stops it again when the calling script
# exits, also after a failed start, unless KEEP_CLUSTER=1. The teardown owns the script's EXIT trap.
fresh_cluster() {
  "$E2E_DIR/scripts/down.sh" > /dev/null 2>&1 || true
  trap _fresh_cluster_down EXIT
  "$E2E_DIR/scripts/up.sh"
}

# run_scenarios LOG ARGS...: runs bin/e2e.test against the cluster fresh_cluster started, with the
# environment it reads (the cluster's shape, REAL_NODE, and whatever the caller exported for its scenarios),
# ARGS after -test.v; the output also goes to LOG. Sets rc to the scenarios' exit status.
run_scenarios() {
  local log=$1
  shift
  set +e
  (cd "$REPO_ROOT" && RUN_DIR="$RUN_DIR" E2E_REPO_ROOT="$REPO_ROOT" NODES="$NODES" GPUS="$GPUS" MODEL="$MODEL" NODE_PREFIX="$NODE_PREFIX" \
    REAL_NODE="${REAL_NODE:-0}" REAL_NODE_NAME="${REAL_NODE_NAME:-real-node}" \
    "$BIN_DIR/e2e.test" -test.v "$@") 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
}

_fresh_cluster_down() {
  if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then
    "$E2E_DIR/scripts/down.sh" > /dev/null || echo "warning: stopping the cluster in $RUN_DIR failed" >&2
  else
    echo "cluster left running (KEEP_CLUSTER=1): KUBECONFIG=$ADMIN_KUBECONFIG; RUN_DIR=$RUN_DIR make down stops it"
  fi
}
