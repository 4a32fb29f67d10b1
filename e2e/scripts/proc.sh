#!/usr/bin/env bash
# proc.sh start|stop|restart|status NAME: manage one process of the running cluster (used by the e2e
# tests to restart the plugin, the controller and the API server). `proc.sh list` prints the names.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cmd="${1:-}"; name="${2:-}"
case "$cmd" in
  list) [[ -f "$PID_DIR/order" ]] && cat "$PID_DIR/order" ;;
  start) start_proc "$name"; sleep 0.3; expect_alive "$name" ;;
  stop) stop_proc "$name" ;;
  restart) stop_proc "$name"; start_proc "$name"; sleep 0.3; expect_alive "$name" ;;
  status) if pid="$(pid_of "$name")"; then echo "$name running (pid $pid)"; else echo "$name stopped"; exit 3; fi ;;
  *) echo "usage: $0 start|stop|restart|status NAME | list" >&2; exit 2 ;;
esac
