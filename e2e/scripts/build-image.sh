#!/usr/bin/env bash
# make image: the release binaries, then an OCI image archive of them (e2e/tools/image/oci_image.py; no
# Docker, no registry) at target/image/tessera.tar. --test also runs the archive's tests.
# IMAGE_REF names it in index.json (default tessera:<workspace version>). IMAGE_PROFILE=debug packs the
# debug binaries instead (what `make test` checks, to spare it a release build); what ships is release.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
OUT="${IMAGE_ARCHIVE:-$TARGET/image/tessera.tar}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO_ROOT/Cargo.toml" | head -1)"
REF="${IMAGE_REF:-tessera:$VERSION}"

command -v python3 >/dev/null || { echo "error: python3 not found; make image needs Python >= 3.11" >&2; exit 2; }
command -v ldd >/dev/null || { echo "error: ldd not found (Debian: apt-get install libc-bin)" >&2; exit 2; }

PROFILE="${IMAGE_PROFILE:-release}"
case "$PROFILE" in
  release) (cd "$REPO_ROOT" && cargo build --release -p tessera-controller -p tessera-kubelet-plugin) ;;
  debug) (cd "$REPO_ROOT" && cargo build -p tessera-controller -p tessera-kubelet-plugin) ;;
  *) echo "error: IMAGE_PROFILE must be release or debug, got $PROFILE" >&2; exit 2 ;;
esac
python3 "$REPO_ROOT/e2e/tools/image/oci_image.py" --out "$OUT" --ref "$REF" --version "$VERSION" \
  --binary "$TARGET/$PROFILE/tessera-controller" --binary "$TARGET/$PROFILE/tessera-kubelet-plugin"
echo "image $REF: $OUT ($(du -h "$OUT" | cut -f1) archive)"

if [[ "${1:-}" == --test ]]; then
  cd "$REPO_ROOT/e2e/tools/image" && IMAGE_ARCHIVE="$OUT" python3 -m unittest -v test_oci_image
fi
