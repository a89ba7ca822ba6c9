{{/* Names. Everything the chart creates is prefixed by raykv.fullname (<release>-raykv). */}}

{{- define "raykv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Kept at <= 40 chars: KubeRay derives pod and service names (<cluster>-head-svc, ...) from it. */}}
{{- define "raykv.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "raykv.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "raykv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "raykv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "raykv.labels" -}}
helm.sh/chart: {{ include "raykv.chart" . }}
{{ include "raykv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: raykv
{{- end -}}

{{/* The RayCluster's name; KubeRay labels its pods ray.io/cluster=<this>. */}}
{{- define "raykv.clusterName" -}}
{{- include "raykv.fullname" . -}}
{{- end -}}

{{/*
A selector of every Ray pod of the release (head and workers). A RayService's cluster is named
<clusterName>-<suffix> (a second one during an upgrade), so there: the chart's labels on the
pods with KubeRay's ray.io/is-ray-node (the helm test pod has the former, not the latter).
*/}}
{{- define "raykv.rayPodSelector" -}}
{{- if .Values.serve.enabled -}}
{{ include "raykv.selectorLabels" . }}
ray.io/is-ray-node: "yes"
{{- else -}}
ray.io/cluster: {{ include "raykv.clusterName" . }}
{{- end -}}
{{- end -}}

{{/* KubeRay's head Service, created by the operator for the RayCluster; with serve.enabled, for
the RayService (named like the RayCluster) on whichever of its clusters serves. */}}
{{- define "raykv.headService" -}}
{{- printf "%s-head-svc" (include "raykv.clusterName" .) -}}
{{- end -}}

{{- define "raykv.headServiceFQDN" -}}
{{- printf "%s.%s.svc" (include "raykv.headService" .) .Release.Namespace -}}
{{- end -}}

{{- define "raykv.secretName" -}}
{{- default (printf "%s-secrets" (include "raykv.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "raykv.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{/* The worker group whose pods hold the CPU tier: the GPU group, else the CPU group. */}}
{{- define "raykv.tierGroup" -}}
{{- if .Values.gpuWorkers.enabled -}}gpuWorkers{{- else -}}cpuWorkers{{- end -}}
{{- end -}}

{{/*
`raykv up` for this release as one shell command line (arguments with shell metacharacters single-quoted). Args:
Values, address (the Ray address it is run against).
*/}}
{{- define "raykv.upCommand" -}}
{{- $r := .Values.raykv -}}
{{- $group := index .Values (include "raykv.tierGroup" .) -}}
{{- $args := list "raykv" "up" "--address" .address -}}
{{- if $r.preset -}}{{- $args = concat $args (list "--preset" $r.preset "--cpu-mem" $group.pinnedMemory "--gpu-mem-fraction" (toString $r.gpuMemFraction) "--block-size" (toString $r.blockSize)) -}}{{- end -}}
{{- $args = concat $args $r.extraArgs -}}
{{- include "raykv.shellJoin" $args -}}
{{- end -}}

{{/* A list of arguments as one shell command line (arguments with shell metacharacters single-quoted). */}}
{{- define "raykv.shellJoin" -}}
{{- $quoted := list -}}
{{- range . -}}
{{- $a := toString . -}}
{{- if regexMatch "^[A-Za-z0-9_./:=@%+,-]+$" $a -}}
{{- $quoted = append $quoted $a -}}
{{- else -}}
{{- $quoted = append $quoted (printf "'%s'" (replace "'" "'\\''" $a)) -}}
{{- end -}}
{{- end -}}
{{- join " " $quoted -}}
{{- end -}}

{{/*
image.pipInstall (the stock Ray image): the shell command that installs it, or "" when the image
already contains raykv.
*/}}
{{- define "raykv.pipInstallCommand" -}}
{{- with .Values.image.pipInstall -}}
{{- include "raykv.shellJoin" (concat (list "python" "-m" "pip" "install" "--no-cache-dir") .) -}}
{{- end -}}
{{- end -}}

{{/*
The Ray container's command where image.pipInstall is set: install, then KubeRay's own `ray start`
(the RayCluster carries ray.io/overwrite-container-cmd, so KubeRay hands it over in
$KUBERAY_GEN_RAY_START_CMD instead of running it itself). Nothing otherwise.
*/}}
{{- define "raykv.rayContainerCommand" -}}
{{- with (include "raykv.pipInstallCommand" .) -}}
command: ["/bin/bash", "-lc", "--"]
args:
  - {{ printf "ulimit -n 65536; %s && $KUBERAY_GEN_RAY_START_CMD" . | quote }}
{{- end -}}
{{- end -}}

{{/* The head's postStart script (start: headCommand). */}}
{{- define "raykv.headStartScript" -}}
until ray health-check >/dev/null 2>&1; do sleep 2; done
for attempt in $(seq 1 30); do
  {{ include "raykv.upCommand" (dict "Values" .Values "address" "auto") }} && exit 0
  echo "raykv up failed (attempt $attempt of 30); retrying in 10s"; sleep 10
done
exit 1
{{- end -}}

{{/* Ray token auth env: every process that talks to the cluster (nodes, autoscaler, clients). */}}
{{- define "raykv.rayAuthEnv" -}}
{{- if .Values.auth.rayTokenAuth -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "raykv.secretName" . }}
      key: ray-auth-token
{{- end -}}
{{- end -}}

{{/* Env of the Ray nodes (head and workers): auth, the secret raykv's transport uses and the
transport settings of `transport` (only those that differ from raykv's defaults). */}}
{{- define "raykv.nodeEnv" -}}
{{- with (include "raykv.rayAuthEnv" .) }}
{{- . }}
{{ end -}}
- name: RAYKV_TRANSPORT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "raykv.secretName" . }}
      key: raykv-transport-secret
{{- with .Values.transport }}
{{- if not .ucx }}
- name: RAYKV_UCX
  value: "0"
{{- end }}
{{- if .ucxTls }}
- name: RAYKV_UCX_TLS
  value: {{ .ucxTls | quote }}
{{- end }}
{{- if .ucxNetDevices }}
- name: RAYKV_UCX_NET_DEVICES
  value: {{ .ucxNetDevices | quote }}
{{- end }}
{{- if .ucxStripes }}
- name: RAYKV_UCX_STRIPES
  value: {{ .ucxStripes | quote }}
{{- end }}
{{- if .peerReads }}
- name: RAYKV_PEER_READS
  value: "1"
{{- end }}
{{- end }}
{{- with .Values.tenantQuotas }}
{{- $quotas := list }}
{{- range $name, $size := . }}
{{- $quotas = append $quotas (printf "%s=%v" $name $size) }}
{{- end }}
- name: RAYKV_TENANT_QUOTAS
  value: {{ join "," $quotas | quote }}
{{- end }}
{{- with .Values.objectStore }}
{{- if .url }}
- name: RAYKV_OBJECT_URL
  value: {{ .url | quote }}
{{- if .endpoint }}
- name: RAYKV_OBJECT_ENDPOINT
  value: {{ .endpoint | quote }}
{{- end }}
{{- with .tenantQuotas }}
{{- $quotas := list }}
{{- range $name, $size := . }}
{{- $quotas = append $quotas (printf "%s=%v" $name $size) }}
{{- end }}
- name: RAYKV_OBJECT_TENANT_QUOTAS
  value: {{ join "," $quotas | quote }}
{{- end }}
{{- with .credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom: {secretKeyRef: {name: {{ . | quote }}, key: AWS_ACCESS_KEY_ID}}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom: {secretKeyRef: {name: {{ . | quote }}, key: AWS_SECRET_ACCESS_KEY}}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "raykv.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- define "raykv.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext -}}
{{- end -}}

{{/* Fail early, naming the key, on combinations the schema cannot express. */}}
{{- define "raykv.validate" -}}
{{- if not (or .Values.gpuWorkers.enabled .Values.cpuWorkers.enabled) -}}
{{- fail "values: gpuWorkers.enabled and cpuWorkers.enabled are both false; raykv needs at least one worker group (set gpuWorkers.enabled=true, or cpuWorkers.enabled=true for a dev cluster)" -}}
{{- end -}}
{{- range $key := list "gpuWorkers" "cpuWorkers" -}}
{{- $g := index $.Values $key -}}
{{- if $g.enabled -}}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) -}}
{{- fail (printf "values: %s.minReplicas (%d) is greater than %s.maxReplicas (%d); raise maxReplicas or lower minReplicas" $key (int $g.minReplicas) $key (int $g.maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) -}}
{{- fail (printf "values: %s.replicas (%d) is outside [%s.minReplicas, %s.maxReplicas] = [%d, %d]; set replicas within that range" $key (int $g.replicas) $key $key (int $g.minReplicas) (int $g.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.gpuWorkers.enabled .Values.cpuWorkers.enabled (eq .Values.gpuWorkers.groupName .Values.cpuWorkers.groupName) -}}
{{- fail (printf "values: gpuWorkers.groupName and cpuWorkers.groupName are both %q; worker group names must differ" .Values.gpuWorkers.groupName) -}}
{{- end -}}
{{- with .Values.serve -}}
{{- if .enabled -}}
{{- if eq $.Values.raykv.start "rayJob" -}}
{{- fail "values: serve.enabled with raykv.start=rayJob; a RayJob cannot find the cluster a RayService names itself, so use raykv.start=headCommand (or none)" -}}
{{- end -}}
{{- if has (int .port) (list 6379 8265 10001 (int $.Values.metrics.port)) -}}
{{- fail (printf "values: serve.port (%d) is a port Ray or the metrics already use on the head (6379, 8265, 10001, metrics.port %d); pick another" (int .port) (int $.Values.metrics.port)) -}}
{{- end -}}
{{- $g := $.Values.gpuWorkers -}}
{{- if $g.enabled -}}
{{- if gt (int .tp) (int $g.gpus) -}}
{{- fail (printf "values: serve.tp (%d) is more than gpuWorkers.gpus (%d); a replica's GPUs are on one pod, so lower serve.tp or raise gpuWorkers.gpus" (int .tp) (int $g.gpus)) -}}
{{- end -}}
{{- if gt (mul .replicas .tp) (mul $g.maxReplicas $g.gpus) -}}
{{- fail (printf "values: serve.replicas x serve.tp (%d x %d) GPUs is more than the GPU worker group holds at gpuWorkers.maxReplicas (%d x %d); lower them or raise gpuWorkers.maxReplicas" (int .replicas) (int .tp) (int $g.maxReplicas) (int $g.gpus)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "true" where the Grafana dashboard ConfigMap renders: metrics.grafanaDashboard.enabled, or
unset (null), with the PodMonitor, whose series the dashboard reads. */}}
{{- define "raykv.grafanaDashboard" -}}
{{- $on := .Values.metrics.grafanaDashboard.enabled -}}
{{- if kindIs "invalid" $on -}}
{{- $on = .Values.metrics.podMonitor.enabled -}}
{{- end -}}
{{- if $on }}true{{ end -}}
{{- end -}}

{{/*
The disk tier's environment on a Ray node (disk.enabled), as the node's tier actor reads it
(raykv.service.tier.actor.disk_settings): its folder on the volume, its bytes and its per-tenant
quotas (disk.tenantQuotas: RAYKV_DISK_TENANT_QUOTAS, as tenantQuotas' form). The folder is
one per Kubernetes node and role (head, or the worker group's name) so that a pod placed again
on the node finds its slabs, and a hostPath or shared claim is not written by two groups' tiers.
Args: root, role.
*/}}
{{- define "raykv.diskEnv" -}}
{{- $d := .root.Values.disk -}}
{{- if $d.enabled -}}
- name: RAYKV_K8S_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: RAYKV_DISK_PATH
  value: {{ printf "%s/$(RAYKV_K8S_NODE_NAME)-%s" (trimSuffix "/" $d.path) .role | quote }}
- name: RAYKV_DISK_BYTES
  value: {{ ternary $d.size (toString (int64 $d.size)) (kindIs "string" $d.size) | quote }}
{{- with $d.tenantQuotas }}
{{- $quotas := list }}
{{- range $name, $size := . }}
{{- $quotas = append $quotas (printf "%s=%v" $name $size) }}
{{- end }}
- name: RAYKV_DISK_TENANT_QUOTAS
  value: {{ join "," $quotas | quote }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The disk tier's volume mount on a Ray container (disk.enabled). */}}
{{- define "raykv.diskMount" -}}
{{- if .Values.disk.enabled -}}
- {name: raykv-disk, mountPath: {{ .Values.disk.path | quote }}}
{{- end -}}
{{- end -}}

{{/* The disk tier's volume in a Ray pod (disk.enabled): disk.volume's one kind. */}}
{{- define "raykv.diskVolume" -}}
{{- $d := .Values.disk -}}
{{- if $d.enabled -}}
- name: raykv-disk
{{- with $d.volume.hostPath }}
  hostPath:
    path: {{ .path | quote }}
    type: {{ .type | default "Directory" }}
{{- end }}
{{- with $d.volume.persistentVolumeClaim }}
  persistentVolumeClaim:
    claimName: {{ .claimName | quote }}
{{- end }}
{{- with $d.volume.ephemeral }}
  ephemeral:
    volumeClaimTemplate:
      metadata:
        labels:
          {{- include "raykv.selectorLabels" $ | nindent 10 }}
      spec:
        accessModes: [ReadWriteOnce]
        {{- with .storageClassName }}
        storageClassName: {{ . | quote }}
        {{- end }}
        resources:
          requests:
            storage: {{ .size | quote }}
{{- end }}
{{- end -}}
{{- end -}}
