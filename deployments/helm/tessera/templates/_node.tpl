{{/* Environment both node components share (the flags' env fallbacks, kubelet-plugin/README.md). */}}
{{- define "tessera.nodeEnv" -}}
- name: TESSERA_BACKEND
  value: {{ .Values.backend }}
- name: TESSERA_STATE_DIR
  value: {{ .Values.stateDir | quote }}
{{- if eq .Values.backend "nvml" }}
- name: TESSERA_DRIVER_ROOT
  value: {{ .Values.driverRoot | quote }}
{{- end }}
{{- if .Values.mpsSupervisor.enabled }}
- name: TESSERA_MPS_SUPERVISOR_SOCKET
  value: {{ printf "%s/mps-supervisor.sock" (clean .Values.stateDir) | quote }}
{{- end }}
{{- end }}

{{/* Host directories at their host paths: CDI specs and kubelet's registration name host paths. */}}
{{- define "tessera.nodeVolumes" -}}
- name: state
  hostPath: {path: {{ .Values.stateDir | quote }}, type: DirectoryOrCreate}
{{- if eq .Values.backend "nvml" }}
- name: driver-root
  hostPath: {path: {{ .Values.driverRoot | quote }}, type: Directory}
# MIG device nodes (/dev/nvidia-caps/…) appear after the pod starts; a privileged container's /dev is a copy.
- name: dev
  hostPath: {path: /dev, type: Directory}
{{- end }}
{{- end }}

{{- define "tessera.nodeMounts" -}}
{{- if eq .Values.backend "nvml" }}
- name: driver-root
  mountPath: {{ .Values.driverRoot | quote }}
  readOnly: true
- name: dev
  mountPath: /dev
{{- end }}
{{- end }}
