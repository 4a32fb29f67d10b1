#!/usr/bin/env bash
# Builds Helm from the Go module proxy into e2e/bin/helm, at the version pinned in e2e/tools/helm/go.mod
# (a module of its own: Helm's Kubernetes libraries must not meet e2e/k8s's replace block). Relinks only
# when the module versions it is built from, Go or this script change (cold: a few minutes on 2 cores).
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOD_DIR="$E2E_DIR/tools/helm"
BIN_DIR="${E2E_BIN_DIR:-$E2E_DIR/bin}"
SELF="$E2E_DIR/scripts/$(basename "${BASH_SOURCE[0]}")"
PKG=helm.sh/helm/v4/cmd/helm
export GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

command -v go >/dev/null 2>&1 || { echo "error: go not found in PATH; install Go >= 1.26.0" >&2; exit 2; }

HELM_VERSION="$(cd "$MOD_DIR" && go list -m -f '{{.Version}}' helm.sh/helm/v4)"
mkdir -p "$BIN_DIR"
STAMP="$BIN_DIR/.helm-stamp"
want="$( { cd "$MOD_DIR" && go list -deps -f '{{with .Module}}{{.Path}}@{{.Version}}{{end}}' "$PKG" | sort -u; go env GOVERSION; cat "$SELF"; } | sha256sum | cut -d' ' -f1)"

if [[ -x "$BIN_DIR/helm" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "helm $HELM_VERSION up to date in $BIN_DIR"
  exit 0
fi
echo "building helm $HELM_VERSION into $BIN_DIR"
start=$(date +%s)
# helm version reports what internal/version carries; without these it would say v4.x-dev.
LDF="-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
(cd "$MOD_DIR" && go build -trimpath -ldflags "$LDF" -o "$BIN_DIR/helm" "$PKG")
echo "$want" > "$STAMP"
echo "helm built in $(( $(date +%s) - start ))s"
