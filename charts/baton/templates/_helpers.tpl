{{/*
Helpers. Role-parameterised helpers take a dict: (dict "root" $ "role" "prefill").
The roles, in the order every template renders them: router, prefill, decode.
*/}}

{{- define "baton.roles" -}}
router prefill decode
{{- end }}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else if contains "baton" .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-baton" .Release.Name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. app.kubernetes.io/name is always "baton": discovery relies on it. */}}
{{- define "baton.labels" -}}
helm.sh/chart: {{ include "baton.chart" . }}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: baton
{{- end }}

{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: baton
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* <fullname>-<role>: Deployment, Service, PDB and HPA names of a role. */}}
{{- define "baton.roleFullname" -}}
{{- printf "%s-%s" (include "baton.fullname" .root) .role }}
{{- end }}

{{- define "baton.roleSelectorLabels" -}}
{{ include "baton.selectorLabels" .root }}
baton.io/role: {{ .role }}
{{- end }}

{{- define "baton.roleLabels" -}}
{{ include "baton.labels" .root }}
baton.io/role: {{ .role }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{/* "3", or "2-8 (autoscaled)": how many pods a role runs. */}}
{{- define "baton.replicaSummary" -}}
{{- $v := index .root.Values .role }}
{{- if $v.autoscaling.enabled }}
{{- printf "%d-%d (autoscaled)" (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas) }}
{{- else }}
{{- int $v.replicas }}
{{- end }}
{{- end }}

{{- define "baton.image" -}}
{{- $v := index .root.Values .role }}
{{- $repo := $v.image.repository | default .root.Values.image.repository }}
{{- $tag := $v.image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- $digest := $v.image.digest | default .root.Values.image.digest }}
{{- if $digest }}
{{- printf "%s@%s" $repo $digest }}
{{- else }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}
{{- end }}

{{- define "baton.imagePullPolicy" -}}
{{- $v := index .root.Values .role }}
{{- $v.image.pullPolicy | default .root.Values.image.pullPolicy }}
{{- end }}

{{/* The role's resources with the GPU count derived from `gpus`: it is never written twice. */}}
{{- define "baton.resources" -}}
{{- $v := index .root.Values .role }}
{{- $resources := deepCopy ($v.resources | default dict) }}
{{- if gt (int $v.gpus) 0 }}
{{- $limits := $resources.limits | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" (mul (int $v.gpus) (int ($v.tensorParallelSize | default 1))) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.name | default (printf "%s-router" (include "baton.fullname" .)) }}
{{- else }}
{{- .Values.serviceAccount.name | default "default" }}
{{- end }}
{{- end }}

{{- define "baton.redisName" -}}
{{- printf "%s-redis" (include "baton.fullname" .) }}
{{- end }}

{{/* "redis" when router replicas share an index (Redis in the chart, or an external one). */}}
{{- define "baton.prefixIndex" -}}
{{- if or .Values.redis.enabled .Values.redis.externalUrl .Values.redis.externalUrlSecret.name -}}
redis
{{- else -}}
memory
{{- end }}
{{- end }}

{{/* The Redis URL written into the config file (a URL from a Secret comes in through env). */}}
{{- define "baton.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:%d/0" (include "baton.redisName" .) (int .Values.redis.port) }}
{{- else -}}
{{- .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* The config's model.name: what the image holds, or the mounted directory. */}}
{{- define "baton.modelName" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "image" }}
{{- $m.name }}
{{- else if $m.subPath }}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.subPath) }}
{{- else }}
{{- $m.mountPath }}
{{- end }}
{{- end }}

{{/* The `model` OpenAI clients send (router.served_model_name, as baton/router/openai_api/protocol.py names it). */}}
{{- define "baton.servedModelName" -}}
{{- $name := include "baton.modelName" . }}
{{- .Values.router.config.served_model_name | default (ternary "SmolLM2-135M-Instruct" $name (eq $name "default")) }}
{{- end }}

{{/*
The one configuration file, in baton/config.py's schema: the role blocks' `config` keys
plus the keys the chart derives. Derived keys win, and the values schema refuses them in
`config` so that each key has one place.
*/}}
{{- define "baton.config" -}}
{{- $v := .Values }}
{{- $model := merge (dict "name" (include "baton.modelName" .)) (deepCopy $v.model.config) }}
{{- $router := merge (dict
    "port" (int $v.router.service.port)
    "http_port" (int $v.router.service.httpPort)
    "metrics_port" (int $v.router.service.metricsPort)
    "discovery" "kubernetes"
    "namespace" .Release.Namespace
    "discovery_labels" (printf "app.kubernetes.io/instance=%s" .Release.Name)
    "prefill_workers" (list)
    "decode_workers" (list)
    "prefix_index" (include "baton.prefixIndex" .)
    "redis_url" (include "baton.redisUrl" .)) (deepCopy $v.router.config) }}
{{- /* The prefill worker pushes KV only to decode workers its own discovery sees. */}}
{{- $prefill := merge (dict
    "port" (int $v.prefill.service.port)
    "metrics_port" (int $v.prefill.service.metricsPort)
    "discovery" "kubernetes"
    "namespace" .Release.Namespace
    "discovery_labels" (printf "app.kubernetes.io/instance=%s" .Release.Name)
    "decode_workers" (list)) (deepCopy $v.prefill.config) }}
{{- $decode := merge (dict
    "port" (int $v.decode.service.port)
    "metrics_port" (int $v.decode.service.metricsPort)) (deepCopy $v.decode.config) }}
{{- $tls := dict "cert_file" "" "key_file" "" "ca_file" "" "server_name" "" }}
{{- if $v.tls.enabled }}
{{- $dir := trimSuffix "/" $v.tls.mountPath }}
{{- $tls = dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) "ca_file" (ternary (printf "%s/ca.crt" $dir) "" $v.tls.hasCA) }}
{{- /* Workers are discovered, and dialled, by pod IP: check their certificates for a name instead. */}}
{{- $_ := set $tls "server_name" ($v.tls.serverName | default $v.tls.probeServerName) }}
{{- end }}
{{- $tracing := dict "otlp_endpoint" $v.tracing.otlpEndpoint "sample_ratio" $v.tracing.sampleRatio "service_name" "" }}
{{- toYaml (dict "model" $model "router" $router "prefill" $prefill "decode" $decode "tls" $tls "tracing" $tracing) }}
{{- end }}

