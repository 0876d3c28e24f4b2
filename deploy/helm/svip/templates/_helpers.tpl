{{/* Names and labels shared by every object of the chart. */}}

{{- define "svip.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The labels of the chart's own objects; versions change with every chart release. */}}
{{- define "svip.labels" -}}
{{ include "svip.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The labels of the Ray pod templates: no versions, so a chart release that changes nothing
     in the pods does not make KubeRay roll out a new cluster. */}}
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

{{/* The id clients pass as `model`: never a filesystem path (a target in the image is known by
     its last component). */}}
{{- define "svip.modelName" -}}
{{- $target := .Values.model.target -}}
{{ .Values.model.name | default (ternary (base $target) $target (hasPrefix "/" $target)) }}
{{- end -}}

{{- define "svip.modelCacheClaim" -}}
{{ .Values.modelCache.existingClaim | default (printf "%s-model-cache" (include "svip.fullname" .)) }}
{{- end -}}

{{/* A model reference pinned to a hub revision, owner/name@revision (every hub fetch takes it);
     as it is without one. Called with (list reference revision). */}}
{{- define "svip.pinned" -}}
{{- $ref := index . 0 -}}{{- $revision := index . 1 -}}
{{- if $revision -}}{{ printf "%s@%s" $ref $revision }}{{- else -}}{{ $ref }}{{- end -}}
{{- end -}}

{{/* The Serve config (serveConfigV2): the app of deploy/serve-config.yaml, placed on GPUs. */}}
{{- define "svip.serveConfig" -}}
{{- $v := .Values -}}
{{- $args := dict
  "target" (include "svip.pinned" (list $v.model.target $v.model.revision))
  "draft" (ternary $v.model.draft (include "svip.pinned" (list $v.model.draft $v.model.draftRevision)) (eq $v.model.draft "none"))
  "draft_kind" $v.model.draftKind
  "model_name" (include "svip.modelName" .)
  "dtype" $v.model.dtype
  "device" "cuda"
  "target_gpus" (int $v.model.targetGpus)
  "target_tp" (int $v.model.tensorParallel)
  "draft_tp" (int $v.model.draftTensorParallel)
  "draft_gpus" (int $v.model.draftGpus)
  "worker_cpus" $v.serve.workerCpus
  "worker_start_timeout_s" $v.serve.workerStartTimeoutS
  "worker_restarts" (int $v.serve.workerRestarts)
  "draft_stall_s" $v.serve.draftStallS
  "sampled_hold_s" $v.serve.sampledHoldS
  "pipeline" $v.decoding.pipeline
  "num_replicas" (int $v.serve.replicas)
  "max_in_flight" (int $v.serve.maxInFlight)
  "max_waiting" (int $v.serve.maxWaiting)
  "max_queued_requests" (int $v.serve.maxQueuedRequests)
  "kv_cache_tokens" (int $v.serve.kvCacheTokens)
  "max_batched_tokens" (int $v.serve.maxBatchedTokens)
  "load_aware" $v.decoding.loadAware
  "idle_prefill" $v.decoding.idlePrefill
  "draft_parallel" (int $v.decoding.draftParallel)
  "draft_length_cap" (int $v.decoding.draftLengthCap)
  "policy" $v.decoding.policy
  "threshold" $v.decoding.threshold
  "tree" $v.decoding.tree
  "tool_call_parser" $v.decoding.toolCallParser
  "auto_learn" $v.decoding.auto.learn
  "auto_window" (int $v.decoding.auto.window)
  "max_wait_s" $v.serve.maxWaitS
  "max_requests_per_key" (int $v.serve.maxRequestsPerKey)
  "max_kv_tokens_per_key" (int $v.serve.maxKvTokensPerKey)
  "max_tokens_cap" (int $v.serve.maxTokensCap)
  "default_max_tokens" (int $v.serve.defaultMaxTokens)
  "drain_timeout_s" $v.serve.drainTimeoutS
  "allow_ignore_eos" $v.serve.allowIgnoreEos
  "health_check_period_s" $v.serve.healthCheckPeriodS
  "max_request_bytes" (int $v.serve.maxRequestBytes)
  "body_read_timeout_s" $v.serve.bodyReadTimeoutS
  "max_grammar_compile_ms" (int $v.serve.maxGrammarCompileMs)
-}}
{{- if $v.grpcTls.secretName -}}
{{- $_ := set $args "grpc_tls_dir" "/etc/svip/grpc-tls" -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.decoding.auto.cost) -}}
{{- $_ := set $args "auto_cost" $v.decoding.auto.cost -}}
{{- end -}}
{{- if $v.serve.autoscaling.enabled -}}
{{- $_ := set $args "autoscaling" (dict "min_replicas" (int $v.serve.autoscaling.minReplicas) "max_replicas" (int $v.serve.autoscaling.maxReplicas) "target_ongoing_requests" $v.serve.autoscaling.targetOngoingRequests) -}}
{{- end -}}
{{- $app := dict "name" "svip" "route_prefix" "/" "import_path" "svip_serve.app:build_app" "args" $args -}}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" (int $v.service.port)) "applications" (list $app) -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Environment of the Ray containers: the operator's variables of every pod; on the GPU workers
     only (`secrets`), the hub token and the API keys from their Secrets, the weights cache and
     workers.env (the head runs Ray's Jobs API: nothing secret, no model cache there). Called
     with (dict "root" . "secrets" bool). */}}
{{- define "svip.env" -}}
{{- $secrets := .secrets -}}
{{- with .root -}}
{{- if and $secrets .Values.hfToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.secretName }}
      key: {{ .Values.hfToken.secretKey }}
{{- end }}
{{- if and $secrets .Values.apiKey.secretName }}
- name: SVIP_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- if and $secrets .Values.modelCache.enabled }}
- name: HF_HOME
  value: {{ .Values.modelCache.mountPath | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- if $secrets }}
{{- with .Values.workers.env }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Container settings every Ray container shares; (dict "root" . "secrets" bool) as svip.env. */}}
{{- define "svip.container" -}}
{{- $secrets := .secrets -}}
{{- with .root -}}
image: {{ include "svip.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- with include "svip.env" (dict "root" . "secrets" $secrets) | trim }}
env:
  {{- . | nindent 2 }}
{{- end }}
{{- $envFrom := concat .Values.envFrom (ternary .Values.workers.envFrom (list) $secrets) }}
{{- with $envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.containerSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The containers' volume mounts: the model cache on the GPU workers alone. Called with
     (dict "root" . "workers" bool). */}}
{{- define "svip.volumeMounts" -}}
{{- $workers := .workers -}}
{{- with .root -}}
{{- if and $workers .Values.modelCache.enabled }}
- {name: model-cache, mountPath: {{ .Values.modelCache.mountPath | quote }}}
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The pods' volumes: the model cache on the GPU workers alone; (dict "root" . "workers" bool). */}}
{{- define "svip.volumes" -}}
{{- $workers := .workers -}}
{{- with .root -}}
{{- if and $workers .Values.modelCache.enabled }}
- name: model-cache
  persistentVolumeClaim: {claimName: {{ include "svip.modelCacheClaim" . }}}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Pod settings every Ray pod shares. */}}
{{- define "svip.podSpec" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{- define "svip.podAnnotations" -}}
{{- if .Values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
{{- end }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Fail early, with the reason, on values no cluster could run. */}}
{{- define "svip.checks" -}}
{{- if and (eq .Values.model.draftKind "eagle") (eq .Values.model.draft "none") -}}
{{- fail "model.draftKind eagle needs model.draft: a feature head's hub id or path (or draftKind model with draft none for the target alone)" -}}
{{- end -}}
{{- if and (gt (int .Values.model.tensorParallel) 1) (gt (int .Values.model.targetGpus) 1) -}}
{{- fail "model.tensorParallel takes one GPU a rank: leave model.targetGpus at 1" -}}
{{- end -}}
{{- if and (gt (int .Values.model.draftTensorParallel) 1) (gt (int .Values.model.draftGpus) 1) -}}
{{- fail "model.draftTensorParallel takes one GPU a rank: leave model.draftGpus at 1" -}}
{{- end -}}
{{- if and (gt (int .Values.model.draftTensorParallel) 1) (or (eq .Values.model.draft "none") (eq .Values.model.draftKind "eagle")) -}}
{{- fail "model.draftTensorParallel needs a draft model: a feature head runs on one device, and draft none has none" -}}
{{- end -}}
{{- $targetGpus := ternary (int .Values.model.tensorParallel) (int .Values.model.targetGpus) (gt (int .Values.model.tensorParallel) 1) -}}
{{- $draftGpus := ternary (int .Values.model.draftTensorParallel) (int .Values.model.draftGpus) (gt (int .Values.model.draftTensorParallel) 1) -}}
{{- $perPipeline := add $targetGpus (ternary 0 $draftGpus (eq .Values.model.draft "none")) -}}
{{- if lt (int .Values.workers.gpusPerWorker) (int $perPipeline) -}}
{{- fail (printf "workers.gpusPerWorker (%d) cannot hold one pipeline: the target's %d GPUs (model.targetGpus, or a GPU each of model.tensorParallel ranks) + the draft's (model.draftGpus, or a GPU each of model.draftTensorParallel ranks) = %d GPUs, packed on one node" (int .Values.workers.gpusPerWorker) $targetGpus (int $perPipeline)) -}}
{{- end -}}
{{- $pipelines := ternary (int .Values.serve.autoscaling.maxReplicas) (int .Values.serve.replicas) .Values.serve.autoscaling.enabled -}}
{{- $capacity := mul (int .Values.workers.maxReplicas) (div (int .Values.workers.gpusPerWorker) (int $perPipeline)) -}}
{{- if gt (int $pipelines) (int $capacity) -}}
{{- fail (printf "%d pipelines (serve.replicas, or serve.autoscaling.maxReplicas) need more GPU workers: at most %d workers x %d pipelines each fit" (int $pipelines) (int .Values.workers.maxReplicas) (div (int .Values.workers.gpusPerWorker) (int $perPipeline))) -}}
{{- end -}}
{{- if gt (int .Values.workers.minReplicas) (int .Values.workers.maxReplicas) -}}
{{- fail "workers.minReplicas must be <= workers.maxReplicas" -}}
{{- end -}}
{{- if and .Values.serve.autoscaling.enabled (gt (int .Values.serve.autoscaling.minReplicas) (int .Values.serve.autoscaling.maxReplicas)) -}}
{{- fail "serve.autoscaling.minReplicas must be <= serve.autoscaling.maxReplicas" -}}
{{- end -}}
{{- if and .Values.podDisruptionBudget.enabled (ge (int .Values.podDisruptionBudget.minAvailable) (int .Values.workers.minReplicas)) -}}
{{- fail (printf "podDisruptionBudget.minAvailable (%d) >= workers.minReplicas (%d) would block every node drain: lower it, or leave the budget off" (int .Values.podDisruptionBudget.minAvailable) (int .Values.workers.minReplicas)) -}}
{{- end -}}
{{- if and .Values.ingress.enabled (not .Values.apiKey.secretName) (not .Values.apiKey.allowOpen) -}}
{{- fail "ingress.enabled without apiKey.secretName would publish an open API: set apiKey.secretName (a Secret of keys), or apiKey.allowOpen: true to publish it open on purpose" -}}
{{- end -}}
{{- if and (has .Values.service.type (list "LoadBalancer" "NodePort")) (not .Values.apiKey.secretName) (not .Values.apiKey.allowOpen) -}}
{{- fail (printf "service.type %s without apiKey.secretName would publish an open API outside the cluster: set apiKey.secretName (a Secret of keys), or apiKey.allowOpen: true to publish it open on purpose" .Values.service.type) -}}
{{- end -}}
{{- if and .Values.head.faultTolerance.enabled (not .Values.head.faultTolerance.redisAddress) -}}
{{- fail "head.faultTolerance.enabled needs head.faultTolerance.redisAddress (an external Redis)" -}}
{{- end -}}
{{- if and (eq .Values.upgradeStrategy.type "NewClusterWithIncrementalUpgrade") (not .Values.upgradeStrategy.clusterUpgradeOptions.gatewayClassName) -}}
{{- fail "upgradeStrategy NewClusterWithIncrementalUpgrade needs clusterUpgradeOptions (gatewayClassName, stepSizePercent, intervalSeconds)" -}}
{{- end -}}
{{- end -}}
