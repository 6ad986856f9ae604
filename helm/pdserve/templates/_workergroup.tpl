{{/* One worker group of the RayCluster, for either pool. Called with
     (dict "role" "prefill"|"decode" "pool" <values of the pool> "root" $). */}}
{{- define "pdserve.workerGroup" -}}
{{- $root := .root -}}
{{- $p := .pool -}}
{{- $v := $root.Values -}}
- groupName: {{ .role }}
  replicas: {{ $p.replicas }}
  minReplicas: {{ $p.minPods }}
  maxReplicas: {{ $p.maxPods }}
  rayStartParams:
    # the pool's Ray resource: one unit per replica slot (services/app.py places replicas by it)
    resources: {{ printf "\"{\\\"%s\\\": %d}\"" $p.rayResource (int $p.replicasPerPod) | squote }}
    num-cpus: {{ $p.resources.requests.cpu | toString | quote }}
    {{- if gt (float64 $p.gpus) 0.0 }}
    num-gpus: {{ $p.gpus | toString | quote }}
    {{- end }}
    {{- include "pdserve.rayPortParams" $root | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $root | nindent 8 }}
        pdserve.io/component: ray
        pdserve.io/role: {{ .role }}
    spec:
      terminationGracePeriodSeconds: {{ add (int $v.serve.shutdownGraceS) 15 }}
      securityContext: {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with $v.image.pullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . }}
        {{- end }}
      {{- end }}
      {{- with $p.nodeSelector }}
      nodeSelector: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $p.tolerations }}
      tolerations: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $p.affinity }}
      affinity: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "pdserve.initContainers" $root | nindent 6 }}
      containers:
        - name: ray-worker
          image: "{{ $v.image.repository }}:{{ $v.image.tag }}"
          imagePullPolicy: {{ $v.image.pullPolicy }}
          securityContext: {{- toYaml $v.containerSecurityContext | nindent 12 }}
          env: {{- include "pdserve.env" $root | nindent 12 }}
          ports:
            - {name: metrics, containerPort: {{ $v.ports.metrics }}}
            {{- if eq .role "prefill" }}
            - {name: kv, containerPort: {{ $v.serve.kvPort }}}
            {{- end }}
          resources:
            requests:
              {{- toYaml $p.resources.requests | nindent 14 }}
              {{- if gt (float64 $p.gpus) 0.0 }}
              nvidia.com/gpu: {{ $p.gpus }}
              {{- end }}
            limits:
              {{- toYaml $p.resources.limits | nindent 14 }}
              {{- if gt (float64 $p.gpus) 0.0 }}
              nvidia.com/gpu: {{ $p.gpus }}
              {{- end }}
          volumeMounts: {{- include "pdserve.volumeMounts" $root | nindent 12 }}
      volumes: {{- include "pdserve.volumes" $root | nindent 8 }}
{{- end -}}
