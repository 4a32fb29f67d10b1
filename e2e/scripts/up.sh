#!/usr/bin/env bash
# `make up`: a real local Kubernetes 1.37 (K8S_VERSION=1.36: 1.36) control plane (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager) as plain processes, N fake GPU nodes (kubelet stand-in + tessera's kubelet
# plugin on the simulated backend), tessera's controller, CRDs, DeviceClasses and the examples.
# Variables: NODES GPUS MODEL (node shape), SKIP_EXAMPLES=1, SKIP_DRIVER=1 (control plane and nodes
# only), RUN_DIR, *_PORT, FEATURE_GATES, RUNTIME_CONFIG, SCHEDULER_ARGS (extra kube-scheduler flags),
# REAL_NODE=1 (also a real node: kubelet + containerd + runc, e2e/scripts/real-node.sh; make e2e sets it),
# ADDONS=autoscaling,kueue (a list: autoscaling = Prometheus and KEDA, e2e/scripts/autoscaling.sh, needs the real
# node; kueue = Kueue's manager, e2e/scripts/kueue.sh, needs root; make e2e sets both),
# INSTALL=host|chart (host, the default here: the controller runs as a host process; chart: the real node
# comes up and tessera's controller and the real node's plugin are installed by `helm install` of
# deployments/helm/tessera, as on a cluster; `make up` picks chart when run as root).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$REPO_ROOT"
# tessera's namespace: the chart's release namespace, and the lease namespace the host controller and
# plugins are given, so the controller's leader Lease, the plugins' heartbeat Leases and the Roles that
# allow both all live in one place.
TESSERA_NAMESPACE=tessera-system

if [[ -d "$PID_DIR" ]]; then
  for f in "$PID_DIR"/*.pid; do
    [[ -e "$f" ]] || continue
    if pid_of "$(basename "$f" .pid)" >/dev/null; then
      die "a cluster is already running from $RUN_DIR (process $(basename "$f" .pid)); run 'make down' first"
    fi
  done
fi
rm -rf "$RUN_DIR"
mkdir -p "$LOG_DIR" "$PID_DIR" "$PROC_DIR"

step "preflight: tools and ports"
command -v go >/dev/null || die "go not found in PATH; install Go >= 1.26 (Kubernetes 1.36 and 1.37 need it)"
gov="$(go env GOVERSION)"; gominor="$(echo "${gov#go}" | cut -d. -f2)"
[[ "${gov#go}" == 1.* && "$gominor" -ge 26 ]] || die "Go $gov is too old; Kubernetes 1.36 and 1.37 need Go >= 1.26"
for p in "$ETCD_PORT" "$ETCD_PEER_PORT" "$API_PORT" "$SCHEDULER_PORT" "$CONTROLLER_MANAGER_PORT"; do
  port_in_use "$p" && die "port $p on 127.0.0.1 is in use; free it or set ETCD_PORT/ETCD_PEER_PORT/API_PORT/SCHEDULER_PORT/CONTROLLER_MANAGER_PORT"
done

step "build: Kubernetes control plane + kubelet stand-in (log: $LOG_DIR/build-go.log)"
"$E2E_DIR/scripts/build-k8s.sh" > "$LOG_DIR/build-go.log" 2>&1 || die "Go build failed" "$LOG_DIR/build-go.log"
grep -E 'built in|up to date' "$LOG_DIR/build-go.log" | sed 's/^/    /'
# The fake NIC, the second DRA driver of the two-driver scenario (e2e/k8s/cmd/fakenic): always from go.mod
# (the kubelet-plugin helper of 1.37), since it speaks kubelet's DRA v1 gRPC and resource.k8s.io/v1, which
# 1.36 to 1.38 serve alike. Built here, not in build-k8s.sh, whose text is part of the control plane's stamp.
(cd "$E2E_DIR/k8s" && GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0 \
  go build -trimpath -o "$BIN_DIR/fakenic" ./cmd/fakenic) >> "$LOG_DIR/build-go.log" 2>&1 \
  || die "building the fake NIC driver failed" "$LOG_DIR/build-go.log"

if [[ "${SKIP_DRIVER:-0}" != 1 ]]; then
  # Always let cargo decide (seconds when nothing changed): a stale binary from an older tree would
  # otherwise run silently. Without cargo, prebuilt binaries are used as they are.
  if command -v cargo >/dev/null || [[ ! -x "$PLUGIN_BIN" || ! -x "$CONTROLLER_BIN" ]]; then
    command -v cargo >/dev/null || die "cargo not found in PATH and $PLUGIN_BIN / $CONTROLLER_BIN are missing"
    # The simulated NVIDIA driver the real node's driver root holds (kubelet-plugin/sim-driver/*: libnvidia-ml,
    # libcuda, nvidia-smi and the MPS tools), which `simulate driver-root` copies from target/debug.
    pkgs=(-p tessera-kubelet-plugin -p tessera-controller)
    for toml in "$REPO_ROOT"/kubelet-plugin/sim-driver/*/Cargo.toml; do
      [[ -f "$toml" ]] && pkgs+=(-p "$(sed -n 's/^name = "\(.*\)"/\1/p' "$toml" | head -1)")
    done
    step "build: cargo build ${pkgs[*]} (log: $LOG_DIR/build-rust.log)"
    cargo build "${pkgs[@]}" > "$LOG_DIR/build-rust.log" 2>&1 || die "cargo build failed" "$LOG_DIR/build-rust.log"
  fi
  [[ -x "$PLUGIN_BIN" ]] || die "$PLUGIN_BIN missing after cargo build"
  [[ -x "$CONTROLLER_BIN" ]] || die "$CONTROLLER_BIN missing after cargo build"
  # The host controller and plugins run with the chart's own roles (rendered by helm), not system:masters.
  step "build: helm, for the chart's RBAC (log: $LOG_DIR/build-helm.log)"
  "$E2E_DIR/scripts/build-helm.sh" > "$LOG_DIR/build-helm.log" 2>&1 || die "helm build failed" "$LOG_DIR/build-helm.log"
