#!/usr/bin/env bash
# The Debian packages the real node needs (e2e/scripts/build-node.sh, real-node.sh):
#   gcc            the pause program, runc's cgo part
#   libseccomp-dev runc's seccomp support (containerd gives every sandbox a seccomp profile)
#   busybox-static the workload image's /bin/busybox
#   iptables       the CNI bridge plugin's masquerade and portmap rules
#   tmux           the 80-column terminal `kubectl tessera top` is drawn in (e2etest/realnode_top_test.go)
# --check: fail, naming the missing ones and this script, if any is absent. --install: apt-get install the
# missing ones (idempotent: nothing runs when all are there; .ci/run calls it before `make test`).
set -euo pipefail
PKGS=(gcc libseccomp-dev busybox-static iptables tmux)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
case "${1:---check}" in
  --check)
    [[ ${#missing[@]} == 0 ]] && exit 0
    echo "error: the real node needs the Debian packages ${missing[*]}: run $0 --install (as root)" >&2
    exit 2 ;;
  --install)
    [[ ${#missing[@]} == 0 ]] && { echo "node packages installed: ${PKGS[*]}"; exit 0; }
    command -v apt-get >/dev/null || { echo "error: no apt-get; install ${missing[*]} with this system's package manager" >&2; exit 2; }
    sudo=(); [[ $(id -u) == 0 ]] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" ;;
  *) echo "usage: $0 [--check|--install]" >&2; exit 2 ;;
esac
