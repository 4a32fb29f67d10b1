#!/usr/bin/env bash
# real-node.sh up|down: a real Kubernetes node beside the kubelet stand-ins: the upstream kubelet of the
# control plane's release, containerd 2.x (CDI on), runc and the CNI bridge, all built by build-node.sh.
# Everything it owns lives under $RUN_DIR/real-node/: containerd's root, state and socket, the kubelet's
# --root-dir (plugins/, plugins_registry/), the CDI spec dir, the CNI config, pod logs.
#
# up (from up.sh, once the control plane runs): builds the node's simulated NVIDIA driver (below), starts
# containerd and the kubelet as processes of the run dir (start_proc, so proc.sh and make down know them),
# imports the pause, busybox, cuda-probe and tessera images, waits for the Node to be Ready, removes the not-ready taint (no node-lifecycle controller runs here) and labels
# and taints it as a GPU node (nvidia.com/gpu.present=true, nvidia.com/gpu=present:NoSchedule, as GKE taints
# GPU nodes), so the chart's DaemonSets land on it and pods of the stand-in scenarios do not.
# down (from down.sh, before the processes are stopped): removes every pod sandbox through the CRI, stops
# leftover shims of this containerd, unmounts what containerd and the kubelet mounted under $RUN_DIR, and
# removes the bridge and the iptables chain.
#
# The kubelet serves on the bridge's address (the node's InternalIP, --node-ip), which the API server dials
# for `kubectl logs`, `exec` and `port-forward` (--kubelet-preferred-address-types InternalIP first: nothing
# resolves the name real-node) and verifies against the cluster CA, which signed the kubelet's serving
# certificate for that address; the kubelet authenticates the API server's client certificate against the
# same CA and authorizes it by SubjectAccessReview (webhook mode; up.sh binds kube-apiserver-kubelet-client
# to system:kubelet-api-admin).
#
# Pods reach the API server as in-cluster clients do: kubelet gives them KUBERNETES_SERVICE_HOST=10.0.0.1
# (the `kubernetes` Service) and no kube-proxy runs, so a DNAT rule on the node's bridge sends 10.0.0.1:443
# to the API server on 127.0.0.1 (route_localnet on that bridge only; the serving certificate names 10.0.0.1).
#
# The node's GPUs are a simulated NVIDIA driver built from this repository, laid out as on a host with the
# driver installed: the driver root $RUN_DIR/real-node/driver-root (libnvidia-ml.so.1, libcuda.so.1,
# nvidia-smi, the MPS tools; the chart's driverRoot, which its nvml backend loads NVML from) and its
# simulated kernel, the GPUs' hardware state and /proc files, in the chart's stateDir
# ($RUN_DIR/real-node/tessera/simulated-kernel; driver-root/tessera-sim links to it), which the plugin pod mounts
# read-write (the driver root it mounts read-only). `tessera-kubelet-plugin simulate driver-root` makes both
# from REAL_NODE_GPUS (6) x REAL_NODE_MODEL (H100-SXM5-80GB). The stateDir and the driver root are made
# shared mounts, as / is on a systemd host: the chart's nvml pods mount them with HostToContainer (and the
# stateDir Bidirectional) propagation, which containerd refuses on a private mount (this machine's /). The
# pods read the driver root at /driver-root; the CDI specs name its host path.
#
# Clusters of other run dirs may run a real node at the same time: the bridge, subnet, kubelet ports, iptables
# chain and the kubelet's cgroup root are all derived from API_PORT, so two of them never share one.
# Variables: REAL_NODE_NAME (real-node), REAL_NODE_BRIDGE (tsr<API_PORT>), REAL_NODE_SUBNET
# (10.99.<API_PORT mod 256>.0/24), REAL_NODE_KUBELET_PORT (API_PORT+10), REAL_NODE_HEALTHZ_PORT (API_PORT+11),
# REAL_NODE_GPUS (6), REAL_NODE_MODEL (H100-SXM5-80GB), REAL_NODE_LATENCIES (none), TESSERA_IMAGE (target/image/tessera.tar).
# The cluster DNS (CoreDNS, start_dns) serves on the node's address, port 53; its health and ready ports are
# API_PORT+12 and API_PORT+13 on 127.0.0.1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NODE_BIN="${NODE_BIN_DIR:-$E2E_DIR/bin/node}"
RN_NAME="${REAL_NODE_NAME:-real-node}"
RN_DIR="$RUN_DIR/real-node"
RN_BRIDGE="${REAL_NODE_BRIDGE:-tsr$API_PORT}"
# The node's address: a host address of this cluster's own (the bridge exists before the kubelet starts),
# which kubelet accepts as --node-ip where it refuses a loopback one.
RN_ADDRESS="$RN_GATEWAY"
RN_KUBELET_PORT="${REAL_NODE_KUBELET_PORT:-$((API_PORT + 10))}"
RN_HEALTHZ_PORT="${REAL_NODE_HEALTHZ_PORT:-$((API_PORT + 11))}"
RN_DNS_HEALTH_PORT=$((API_PORT + 12))
RN_DNS_READY_PORT=$((API_PORT + 13))
# The kubelet removes pod cgroups it does not know under its root: each real node needs a root of its own.
RN_CGROUP="tessera-e2e-$API_PORT"
RN_CHAIN="TESSERA-APISERVER-$API_PORT"
CONTAINERD_SOCK="$RN_DIR/containerd/containerd.sock"
TESSERA_IMAGE="${TESSERA_IMAGE:-$CARGO_TARGET/image/tessera.tar}"
SANDBOX_IMAGE="registry.k8s.io/pause:3.10-tessera"
RN_GPUS="${REAL_NODE_GPUS:-6}"
RN_MODEL="${REAL_NODE_MODEL:-H100-SXM5-80GB}"
# The chart's stateDir on this node (up.sh's install_chart and the e2e scenarios set it).
RN_STATE_DIR="$RN_DIR/tessera"
RN_DRIVER_ROOT="$RN_DIR/driver-root"
RN_SIM_KERNEL="$RN_STATE_DIR/simulated-kernel"