fi

# ADDONS: a comma- or space-separated list.
ADDONS="${ADDONS:-}"
read -ra addons <<< "${ADDONS//,/ }"
for a in "${addons[@]}"; do
  case "$a" in
    autoscaling | kueue) ;;
    *) die "ADDONS=$ADDONS: the add-ons are autoscaling (Prometheus + KEDA) and kueue (Kueue)" ;;
  esac
done
addon() { [[ " ${ADDONS//,/ } " == *" $1 "* ]]; }
if addon autoscaling; then
  step "build: Prometheus and KEDA (log: $LOG_DIR/build-autoscaling.log)"
  "$E2E_DIR/scripts/build-autoscaling.sh" > "$LOG_DIR/build-autoscaling.log" 2>&1 \
    || die "building the autoscaling add-on failed" "$LOG_DIR/build-autoscaling.log"
  grep -E 'built in|up to date' "$LOG_DIR/build-autoscaling.log" | sed 's/^/    /'
fi
if addon kueue; then
  step "build: Kueue (log: $LOG_DIR/build-kueue.log)"
  "$E2E_DIR/scripts/build-kueue.sh" > "$LOG_DIR/build-kueue.log" 2>&1 \
    || die "building the kueue add-on failed" "$LOG_DIR/build-kueue.log"
  grep -E 'built in|up to date' "$LOG_DIR/build-kueue.log" | sed 's/^/    /'
fi

INSTALL="${INSTALL:-host}"
case "$INSTALL" in
  host) REAL_NODE="${REAL_NODE:-0}" ;;
  chart)
    [[ "${SKIP_DRIVER:-0}" == 1 ]] && die "INSTALL=chart installs tessera; it cannot be combined with SKIP_DRIVER=1"
    [[ "${REAL_NODE:-1}" == 1 ]] || die "INSTALL=chart needs the real node the chart's pods run on; leave REAL_NODE unset (or 1)"
    [[ "$(id -u)" == 0 ]] || die "INSTALL=chart runs a real kubelet and containerd, which need root; run as root or use INSTALL=host"
    REAL_NODE=1 ;;
  *) die "INSTALL=$INSTALL: use host (tessera's controller as a host process) or chart (helm install onto the real node)" ;;
