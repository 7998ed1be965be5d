{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The RayCluster's name; KubeRay derives pod and service names from it. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "tandem.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "tandem.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tandem.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The --model argument: a builtin name, a hub id or the mounted directory. */}}
{{- define "tandem.modelArg" -}}
{{- $m := .Values.model -}}
{{- if has $m.source (list "pvc" "hostPath") -}}
{{- if $m.name -}}{{ printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.name) }}{{- else -}}{{ $m.mountPath }}{{- end -}}
{{- else -}}
{{- required "model.name is required for model.source builtin or hub" $m.name -}}
{{- end -}}
{{- end -}}

{{/* Cross-field checks the schema cannot say clearly. Renders nothing. */}}
{{- define "tandem.validate" -}}
{{- $p := .Values.pools -}}
{{- if $p.colocated.enabled -}}
{{- if or $p.prefill.enabled $p.decode.enabled -}}
{{- fail "pools.colocated.enabled: a colocated pool replaces prefill and decode; set pools.prefill.enabled and pools.decode.enabled to false" -}}
{{- end -}}
{{- if lt (int $p.colocated.replicas) 1 -}}
{{- fail "pools.colocated.replicas must be >= 1" -}}
{{- end -}}
{{- else -}}
{{- if not $p.decode.enabled -}}
{{- fail "pools.decode.enabled: disaggregated serving needs a decode pool (or enable pools.colocated alone)" -}}
{{- end -}}
{{- if lt (int $p.decode.replicas) 1 -}}
{{- fail "pools.decode.replicas must be >= 1" -}}
{{- end -}}
{{- end -}}
{{- range $role := list "prefill" "decode" "colocated" -}}
{{- $pool := index $p $role -}}
{{- if and $pool.enabled (not $.Values.gpu.enabled) (gt (int $pool.tensorParallelSize) 1) -}}
{{- fail (printf "pools.%s.tensorParallelSize: %v GPUs per engine needs gpu.enabled=true" $role $pool.tensorParallelSize) -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) -}}
{{- fail "model.pvc.claimName is required when model.source is pvc" -}}
{{- end -}}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) -}}
{{- fail "model.hostPath.path is required when model.source is hostPath" -}}
{{- end -}}
{{- range $role := list "prefill" "decode" "colocated" -}}
{{- $pool := index $p $role -}}
{{- if $pool.enabled -}}
{{- $lo := int (include "tandem.minReplicas" $pool) -}}
{{- $hi := int (include "tandem.maxReplicas" $pool) -}}
{{- if or (gt $lo (int $pool.replicas)) (lt $hi (int $pool.replicas)) -}}
{{- fail (printf "pools.%s.minReplicas / maxReplicas: need minReplicas <= replicas (%v) <= maxReplicas" $role $pool.replicas) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.serve.planner.mode "sla") (not .Values.serve.planner.profile) -}}
{{- fail "serve.planner.profile: the sla planner needs a profile (tandem profile writes one)" -}}
{{- end -}}
{{- if and .Values.ingress.enabled (not .Values.ingress.host) -}}
{{- fail "ingress.host is required when ingress.enabled is true" -}}
{{- end -}}
{{- end -}}

{{/* A pool's worker group pod range (null: its replicas). */}}
{{- define "tandem.minReplicas" -}}
{{- if kindIs "invalid" .minReplicas }}{{ .replicas }}{{ else }}{{ .minReplicas }}{{ end -}}
{{- end -}}
{{- define "tandem.maxReplicas" -}}
{{- if kindIs "invalid" .maxReplicas }}{{ .replicas }}{{ else }}{{ .maxReplicas }}{{ end -}}
{{- end -}}

