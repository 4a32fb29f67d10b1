#!/usr/bin/env bash
# make image: the release binaries and the simulated driver, then an OCI image archive of them
# (e2e/tools/image/oci_image.py; no Docker, no registry) at target/image/tessera.tar. --test also runs the
# archive's tests. IMAGE_REF names it in index.json (default tessera:<workspace version>). IMAGE_PROFILE=debug
# packs the debug builds instead (what `make test` checks, to spare it a release build); what ships is release.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
OUT="${IMAGE_ARCHIVE:-$TARGET/image/tessera.tar}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO_ROOT/Cargo.toml" | head -1)"
REF="${IMAGE_REF:-tessera:$VERSION}"

command -v python3 >/dev/null || { echo "error: python3 not found; make image needs Python >= 3.11" >&2; exit 2; }
command -v ldd >/dev/null || { echo "error: ldd not found (Debian: apt-get install libc-bin)" >&2; exit 2; }

# The simulated NVIDIA driver (kubelet-plugin/sim-driver) goes to /usr/lib/tessera-sim, where the plugin's
# `simulated` backend finds it (<exe dir>/../lib/tessera-sim) to install into its driver root.
PACKAGES=(-p tessera-controller -p tessera-kubelet-plugin -p tessera-sim-nvml -p tessera-sim-cuda -p tessera-sim-tools)
SIM_DRIVER=(libnvidia_ml.so libcuda.so libnvidia_ptxjitcompiler.so libnvidia_nvvm.so nvidia-smi nvidia-cuda-mps-control nvidia-cuda-mps-server)
PROFILE="${IMAGE_PROFILE:-release}"
case "$PROFILE" in
  release) (cd "$REPO_ROOT" && cargo build --release "${PACKAGES[@]}") ;;
  debug) (cd "$REPO_ROOT" && cargo build "${PACKAGES[@]}") ;;
  *) echo "error: IMAGE_PROFILE must be release or debug, got $PROFILE" >&2; exit 2 ;;
esac
# tessera's CDI hook (kubelet-plugin/cdi-hook), which the plugin installs on the host and the container
# runtime runs there: linked statically (glibc's static libc.a, libc6-dev), since the host's glibc may be
# older than this machine's. Built on its own target dir, so the workspace's dynamic build is not redone.
HOOK_TARGET="$TARGET/cdi-hook-static"
HOOK_PROFILE_FLAG=()
[[ "$PROFILE" == release ]] && HOOK_PROFILE_FLAG=(--release)
(cd "$REPO_ROOT" && cargo rustc -p tessera-cdi-hook --bin tessera-cdi-hook "${HOOK_PROFILE_FLAG[@]}" \
  --target-dir "$HOOK_TARGET" -- -C target-feature=+crt-static)
HOOK="$HOOK_TARGET/$PROFILE/tessera-cdi-hook"
ldd "$HOOK" 2>&1 | grep -q 'statically linked\|not a dynamic executable' \
  || { echo "error: $HOOK is not statically linked" >&2; exit 1; }
FILES=()
for name in "${SIM_DRIVER[@]}"; do FILES+=(--file "$TARGET/$PROFILE/$name:/usr/lib/tessera-sim/$name"); done
python3 "$REPO_ROOT/e2e/tools/image/oci_image.py" --out "$OUT" --ref "$REF" --version "$VERSION" \
  --binary "$TARGET/$PROFILE/tessera-controller" --binary "$TARGET/$PROFILE/tessera-kubelet-plugin" \
  --binary "$HOOK" "${FILES[@]}"
echo "image $REF: $OUT ($(du -h "$OUT" | cut -f1) archive)"

if [[ "${1:-}" == --test ]]; then
  cd "$REPO_ROOT/e2e/tools/image" && IMAGE_ARCHIVE="$OUT" python3 -m unittest -v test_oci_image
fi