esac
if [[ "$REAL_NODE" == 1 ]]; then
  step "build: real node (kubelet, containerd, runc, CNI, images; log: $LOG_DIR/build-node.log)"
  "$E2E_DIR/scripts/build-node.sh" > "$LOG_DIR/build-node.log" 2>&1 || die "real node build failed" "$LOG_DIR/build-node.log"
  grep -E 'built in|up to date|written' "$LOG_DIR/build-node.log" | sed 's/^/    /'
  if [[ "${SKIP_DRIVER:-0}" != 1 ]]; then
    # The chart's image, from the debug binaries just built: the real node imports it (nothing is pulled).
    step "build: tessera image from the debug binaries (log: $LOG_DIR/build-image.log)"
    IMAGE_PROFILE=debug "$E2E_DIR/scripts/build-image.sh" > "$LOG_DIR/build-image.log" 2>&1 \
      || die "image build failed" "$LOG_DIR/build-image.log"
  fi
fi

# install_chart: `helm install` of deployments/helm/tessera onto the real node, the way a platform team
# installs it: the image the real node imported (never pulled), the nvml backend over the node's driver
# root (the simulated NVIDIA driver real-node.sh built), the real kubelet's directories, the DeviceClasses
# and GpuPolicy this script applied kept as they are. The stand-in nodes keep
# their host plugins (they run no containers); the chart's controller publishes for every node.
install_chart() {
  local rn="${REAL_NODE_NAME:-real-node}" rnd="$RUN_DIR/real-node"
  step "helm install tessera (deployments/helm/tessera, nvml backend) onto $rn (log: $LOG_DIR/helm-install.log)"
  "$E2E_DIR/bin/helm" install tessera "$REPO_ROOT/deployments/helm/tessera" --namespace "$TESSERA_NAMESPACE" \
    --kubeconfig "$ADMIN_KUBECONFIG" --wait --timeout 240s \
    --set backend=nvml --set "driverRoot=$rnd/driver-root" --set image.pullPolicy=Never \
    --set "kubeletDir=$rnd/kubelet" --set "cdiDir=$rnd/cdi" --set "stateDir=$rnd/tessera" \
    --set deviceClasses.create=false --set gpuPolicy.create=false \
    --set "controller.nodeSelector.kubernetes\.io/hostname=$rn" \
    --set 'controller.tolerations[0].key=nvidia.com/gpu' --set 'controller.tolerations[0].operator=Exists' \
    --set 'controller.tolerations[0].effect=NoSchedule' \
    --set "webhook.nodeSelector.kubernetes\.io/hostname=$rn" \
    --set 'webhook.tolerations[0].key=nvidia.com/gpu' --set 'webhook.tolerations[0].operator=Exists' \
    --set 'webhook.tolerations[0].effect=NoSchedule' \
    > "$LOG_DIR/helm-install.log" 2>&1 || die "helm install of the chart failed" "$LOG_DIR/helm-install.log"
  sed 's/^/    /' "$LOG_DIR/helm-install.log" | grep -E 'STATUS|REVISION' || true
}

step "pki: CA, serving cert, service-account keys, tokens, kubeconfigs in $PKI_DIR"
# tessera's own identities get no group ("user@"): the chart's roles, bound below, are all they may do.
# With SKIP_DRIVER=1 nothing binds them, and whoever starts plugins there keeps system:masters.
tessera_groups="@"
[[ "${SKIP_DRIVER:-0}" == 1 ]] && tessera_groups=""
ids="admin=admin,scheduler=system:kube-scheduler,controller-manager=system:kube-controller-manager,controller=tessera-controller$tessera_groups"
plugin_users=()
for i in $(seq 0 $((NODES - 1))); do
  n="$(node_name "$i")"
  ids+=",kubelet-$n=system:node:$n,plugin-$n=tessera-plugin-$n$tessera_groups"
  plugin_users+=("tessera-plugin-$n")
