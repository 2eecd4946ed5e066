{{/* Full name of the release's objects, at most 63 characters. */}}
{{- define "dpserve-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator pod (immutable once installed). */}}
{{- define "dpserve-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object of the chart. */}}
{{- define "dpserve-operator.labels" -}}
{{ include "dpserve-operator.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "dpserve-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dpserve-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "dpserve-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespace served when not cluster-wide. */}}
{{- define "dpserve-operator.watchNamespace" -}}
{{- default .Release.Namespace .Values.watch.namespace -}}
{{- end -}}
