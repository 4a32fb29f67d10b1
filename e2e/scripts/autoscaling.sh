#!/usr/bin/env bash
# autoscaling.sh up: the autoscaling add-on of the local cluster (`make up ADDONS=autoscaling`; `make e2e`
# always starts it): Prometheus scraping tessera, KEDA's operator and its external-metrics API server
# behind the API server's aggregation layer, so a ScaledObject on tessera's per-claim GPU gauges scales a
# Deployment through kube-controller-manager's HPA controller. All three are upstream's own servers, built
# from the Go module proxy by build-autoscaling.sh, running as processes of the run dir (make down stops them).
#
# - Prometheus (127.0.0.1:PROMETHEUS_PORT, default API_PORT+20) discovers pods with the chart's
#   prometheus.io/scrape, /port and /path annotations through the API server (kubernetes_sd, role pod), as a
#   Prometheus without the operator reads them, and scrapes the stand-in nodes' host plugins at their
#   metrics ports. Scrape interval 2 s (AUTOSCALING_SCRAPE_INTERVAL): the e2e measures reactions in seconds.
# - KEDA's operator: ScaledObjects become HPAs on external metrics; its metrics service (gRPC, mutual TLS)
#   on 127.0.0.1:API_PORT+23.
# - KEDA's metrics adapter serves external.metrics.k8s.io on the real node's bridge address (API_PORT+24):
#   the APIService names the Service keda/keda-metrics-apiserver, whose Endpoints hold that address, which
#   the API server dials (--enable-aggregator-routing; no kube-proxy runs). It trusts the API server's
#   front-proxy client certificate by the request-header CA (up.sh's --requestheader-* flags).
# KEDA runs with the admin identity (system:masters): its own RBAC is not what this cluster tests.
# Needs the real node (its bridge address) and REAL_NODE=1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ABIN="${AUTOSCALING_BIN_DIR:-$E2E_DIR/bin/autoscaling}"
ADIR="$RUN_DIR/autoscaling"
RN_ADDRESS="$RN_GATEWAY"
PROMETHEUS_PORT="${PROMETHEUS_PORT:-$((API_PORT + 20))}"
KEDA_METRICS_PORT=$((API_PORT + 21))
KEDA_HEALTH_PORT=$((API_PORT + 22))
KEDA_GRPC_PORT=$((API_PORT + 23))
KEDA_ADAPTER_PORT=$((API_PORT + 24))
KEDA_ADAPTER_METRICS_PORT=$((API_PORT + 25))
SCRAPE="${AUTOSCALING_SCRAPE_INTERVAL:-2s}"
kubectl() { "$BIN_DIR/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

up() {
  for b in prometheus keda-operator keda-adapter keda-crds.yaml; do
    [[ -e "$ABIN/$b" ]] || die "$ABIN/$b missing: run e2e/scripts/build-autoscaling.sh"
  done
  ip -br addr | grep -qF " $RN_ADDRESS/" || die "no host address $RN_ADDRESS: the autoscaling add-on needs the real node (REAL_NODE=1)"
  for p in "$PROMETHEUS_PORT" "$KEDA_METRICS_PORT" "$KEDA_HEALTH_PORT" "$KEDA_GRPC_PORT" "$KEDA_ADAPTER_METRICS_PORT"; do
    port_in_use "$p" && die "port $p on 127.0.0.1 is in use (the autoscaling add-on takes API_PORT+20..25)"
  done
  mkdir -p "$ADIR/prometheus-data" "$ADIR/keda-certs" "$ADIR/keda-ca" "$ADIR/targets"

  local targets=() i
  for i in $(seq 0 $((NODES - 1))); do targets+=("\"127.0.0.1:$(( ${METRICS_BASE_PORT:-$((API_PORT + 1000))} + i ))\""); done
  cat > "$ADIR/prometheus.yml" <<YAML
global:
  scrape_interval: $SCRAPE
  evaluation_interval: $SCRAPE
scrape_configs:
  # Pods that ask to be scraped (the chart's controller and kubelet plugins), as they ask.
  - job_name: kubernetes-pods
    kubernetes_sd_configs:
      - role: pod
        kubeconfig_file: $ADMIN_KUBECONFIG
    relabel_configs:
      - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape]
        action: keep
        regex: "true"
      - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_path]
        action: replace
        target_label: __metrics_path__
        regex: (.+)
      - source_labels: [__meta_kubernetes_pod_ip, __meta_kubernetes_pod_annotation_prometheus_io_port]
        action: replace
        regex: (.+);(\d+)
        replacement: \$1:\$2
        target_label: __address__
      - source_labels: [__meta_kubernetes_namespace]
        target_label: kubernetes_namespace
      - source_labels: [__meta_kubernetes_pod_name]
        target_label: kubernetes_pod
      - source_labels: [__meta_kubernetes_pod_node_name]
        target_label: node
  # The stand-in nodes' host plugins (up.sh), which are processes, not pods.
  - job_name: tessera-host-plugins
    static_configs:
      - targets: [$(IFS=,; echo "${targets[*]}")]
  # Whatever a test serves itself (the e2e's request gateway): file_sd targets dropped into targets/.
  - job_name: extra
    file_sd_configs:
      - files: [$ADIR/targets/*.json]
        refresh_interval: 2s
YAML
  step "autoscaling: Prometheus $("$ABIN/prometheus" --version 2>&1 | head -1 | awk '{print $3}') on 127.0.0.1:$PROMETHEUS_PORT (scrape every $SCRAPE)"
  write_proc prometheus -- "$ABIN/prometheus" --config.file "$ADIR/prometheus.yml" \
    --storage.tsdb.path "$ADIR/prometheus-data" --storage.tsdb.retention.time 6h \
    --web.listen-address "127.0.0.1:$PROMETHEUS_PORT" --log.level warn
  start_proc prometheus
  clusterctl wait-url --url "http://127.0.0.1:$PROMETHEUS_PORT/-/ready" --timeout 60s \
    || die "Prometheus did not become ready" "$LOG_DIR/prometheus.log"
  echo "http://127.0.0.1:$PROMETHEUS_PORT" > "$ADIR/prometheus.url"

  # One key pair for the operator's metrics service and the adapter (both sides of KEDA's mutual TLS, and
  # the adapter's serving certificate the API server verifies against the APIService's caBundle).
  clusterctl sign-cert --dir "$PKI_DIR" --out "$ADIR/keda-certs/tls" --cn keda-metrics-apiserver --client \
    --ips "127.0.0.1,$RN_ADDRESS" --dns "keda-metrics-apiserver.keda.svc,keda-operator.keda.svc.cluster.local" \
    || die "signing KEDA's certificate failed"
  cp "$PKI_DIR/ca.crt" "$ADIR/keda-certs/ca.crt"

  local ca
  ca="$(base64 -w0 < "$PKI_DIR/ca.crt")"
  {
    cat "$ABIN/keda-crds.yaml"
    cat <<YAML
---
apiVersion: v1
kind: Namespace
metadata:
  name: keda
---
apiVersion: v1
kind: Service
metadata:
  name: keda-metrics-apiserver
  namespace: keda
spec:
  ports:
    - {name: https, port: 443, targetPort: $KEDA_ADAPTER_PORT}
---
# No selector: the adapter is a process on the host, at the real node's bridge address.
apiVersion: v1
kind: Endpoints
metadata:
  name: keda-metrics-apiserver
  namespace: keda
subsets:
  - addresses: [{ip: "$RN_ADDRESS"}]
    ports: [{name: https, port: $KEDA_ADAPTER_PORT}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata:
  name: v1beta1.external.metrics.k8s.io
spec:
  service: {name: keda-metrics-apiserver, namespace: keda, port: 443}
  group: external.metrics.k8s.io
  version: v1beta1
  caBundle: $ca
  groupPriorityMinimum: 100
  versionPriority: 100
YAML
  } > "$ADIR/keda.yaml"
  clusterctl apply --kubeconfig "$ADMIN_KUBECONFIG" "$ADIR/keda.yaml" > "$LOG_DIR/apply-keda.log" 2>&1 \
    || die "applying KEDA's CRDs and APIService failed" "$LOG_DIR/apply-keda.log"

  local env=(KUBECONFIG="$ADMIN_KUBECONFIG" WATCH_NAMESPACE="" POD_NAMESPACE=keda KEDA_CLUSTER_OBJECT_NAMESPACE=keda
    OPERATOR_NAME=keda-operator KEDA_HTTP_DEFAULT_TIMEOUT=3000)
  write_proc keda-operator "${env[@]}" -- "$ABIN/keda-operator" --leader-elect=false \
    --metrics-bind-address "127.0.0.1:$KEDA_METRICS_PORT" --health-probe-bind-address "127.0.0.1:$KEDA_HEALTH_PORT" \
    --metrics-service-bind-address "127.0.0.1:$KEDA_GRPC_PORT" --cert-dir "$ADIR/keda-certs" --ca-dir "$ADIR/keda-ca" \
    --enable-cert-rotation=false --enable-webhook-patching=false --enable-apiservice-patching=false --zap-log-level=info
  start_proc keda-operator
  write_proc keda-adapter "${env[@]}" -- "$ABIN/keda-adapter" \
    --bind-address "$RN_ADDRESS" --secure-port "$KEDA_ADAPTER_PORT" --port "$KEDA_ADAPTER_METRICS_PORT" \
    --cert-dir "$ADIR/keda-certs" --tls-cert-file "$ADIR/keda-certs/tls.crt" --tls-private-key-file "$ADIR/keda-certs/tls.key" \
    --authentication-kubeconfig "$ADMIN_KUBECONFIG" --authorization-kubeconfig "$ADMIN_KUBECONFIG" \
    --lister-kubeconfig "$ADMIN_KUBECONFIG" \
    --metrics-service-address "127.0.0.1:$KEDA_GRPC_PORT" --zap-log-level=info
  start_proc keda-adapter
  clusterctl wait-url --url "http://127.0.0.1:$KEDA_HEALTH_PORT/readyz" --timeout 90s \
    || die "KEDA's operator did not become ready" "$LOG_DIR/keda-operator.log"
  local ok=0
  for _ in $(seq 1 60); do
    if kubectl get --raw /apis/external.metrics.k8s.io/v1beta1 >/dev/null 2>&1; then ok=1; break; fi
    sleep 1
  done
  [[ $ok == 1 ]] || die "the API server does not serve external.metrics.k8s.io through KEDA's adapter" "$LOG_DIR/keda-adapter.log"
  step "autoscaling: KEDA operator and metrics adapter (external.metrics.k8s.io via $RN_ADDRESS:$KEDA_ADAPTER_PORT)"
}

case "${1:-}" in
  up) up ;;
  *) echo "usage: $0 up   (make down stops what it started)" >&2; exit 2 ;;
esac