done
# The real node's kubelet is a node and nothing more (Node authorizer, NodeRestriction).
[[ "$REAL_NODE" == 1 ]] && ids+=",kubelet-${REAL_NODE_NAME:-real-node}=system:node:${REAL_NODE_NAME:-real-node}@system:nodes"
# The real node's cluster DNS (real-node.sh) reads Services and EndpointSlices as CoreDNS does, no more.
[[ "$REAL_NODE" == 1 ]] && ids+=",coredns=system:coredns@"
clusterctl pki --dir "$PKI_DIR" --server "https://127.0.0.1:$API_PORT" --identities "$ids" \
  > "$LOG_DIR/pki.log" 2>&1 || die "PKI generation failed" "$LOG_DIR/pki.log"

gates=()
[[ -n "$FEATURE_GATES" ]] && gates=("--feature-gates=$FEATURE_GATES")

step "etcd on 127.0.0.1:$ETCD_PORT"
write_proc etcd -- "$BIN_DIR/etcd" \
  --name default --data-dir "$RUN_DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "default=http://127.0.0.1:$ETCD_PEER_PORT" --unsafe-no-fsync --log-level warn
start_proc etcd
clusterctl wait-url --url "http://127.0.0.1:$ETCD_PORT/health" --timeout 30s || die "etcd did not become healthy" "$LOG_DIR/etcd.log"

step "kube-apiserver on https://127.0.0.1:$API_PORT"
# --enable-aggregator-routing: the API server calls webhook Services (the chart's admission webhook) and
# APIServices (KEDA's metrics adapter) at their endpoints' addresses, which the host routes to the real
# node's bridge; no kube-proxy runs here to make ClusterIPs answer. --requestheader-* and --proxy-client-*:
# the aggregation layer, which proxies external.metrics.k8s.io to KEDA's adapter as front-proxy-client.
# --client-ca-file: extension API servers read it from kube-system/extension-apiserver-authentication (a
# certificate the CA signed names its user by CN and no group; the identities above use tokens).
rc=()
[[ -n "$RUNTIME_CONFIG" ]] && rc=("--runtime-config=$RUNTIME_CONFIG")
# ServiceAccount admission refuses pods in a namespace until its `default` ServiceAccount exists, which
# kube-controller-manager's serviceaccount controller creates; without that process (the rate benchmark)
# the admission plugin stays off.
[[ "${SKIP_CONTROLLER_MANAGER:-0}" == 1 ]] && rc+=(--disable-admission-plugins ServiceAccount)
# ResourceQuota admission as GKE configures it: pods of the PriorityClasses system-node-critical and
# system-cluster-critical are admitted only in a namespace with a ResourceQuota scoped to them (GKE ships
# one in kube-system; tessera's chart brings one to its namespace, priorityQuota.create). Kubernetes docs,
# "Resource Quotas", "Limit Priority Class consumption by default"; nothing here runs such pods elsewhere.
ADMISSION_CONFIG="$RUN_DIR/admission-config.yaml"
cat > "$ADMISSION_CONFIG" <<'YAML'
apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
  - name: ResourceQuota
    configuration:
      apiVersion: apiserver.config.k8s.io/v1
      kind: ResourceQuotaConfiguration
      limitedResources:
        - resource: pods
          matchScopes:
            - scopeName: PriorityClass
              operator: In
              values: [system-node-critical, system-cluster-critical]