{{/* Settings that cannot be expressed in values.schema.json; each failure says what to change. */}}
{{/*
The Secret holding the cluster token: the one named in values, or the one the chart creates.
*/}}
{{- define "baton.clusterTokenSecret" -}}
{{- .Values.clusterAuth.tokenSecret.name | default (printf "%s-cluster-token" (include "baton.fullname" .)) }}
{{- end }}

{{/*
The Secret holding the public API's bearer token (empty when auth.open), and the one holding the
chart's Redis password.
*/}}
{{- define "baton.apiTokenSecret" -}}
{{- if not .Values.auth.open }}
{{- .Values.auth.tokenSecret.name | default (printf "%s-api-token" (include "baton.fullname" .)) }}
{{- end }}
{{- end }}

{{- define "baton.redisPasswordSecret" -}}
{{- .Values.redis.passwordSecret.name | default (printf "%s-redis-password" (include "baton.fullname" .)) }}
{{- end }}

{{/*
A Secret holding one random value under `key`, made at install and kept as it is afterwards.
Takes (dict "root" $ "name" NAME "key" KEY).
*/}}
{{- define "baton.randomSecret" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "baton.labels" .root | nindent 4 }}
  annotations:
    helm.sh/resource-policy: keep
type: Opaque
data:
  {{- if and $existing (index $existing.data .key) }}
  {{ .key }}: {{ index $existing.data .key }}
  {{- else }}
  {{ .key }}: {{ randAlphaNum 48 | b64enc }}
  {{- end }}
{{- end }}

{{/*
Seconds a role drains on SIGTERM: its config's drain_timeout_s (20 unless set).
*/}}
{{- define "baton.drainSeconds" -}}
{{- (index .root.Values .role).config.drain_timeout_s | default 20 }}
{{- end }}

