#!/usr/bin/env bash
# `make gpu-check`: a read-only check of tessera's nvml path on a node with a real NVIDIA GPU.
#
# It changes no MIG mode, compute mode or time-slice setting, creates or destroys no MIG instance and resets
# nothing: every step only reads. What it prints, in order:
#   1. the driver as nvidia-smi reports it (name, UUID, MIG mode, compute mode);
#   2. `tessera-kubelet-plugin discover --backend nvml` (the NodeInventory the plugin would publish);
#   3. `discover --cdi` (the CDI spec a claim of every whole GPU would get), saved to $OUT_DIR/cdi.json;
#   4. the MIG UUID check: each live MIG device's UUID as tessera reads it (`discover --mig-devices`) against
#      `nvidia-smi -L`, MATCH or MISMATCH per device (nothing to check when MIG mode is off everywhere);
#   5. the NEEDED entries of the real libnvidia-ml.so.1 and libcuda.so.1 (what an image must carry);
#   6. the CUDA probe (e2e/images/cuda-probe.c, built here with cc) started with the CDI spec's edits: in a
#      private mount namespace whose /dev holds only the spec's device nodes and whose driver files are the
#      spec's mounts, with the spec's environment, as a container runtime would apply them. Where the
#      namespace cannot be made (no unshare, a sandbox that refuses mknod), the probe runs with the spec's
#      environment only, and the output says so;
#   7. the simulator's rules against this driver (the review's first-GPU check list): facts from
#      `target/debug/examples/driver_facts` (kubelet-plugin/examples/driver_facts.rs: the GPU-instance profile
#      calls v1 and V with MIG off, the compute and MPS process lists, 8 concurrent nvmlDeviceGetHandleByUUID
#      under a usage scrape, fabric info), the mount of the CDI hook's directory (GPU_CHECK_HOOK_DIR, default
#      /var/lib/tessera/bin) and the host's ldconfig, then a table: rule, what the simulator does, what this
#      node did, CONFIRMED / CONTRADICTED / NOT SEEN, and a line naming the simulator rules to change
#      (also in $OUT_DIR/simulator-rules.md). It starts no MPS daemon: the MPS row needs a share's workload
#      already running. A contradiction does not fail the check.
#
# Usage: e2e/scripts/gpu-check.sh [DRIVER_ROOT]. Without an argument the driver root is found: `/` when the
# loader knows libnvidia-ml.so.1, else /run/nvidia/driver (GPU Operator), /home/kubernetes/bin/nvidia
# (GKE), /usr/local/nvidia. PLUGIN_BIN names the plugin binary (default target/debug, `make gpu-check`
# builds it), DRIVER_FACTS_BIN the facts program (default target/debug/examples/driver_facts); OUT_DIR where
# the outputs go (default bench-results/gpu-check). Exit status: 0 when every check ran and agreed, 1 when
# one disagreed or did not run, 2 when no GPU or driver was found.
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PLUGIN_BIN="${PLUGIN_BIN:-$REPO_ROOT/target/debug/tessera-kubelet-plugin}"
OUT_DIR="${OUT_DIR:-$REPO_ROOT/bench-results/gpu-check}"
PROBE_SRC="$REPO_ROOT/e2e/images/cuda-probe.c"
mkdir -p "$OUT_DIR"
failed=0

section() { printf '\n==== %s ====\n' "$*"; }
disagree() { echo "MISMATCH: $*"; failed=1; }