YAML
write_proc kube-apiserver -- "$BIN_DIR/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
  --tls-cert-file "$PKI_DIR/serving.crt" --tls-private-key-file "$PKI_DIR/serving.key" \
  --cert-dir "$RUN_DIR/apiserver-certs" \
  --token-auth-file "$PKI_DIR/tokens.csv" --authorization-mode Node,RBAC \
  --service-cluster-ip-range 10.0.0.0/24 \
  --service-account-issuer https://kubernetes.default.svc \
  --service-account-key-file "$PKI_DIR/sa.pub" --service-account-signing-key-file "$PKI_DIR/sa.key" \
  --endpoint-reconciler-type none \
  --kubelet-client-certificate "$PKI_DIR/kubelet-client.crt" --kubelet-client-key "$PKI_DIR/kubelet-client.key" \
  --kubelet-certificate-authority "$PKI_DIR/ca.crt" --kubelet-preferred-address-types InternalIP,Hostname \
  --enable-aggregator-routing=true \
  --client-ca-file "$PKI_DIR/ca.crt" \
  --requestheader-client-ca-file "$PKI_DIR/ca.crt" --requestheader-allowed-names front-proxy-client \
  --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
  --requestheader-extra-headers-prefix X-Remote-Extra- \
  --proxy-client-cert-file "$PKI_DIR/front-proxy-client.crt" --proxy-client-key-file "$PKI_DIR/front-proxy-client.key" \
  --admission-control-config-file "$ADMISSION_CONFIG" \
  --allow-privileged=true --profiling=false "${gates[@]}" "${rc[@]}"
start_proc kube-apiserver
clusterctl wait-api --kubeconfig "$ADMIN_KUBECONFIG" --timeout 90s || die "kube-apiserver did not become ready" "$LOG_DIR/kube-apiserver.log"

step "kube-scheduler and kube-controller-manager"
write_proc kube-scheduler -- "$BIN_DIR/kube-scheduler" \
  --kubeconfig "$PKI_DIR/scheduler.kubeconfig" --leader-elect=false \
  --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" --cert-dir "$RUN_DIR/scheduler-certs" "${gates[@]}" \
  ${SCHEDULER_ARGS:-}
start_proc kube-scheduler
# The controllers users' workloads rely on. Left out: node-lifecycle (the stand-ins' pods would be evicted
# from nodes it judges unhealthy), pod-garbage-collector (it deletes pods bound to nodes that do not exist,
# which the explain scenarios keep), the CSR signers (no cluster-signing key), cloud and volume controllers.
KCM_CONTROLLERS=resourceclaim-controller,device-taint-eviction-controller,garbage-collector-controller,namespace-controller
KCM_CONTROLLERS+=,serviceaccount-controller,root-ca-certificate-publisher-controller,daemonset-controller,deployment-controller
KCM_CONTROLLERS+=,replicaset-controller,replicationcontroller-controller,statefulset-controller,job-controller,cronjob-controller
KCM_CONTROLLERS+=,ttl-after-finished-controller,disruption-controller,resourcequota-controller,clusterrole-aggregation-controller
KCM_CONTROLLERS+=,endpoints-controller,endpointslice-controller,endpointslice-mirroring-controller,ephemeral-volume-controller
KCM_CONTROLLERS+=,horizontal-pod-autoscaler-controller
write_proc kube-controller-manager -- "$BIN_DIR/kube-controller-manager" \
  --kubeconfig "$PKI_DIR/controller-manager.kubeconfig" --leader-elect=false \
  --bind-address 127.0.0.1 --secure-port "$CONTROLLER_MANAGER_PORT" --cert-dir "$RUN_DIR/controller-manager-certs" \
  --controllers "$KCM_CONTROLLERS" \
  --root-ca-file "$PKI_DIR/ca.crt" \
  "${gates[@]}"
# SKIP_CONTROLLER_MANAGER=1 (the scheduler rate benchmark): nothing there needs it, and its informers
# would hold a third copy of every slice.
if [[ "${SKIP_CONTROLLER_MANAGER:-0}" != 1 ]]; then
  start_proc kube-controller-manager
fi
clusterctl wait-url --url "https://127.0.0.1:$SCHEDULER_PORT/healthz" --timeout 60s || die "kube-scheduler not healthy" "$LOG_DIR/kube-scheduler.log"
if [[ "${SKIP_CONTROLLER_MANAGER:-0}" != 1 ]]; then
  clusterctl wait-url --url "https://127.0.0.1:$CONTROLLER_MANAGER_PORT/healthz" --timeout 60s || die "kube-controller-manager not healthy" "$LOG_DIR/kube-controller-manager.log"
