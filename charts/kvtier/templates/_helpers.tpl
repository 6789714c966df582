{{- define "kvtier.name" -}}kvtier{{- end -}}

{{- define "kvtier.fullname" -}}
{{- printf "%s-%s" .Release.Name "kvtier" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvtier.labels" -}}
app.kubernetes.io/name: kvtier-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: kvtier-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvtier.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "kvtier.fullname" .) .Values.serviceAccount.name }}{{- else -}}{{ required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{- define "kvtier.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}

{{- define "kvtier.webhookService" -}}{{ include "kvtier.fullname" . }}-webhook{{- end -}}
{{- define "kvtier.certSecret" -}}{{ include "kvtier.fullname" . }}-webhook-tls{{- end -}}
