#!/usr/bin/env bash
# plugin-pod.sh start NODE NAME POD_UID HEALTH_PORT: starts another instance of node NODE's plugin as if it
# ran in the pod POD_UID of a DaemonSet rolling with maxSurge: the launch command of plugin-NODE (same
# directories, same state dir, same kubeconfig) plus POD_UID and a readiness endpoint on 127.0.0.1, under
# the process name NAME, so proc.sh stop|status NAME and make down handle it like any other process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cmd="${1:-}"; node="${2:-}"; name="${3:-}"; uid="${4:-}"; port="${5:-}"
usage() { echo "usage: $0 start NODE NAME POD_UID HEALTH_PORT" >&2; exit 2; }
[[ "$cmd" == start && -n "$node" && -n "$name" && -n "$uid" && -n "$port" ]] || usage
# Only what a pod UID and a port can be: both go into a launch script.
[[ "$uid" =~ ^[A-Za-z0-9-]+$ ]] || { echo "POD_UID must be letters, digits and '-': $uid" >&2; exit 2; }
[[ "$port" =~ ^[0-9]+$ ]] || { echo "HEALTH_PORT must be a number: $port" >&2; exit 2; }
[[ "$name" =~ ^plugin-[A-Za-z0-9.-]+$ ]] || { echo "NAME must start with plugin-: $name" >&2; exit 2; }
src="$PROC_DIR/plugin-$node.sh"
[[ -f "$src" ]] || { echo "no launch script $src: is the cluster up (make up)?" >&2; exit 1; }
# After the node's own exports (which may set a health address too) and before its exec line, so these win.
{
  sed '$d' "$src"
  printf 'export POD_UID=%q\n' "$uid"
  printf 'export TESSERA_HEALTH_ADDR=%q\n' "127.0.0.1:$port"
  tail -n 1 "$src"
} > "$PROC_DIR/$name.sh"
chmod +x "$PROC_DIR/$name.sh"
start_proc "$name"
sleep 0.3
expect_alive "$name"
