#!/usr/bin/env bash
# kueue.sh up: the kueue add-on of the local cluster (`make up ADDONS=kueue`; `make e2e` always starts it):
# Kueue's controller manager (upstream's, built from the Go module proxy by build-kueue.sh) as a process of the
# run dir (make down stops it), with its CRDs applied and a configuration that charges tessera's DRA claims to
# ClusterQueue quotas. Kueue v0.19.2's DRA gates (pkg/features/kube_features.go): KueueDRAIntegration (beta,
# on), KueueDRAIntegrationExtendedResource (beta, on) and KueueDRAIntegrationPartitionableDevices (counter
# sources; beta, on) by default; KueueDRAIntegrationConsumableCapacity (capacity sources; alpha, off) turned
# on here. resources.deviceClassMappings maps tessera's DeviceClasses (deployments/classes) to logical
# resources:
#   gpu.tessera.dev                            -> tessera.dev/gpu               (whole GPUs, one per device)
#   shared.gpu.tessera.dev                     -> tessera.dev/gpu-share-memory  (shares: the bytes of `memory`
#                                                 capacity each claim consumes, a capacity source)
#   mig.gpu.tessera.dev, mig-*.gpu.tessera.dev -> tessera.dev/mig-memory        (MIG: the bytes of the `memory`
#                                                 counter a placement consumes, a counter source; published
#                                                 by GpuPolicy rules with dynamicMig.quotaCounters: [memory],
#                                                 which TestKueue* turns on for its length)
# What a counter source charges (the largest amount among the devices a request can match), and why a
# share's `compute` is not charged: see deployments/examples/kueue/README.md (What Kueue v0.19.2 charges).
# deployments/examples/kueue/README.md shows the same featureGates and deviceClassMappings.
#
# Without Kueue's admission webhooks: the manager serves them (controller-runtime needs a serving certificate
# for that, signed here by the cluster's CA) but no webhook configuration points at them, so Kueue changes
# nothing of what other scenarios create. A Job for a queue is therefore created suspended, with the
# kueue.x-k8s.io/queue-name label (what Kueue's Job webhook would do to it); Kueue's Job controller still
# makes its Workload, admits it and unsuspends it. Its objects are not defaulted or validated by its webhooks.
# Kueue's metrics server is off (bindAddress "0"), but with internal certificate management off the manager
# still loads a metrics certificate from the fixed path /etc/kueue/metrics/certs (cmd/kueue/main.go): the
# manager runs in a mount namespace of its own (unshare) where the run dir's certificate is bind-mounted
# there; on the host that path stays an empty directory. Hence root, as the real node needs anyway.
# Kueue runs with the admin identity (system:masters): its own RBAC is not what this cluster tests.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

KBIN="${KUEUE_BIN_DIR:-$E2E_DIR/bin/kueue}"
KDIR="$RUN_DIR/kueue"
KUEUE_HEALTH_PORT=$((API_PORT + 30))
KUEUE_WEBHOOK_PORT=$((API_PORT + 31))
METRICS_CERT_PATH=/etc/kueue/metrics/certs

up() {
  for b in kueue-manager kueue-crds.yaml kueue-version; do
    [[ -e "$KBIN/$b" ]] || die "$KBIN/$b missing: run e2e/scripts/build-kueue.sh"
  done
  [[ "$(id -u)" == 0 ]] || die "the kueue add-on needs root (a mount namespace for Kueue's fixed metrics certificate path)"
  for p in "$KUEUE_HEALTH_PORT" "$KUEUE_WEBHOOK_PORT"; do
    port_in_use "$p" && die "port $p on 127.0.0.1 is in use (the kueue add-on takes API_PORT+30..31)"
  done
  mkdir -p "$KDIR/certs" "$METRICS_CERT_PATH"

  clusterctl sign-cert --dir "$PKI_DIR" --out "$KDIR/certs/tls" --cn kueue-webhook-service \
    --ips 127.0.0.1 --dns kueue-webhook-service.kueue-system.svc || die "signing Kueue's certificate failed"

  cat > "$KDIR/config.yaml" <<YAML
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
health:
  healthProbeBindAddress: 127.0.0.1:$KUEUE_HEALTH_PORT
metrics:
  bindAddress: "0"
webhook:
  host: 127.0.0.1
  port: $KUEUE_WEBHOOK_PORT
  certDir: $KDIR/certs
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
integrations:
  frameworks: ["batch/job"]
featureGates:
  # Capacity sources (the shares' memory); alpha in v0.19, off by default.
  KueueDRAIntegrationConsumableCapacity: true
  # Its API server would need a certificate and an APIService of its own; nothing here reads it.
  VisibilityOnDemand: false
resources:
  deviceClassMappings:
  - name: tessera.dev/gpu
    deviceClassNames: [gpu.tessera.dev]
  - name: tessera.dev/gpu-share-memory
    deviceClassNames: [shared.gpu.tessera.dev]
    sources:
    - capacity:
        name: memory
        driver: gpu.tessera.dev
        deviceSelector:
          cel:
            expression: device.attributes["gpu.tessera.dev"].type == "shared"
  - name: tessera.dev/mig-memory
    deviceClassNames: [mig.gpu.tessera.dev$(for f in "$REPO_ROOT"/deployments/classes/mig-profiles/*.yaml; do printf ', %s' "$(basename "$f" .yaml)"; done)]
    sources:
    - counter:
        name: memory
        driver: gpu.tessera.dev
        deviceSelector:
          cel:
            expression: device.attributes["gpu.tessera.dev"].type == "mig"
YAML

  {
    cat "$KBIN/kueue-crds.yaml"
    printf -- '---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: kueue-system\n'
  } > "$KDIR/kueue.yaml"
  clusterctl apply --kubeconfig "$ADMIN_KUBECONFIG" "$KDIR/kueue.yaml" > "$LOG_DIR/apply-kueue.log" 2>&1 \
    || die "applying Kueue's CRDs failed" "$LOG_DIR/apply-kueue.log"

  # unshare: a private mount namespace (no --fork: the manager keeps the pid start_proc records).
  write_proc kueue KUBECONFIG="$ADMIN_KUBECONFIG" -- unshare --mount --propagation private -- \
    sh -c 'mount --bind "$1" "$2" && shift 2 && exec "$@"' kueue "$KDIR/certs" "$METRICS_CERT_PATH" \
    "$KBIN/kueue-manager" --config "$KDIR/config.yaml" --zap-log-level=info
  start_proc kueue
  clusterctl wait-url --url "http://127.0.0.1:$KUEUE_HEALTH_PORT/readyz" --timeout 90s \
    || die "Kueue's manager did not become ready" "$LOG_DIR/kueue.log"
  step "kueue: Kueue $(cat "$KBIN/kueue-version") manager (KueueDRAIntegration with extended resources, counter and capacity sources; tessera.dev/gpu, tessera.dev/gpu-share-memory, tessera.dev/mig-memory)"
}

case "${1:-}" in
  up) up ;;
  *) echo "usage: $0 up   (make down stops what it started)" >&2; exit 2 ;;
esac