ctr_() { "$NODE_BIN/ctr" --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }
crictl_() { "$NODE_BIN/crictl" --runtime-endpoint "unix://$CONTAINERD_SOCK" --timeout 20s "$@"; }
kubectl_() { "$BIN_DIR/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

write_configs() {
  mkdir -p "$RN_DIR"/{containerd,kubelet,cdi,cni/net.d,pod-logs,volume-plugins,runc}
  cat > "$RN_DIR/containerd.toml" <<EOF
# containerd for the e2e real node (e2e/scripts/real-node.sh); every path under the run dir.
version = 3
root = "$RN_DIR/containerd/root"
state = "$RN_DIR/containerd/state"
imports = []

[grpc]
  address = "$CONTAINERD_SOCK"

[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$SANDBOX_IMAGE"

[plugins.'io.containerd.cri.v1.runtime']
  # containerd 2.x always reads CDI specs (the 1.7 enable_cdi key is gone); the plugin writes them here.
  cdi_spec_dirs = ["$RN_DIR/cdi"]
  # The session lacks CAP_SYS_RESOURCE: runc could not lower the sandbox's oom_score_adj below its own.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$NODE_BIN/runc"
        Root = "$RN_DIR/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$NODE_BIN/cni"]
    conf_dir = "$RN_DIR/cni/net.d"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.internal.v1.opt']
  path = "$RN_DIR/containerd/opt"

[plugins.'io.containerd.nri.v1.nri']
  disable = true
EOF
  # No masquerade and no port maps: pods talk only to the API server through the DNAT below.
  cat > "$RN_DIR/cni/net.d/10-tessera.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "tessera-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "$RN_BRIDGE", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$RN_SUBNET", "gateway": "$RN_GATEWAY"}]],
              "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$RN_DIR/cni/ipam"}},
    {"type": "loopback"}
  ]
}
EOF
  local gates=""
  [[ -n "$FEATURE_GATES" ]] && gates="featureGates: {$(echo "$FEATURE_GATES" | sed 's/=/: /g')}"
  "$BIN_DIR/clusterctl" sign-cert --dir "$PKI_DIR" --out "$RN_DIR/kubelet-serving" --cn "$RN_NAME" \
    --ips "$RN_ADDRESS" --dns "$RN_NAME" > "$LOG_DIR/real-node-pki.log" 2>&1 \
    || die "signing the real kubelet's serving certificate failed" "$LOG_DIR/real-node-pki.log"
  # Ports away from the defaults (10250, 10248); the API port on the node's address, healthz on 127.0.0.1;
  # cgroup v1 hosts allowed
  # (failCgroupV1, KEP-5573); no image GC or disk eviction, which would remove the imported images on a
  # busy shared disk.
  cat > "$RN_DIR/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $RN_ADDRESS
