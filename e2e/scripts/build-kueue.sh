#!/usr/bin/env bash
# Builds the kueue add-on (e2e/scripts/kueue.sh) from the Go module proxy, into e2e/bin/kueue/:
#   - kueue-manager: Kueue's controller manager (sigs.k8s.io/kueue/cmd/kueue, e2e/tools/kueue), the one
#     binary of a Kueue install (its webhooks, controllers and scheduler);
#   - kueue-crds.yaml: Kueue's CRDs (config/components/crd/bases of the same module), and kueue-version.
# Relinked only when what it is built from changes (module versions, Go, this script). Cold, on 2 cores: see
# e2e/README.md (The kueue add-on); Go's build cache keeps an unchanged rebuild to seconds.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SELF="$E2E_DIR/scripts/$(basename "${BASH_SOURCE[0]}")"
OUT="${KUEUE_BIN_DIR:-$E2E_DIR/bin/kueue}"
export GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

command -v go >/dev/null 2>&1 || { echo "error: go not found in PATH; install Go >= 1.26.8" >&2; exit 2; }
mkdir -p "$OUT"

KUEUE_MOD="$E2E_DIR/tools/kueue"
KUEUE_PKG=sigs.k8s.io/kueue/cmd/kueue
KUEUE_VERSION="$(cd "$KUEUE_MOD" && go list -m -f '{{.Version}}' sigs.k8s.io/kueue)"
want="$( { mods_of "$KUEUE_MOD" "$KUEUE_PKG"; go env GOVERSION; cat "$SELF"; } | sha256sum | cut -d' ' -f1)"
if stamp_ok "$OUT" kueue "$want" "$OUT/kueue-manager" "$OUT/kueue-crds.yaml" "$OUT/kueue-version"; then
  echo "Kueue $KUEUE_VERSION up to date in $OUT"
else
  start=$(date +%s)
  ldf="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
  (cd "$KUEUE_MOD" && go build -trimpath -ldflags "$ldf" -o "$OUT/kueue-manager" "$KUEUE_PKG")
  dir="$(cd "$KUEUE_MOD" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
  : > "$OUT/kueue-crds.yaml"
  for f in "$dir"/config/components/crd/bases/*.yaml; do
    { echo "---"; cat "$f"; } >> "$OUT/kueue-crds.yaml"
  done
  echo "$KUEUE_VERSION" > "$OUT/kueue-version"
  echo "$want" > "$OUT/.kueue-stamp"
  echo "Kueue $KUEUE_VERSION built in $(( $(date +%s) - start ))s"
fi
