{{/*
One KubeRay worker group. Args: root (the chart context), group (its values), gpus (per pod;
0 for a CPU group). GPUs go in limits and requests alike (extended resources require it), and
KubeRay passes the limit to `ray start --num-gpus`.
*/}}
{{- define "raykv.workerGroup" -}}
{{- $root := .root -}}
{{- $g := .group -}}
{{- $resources := deepCopy $g.resources -}}
{{- if gt (int .gpus) 0 -}}
{{- $gpuName := $root.Values.gpuWorkers.gpuResourceName -}}
{{- $_ := set $resources "limits" (merge (dict $gpuName (int .gpus)) (default dict $resources.limits)) -}}
{{- $_ := set $resources "requests" (merge (dict $gpuName (int .gpus)) (default dict $resources.requests)) -}}
{{- end -}}
- groupName: {{ $g.groupName }}
  replicas: {{ $g.replicas }}
  minReplicas: {{ $g.minReplicas }}
  maxReplicas: {{ $g.maxReplicas }}
  rayStartParams:
    metrics-export-port: {{ $root.Values.metrics.port | quote }}
    {{- with $g.rayStartParams }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "raykv.labels" $root | nindent 8 }}
        raykv.io/role: {{ ternary "gpu-worker" "cpu-worker" (gt (int .gpus) 0) }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "raykv.podSecurityContext" $root | nindent 8 }}
      containers:
        - name: ray-worker
          image: {{ include "raykv.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- with (include "raykv.rayContainerCommand" $root) }}
          {{- . | nindent 10 }}
          {{- end }}
          ports:
            - {containerPort: {{ $root.Values.metrics.port }}, name: metrics, protocol: TCP}
            {{- if $root.Values.serve.enabled }}
            - {containerPort: {{ $root.Values.serve.port }}, name: serve, protocol: TCP}
            {{- end }}
          env:
            {{- include "raykv.nodeEnv" $root | nindent 12 }}
            {{- with (include "raykv.diskEnv" (dict "root" $root "role" $g.groupName)) }}
            {{- . | nindent 12 }}
            {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- include "raykv.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            - {name: dshm, mountPath: /dev/shm}
            {{- with (include "raykv.diskMount" $root) }}
            {{- . | nindent 12 }}
            {{- end }}
      {{- with $g.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $g.shmSize }}
        {{- with (include "raykv.diskVolume" $root) }}
        {{- . | nindent 8 }}
        {{- end }}
{{- end -}}
