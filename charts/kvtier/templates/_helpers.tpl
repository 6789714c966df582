{{- define "kvtier.name" -}}kvtier{{- end -}}

{{/*
53 characters, so that with the longest suffix a name of at most 63 takes ("-uninstall", a
Job's) every name fits: a release name of up to 53, what Helm allows.
*/}}
{{- define "kvtier.fullname" -}}
{{- printf "%s-%s" .Release.Name "kvtier" | trunc 53 | trimSuffix "-" -}}
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

{{/*
The webhook's self-made certificate kept in the cluster, if any: a Secret of this chart's
that holds its CA (`ca.crt`), which an upgrade reuses rather than make a new CA the running
operator does not serve. Empty where there is none, or no cluster to ask (`helm template`).
*/}}
{{- define "kvtier.keptCert" -}}
{{- $kept := lookup "v1" "Secret" .Release.Namespace (include "kvtier.certSecret" .) -}}
{{- if and $kept $kept.data (hasKey $kept.data "ca.crt") (hasKey $kept.data "tls.crt") -}}
{{- toJson $kept.data -}}
{{- end -}}
{{- end -}}