find_root() {
  if [[ $# -gt 0 && -n "$1" ]]; then echo "$1"; return; fi
  if ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml.so.1 '; then echo /; return; fi
  for r in /run/nvidia/driver /home/kubernetes/bin/nvidia /usr/local/nvidia; do
    if compgen -G "$r/lib64/libnvidia-ml.so.1" >/dev/null || compgen -G "$r/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" >/dev/null \
      || compgen -G "$r/lib/libnvidia-ml.so.1" >/dev/null; then
      echo "$r"; return
    fi
  done
  echo /
}
DRIVER_ROOT="$(find_root "${1:-}")"

section "host"
date -u +%Y-%m-%dT%H:%M:%SZ
uname -srm
echo "driver root: $DRIVER_ROOT"
[[ -r /proc/driver/nvidia/version ]] && head -1 /proc/driver/nvidia/version

section "1. nvidia-smi (read-only queries)"
SMI="$(command -v nvidia-smi || true)"
for d in "$DRIVER_ROOT/usr/bin" "$DRIVER_ROOT/bin"; do [[ -z "$SMI" && -x "$d/nvidia-smi" ]] && SMI="$d/nvidia-smi"; done
if [[ -z "$SMI" ]]; then
  echo "nvidia-smi not found: is this a GPU node?"; exit 2
fi
"$SMI" -L | tee "$OUT_DIR/nvidia-smi-L.txt"
"$SMI" --query-gpu=index,name,uuid,pci.bus_id,driver_version,mig.mode.current,mig.mode.pending,compute_mode,memory.total \
  --format=csv | tee "$OUT_DIR/nvidia-smi-query.csv"

section "2. tessera-kubelet-plugin discover --backend nvml"
if [[ ! -x "$PLUGIN_BIN" ]]; then echo "$PLUGIN_BIN missing: build it (make gpu-check does) or set PLUGIN_BIN"; exit 2; fi
if ! "$PLUGIN_BIN" discover --backend nvml --driver-root "$DRIVER_ROOT" --node-name "$(hostname)" | tee "$OUT_DIR/inventory.yaml"; then
  disagree "discover failed"
fi
# Every UUID nvidia-smi lists for a whole GPU must be in the inventory.
for uuid in $(grep -o 'UUID: GPU-[0-9a-f-]*' "$OUT_DIR/nvidia-smi-L.txt" | cut -d' ' -f2); do
  grep -q "$uuid" "$OUT_DIR/inventory.yaml" && echo "inventory has $uuid" || disagree "inventory lacks $uuid"
done

section "3. discover --cdi (saved to $OUT_DIR/cdi.json)"
if "$PLUGIN_BIN" discover --backend nvml --driver-root "$DRIVER_ROOT" --cdi > "$OUT_DIR/cdi.json"; then
  python3 - "$OUT_DIR/cdi.json" <<'EOF'
import json, sys
spec = json.load(open(sys.argv[1]))
for d in spec["devices"]:
    e = d["containerEdits"]
    print(d["name"])
    for n in e.get("deviceNodes", []):
        print("  node  %s %s:%s" % (n["path"], n.get("major"), n.get("minor")))
    for m in e.get("mounts", []):
        print("  mount %s -> %s" % (m["hostPath"], m["containerPath"]))
    for v in e.get("env", []):
        print("  env   %s" % v)
EOF
else
  disagree "discover --cdi failed"
fi

section "4. MIG UUID check"
if "$PLUGIN_BIN" discover --backend nvml --driver-root "$DRIVER_ROOT" --mig-devices > "$OUT_DIR/mig-devices.txt" 2>&1; then
  cat "$OUT_DIR/mig-devices.txt"
  smi_migs=$(grep -o 'UUID: MIG-[0-9a-f-]*' "$OUT_DIR/nvidia-smi-L.txt" | cut -d' ' -f2 | sort)
  tessera_migs=$(grep -o 'MIG-[0-9a-f-]*' "$OUT_DIR/mig-devices.txt" | sort -u)
  if [[ -z "$smi_migs" && -z "$tessera_migs" ]]; then
    echo "no MIG device exists (MIG mode off, or no instances): nothing to compare; this check creates none"
  else
    for u in $smi_migs; do grep -qx "$u" <<<"$tessera_migs" && echo "MATCH $u" || disagree "tessera does not read $u"; done
    for u in $tessera_migs; do grep -qx "$u" <<<"$smi_migs" || disagree "tessera reads $u, nvidia-smi does not list it"; done
  fi
  if grep -q 'GPU-' "$OUT_DIR/mig-devices.txt"; then disagree "a MIG device was read with a GPU- UUID (the parent's)"; fi
else
  cat "$OUT_DIR/mig-devices.txt"; disagree "discover --mig-devices failed"
fi

section "5. NEEDED entries of the driver's libraries"
needed() {
  if command -v readelf >/dev/null; then readelf -d "$1" | awk '/NEEDED|SONAME/ {print "  " $2 " " $NF}'
  else python3 - "$1" <<'EOF'
import struct, sys
# Minimal ELF64 reader: the dynamic section's DT_NEEDED (1) and DT_SONAME (14) strings.
data = open(sys.argv[1], "rb").read()
shoff, = struct.unpack_from("<Q", data, 0x28); shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
for s in secs:
    if s[1] != 6:  # SHT_DYNAMIC
        continue
    strtab = secs[s[6]]
    for off in range(s[4], s[4] + s[5], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag in (1, 14):
            start = strtab[4] + val
            name = data[start:data.index(b"\0", start)].decode()
            print("  (%s) %s" % ("NEEDED" if tag == 1 else "SONAME", name))
EOF
  fi
}
for lib in libnvidia-ml.so.1 libcuda.so.1; do
  path=""
  for d in usr/lib/x86_64-linux-gnu usr/lib64 lib64 lib/x86_64-linux-gnu usr/lib lib ""; do
    [[ -e "$DRIVER_ROOT/$d/$lib" ]] && { path="$(readlink -f "$DRIVER_ROOT/$d/$lib")"; break; }
  done
  if [[ -z "$path" ]]; then echo "$lib: not found under $DRIVER_ROOT"; continue; fi
  echo "$lib -> $path"
  needed "$path" | tee -a "$OUT_DIR/needed.txt"
done

section "6. the CUDA probe with the CDI spec's edits"
if ! command -v cc >/dev/null; then echo "no C compiler: probe not built"; failed=1
elif ! cc -O1 -o "$OUT_DIR/cuda-probe" "$PROBE_SRC" -ldl; then disagree "probe did not build"
else
  python3 - "$OUT_DIR/cdi.json" "$OUT_DIR/cuda-probe" "$OUT_DIR/probe-run.sh" <<'EOF'
import json, shlex, sys
spec = json.load(open(sys.argv[1]))
probe, out = sys.argv[2], sys.argv[3]
# The first device's edits: one whole GPU, as a one-GPU claim gets them.
e = spec["devices"][0]["containerEdits"]
lines = ["set -e", "mount --make-rprivate /", "mkdir -p /tmp/gpu-check-dev",
         "mount -t tmpfs -o mode=755 tmpfs /tmp/gpu-check-dev",
         "for n in null zero urandom; do touch /tmp/gpu-check-dev/$n; mount --bind /dev/$n /tmp/gpu-check-dev/$n; done"]
for n in e.get("deviceNodes", []):
    p = n["path"]
    lines.append("mkdir -p %s" % shlex.quote("/tmp/gpu-check-dev" + p[len("/dev"):].rsplit("/", 1)[0]))
    lines.append("mknod -m 666 %s c %d %d" % (shlex.quote("/tmp/gpu-check-dev" + p[len("/dev"):]), n["major"], n["minor"]))
lines.append("mount --move /tmp/gpu-check-dev /dev")
for m in e.get("mounts", []):
    if m["hostPath"] != m["containerPath"]:
        lines.append("mkdir -p %s && touch %s" % (shlex.quote(m["containerPath"].rsplit("/", 1)[0]), shlex.quote(m["containerPath"])))
        lines.append("mount --bind %s %s" % (shlex.quote(m["hostPath"]), shlex.quote(m["containerPath"])))
env = " ".join(shlex.quote(v) for v in e.get("env", []))
lines.append("exec env %s %s" % (env, shlex.quote(probe)))
open(out, "w").write("\n".join(lines) + "\n")
print("device: " + spec["devices"][0]["name"])
EOF
  if command -v unshare >/dev/null && unshare --mount --fork bash "$OUT_DIR/probe-run.sh" > "$OUT_DIR/probe.txt" 2>&1; then
    echo "(in a private mount namespace with the spec's device nodes)"
  else
    echo "(the private mount namespace could not be made here: the probe ran with the spec's environment only)"
    env $(python3 -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1]))["devices"][0]["containerEdits"].get("env", [])))' "$OUT_DIR/cdi.json") \
      "$OUT_DIR/cuda-probe" > "$OUT_DIR/probe.txt" 2>&1 || disagree "the probe failed"
  fi
  cat "$OUT_DIR/probe.txt"
  first_uuid=$(grep -o 'UUID: GPU-[0-9a-f-]*' "$OUT_DIR/nvidia-smi-L.txt" | head -1 | cut -d' ' -f2)
  grep -q "$first_uuid" "$OUT_DIR/probe.txt" && echo "probe sees $first_uuid" || disagree "probe does not see $first_uuid"
