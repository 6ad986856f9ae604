{{/* Names and labels. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Every Ray pod of this release carries these (head and workers); `role` tells them apart. */}}
{{- define "pdserve.raySelector" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
pdserve.io/component: ray
{{- end -}}

{{- define "pdserve.redisHost" -}}
{{ include "pdserve.fullname" . }}-redis
{{- end -}}

{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "pdserve.redisHost" . }}:6379/0
{{- else -}}
{{ .Values.redis.externalUrl }}
{{- end -}}
{{- end -}}

{{/* The Secret and key of the Redis password, or nothing when Redis has none. */}}
{{- define "pdserve.redisSecret" -}}
{{- if .Values.redis.existingSecret -}}
{{ .Values.redis.existingSecret }}
{{- else if or .Values.redis.password .Values.redis.enabled -}}
{{ include "pdserve.fullname" . }}-redis
{{- end -}}
{{- end -}}

{{- define "pdserve.authSecret" -}}
{{- if .Values.auth.existingSecret -}}
{{ .Values.auth.existingSecret }}
{{- else -}}
{{ include "pdserve.fullname" . }}-auth
{{- end -}}
{{- end -}}

{{/* The model path as the replicas see it. */}}
{{- define "pdserve.modelPath" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "image" -}}{{ $m.path }}
{{- else if or (eq $m.source "pvc") (eq $m.source "download") -}}/models/{{ $m.path }}
{{- end -}}
{{- end -}}

{{/* One pool's ServeConfig fields (PoolConfig in services/config.py). */}}
{{- define "pdserve.poolArgs" -}}
{{- $p := .pool -}}
replicas: {{ $p.replicas }}
resource: {{ $p.rayResource }}
num_gpus: {{ if gt (float64 $p.gpus) 0.0 }}{{ divf $p.gpus $p.replicasPerPod }}{{ else }}0{{ end }}
threads: {{ $p.threads }}
num_kv_blocks: {{ $p.numKvBlocks }}
max_num_seqs: {{ $p.maxNumSeqs }}
max_num_batched_tokens: {{ $p.maxNumBatchedTokens }}
max_queued_requests: {{ $p.maxQueuedRequests }}
{{- with $p.autoscaling }}
{{- if .enabled }}
autoscaling:
  target_s: {{ .targetS }}
  percentile: {{ .percentile }}
  min_replicas: {{ .minReplicas }}
  max_replicas: {{ .maxReplicas }}
  up_cooldown_s: {{ .upCooldownS }}
  down_cooldown_s: {{ .downCooldownS }}
  up_delay_s: {{ .upDelayS }}
  down_delay_s: {{ .downDelayS }}
  idle_s: {{ .idleS }}
  {{- if hasKey . "queuedTokensPerReplica" }}
  queued_tokens_per_replica: {{ .queuedTokensPerReplica }}
  {{- end }}
  {{- if hasKey . "kvUsageHigh" }}
  kv_usage_high: {{ .kvUsageHigh }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The application's args: ServeConfig fields, read by services.app:app_from_env.
     Secrets are not here: the token and the Redis password reach the pods as env vars. */}}
{{- define "pdserve.serveArgs" -}}
{{- $v := .Values -}}
{{- $s := $v.serve -}}
{{- $gpu := or (gt (float64 $v.prefill.gpus) 0.0) (gt (float64 $v.decode.gpus) 0.0) -}}
mode: {{ $s.mode }}
{{- with include "pdserve.modelPath" . }}
model: {{ . | quote }}
{{- end }}
conditional_threshold: {{ $s.conditionalThreshold }}
block_size: {{ $s.blockSize }}
{{- with $s.maxModelLen }}
max_model_len: {{ . }}
{{- end }}
{{- with $s.servedModelName }}
served_model_name: {{ . | quote }}
{{- end }}
dtype: {{ $s.dtype }}
quantization: {{ $s.quantization }}
batch_invariant: {{ $s.batchInvariant }}
kv_cache_dtype: {{ $s.kvCacheDtype }}
device: {{ if $gpu }}cuda{{ else }}cpu{{ end }}
speculative_tokens: {{ $s.speculativeTokens }}
attention_backend: {{ $s.attentionBackend }}
cuda_graphs: {{ $s.cudaGraphs }}
gpu_memory_utilization: {{ $s.gpuMemoryUtilization }}
http_host: 0.0.0.0
http_port: {{ $v.ports.http }}
grpc_port: {{ $v.ports.grpc }}
{{- if $v.grpcTls.enabled }}
grpc_tls_cert: /etc/pdserve/tls/tls.crt
grpc_tls_key: /etc/pdserve/tls/tls.key
{{- end }}
{{- if $v.kvTls.enabled }}
kv_tls_cert: /etc/pdserve/kv-tls/tls.crt
kv_tls_key: /etc/pdserve/kv-tls/tls.key
kv_tls_ca: /etc/pdserve/kv-tls/ca.crt
kv_tls_server_name: {{ $v.kvTls.serverName | quote }}
{{- end }}
max_inflight_requests: {{ $s.maxInflightRequests }}
retry_after_s: {{ $s.retryAfterS }}
kv_transport: {{ $s.kvTransport }}
kv_port: {{ $s.kvPort }}
kv_streaming: {{ $s.kvStreaming }}
kv_timeout_s: {{ $s.kvTimeoutS }}
kv_hold_timeout_s: {{ $s.kvHoldTimeoutS }}
kv_host_buffer_mb: {{ $s.kvHostBufferMb }}
kv_pull_budget_mb: {{ $s.kvPullBudgetMb }}
kv_stream_buffer_mb: {{ $s.kvStreamBufferMb }}
kv_stream_stall_s: {{ $s.kvStreamStallS }}
kv_join_wait_ms: {{ $s.kvJoinWaitMs }}
request_timeout_s: {{ $s.requestTimeoutS }}
resume_timeout_s: {{ $s.resumeTimeoutS }}
shutdown_grace_s: {{ $s.shutdownGraceS }}
max_request_bytes: {{ $s.maxRequestBytes | int }}
serve_data_plane: {{ $s.serveDataPlane }}
routing: {{ $s.routing }}
{{- if eq $s.routing "prefix_aware" }}
redis_url: {{ include "pdserve.redisUrl" . | quote }}
{{- end }}
gateway_resource: gateway_pool
{{- if eq $s.mode "disaggregated" }}
prefill:
{{ include "pdserve.poolArgs" (dict "pool" $v.prefill) | indent 2 }}
{{- end }}
decode:
{{ include "pdserve.poolArgs" (dict "pool" $v.decode) | indent 2 }}
{{- end -}}