fi

crds=("$REPO_ROOT/deployments/crds")
if ! compgen -G "$REPO_ROOT/deployments/crds/*.yaml" >/dev/null && [[ -x "$CONTROLLER_BIN" ]]; then
  # Not generated into the tree yet: take them straight from the controller.
  "$CONTROLLER_BIN" crds > "$RUN_DIR/crds.yaml" 2> "$LOG_DIR/crds.log" || die "tessera-controller crds failed" "$LOG_DIR/crds.log"
  crds=("$RUN_DIR/crds.yaml")
fi
manifests=()
policy="${POLICY:-$E2E_DIR/manifests/gpupolicy.yaml}"
[[ "$policy" == none ]] && policy=""
# Only the top-level classes: deployments/classes/mig-profiles/ is opt-in (deployments/classes/README.md).
for p in "${crds[@]}" "$REPO_ROOT"/deployments/classes/*.yaml $policy; do
  if [[ -f "$p" ]] || compgen -G "$p/*.yaml" >/dev/null; then manifests+=("$p"); fi
done
if [[ ${#manifests[@]} -gt 0 ]]; then
  step "apply CRDs, DeviceClasses, GpuPolicy: ${manifests[*]#$REPO_ROOT/}"
  clusterctl apply --kubeconfig "$ADMIN_KUBECONFIG" "${manifests[@]}" > "$LOG_DIR/apply-deployments.log" 2>&1 \
    || die "applying CRDs/DeviceClasses failed" "$LOG_DIR/apply-deployments.log"
fi
printf 'apiVersion: v1\nkind: Namespace\nmetadata:\n  name: %s\n' "$TESSERA_NAMESPACE" > "$RUN_DIR/namespace.yaml"
clusterctl apply --kubeconfig "$ADMIN_KUBECONFIG" "$RUN_DIR/namespace.yaml" > /dev/null || die "creating namespace $TESSERA_NAMESPACE failed"
# The API server reaches kubelets (`kubectl logs`, `exec`, `port-forward`) as kube-apiserver-kubelet-client
# (WritePKI's client certificate); the real kubelet authorizes it by SubjectAccessReview, as kubeadm sets up.
cat > "$RUN_DIR/kubelet-api.yaml" <<'EOF'
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: kube-apiserver-kubelet-client
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:kubelet-api-admin}
subjects:
  - {apiGroup: rbac.authorization.k8s.io, kind: User, name: kube-apiserver-kubelet-client}
---
# What CoreDNS's kubernetes plugin reads (the role kubeadm gives it).
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: system:coredns
rules:
  - apiGroups: [""]
    resources: [services, pods, namespaces]
    verbs: [list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: system:coredns
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:coredns}
subjects:
  - {apiGroup: rbac.authorization.k8s.io, kind: User, name: system:coredns}
EOF
clusterctl apply --kubeconfig "$ADMIN_KUBECONFIG" "$RUN_DIR/kubelet-api.yaml" > /dev/null \
  || die "binding kube-apiserver-kubelet-client to system:kubelet-api-admin (and CoreDNS's role) failed"
if [[ "${SKIP_DRIVER:-0}" != 1 ]]; then
  step "RBAC: the chart's roles (renamed e2e-host-*) for the host controller and plugins"
  "$E2E_DIR/bin/helm" template tessera "$REPO_ROOT/deployments/helm/tessera" --namespace "$TESSERA_NAMESPACE" \
    --show-only templates/rbac.yaml > "$RUN_DIR/chart-rbac.yaml" 2> "$LOG_DIR/host-rbac.log" \
    || die "helm template of the chart's RBAC failed" "$LOG_DIR/host-rbac.log"
  plugins_csv="$(IFS=,; echo "${plugin_users[*]}")"
  clusterctl host-rbac --kubeconfig "$ADMIN_KUBECONFIG" --namespace "$TESSERA_NAMESPACE" --controller tessera-controller \
    --plugins "$plugins_csv" "$RUN_DIR/chart-rbac.yaml" >> "$LOG_DIR/host-rbac.log" 2>&1 \
    || die "binding the chart's roles to the host identities failed" "$LOG_DIR/host-rbac.log"
fi

for i in $(seq 0 $((NODES - 1))); do
  n="$(node_name "$i")"; d="$(node_dir "$n")"
  mkdir -p "$d/registry" "$d/plugins" "$d/cdi" "$d/plugin-state" "$d/kubelet-state"
  printf 'gpus:\n  - model: %s\n    count: %s\n' "$MODEL" "$GPUS" > "$d/node.yaml"
  # A stable fake boot id per node: a plugin restart is not a node reboot.
  echo "$(cat /proc/sys/kernel/random/uuid)" > "$d/boot_id"

  step "node $n: kubelet stand-in"
  write_proc "kubelet-$n" -- "$BIN_DIR/mini-kubelet" \
    --kubeconfig "$PKI_DIR/kubelet-$n.kubeconfig" --node-name "$n" \
    --registry-dir "$d/registry" --cdi-dir "$d/cdi" --state-dir "$d/kubelet-state" \
    ${FEATURE_GATES:+--feature-gates "$FEATURE_GATES"}
  start_proc "kubelet-$n"
  clusterctl wait-node --kubeconfig "$ADMIN_KUBECONFIG" --node "$n" --timeout 60s || die "node $n did not become Ready" "$LOG_DIR/kubelet-$n.log"

  if [[ "${SKIP_DRIVER:-0}" != 1 ]]; then
    step "node $n: tessera-kubelet-plugin (simulated, $GPUS x $MODEL)"
    # Probes and /metrics on METRICS_BASE_PORT (API_PORT+1000; +100 is the scheduler benchmark's API server)
    # + the node's index; plugin-pod.sh's surge instance exports its own address after these.
    write_proc "plugin-$n" KUBECONFIG="$PKI_DIR/plugin-$n.kubeconfig" RUST_LOG="${RUST_LOG:-info}" TESSERA_LEASE_NAMESPACE="$TESSERA_NAMESPACE" \
      TESSERA_HEALTH_ADDR="127.0.0.1:$(( ${METRICS_BASE_PORT:-$((API_PORT + 1000))} + i ))" -- "$PLUGIN_BIN" \
      --node-name "$n" --backend simulated --simulated-node-file "$d/node.yaml" \
      --state-dir "$d/plugin-state" --kubelet-registry-dir "$d/registry" --kubelet-plugins-dir "$d/plugins" \
      --cdi-dir "$d/cdi" --boot-id-file "$d/boot_id" --kubeconfig "$PKI_DIR/plugin-$n.kubeconfig"
    start_proc "plugin-$n"
  fi
done

if [[ "${SKIP_DRIVER:-0}" != 1 ]]; then
  for i in $(seq 0 $((NODES - 1))); do
    n="$(node_name "$i")"
    step "node $n: waiting for the plugin's NodeInventory"
    ready=0
    for _ in $(seq 1 18); do
      if clusterctl wait-inventory --kubeconfig "$ADMIN_KUBECONFIG" --node "$n" --timeout 5s 2>/dev/null; then ready=1; break; fi
      if grep -q 'PROTOCOL_ERROR' "$LOG_DIR/kubelet-$n.log"; then
        grep -m1 'PROTOCOL_ERROR' "$LOG_DIR/kubelet-$n.log" | cut -c1-400 >&2
        echo "kubelet's registration call (GetInfo) was rejected by the plugin's gRPC server: is the h2 patch" >&2
        echo "in third_party/ (see third_party/README.md) still applied?" >&2
        die "plugin on $n cannot register with the kubelet" "$LOG_DIR/kubelet-$n.log"
      fi
    done
    [[ $ready == 1 ]] || die "plugin on $n did not report a ready NodeInventory within 90s" "$LOG_DIR/plugin-$n.log"
  done

  # Probes and /metrics one below the plugins' METRICS_BASE_PORT (the MIG fragmentation scenario scrapes it).
  write_proc controller KUBECONFIG="$PKI_DIR/controller.kubeconfig" RUST_LOG="${RUST_LOG:-info}" TESSERA_LEASE_NAMESPACE="$TESSERA_NAMESPACE" \
    TESSERA_HEALTH_ADDR="127.0.0.1:$(( ${METRICS_BASE_PORT:-$((API_PORT + 1000))} - 1 ))" -- "$CONTROLLER_BIN" \
    --kubeconfig "$PKI_DIR/controller.kubeconfig"
  published=()
  if [[ "$INSTALL" == chart ]]; then
    "$E2E_DIR/scripts/real-node.sh" up || die "the real node did not come up"
    install_chart
    published=("${REAL_NODE_NAME:-real-node}")
  else
    step "tessera-controller"
    start_proc controller
  fi
  for i in $(seq 0 $((NODES - 1))); do published+=("$(node_name "$i")"); done
  for n in "${published[@]}"; do
    out="$(clusterctl wait-slices --kubeconfig "$ADMIN_KUBECONFIG" --node "$n" --timeout 90s)" \
      || die "no ResourceSlices for $n from the controller" "$LOG_DIR/controller.log"
    step "node $n: ResourceSlices published ($out)"
  done

  if [[ "${SKIP_EXAMPLES:-0}" != 1 && -d "$REPO_ROOT/deployments/examples" ]]; then
    # With the chart, the real node runs the examples' containers (the stand-ins run none): each pod is
    # pinned there, and its log shows the devices it was given.
    pin=()
    [[ "$INSTALL" == chart ]] && pin=(--node "${REAL_NODE_NAME:-real-node}")
    step "apply examples: deployments/examples${pin[*]:+ (pods on ${pin[1]})}"
    clusterctl apply --kubeconfig "$ADMIN_KUBECONFIG" "${pin[@]}" "$REPO_ROOT/deployments/examples" > "$LOG_DIR/apply-examples.log" 2>&1 \
      || die "applying examples failed" "$LOG_DIR/apply-examples.log"
    step "pods (waiting up to 120s for them to settle)"
    clusterctl report --kubeconfig "$ADMIN_KUBECONFIG" --wait 120s | tee "$RUN_DIR/report.txt"
    if [[ ${#pin[@]} -gt 0 ]]; then
      for p in $("$BIN_DIR/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" get pods -n tessera-examples \
          --field-selector "spec.nodeName=${pin[1]},status.phase=Running" -o name); do
        echo "    \$ kubectl logs -n tessera-examples $p"
        "$BIN_DIR/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" logs -n tessera-examples "$p" 2>&1 | sed 's/^/      /' \
          | tee -a "$RUN_DIR/report.txt"
      done
    fi
  fi
fi

if [[ "$REAL_NODE" == 1 && "$INSTALL" != chart ]]; then
  "$E2E_DIR/scripts/real-node.sh" up || die "the real node did not come up"
fi
if addon autoscaling; then
  [[ "$REAL_NODE" == 1 ]] || die "ADDONS=autoscaling needs the real node (REAL_NODE=1): KEDA's adapter serves on its bridge address"
  "$E2E_DIR/scripts/autoscaling.sh" up || die "the autoscaling add-on did not come up"
fi
if addon kueue; then
  "$E2E_DIR/scripts/kueue.sh" up || die "the kueue add-on did not come up"
fi

step "cluster is up"
# kubectl is built with the control plane (build-k8s.sh), of the same release.
cat <<MSG
    export KUBECONFIG=$ADMIN_KUBECONFIG PATH=$BIN_DIR:\$PATH
    kubectl get nodes
    kubectl get resourceslices
    kubectl get pods -A -o wide
    kubectl describe pod -n <namespace> <pod>
    logs: $LOG_DIR    report again: $BIN_DIR/clusterctl report
    stop: make down
MSG
