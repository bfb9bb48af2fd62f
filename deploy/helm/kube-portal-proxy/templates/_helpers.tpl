{{/* The objects' name: the release name, with the chart's name unless it contains it. */}}
{{- define "kpp.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The pods' selector. Only the name, as in deploy/: a DaemonSet's selector cannot change, and
     a cluster installed with kubectl apply -k deploy/ moves to the chart without a new one. */}}
{{- define "kpp.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
{{- end -}}

{{- define "kpp.labels" -}}
{{ include "kpp.selectorLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ include "kpp.imageTag" . | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kpp.imageTag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "kpp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "kpp.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* The port of an ip:port value. */}}
{{- define "kpp.port" -}}
{{- regexReplaceAll "^.*:([0-9]+)$" . "${1}" -}}
{{- end -}}

{{/* Fails the render when a Prometheus scrape object is asked for while the metrics-only
     address is unset or on loopback: Prometheus would see the target down. (The scrape never
     goes to metricsBindAddress, which serves the debug pages and pprof too.) */}}
{{- define "kpp.checkMetricsAddress" -}}
{{- $addr := .Values.proxy.metricsOnlyBindAddress -}}
{{- if or (eq $addr "") (hasPrefix "127." $addr) (hasPrefix "[::1]" $addr) -}}
{{- fail (printf "monitoring.serviceMonitor.enabled needs proxy.metricsOnlyBindAddress reachable by Prometheus (e.g. 0.0.0.0:10251), which serves /metrics alone; it is %q (loopback or disabled)" $addr) -}}
{{- end -}}
{{- end -}}