port: $RN_KUBELET_PORT
tlsCertFile: $RN_DIR/kubelet-serving.crt
tlsPrivateKeyFile: $RN_DIR/kubelet-serving.key
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $RN_HEALTHZ_PORT
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
cgroupDriver: cgroupfs
cgroupRoot: /$RN_CGROUP
failCgroupV1: false
failSwapOn: false
podLogsDir: $RN_DIR/pod-logs
volumePluginDir: $RN_DIR/volume-plugins
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI_DIR/ca.crt}
authorization:
  mode: Webhook
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi"}
clusterDNS: [$RN_ADDRESS]
clusterDomain: cluster.local
registerWithTaints:
  - {key: nvidia.com/gpu, value: present, effect: NoSchedule}
$gates
EOF
}

# The kubelet requires its cgroup root to exist in every hierarchy (cgroup v1 here: one per controller).
cgroup_dirs() {
  local d
  for d in /sys/fs/cgroup/*/; do
    [[ -d "$d" && -w "$d" ]] && echo "${d%/}/$RN_CGROUP"
  done
}

setup_cgroups() {
  local d
  for d in $(cgroup_dirs); do mkdir -p "$d"; done
}

# Deepest first; only empty cgroups can be removed, and every process in them is gone by now.
teardown_cgroups() {
  local d
  for d in $(cgroup_dirs); do
    [[ -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}

# The bridge exists before the first pod, so route_localnet can be set on it alone. The CNI bridge plugin
# (isGateway) turns on net.ipv4.ip_forward; its value before is kept to put back at down.
setup_network() {
  [[ -f "$RN_DIR/ip_forward.before" ]] || cat /proc/sys/net/ipv4/ip_forward > "$RN_DIR/ip_forward.before"
  if ! ip link show "$RN_BRIDGE" >/dev/null 2>&1; then
    ip link add "$RN_BRIDGE" type bridge
    ip addr add "$RN_GATEWAY/${RN_SUBNET#*/}" dev "$RN_BRIDGE"
  fi
  ip link set "$RN_BRIDGE" up
  sysctl -qw "net.ipv4.conf.$RN_BRIDGE.route_localnet=1"
  iptables -t nat -N "$RN_CHAIN" 2>/dev/null || iptables -t nat -F "$RN_CHAIN"
  iptables -t nat -A "$RN_CHAIN" -i "$RN_BRIDGE" -d 10.0.0.1/32 -p tcp --dport 443 \
    -j DNAT --to-destination "127.0.0.1:$API_PORT"
  iptables -t nat -C PREROUTING -j "$RN_CHAIN" 2>/dev/null || iptables -t nat -A PREROUTING -j "$RN_CHAIN"
}

# The cluster DNS: CoreDNS on the node's bridge address, port 53 (the kubelet's clusterDNS, so pods get
# ClusterFirst: cluster.local from the API server, the rest forwarded to the host's resolvers). No
# kube-proxy runs, so there is no kube-dns Service; the pods' resolv.conf names this address directly.
start_dns() {
  cat > "$RN_DIR/Corefile" <<EOF
.:53 {
    bind $RN_ADDRESS
    errors
    health 127.0.0.1:$RN_DNS_HEALTH_PORT
    ready 127.0.0.1:$RN_DNS_READY_PORT
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $PKI_DIR/coredns.kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
    forward . /etc/resolv.conf
}
EOF
  write_proc "dns-$RN_NAME" -- "$NODE_BIN/coredns" -conf "$RN_DIR/Corefile"
  start_proc "dns-$RN_NAME"
  "$BIN_DIR/clusterctl" wait-url --url "http://127.0.0.1:$RN_DNS_READY_PORT/ready" --timeout 30s \
    || die "CoreDNS did not become ready on $RN_ADDRESS:53" "$LOG_DIR/dns-$RN_NAME.log"
  step "real node $RN_NAME: cluster DNS ($("$NODE_BIN/coredns" -version | head -1)) on $RN_ADDRESS:53"
}