{{/* Environment shared by every Ray pod. */}}
{{- define "pdserve.env" -}}
- name: OMP_NUM_THREADS
  value: "1"
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: {{ if eq .Values.serve.serveDataPlane "grpc" }}"1"{{ else }}"0"{{ end }}
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: HOME
  value: /tmp
- name: PDSERVE_CACHE_DIR
  value: /cache
{{- with include "pdserve.redisSecret" . }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.existingSecretKey }}
{{- end }}
{{- end -}}

{{/* The head's environment: the shared one, and the API token. NOTE: only the head needs the
     token (the Serve app is built there and only the gateway checks it; engine replicas get a
     config without it), so worker pods never see it. */}}
{{- define "pdserve.headEnv" -}}
{{ include "pdserve.env" . }}
{{- with .Values.auth.apiKeysSecret }}
- name: PDSERVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: api_keys
{{- end }}
{{- if .Values.auth.enabled }}
- name: PDSERVE_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.authSecret" . }}
      key: {{ .Values.auth.existingSecretKey }}
{{- end }}
{{- end -}}

{{/* Writable scratch (the root filesystem is read-only) and the model's volume. */}}
{{- define "pdserve.volumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
{{- if .Values.model.cache.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.cache.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.cache.sizeLimit }}
{{- end }}
- name: shm
  emptyDir: {medium: Memory}
{{- if eq .Values.model.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "download" }}
- name: models
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit }}
{{- end }}
{{- if .Values.grpcTls.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ .Values.grpcTls.secretName }}
{{- end }}
{{- if .Values.kvTls.enabled }}
- name: kv-tls
  secret:
    secretName: {{ required "kvTls.secretName" .Values.kvTls.secretName }}
{{- end }}
{{- end -}}

{{- define "pdserve.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: cache, mountPath: /cache}
- {name: shm, mountPath: /dev/shm}
{{- if or (eq .Values.model.source "pvc") (eq .Values.model.source "download") }}
- {name: models, mountPath: /models, readOnly: {{ eq .Values.model.source "pvc" }}}
{{- end }}
{{- if .Values.grpcTls.enabled }}
- {name: grpc-tls, mountPath: /etc/pdserve/tls, readOnly: true}
{{- end }}
{{- if .Values.kvTls.enabled }}
- {name: kv-tls, mountPath: /etc/pdserve/kv-tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* The init container that downloads the model (model.source: download). */}}
{{- define "pdserve.initContainers" -}}
{{- if eq .Values.model.source "download" }}
initContainers:
  - name: fetch-model
    image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: [python, -c]
    args:
      - |
        import os, sys, urllib.request
        dst = os.path.join("/models", sys.argv[2])
        if not os.path.exists(dst):
            urllib.request.urlretrieve(sys.argv[1], dst + ".part")
            os.replace(dst + ".part", dst)
      - {{ .Values.model.download.url | quote }}
      - {{ .Values.model.path | quote }}
    securityContext: {{- toYaml .Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: /models}
      - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end -}}

{{/* Ray's fixed ports, so the NetworkPolicy can name them (values rayPorts). */}}
{{- define "pdserve.rayPortParams" -}}
{{- $r := .Values.rayPorts -}}
node-manager-port: {{ $r.nodeManager | quote }}
object-manager-port: {{ $r.objectManager | quote }}
runtime-env-agent-port: {{ $r.runtimeEnvAgent | quote }}
dashboard-agent-listen-port: {{ $r.dashboardAgent | quote }}
dashboard-agent-grpc-port: {{ $r.dashboardAgentGrpc | quote }}
metrics-export-port: {{ .Values.ports.metrics | quote }}
min-worker-port: {{ $r.minWorker | quote }}
max-worker-port: {{ $r.maxWorker | quote }}
{{- end -}}
