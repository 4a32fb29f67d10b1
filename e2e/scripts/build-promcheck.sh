#!/usr/bin/env bash
# Builds promcheck (Prometheus' exposition parser, TSDB and PromQL engine as a library; e2e/tools/promcheck)
# into e2e/bin/promcheck. The e2e scenario TestMetrics* runs it once per run; go's build cache makes an
# unchanged build take seconds (cold: a few minutes on 2 cores, downloads from the Go module proxy).
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${E2E_BIN_DIR:-$E2E_DIR/bin}"
export GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

command -v go >/dev/null 2>&1 || { echo "error: go not found in PATH; install Go >= 1.26.7" >&2; exit 2; }
mkdir -p "$BIN_DIR"
(cd "$E2E_DIR/tools/promcheck" && go build -trimpath -ldflags "-s -w" -o "$BIN_DIR/promcheck" .)
echo "promcheck built into $BIN_DIR"