{{/* serve.yaml: the `tandem serve --config` file (snake_case keys). */}}
{{- define "tandem.serveConfig" -}}
{{- $s := .Values.serve -}}
{{- $p := .Values.pools -}}
{{- $cfg := dict
  "model" (include "tandem.modelArg" .)
  "disagg_min_tokens" $s.disaggMinTokens
  "kv_lease_s" $s.kvLeaseS
  "load_failure_policy" $s.loadFailurePolicy
  "max_restarts" $s.maxRestarts
  "max_request_body_mb" $s.maxRequestBodyMb
  "max_num_requests" $s.maxNumRequests
  "request_timeout_s" $s.requestTimeoutS
  "api_server_count" (int $s.apiServerCount)
  "num_gpus_per_engine" 0
-}}
{{- range $k, $v := $s.engine }}{{ $_ := set $cfg $k $v }}{{ end -}}
{{- if ne $s.planner.mode "off" -}}
{{- $_ := set $cfg "planner" $s.planner.mode -}}
{{- $_ := set $cfg "planner_interval_s" $s.planner.intervalS -}}
{{- if hasKey $s.planner "watchIntervalS" }}{{ $_ := set $cfg "planner_watch_interval_s" $s.planner.watchIntervalS }}{{ end -}}
{{- $_ := set $cfg "ttft_slo_ms" $s.planner.ttftSloMs -}}
{{- $_ := set $cfg "itl_slo_ms" $s.planner.itlSloMs -}}
{{- if $s.planner.profile }}{{ $_ := set $cfg "planner_profile" $s.planner.profile }}{{ end -}}
{{- end -}}
{{- range $role := list "prefill" "decode" "colocated" -}}
{{- $pool := index $p $role -}}
{{- if $pool.enabled -}}
{{- $_ := set $cfg $role (mul $pool.replicas $pool.enginesPerPod) -}}
{{- $_ := set $cfg (printf "%s_ray_resources" $role) (dict (printf "tandem_%s" $role) 1) -}}
{{- $_ := set $cfg (printf "%s_num_gpus_per_engine" $role) (ternary (int $pool.tensorParallelSize) 0 $.Values.gpu.enabled) -}}
{{- $perPod := int $pool.enginesPerPod -}}
{{- $_ := set $cfg (printf "%s_min_engines" $role) (max 1 (mul (int (include "tandem.minReplicas" $pool)) $perPod)) -}}
{{- $_ := set $cfg (printf "%s_max_engines" $role) (mul (int (include "tandem.maxReplicas" $pool)) $perPod) -}}
{{- if $pool.engine }}{{ $_ := set $cfg (printf "%s_engine" $role) $pool.engine }}{{ end -}}
{{- else -}}
{{- $_ := set $cfg $role 0 -}}
{{- end -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The gateway command run on the head after Ray starts. */}}
{{- define "tandem.serveCommand" -}}
{{- $args := list "tandem" "serve" "--config" "/etc/tandem/serve.yaml" "--address" "auto" "--host" "0.0.0.0" "--port" (toString .Values.serve.port) -}}
{{- if include "tandem.apiKeySecret" . -}}{{- $args = concat $args (list "--api-key" "\"$TANDEM_API_KEY\"") -}}{{- end -}}
{{- if .Values.serve.logFormat -}}{{- $args = concat $args (list "--log-format" .Values.serve.logFormat) -}}{{- end -}}
{{- if .Values.serve.otlpTracesEndpoint -}}{{- $args = concat $args (list "--otlp-traces-endpoint" (squote .Values.serve.otlpTracesEndpoint)) -}}{{- end -}}
{{- range .Values.serve.extraArgs -}}{{- $args = append $args (squote .) -}}{{- end -}}
{{- join " " $args -}}
{{- end -}}

{{/* Volumes every Ray pod mounts: /dev/shm (UCX, object store), caches, the model. */}}
{{- define "tandem.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: cache
  emptyDir: {}
- name: serve-config
  configMap:
    name: {{ include "tandem.fullname" .root }}-serve
{{- $m := .root.Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: cache
  mountPath: /cache
- name: serve-config
  mountPath: /etc/tandem
  readOnly: true
{{- if has .Values.model.source (list "pvc" "hostPath") }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.env" -}}
- name: TANDEM_CACHE_DIR
  value: /cache/tandem
- name: HF_HOME
  value: /cache/huggingface
{{- if and (eq .Values.model.source "hub") .Values.model.hubTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hubTokenSecret.name }}
      key: {{ .Values.model.hubTokenSecret.key }}
{{- end }}
{{- end -}}