fi

section "7. simulator rules against this driver"
# The places where the simulated driver (kubelet-plugin/sim-driver) may be kinder than NVIDIA's, review
# 9b52720 §2e: facts from kubelet-plugin/examples/driver_facts.rs (read-only NVML calls; it starts no MPS
# daemon and changes nothing), the hook directory's mount and the host's ldconfig. A CONTRADICTED row is a
# finding for the simulator, not a failure of this check; a program that did not run is.
FACTS_BIN="${DRIVER_FACTS_BIN:-$REPO_ROOT/target/debug/examples/driver_facts}"
HOOK_DIR="${GPU_CHECK_HOOK_DIR:-/var/lib/tessera/bin}"
: > "$OUT_DIR/simulator-rules.tsv"
if [[ ! -x "$FACTS_BIN" ]]; then
  echo "$FACTS_BIN missing: build it (make gpu-check does: cargo build --example driver_facts) or set DRIVER_FACTS_BIN"
  failed=1
else
  "$FACTS_BIN" --driver-root "$DRIVER_ROOT" > "$OUT_DIR/driver-facts.txt" 2>&1
  facts_rc=$?
  grep -v $'^verdict\t' "$OUT_DIR/driver-facts.txt"
  grep $'^verdict\t' "$OUT_DIR/driver-facts.txt" | cut -f2- >> "$OUT_DIR/simulator-rules.tsv"
  if [[ $facts_rc != 0 ]]; then echo "driver_facts exited $facts_rc: the NVML rules were not checked"; failed=1; fi
