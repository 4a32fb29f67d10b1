#!/usr/bin/env bash
# Builds the autoscaling add-on (e2e/scripts/autoscaling.sh) from the Go module proxy, into e2e/bin/autoscaling/:
#   - prometheus: upstream's server (e2e/tools/prometheus) with the build tags remove_all_sd,enable_kubernetes_sd,
#     the one service discovery the add-on uses (the others would pull every cloud SDK into the build);
#   - keda-operator and keda-adapter: KEDA's operator and its external-metrics API server (e2e/tools/keda),
#     and KEDA's CRDs (keda.sh and eventing.keda.sh, which the operator watches), from the same module.
# Each part is relinked only when what it is built from changes (module versions, Go, this script).
# Cold, on 2 cores: KEDA ~10 min (every scaler is compiled in), Prometheus ~4 min; Go's build cache keeps
# an unchanged rebuild to seconds.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SELF="$E2E_DIR/scripts/$(basename "${BASH_SOURCE[0]}")"
OUT="${AUTOSCALING_BIN_DIR:-$E2E_DIR/bin/autoscaling}"
export GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

command -v go >/dev/null 2>&1 || { echo "error: go not found in PATH; install Go >= 1.26.8" >&2; exit 2; }
mkdir -p "$OUT"


PROM_MOD="$E2E_DIR/tools/prometheus"
PROM_PKG=github.com/prometheus/prometheus/cmd/prometheus
PROM_TAGS=remove_all_sd,enable_kubernetes_sd
PROM_VERSION="$(cd "$PROM_MOD" && go list -m -f '{{.Version}}' github.com/prometheus/prometheus)"
want="$( { TAGS=$PROM_TAGS mods_of "$PROM_MOD" "$PROM_PKG"; go env GOVERSION; cat "$SELF"; } | sha256sum | cut -d' ' -f1)"
if stamp_ok "$OUT" prometheus "$want" "$OUT/prometheus"; then
  echo "Prometheus $PROM_VERSION up to date in $OUT"
else
  start=$(date +%s)
  # Prometheus' module is v0.3xx.y for server 3.xx.y; its version line shows the server's release.
  minor="$(echo "$PROM_VERSION" | cut -d. -f2)"; patch="$(echo "$PROM_VERSION" | cut -d. -f3)"
  ldf="-s -w -X github.com/prometheus/common/version.Version=3.${minor#3}.$patch"
  (cd "$PROM_MOD" && go build -trimpath -tags "$PROM_TAGS" -ldflags "$ldf" -o "$OUT/prometheus" "$PROM_PKG")
  echo "$want" > "$OUT/.prometheus-stamp"
  echo "Prometheus $PROM_VERSION built in $(( $(date +%s) - start ))s"
fi

KEDA_MOD="$E2E_DIR/tools/keda"
KEDA_PKGS=(github.com/kedacore/keda/v2/cmd/operator github.com/kedacore/keda/v2/cmd/adapter)
KEDA_VERSION="$(cd "$KEDA_MOD" && go list -m -f '{{.Version}}' github.com/kedacore/keda/v2)"
want="$( { mods_of "$KEDA_MOD" "${KEDA_PKGS[@]}"; go env GOVERSION; cat "$SELF"; } | sha256sum | cut -d' ' -f1)"
if stamp_ok "$OUT" keda "$want" "$OUT/keda-operator" "$OUT/keda-adapter" "$OUT/keda-crds.yaml"; then
  echo "KEDA $KEDA_VERSION up to date in $OUT"
else
  start=$(date +%s)
  ldf="-s -w -X github.com/kedacore/keda/v2/version.Version=$KEDA_VERSION"
  (cd "$KEDA_MOD" && go build -trimpath -ldflags "$ldf" -o "$OUT/keda-operator" "${KEDA_PKGS[0]}")
  (cd "$KEDA_MOD" && go build -trimpath -ldflags "$ldf" -o "$OUT/keda-adapter" "${KEDA_PKGS[1]}")
  dir="$(cd "$KEDA_MOD" && go list -m -f '{{.Dir}}' github.com/kedacore/keda/v2)"
  : > "$OUT/keda-crds.yaml"
  for f in "$dir"/config/crd/bases/*.yaml; do
    { echo "---"; cat "$f"; } >> "$OUT/keda-crds.yaml"
  done
  echo "$want" > "$OUT/.keda-stamp"
  echo "KEDA $KEDA_VERSION built in $(( $(date +%s) - start ))s"
fi
