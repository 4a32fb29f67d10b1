{{/* Labels every object of the release carries. */}}
{{- define "tessera.labels" -}}
app.kubernetes.io/name: tessera
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Selector labels of one component (immutable once installed: name and component only). */}}
{{- define "tessera.selector" -}}
app.kubernetes.io/name: tessera
app.kubernetes.io/component: {{ . }}
{{- end }}

{{- define "tessera.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
The controller's leader Lease (in the release namespace): the controller holds it, and the plugins read its
annotation to learn whether the leader watches their heartbeat Leases, so both must be given one name.
*/}}
{{- define "tessera.leaderLease" -}}
tessera-controller
{{- end }}

{{/* The admission webhook's ValidatingWebhookConfiguration (cluster-scoped; the webhook patches its caBundle). */}}
{{- define "tessera.webhookConfiguration" -}}
tessera-claims
{{- end }}

{{/* The ServiceAccount user names the admission policy matches. */}}
{{- define "tessera.pluginUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:tessera-kubelet-plugin
{{- end }}

{{/*
Checks what the schema cannot say, failing with the value to change.
*/}}
{{- define "tessera.validate" -}}
{{- if and .Values.gpuPolicy.create (not .Values.gpuPolicy.rules) (not (.Files.Get (printf "files/policies/%s.yaml" .Values.gpuPolicy.preset))) }}
{{- fail (printf "gpuPolicy.preset: %q is not one of deployments/policies/ (all-whole, mixed, shared-mps, static-mig); or set gpuPolicy.rules" .Values.gpuPolicy.preset) }}
{{- end }}
{{- if ge (int .Values.kubeletPlugin.heartbeatInterval) (int .Values.controller.heartbeatTimeout) }}
{{- fail (printf "kubeletPlugin.heartbeatInterval (%v s) must be below controller.heartbeatTimeout (%v s), or every node's pool is withdrawn between heartbeats" .Values.kubeletPlugin.heartbeatInterval .Values.controller.heartbeatTimeout) }}
{{- end }}
{{- if and .Values.webhook.enabled .Values.webhook.certManager.enabled (not .Values.webhook.certManager.issuerRef) }}
{{- fail "webhook.certManager.issuerRef: name the cert-manager Issuer or ClusterIssuer (name, kind) that signs the webhook's certificate, or set webhook.certManager.enabled=false to let the webhook make its own" }}
{{- end }}
{{- end }}

{{/* prometheus.io annotations for a pod serving /metrics on its health port: (list .Values.metrics port). */}}
{{- define "tessera.scrapeAnnotations" -}}
{{- $metrics := index . 0 -}}
{{- $port := index . 1 -}}
{{- if and $metrics.podAnnotations $port -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ $port | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end }}
