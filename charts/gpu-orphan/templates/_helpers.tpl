{{/* The chart's name, or nameOverride. */}}
{{- define "gpu-orphan.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name. */}}
{{- define "gpu-orphan.fullname" -}}
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

{{/* Labels of every object. */}}
{{- define "gpu-orphan.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "gpu-orphan.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the release's pods; add app.kubernetes.io/component. */}}
{{- define "gpu-orphan.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-orphan.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The image of every container. */}}
{{- define "gpu-orphan.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding the tokens (keys webhook and agent). */}}
{{- define "gpu-orphan.secretName" -}}
{{- default (printf "%s-token" (include "gpu-orphan.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The node agents' Service, which Kubernetes discovery reads. */}}
{{- define "gpu-orphan.agentsService" -}}
{{- printf "%s-remediator" (include "gpu-orphan.fullname" .) }}
{{- end }}

{{- define "gpu-orphan.dispatcherName" -}}
{{- printf "%s-dispatcher" (include "gpu-orphan.fullname" .) }}
{{- end }}

{{- define "gpu-orphan.nodeName" -}}
{{- printf "%s-node" (include "gpu-orphan.fullname" .) }}
{{- end }}

{{/*
A flag whose value is set: (list "name" value) renders a new line
`- "--name=value"` indented for a container's args, and nothing for "".
*/}}
{{- define "gpu-orphan.flag" -}}
{{- $v := index . 1 }}
{{- if ne (toString $v) "" }}
{{- printf "--%s=%v" (index . 0) $v | quote | printf "- %s" | nindent 12 }}
{{- end }}
{{- end }}

{{/* The job the exporter alerts select. */}}
{{- define "gpu-orphan.exporterJob" -}}
{{- default .Values.monitoring.jobs.exporter .Values.prometheusRule.exporterJob }}
{{- end }}

{{/* The jobs the remediator alerts select, as a list in JSON. */}}
{{- define "gpu-orphan.remediatorJobs" -}}
{{- $jobs := .Values.prometheusRule.remediatorJobs }}
{{- if not $jobs }}
{{- $jobs = list .Values.monitoring.jobs.remediator .Values.monitoring.jobs.dispatcher }}
{{- end }}
{{- $jobs | uniq | toJson }}
{{- end }}

{{/*
The relabelings of a monitor's endpoint: the node label from the pod's
node (the alerts, the dashboards and --node.name key on it), and the job
label the alert rules select.
*/}}
{{- define "gpu-orphan.relabelings" -}}
- action: replace
  sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
- action: replace
  targetLabel: job
  replacement: {{ . | quote }}
{{- end }}
