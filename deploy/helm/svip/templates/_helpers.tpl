{{/* Names and labels shared by every object of the chart. */}}

{{- define "svip.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "svip.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "svip.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "svip.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "svip.serveService" -}}
{{ include "svip.fullname" . }}-serve
{{- end -}}

{{- define "svip.modelName" -}}
{{ .Values.model.name | default .Values.model.target }}
{{- end -}}

{{/* The Serve config (serveConfigV2): the app of deploy/serve-config.yaml, placed on GPUs. */}}
{{- define "svip.serveConfig" -}}
{{- $v := .Values -}}
{{- $args := dict
  "target" $v.model.target
  "draft" $v.model.draft
  "model_name" (include "svip.modelName" .)
  "dtype" $v.model.dtype
  "device" "cuda"
  "target_gpus" (int $v.model.targetGpus)
  "draft_gpus" (int $v.model.draftGpus)
  "worker_cpus" $v.serve.workerCpus
  "pipeline" $v.decoding.pipeline
  "num_replicas" (int $v.serve.replicas)
  "max_in_flight" (int $v.serve.maxInFlight)
  "max_waiting" (int $v.serve.maxWaiting)
  "max_queued_requests" (int $v.serve.maxQueuedRequests)
  "policy" $v.decoding.policy
  "threshold" $v.decoding.threshold
-}}
{{- $app := dict "name" "svip" "route_prefix" "/" "import_path" "svip_serve.app:build_app" "args" $args -}}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" (int $v.service.port)) "applications" (list $app) -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Environment of every Ray container: the hub token, when a Secret is named. */}}
{{- define "svip.env" -}}
{{- if .Values.hfToken.secretName -}}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.secretName }}
      key: {{ .Values.hfToken.secretKey }}
{{- end }}
{{- end -}}

{{- define "svip.podAnnotations" -}}
{{- if .Values.metrics.scrapeAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
{{- end }}
{{- end -}}

{{/* Fail early, with the reason, on values no cluster could run. */}}
{{- define "svip.checks" -}}
{{- $perPipeline := add (int .Values.model.targetGpus) (ternary 0 (int .Values.model.draftGpus) (eq .Values.model.draft "none")) -}}
{{- if lt (int .Values.workers.gpusPerWorker) (int $perPipeline) -}}
{{- fail (printf "workers.gpusPerWorker (%d) cannot hold one pipeline: model.targetGpus + model.draftGpus = %d GPUs, packed on one node" (int .Values.workers.gpusPerWorker) (int $perPipeline)) -}}
{{- end -}}
{{- $capacity := mul (int .Values.workers.maxReplicas) (div (int .Values.workers.gpusPerWorker) (int $perPipeline)) -}}
{{- if gt (int .Values.serve.replicas) (int $capacity) -}}
{{- fail (printf "serve.replicas (%d) pipelines need more GPU workers: at most %d workers x %d pipelines each fit" (int .Values.serve.replicas) (int .Values.workers.maxReplicas) (div (int .Values.workers.gpusPerWorker) (int $perPipeline))) -}}
{{- end -}}
{{- if gt (int .Values.workers.minReplicas) (int .Values.workers.maxReplicas) -}}
{{- fail "workers.minReplicas must be <= workers.maxReplicas" -}}
{{- end -}}
{{- end -}}