# The simulated driver: driver root and kernel (see the header), from the debug plugin up.sh built.
setup_driver() {
  mkdir -p "$RN_STATE_DIR"
  findmnt -rn -M "$RN_STATE_DIR" > /dev/null || mount --bind "$RN_STATE_DIR" "$RN_STATE_DIR"
  mount --make-rshared "$RN_STATE_DIR"
  if [[ ! -x "$PLUGIN_BIN" ]]; then
    echo "warning: $PLUGIN_BIN missing: the real node has no driver root (the chart's nvml backend finds no GPU)" >&2
    return 0
  fi
  printf 'gpus:\n  - model: %s\n    count: %s\n' "$RN_MODEL" "$RN_GPUS" > "$RN_DIR/sim-node.yaml"
  # REAL_NODE_LATENCIES (a YAML flow map, e.g. {gpuInstanceCreateMs: 3000}): time the simulated driver spends
  # in MIG reconfiguration calls; the fault suite sets it to kill the plugin inside a prepare.
  [[ -n "${REAL_NODE_LATENCIES:-}" ]] && printf 'latencies: %s\n' "$REAL_NODE_LATENCIES" >> "$RN_DIR/sim-node.yaml"
  "$PLUGIN_BIN" simulate driver-root --root "$RN_DRIVER_ROOT" --kernel "$RN_SIM_KERNEL" --node-name "$RN_NAME" \
    --node-file "$RN_DIR/sim-node.yaml" > "$LOG_DIR/real-node-driver.log" 2>&1 \
    || die "tessera-kubelet-plugin simulate driver-root failed" "$LOG_DIR/real-node-driver.log"
  [[ "$(readlink -f "$RN_DRIVER_ROOT/tessera-sim")" == "$(readlink -f "$RN_SIM_KERNEL")" ]] \
    || die "$RN_DRIVER_ROOT/tessera-sim does not lead to the simulated kernel $RN_SIM_KERNEL" "$LOG_DIR/real-node-driver.log"
  # The chart's pods mount the driver root at /driver-root with HostToContainer propagation (a driver that
  # changes under them shows through), which containerd refuses on a private mount, as for the stateDir.
  findmnt -rn -M "$RN_DRIVER_ROOT" > /dev/null || mount --bind "$RN_DRIVER_ROOT" "$RN_DRIVER_ROOT"
  mount --make-rshared "$RN_DRIVER_ROOT"
  step "real node $RN_NAME: simulated NVIDIA driver $RN_GPUS x $RN_MODEL (driver root $RN_DRIVER_ROOT, kernel $RN_SIM_KERNEL)"
}

teardown_network() {
  if iptables -t nat -S "$RN_CHAIN" >/dev/null 2>&1; then
    while iptables -t nat -D PREROUTING -j "$RN_CHAIN" 2>/dev/null; do :; done
    iptables -t nat -F "$RN_CHAIN"
    iptables -t nat -X "$RN_CHAIN"
  fi
  if ip link show "$RN_BRIDGE" >/dev/null 2>&1; then ip link delete "$RN_BRIDGE"; fi
  # Only the last real node on the host puts it back: another one's pods still route through it.
  if [[ -f "$RN_DIR/ip_forward.before" ]] && ! ip -br link show type bridge | grep -q '^tsr'; then
    sysctl -qw "net.ipv4.ip_forward=$(cat "$RN_DIR/ip_forward.before")"
  fi
}

