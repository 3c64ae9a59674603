{{/* Names and labels. */}}
{{- define "llm-watchdog.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llm-watchdog.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "llm-watchdog.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llm-watchdog.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "llm-watchdog.labels" -}}
{{ include "llm-watchdog.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | default "Helm" }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "llm-watchdog.servingName" -}}
{{- default (printf "%s-serving" .Release.Name) .Values.serving.name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the pods carrying the watchdog (its own, or the serving ones). */}}
{{- define "llm-watchdog.podSelector" -}}
{{- if eq .Values.mode "standalone" -}}
{{ include "llm-watchdog.selectorLabels" . }}
{{- else if .Values.serving.enabled -}}
app.kubernetes.io/name: {{ include "llm-watchdog.servingName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- else -}}
{{- if not .Values.serving.podLabels }}
{{- fail "serving.podLabels: the labels of your serving pods are required (mode sidecar, serving.enabled false)" }}
{{- end -}}
{{ toYaml .Values.serving.podLabels }}
{{- end }}
{{- end }}

{{- define "llm-watchdog.checkMode" -}}
{{- if not (has .Values.mode (list "standalone" "sidecar")) }}
{{- fail (printf "mode must be standalone or sidecar, got %q" .Values.mode) }}
{{- end }}
{{- end }}

{{/* The port the daemon listens on: config.server.port if set, else service.port. The container
port, every probe (by the port's name) and the Service's targetPort follow it. */}}
{{- define "llm-watchdog.serverPort" -}}
{{- $server := get (.Values.config | default dict) "server" | default dict }}
{{- if hasKey $server "port" }}{{ int $server.port }}{{ else }}{{ int .Values.service.port }}{{ end }}
{{- end }}

{{/* The daemon's config file: the values' config plus the paths and port this chart sets up. */}}
{{- define "llm-watchdog.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) }}
{{- if not (hasKey $cfg "policies") }}
{{- $_ := set $cfg "policies" (list "/etc/llm-watchdog/policies") }}
{{- end }}
{{- $server := merge (deepCopy (get $cfg "server" | default dict)) (dict "host" "0.0.0.0" "port" (include "llm-watchdog.serverPort" . | int)) }}
{{- $_ := set $cfg "server" $server }}
{{- toYaml $cfg }}
{{- end }}

{{/* The watchdog container: the same in both modes, less the readiness probe in sidecar mode. */}}
{{- define "llm-watchdog.container" -}}
- name: llm-watchdog
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["run", "--config", "/etc/llm-watchdog/config.yaml"]
  env:
    - name: LLMWD_INSTANCE
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: HOME
      value: {{ .Values.stateDir.mountPath | quote }}
    - name: XDG_CACHE_HOME
      value: {{ printf "%s/cache" .Values.stateDir.mountPath | quote }}
    {{- range .Values.secretEnv }}
    - name: {{ required "secretEnv[].name" .name }}
      valueFrom:
        secretKeyRef:
          name: {{ required (printf "secretEnv %s: secret" .name) .secret }}
          key: {{ required (printf "secretEnv %s: key" .name) .key }}
          {{- if hasKey . "optional" }}
          optional: {{ .optional }}
          {{- end }}
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: wd-metrics, containerPort: {{ include "llm-watchdog.serverPort" . }}, protocol: TCP}
  startupProbe:
    httpGet: {path: /livez, port: wd-metrics}
    {{- toYaml .Values.probes.startup | nindent 4 }}
  livenessProbe:
    httpGet: {path: /livez, port: wd-metrics}
    {{- toYaml .Values.probes.liveness | nindent 4 }}
  {{- if eq .Values.mode "standalone" }}
  readinessProbe:
    httpGet: {path: /readyz, port: wd-metrics}
    {{- toYaml .Values.probes.readiness | nindent 4 }}
  {{- end }}
  resources:
    {{- $res := ternary .Values.resources.withEngine .Values.resources.daemon .Values.engine.inProcess | deepCopy }}
    {{- if and .Values.engine.inProcess (gt (int .Values.engine.gpus) 0) }}
    {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (int .Values.engine.gpus)) ($res.limits | default dict)) }}
    {{- end }}
    {{- toYaml $res | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: wd-config, mountPath: /etc/llm-watchdog/config.yaml, subPath: config.yaml, readOnly: true}
    - {name: wd-policies, mountPath: /etc/llm-watchdog/policies, readOnly: true}
    - {name: wd-state, mountPath: {{ .Values.stateDir.mountPath }}}
    - {name: wd-tmp, mountPath: /tmp}
    {{- range .Values.secretMounts }}
    - {name: {{ .name }}, mountPath: {{ .mountPath }}, readOnly: true}
    {{- end }}
    {{- with .Values.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The volumes the watchdog container mounts. */}}
{{- define "llm-watchdog.volumes" -}}
- name: wd-config
  configMap: {name: {{ include "llm-watchdog.fullname" . }}}
- name: wd-policies
  configMap: {name: {{ .Values.policies.existingConfigMap | default (printf "%s-policies" (include "llm-watchdog.fullname" .)) }}}
- name: wd-state
  emptyDir: {sizeLimit: {{ .Values.stateDir.sizeLimit }}}
- name: wd-tmp
  emptyDir: {medium: Memory, sizeLimit: 64Mi}
{{- range .Values.secretMounts }}
- name: {{ .name }}
  secret: {secretName: {{ .secret }}, defaultMode: 0440}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}