fi
facts_missing=""
grep -q . "$OUT_DIR/simulator-rules.tsv" ||
  facts_missing="the NVML rules (N6, N7, N8, N3) were not checked: driver_facts did not run"
# N1 (GKE COS): the hook is installed to <stateDir>/bin and run by runc from there; `/var` noexec refuses it.
dir="$HOOK_DIR"
while [[ ! -e "$dir" && "$dir" != / ]]; do dir="$(dirname "$dir")"; done
if command -v findmnt >/dev/null; then
  read -r mnt_target mnt_opts < <(findmnt -n -o TARGET,OPTIONS --target "$dir")
else
  read -r mnt_target mnt_opts < <(awk -v d="$dir" '{ m = $2; p = (m == "/") ? "/" : m "/";
    if ((d == m || index(d "/", p) == 1) && length(m) >= best) { best = length(m); t = m; o = $4 } }
    END { print t, o }' /proc/self/mounts)
fi
echo "hook dir $HOOK_DIR: mount $mnt_target ($mnt_opts)"
mount 2>/dev/null | grep -E ' on /var( |$)' || echo "(/var is not a mount of its own)"
sim_var="the CDI hook runs from <stateDir>/bin, $HOOK_DIR (exec on every test node)"
if [[ ",$mnt_opts," == *,noexec,* ]]; then
  printf '%s\t%s\t%s\t%s\n' "N1 /var noexec" "$sim_var" \
    "$HOOK_DIR is on $mnt_target mounted noexec: runc cannot run the hook; set the chart value cdiHookDir to an exec mount \
(its default with GKE's driverRoot: /home/kubernetes/bin/tessera)" \
    CONTRADICTED >> "$OUT_DIR/simulator-rules.tsv"
else
  printf '%s\t%s\t%s\t%s\n' "N1 /var noexec" "$sim_var" "$HOOK_DIR is on $mnt_target, exec ($mnt_opts)" CONFIRMED \
    >> "$OUT_DIR/simulator-rules.tsv"
fi
# N1: the hook runs the host's ldconfig, the first of these (kubelet-plugin/cdi-hook LDCONFIG_CANDIDATES).
ls -l /sbin/ldconfig* /usr/sbin/ldconfig* 2>/dev/null || echo "no /sbin/ldconfig* or /usr/sbin/ldconfig*"
ldconfig_found=""
for l in /sbin/ldconfig.real /sbin/ldconfig /usr/sbin/ldconfig; do
  [[ -x "$l" ]] && ldconfig_found="${ldconfig_found:+$ldconfig_found, }$l"
done
sim_ldconfig="the hook finds the host's ldconfig (/sbin/ldconfig.real, /sbin/ldconfig or /usr/sbin/ldconfig)"
if [[ -n "$ldconfig_found" ]]; then
  printf '%s\t%s\t%s\t%s\n' "N1 ldconfig present" "$sim_ldconfig" "found $ldconfig_found" CONFIRMED \
    >> "$OUT_DIR/simulator-rules.tsv"
else
  printf '%s\t%s\t%s\t%s\n' "N1 ldconfig present" "$sim_ldconfig" \
    "none of the three: the hook fails every container with a tessera device (pass it --ldconfig-path)" CONTRADICTED \
    >> "$OUT_DIR/simulator-rules.tsv"
fi
echo
awk -F'\t' 'BEGIN { print "| rule | simulator | this node | verdict |"; print "|---|---|---|---|" }
  { printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4 }' "$OUT_DIR/simulator-rules.tsv" | tee "$OUT_DIR/simulator-rules.md"
to_change=$(awk -F'\t' '$4 == "CONTRADICTED" { printf "%s%s", sep, $1; sep = "; " }' "$OUT_DIR/simulator-rules.tsv")
not_seen=$(awk -F'\t' '$4 == "NOT SEEN" { printf "%s%s", sep, $1; sep = "; " }' "$OUT_DIR/simulator-rules.tsv")
[[ -n "$facts_missing" ]] && echo "$facts_missing" | tee -a "$OUT_DIR/simulator-rules.md"
[[ -n "$not_seen" ]] && echo "not seen on this node (re-run where they can be): $not_seen" |
  tee -a "$OUT_DIR/simulator-rules.md"
echo "simulator rules to change: ${to_change:-none, the driver contradicted no rule checked}" |
  tee -a "$OUT_DIR/simulator-rules.md"

section "result"
if [[ $failed == 0 ]]; then echo "GPU CHECK PASS"; else echo "GPU CHECK FAIL"; fi
exit $failed
