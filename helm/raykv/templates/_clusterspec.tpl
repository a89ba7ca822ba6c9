{{/*
The spec of the release's Ray cluster (head, worker groups, autoscaler, the raykv start hook):
the RayCluster's spec, or a RayService's rayClusterConfig with serve.enabled.
*/}}
{{- define "raykv.clusterSpec" -}}
{{- $metricsPort := int .Values.metrics.port -}}
rayVersion: {{ .Values.rayVersion | quote }}
enableInTreeAutoscaling: {{ .Values.autoscaling.enabled }}
{{- if .Values.autoscaling.enabled }}
autoscalerOptions:
  upscalingMode: {{ .Values.autoscaling.upscalingMode }}
  idleTimeoutSeconds: {{ .Values.autoscaling.idleTimeoutSeconds }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  resources:
    {{- toYaml .Values.autoscaling.resources | nindent 4 }}
  securityContext:
    {{- include "raykv.containerSecurityContext" . | nindent 4 }}
  {{- with (include "raykv.rayAuthEnv" .) }}
  env:
    {{- . | nindent 4 }}
  {{- end }}
{{- end }}
headGroupSpec:
  serviceType: ClusterIP
  rayStartParams:
    # No GPUs on the head: the Coordinator is CPU-only; GPU pools live on the workers.
    num-gpus: "0"
    dashboard-host: "0.0.0.0"
    metrics-export-port: {{ $metricsPort | quote }}
    {{- with .Values.head.rayStartParams }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "raykv.labels" . | nindent 8 }}
        raykv.io/role: head
    spec:
      {{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "raykv.podSecurityContext" . | nindent 8 }}
      containers:
        - name: ray-head
          image: {{ include "raykv.image" . }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          {{- with (include "raykv.rayContainerCommand" .) }}
          {{- . | nindent 10 }}
          {{- end }}
          ports:
            - {containerPort: 6379, name: gcs-server, protocol: TCP}
            - {containerPort: 8265, name: dashboard, protocol: TCP}
            - {containerPort: 10001, name: client, protocol: TCP}
            - {containerPort: {{ $metricsPort }}, name: metrics, protocol: TCP}
            {{- if .Values.serve.enabled }}
            # Ray Serve's HTTP proxy: KubeRay builds the serve Service from this port's name.
            - {containerPort: {{ .Values.serve.port }}, name: serve, protocol: TCP}
            {{- end }}
          env:
            {{- include "raykv.nodeEnv" . | nindent 12 }}
            {{- with (include "raykv.diskEnv" (dict "root" . "role" "head")) }}
            {{- . | nindent 12 }}
            {{- end }}
          resources:
            {{- toYaml .Values.head.resources | nindent 12 }}
          securityContext:
            {{- include "raykv.containerSecurityContext" . | nindent 12 }}
          volumeMounts:
            - {name: dshm, mountPath: /dev/shm}
            {{- with (include "raykv.diskMount" .) }}
            {{- . | nindent 12 }}
            {{- end }}
          {{- if eq .Values.raykv.start "headCommand" }}
          lifecycle:
            postStart:
              exec:
                # Runs beside KubeRay's `ray start`: wait until Ray answers, then start raykv
                # (retried: it starts or rejoins the service). Backgrounded so the hook returns
                # at once and can never block or kill the head; log: /tmp/raykv-up.log.
                command:
                  - /bin/bash
                  - -c
                  - 'nohup /bin/bash -c "$0" >/tmp/raykv-up.log 2>&1 &'
                  - |-
                    {{- include "raykv.headStartScript" . | nindent 20 }}
          {{- end }}
      {{- with .Values.head.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.head.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.head.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ .Values.head.shmSize }}
        {{- with (include "raykv.diskVolume" .) }}
        {{- . | nindent 8 }}
        {{- end }}
workerGroupSpecs:
  {{- if .Values.gpuWorkers.enabled }}
  {{- include "raykv.workerGroup" (dict "root" . "group" .Values.gpuWorkers "gpus" (int .Values.gpuWorkers.gpus)) | nindent 2 }}
  {{- end }}
  {{- if .Values.cpuWorkers.enabled }}
  {{- include "raykv.workerGroup" (dict "root" . "group" .Values.cpuWorkers "gpus" 0) | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* metadata of the release's Ray object (the RayCluster, or the RayService with serve.enabled). */}}
{{- define "raykv.clusterMetadata" -}}
name: {{ include "raykv.clusterName" . }}
labels:
  {{- include "raykv.labels" . | nindent 2 }}
{{- if .Values.image.pipInstall }}
annotations:
  # image.pipInstall: the containers' own command runs KubeRay's `ray start` after the install.
  ray.io/overwrite-container-cmd: "true"
{{- end }}
{{- end -}}