up() {
  command -v iptables >/dev/null || die "iptables missing: run e2e/scripts/node-packages.sh --install"
  for b in containerd containerd-shim-runc-v2 ctr crictl runc cni/bridge coredns; do
    [[ -x "$NODE_BIN/$b" ]] || die "$NODE_BIN/$b missing: run e2e/scripts/build-node.sh (make build-node)"
  done
  [[ -x "$BIN_DIR/kubelet" ]] || die "$BIN_DIR/kubelet missing: run e2e/scripts/build-node.sh"
  for p in "$RN_KUBELET_PORT" "$RN_HEALTHZ_PORT" "$RN_DNS_HEALTH_PORT" "$RN_DNS_READY_PORT"; do
    port_in_use "$p" && die "port $p on 127.0.0.1 is in use; set REAL_NODE_KUBELET_PORT / REAL_NODE_HEALTHZ_PORT"
  done
  write_configs
  setup_cgroups
  setup_network
  start_dns
  setup_driver

  step "real node $RN_NAME: containerd $("$NODE_BIN/containerd" --version | awk '{print $3}') (CDI specs in $RN_DIR/cdi)"
  # The shim and runc are found on PATH; nothing else of the host's is used.
  write_proc containerd-real PATH="$NODE_BIN:/usr/sbin:/usr/bin:/sbin:/bin" -- "$NODE_BIN/containerd" \
    --config "$RN_DIR/containerd.toml" --log-level warn
  start_proc containerd-real
  for _ in $(seq 1 60); do [[ -S "$CONTAINERD_SOCK" ]] && ctr_ version >/dev/null 2>&1 && break; sleep 0.5; done
  ctr_ version >/dev/null 2>&1 || die "containerd did not start" "$LOG_DIR/containerd-real.log"

  local images=("$NODE_BIN/images/pause.tar" "$NODE_BIN/images/busybox.tar" "$NODE_BIN/images/cuda-probe.tar")
  [[ -f "$TESSERA_IMAGE" ]] && images+=("$TESSERA_IMAGE")
  for img in "${images[@]}"; do
    ctr_ images import "$img" > "$LOG_DIR/real-node-import.log" 2>&1 \
      || die "importing $img into containerd failed" "$LOG_DIR/real-node-import.log"
  done
  # The CRI resolves a short name (the chart's `tessera:<version>`) as docker.io/library/...; ctr imports it
  # under the name in the archive, so the image gets the long name too.
  local ref
  for ref in $(ctr_ images ls -q | grep -v '^sha256:'); do
    if [[ "$ref" != */* ]]; then
      ctr_ images tag --force "$ref" "docker.io/library/$ref" > /dev/null
    fi
  done
  # The examples (deployments/examples) name the public busybox:1.36; nothing is pulled here, so it is the
  # static busybox image under that name too.
  ctr_ images tag --force tessera.dev/e2e/busybox:1 docker.io/library/busybox:1.36 > /dev/null
  step "real node $RN_NAME: images imported: $(ctr_ images ls -q | grep -v '^sha256:' | tr '\n' ' ')"

  step "real node $RN_NAME: kubelet $("$BIN_DIR/kubelet" --version | awk '{print $2}') (root dir $RN_DIR/kubelet)"
  write_proc "kubelet-$RN_NAME" -- "$BIN_DIR/kubelet" \
    --config "$RN_DIR/kubelet-config.yaml" --kubeconfig "$PKI_DIR/kubelet-$RN_NAME.kubeconfig" \
    --root-dir "$RN_DIR/kubelet" --cert-dir "$RN_DIR/kubelet/pki" --hostname-override "$RN_NAME" \
    --node-ip "$RN_ADDRESS" \
    --node-labels "nvidia.com/gpu.present=true" --v 1
  start_proc "kubelet-$RN_NAME"
  # kubectl wait fails at once while the Node does not exist yet.
  for _ in $(seq 1 60); do kubectl_ get node "$RN_NAME" > /dev/null 2>&1 && break; sleep 1; done
  kubectl_ wait --for=condition=Ready "node/$RN_NAME" --timeout 120s > /dev/null 2>&1 \
    || die "real node $RN_NAME did not become Ready" "$LOG_DIR/kubelet-$RN_NAME.log"
  # TaintNodesByCondition admission gave the new Node not-ready; only the node-lifecycle controller
  # (not run here) would take it off.
  kubectl_ taint nodes "$RN_NAME" node.kubernetes.io/not-ready:NoSchedule- > /dev/null 2>&1 || true
  step "real node $RN_NAME: Ready ($(kubectl_ get node "$RN_NAME" -o jsonpath='{.spec.taints[*].key}') taint kept)"
}

down() {
  [[ -d "$RN_DIR" ]] || return 0
  if pid_of containerd-real >/dev/null; then
    # The kubelet would restart what is removed here.
    stop_proc "kubelet-$RN_NAME"
    crictl_ rmp --all --force > /dev/null 2>&1 || echo "warning: crictl rmp failed; killing shims instead" >&2
  fi
  stop_proc containerd-real
  stop_proc "dns-$RN_NAME"
  # Shims outlive containerd by design; these are ours when they name our socket.
  local pids
  pids="$(ps -eo pid=,args= | awk -v a="$CONTAINERD_SOCK" '$2 ~ /containerd-shim-runc-v2$/ && index($0, a) {print $1}')"
  if [[ -n "$pids" ]]; then
    echo "stopping leftover shims of the real node: $pids"
    kill -KILL $pids 2>/dev/null || true
    sleep 0.5
  fi
  # Deepest first: overlay rootfs, netns, shm and the kubelet's volume mounts.
  findmnt -rn -o TARGET | awk -v d="$RUN_DIR/" 'index($0, d) == 1' | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || echo "warning: cannot unmount $m" >&2
  done
  # TestRealNodeLayouts…'s GKE-like layout lives at GKE's absolute paths; a run killed before its cleanup
  # leaves them (marked as the e2e's own).
  if [[ -f /home/kubernetes/.tessera-e2e ]]; then
    findmnt -rn -o TARGET | awk 'index($0, "/home/kubernetes/") == 1' | sort -r | while read -r m; do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || echo "warning: cannot unmount $m" >&2
    done
    rm -rf /home/kubernetes
  fi
  teardown_network
  teardown_cgroups
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
