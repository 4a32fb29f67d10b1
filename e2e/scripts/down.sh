#!/usr/bin/env bash
# `make down`: stops every process `make up` started (newest first), removes sockets, CDI specs,
# etcd data and certificates; keeps only $RUN_DIR/logs for post-mortems.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ ! -d "$RUN_DIR" ]]; then
  echo "nothing to stop ($RUN_DIR does not exist)"
  exit 0
fi
# The real node's pods first, while containerd can still remove them; then its mounts and network.
"$E2E_DIR/scripts/real-node.sh" down || echo "warning: stopping the real node's pods failed" >&2
names=()
[[ -f "$PID_DIR/order" ]] && mapfile -t names < <(tac "$PID_DIR/order")
for f in "$PID_DIR"/*.pid; do
  [[ -e "$f" ]] || continue
  n="$(basename "$f" .pid)"
  printf '%s\n' "${names[@]}" | grep -qxF "$n" || names+=("$n")
done
for n in "${names[@]}"; do
  if pid="$(pid_of "$n")"; then
    echo "stopping $n (pid $pid)"
    stop_proc "$n"
  fi
  rm -f "$PID_DIR/$n.pid"
done
stop_sessions
find "$RUN_DIR" -mindepth 1 -maxdepth 1 ! -name logs -exec rm -rf {} +
left="$(find "$RUN_DIR" -type s 2>/dev/null | wc -l)"
[[ "$left" == 0 ]] || { echo "FAILED: $left socket(s) left under $RUN_DIR" >&2; exit 1; }
echo "cluster stopped; logs kept in $LOG_DIR"