{{- define "baton.validate" -}}
{{- $v := .Values }}
{{- if and $v.redis.enabled (or $v.redis.externalUrl $v.redis.externalUrlSecret.name) }}
{{- fail "redis.enabled=true runs Redis in the chart; set redis.enabled=false to use redis.externalUrl or redis.externalUrlSecret" }}
{{- end }}
{{- if and $v.auth.open $v.auth.tokenSecret.name }}
{{- fail "auth.open serves the public API without a token, yet auth.tokenSecret.name names one: set only one" }}
{{- end }}
{{- if and $v.redis.externalUrl $v.redis.externalUrlSecret.name }}
{{- fail "set only one of redis.externalUrl and redis.externalUrlSecret.name" }}
{{- end }}
{{- if and (eq $v.model.source "pvc") (not $v.model.pvc.claimName) }}
{{- fail "model.source=pvc needs model.pvc.claimName: the PersistentVolumeClaim holding the model directory" }}
{{- end }}
{{- if and (eq $v.model.source "hostPath") (not $v.model.hostPath.path) }}
{{- fail "model.source=hostPath needs model.hostPath.path: the directory on each node holding the model" }}
{{- end }}
{{- if and $v.tls.enabled (not $v.tls.secretName) }}
{{- fail "tls.enabled=true needs tls.secretName: a Secret with tls.crt and tls.key (and ca.crt with tls.hasCA)" }}
{{- end }}
{{- if and $v.planner.enabled $v.keda.enabled }}
{{- fail "planner.enabled and keda.enabled both scale the worker Deployments: choose one" }}
{{- end }}
{{- if and $v.keda.enabled (not $v.keda.prometheusAddress) }}
{{- fail "keda.enabled needs keda.prometheusAddress: the Prometheus its ScaledObjects query" }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $bounds := index $v.planner $role }}
{{- if and $v.planner.enabled (or (lt (int $bounds.min) 1) (gt (int $bounds.min) (int $bounds.max))) }}
{{- fail (printf "planner.%s needs 1 <= min <= max (got %d..%d)" $role (int $bounds.min) (int $bounds.max)) }}
{{- end }}
{{- if and (or $v.planner.enabled $v.keda.enabled) (index $v $role).autoscaling.enabled }}
{{- fail (printf "%s.autoscaling.enabled (CPU HPA) and the %s both scale the %s Deployment: choose one" $role (ternary "planner" "KEDA" $v.planner.enabled) $role) }}
{{- end }}
{{- end }}
{{- range $role := splitList " " (include "baton.roles" $) }}
{{- $r := index $v $role }}
{{- if and $r.service.headless (ne $r.service.type "ClusterIP") }}
{{- fail (printf "%s.service.headless=true needs %s.service.type=ClusterIP (got %s)" $role $role $r.service.type) }}
{{- end }}
{{- if and (eq $role "router") (gt (int $r.service.httpPort) 0) (has (int $r.service.httpPort) (list (int $r.service.port) (int $r.service.metricsPort))) }}
{{- fail (printf "router.service.httpPort (%d) must differ from router.service.port and metricsPort" (int $r.service.httpPort)) }}
{{- end }}
{{- if eq (int $r.service.port) (int $r.service.metricsPort) }}
{{- fail (printf "%s.service.port and %s.service.metricsPort must differ (both %d)" $role $role (int $r.service.port)) }}
{{- end }}
{{- $drain := include "baton.drainSeconds" (dict "root" $ "role" $role) | float64 }}
{{- if le (float64 $r.terminationGracePeriodSeconds) (addf (float64 $v.preStopSleepSeconds) $drain) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds (%d) plus the %s drain (%v s), or Kubernetes kills it mid-drain" $role (int $r.terminationGracePeriodSeconds) (int $v.preStopSleepSeconds) $role $drain) }}
{{- end }}
{{- if and $r.autoscaling.enabled (gt (int $r.autoscaling.minReplicas) (int $r.autoscaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $role (int $r.autoscaling.minReplicas) (int $r.autoscaling.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A probe of one kind (startup, readiness, liveness) for a role. Plaintext: the kubelet's own
gRPC probe against grpc.health.v1.Health. TLS: the kubelet cannot speak TLS gRPC, so the
probe runs baton-health (cli/health_check.py, in the image) with the pod's certificate.
*/}}
{{- define "baton.probe" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
{{- $probe := deepCopy (index $v.probes .kind) }}
{{- if $root.Values.tls.enabled }}
{{- $command := list "baton-health"
    (printf "--port=%d" (int $v.service.port))
    (printf "--tls-dir=%s" (trimSuffix "/" $root.Values.tls.mountPath))
    (printf "--server-name=%s" $root.Values.tls.probeServerName)
    (printf "--timeout=%d" (int ($probe.timeoutSeconds | default 5))) }}
{{- $_ := set $probe "exec" (dict "command" $command) }}
{{- else }}
{{- $_ := set $probe "grpc" (dict "port" (int $v.service.port)) }}
{{- end }}
{{- toYaml $probe }}
{{- end }}
