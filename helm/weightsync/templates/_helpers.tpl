{{/* Full name of the release's objects. */}}
{{- define "weightsync.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Common labels. */}}
{{- define "weightsync.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of the operator pod. */}}
{{- define "weightsync.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's ServiceAccount. */}}
{{- define "weightsync.serviceAccountName" -}}
{{- default (include "weightsync.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The ClusterRole bound to each RLJob's coordinator ServiceAccount. */}}
{{- define "weightsync.coordinatorRole" -}}
{{- printf "%s-coordinator" (include "weightsync.fullname" .) -}}
{{- end -}}

{{/* The Lease the operators elect their leader on (in the release namespace). */}}
{{- define "weightsync.leaderLease" -}}
{{- printf "%s-leader" (include "weightsync.fullname" .) -}}
{{- end -}}
