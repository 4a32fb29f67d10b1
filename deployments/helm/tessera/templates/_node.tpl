{{/* Environment both node components share (the flags' env fallbacks, kubelet-plugin/README.md). */}}
{{- define "tessera.nodeEnv" -}}
- name: TESSERA_BACKEND
  value: {{ .Values.backend }}
- name: TESSERA_STATE_DIR
  value: {{ .Values.stateDir | quote }}
{{- if eq .Values.backend "nvml" }}
# The host's path of the driver (what CDI specs name) and where this pod reads it.
- name: TESSERA_DRIVER_ROOT
  value: {{ .Values.driverRoot | quote }}
- name: TESSERA_CONTAINER_DRIVER_ROOT
  value: {{ include "tessera.containerDriverRoot" . | quote }}
{{- end }}
{{- if and (eq .Values.backend "nvml") .Values.kubeletPlugin.maskDriverParams }}
# ModifyDeviceFiles: 0 in this container's /proc/driver/nvidia/params, from a copy on the tmpfs below.
- name: TESSERA_DRIVER_PARAMS_MASK_DIR
  value: /run/tessera-params
{{- end }}
{{- if .Values.mpsSupervisor.enabled }}
- name: TESSERA_MPS_SUPERVISOR_SOCKET
  value: {{ printf "%s/mps-supervisor.sock" (clean .Values.stateDir) | quote }}
{{- end }}
{{- end }}

{{/* Host directories at their host paths (CDI specs and kubelet's registration name host paths), except the
driver root, which is mounted at tessera.containerDriverRoot. */}}
{{- define "tessera.nodeVolumes" -}}
- name: state
  hostPath: {path: {{ .Values.stateDir | quote }}, type: DirectoryOrCreate}
{{- if eq .Values.backend "nvml" }}
# DirectoryOrCreate: a driver container mounts the driver there after this pod starts (HostToContainer
# shows it); until then wait-for-driver waits on the empty directory.
- name: driver-root
  hostPath: {path: {{ .Values.driverRoot | quote }}, type: DirectoryOrCreate}
# MIG device nodes (/dev/nvidia-caps/…) appear after the pod starts; a privileged container's /dev is a copy.
- name: dev
  hostPath: {path: /dev, type: Directory}
{{- if .Values.kubeletPlugin.maskDriverParams }}
- name: driver-params
  emptyDir: {medium: Memory, sizeLimit: 1Mi}
{{- end }}
{{- end }}
{{- end }}

{{/*
Where the node components see the host's driverRoot: a fixed path of their own, so any driverRoot mounts,
`/` (a driver installed on the host) included, without hiding the container's files; the plugin names the
host's paths in CDI specs (--driver-root vs --container-driver-root, kubelet-plugin/README.md).
*/}}
{{- define "tessera.containerDriverRoot" -}}/driver-root{{- end }}

{{/*
The init container of both node pods (nvml only): waits until the driver is installed under driverRoot,
printing what is missing every 30 s, so a node whose driver container is still working shows Init:0/1 and
a reason instead of a crash loop. It reads the driver root as the plugin does (and the state dir, where a
simulated driver's kernel lives), nothing else, with no capability.
*/}}
{{- define "tessera.waitForDriver" -}}
{{- if eq .Values.backend "nvml" }}
initContainers:
  - name: wait-for-driver
    image: {{ include "tessera.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["/usr/bin/tessera-kubelet-plugin", "wait-for-driver"]
    env:
      {{- include "tessera.nodeEnv" . | nindent 6 }}
      - name: TESSERA_WAIT_FOR_DRIVER_TIMEOUT
        value: {{ .Values.driver.waitTimeout | quote }}
    securityContext:
      runAsUser: 0
      allowPrivilegeEscalation: false
      capabilities: {drop: ["ALL"]}
      readOnlyRootFilesystem: true
    resources:
      requests: {cpu: 10m, memory: 16Mi}
      limits: {memory: 64Mi}
    volumeMounts:
      - name: driver-root
        mountPath: {{ include "tessera.containerDriverRoot" . | quote }}
        readOnly: true
        mountPropagation: HostToContainer
      - name: state
        mountPath: {{ .Values.stateDir | quote }}
        readOnly: true
        mountPropagation: HostToContainer
{{- end }}
{{- end }}

{{- define "tessera.nodeMounts" -}}
{{- if eq .Values.backend "nvml" }}
# HostToContainer: a driver container that starts after this pod, or an upgraded driver, shows through.
- name: driver-root
  mountPath: {{ include "tessera.containerDriverRoot" . | quote }}
  readOnly: true
  mountPropagation: HostToContainer
- name: dev
  mountPath: /dev
{{- if .Values.kubeletPlugin.maskDriverParams }}
- name: driver-params
  mountPath: /run/tessera-params
{{- end }}
{{- end }}
{{- end }}

{{/*
The host directory the plugin installs tessera's CDI hook into (cdiHookDir), which the container runtime
executes the hook from: on GKE (driverRoot /home/kubernetes/bin/nvidia) /home/kubernetes/bin/tessera, as
Container-Optimized OS mounts /var noexec and /home/kubernetes/bin exec; elsewhere <stateDir>/bin.
*/}}
{{- define "tessera.cdiHookDir" -}}
{{- if .Values.cdiHookDir -}}
{{ clean .Values.cdiHookDir }}
{{- else if eq (clean .Values.driverRoot) "/home/kubernetes/bin/nvidia" -}}
/home/kubernetes/bin/tessera
{{- else -}}
{{ printf "%s/bin" (clean .Values.stateDir) }}
{{- end -}}
{{- end }}

{{/* "true" when the hook directory needs a volume of its own (it is not under stateDir, mounted anyway). */}}
{{- define "tessera.cdiHookDirMounted" -}}
{{- $dir := include "tessera.cdiHookDir" . -}}
{{- $state := clean .Values.stateDir -}}
{{- if and (not .Values.cdiHook) (ne $dir $state) (not (hasPrefix (printf "%s/" (trimSuffix "/" $state)) $dir)) -}}
true
{{- end -}}
{{- end }}
