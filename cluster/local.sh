#!/usr/bin/env bash
# A multi-node Ray cluster on THIS host, for raykv's multi-node tests and for trying raykv on a
# laptop or one GPU box: one head raylet (no GPUs) and N worker raylets, all on 127.0.0.1.
#
#   cluster/local.sh start [N]   head + N workers (default N: one per GPU, or 2 without GPUs)
#   cluster/local.sh status      nodes, their processes, and where metrics are exported
#   cluster/local.sh stop        stop every process this script started, workers first
#   cluster/local.sh address     print the head's GCS address (for `ray.init` / `raykv up`)
#
# Worker i carries the custom resource {"raykv_node_<i>": 1} (head: {"raykv_head": 1}) so
# tests can pin an actor to one node. Where `nvidia-smi -L` lists GPUs, they are split into
# contiguous slices, one slice per worker, through CUDA_VISIBLE_DEVICES.
#
# Environment (all optional):
#   RAYKV_CLUSTER_DIR     state, logs and Ray's temp dir (default /tmp/raykv-cluster-$UID; keep
#                         it short: Ray's unix socket paths under it must stay < 108 bytes)
#   RAYKV_HEAD_PORT       GCS port of the head (default: a free port)
#   RAYKV_HEAD_CPUS / RAYKV_WORKER_CPUS      CPUs per raylet (default 1 / 2)
#   RAYKV_OBJECT_STORE_BYTES                 object store per raylet (default 256 MiB)
#   RAYKV_DASHBOARD=0     skip the dashboard (faster start; default 1)
#   RAYKV_STOP_GRACE_S    seconds `stop` waits after SIGTERM before SIGKILL (default 3)
#   RAYKV_UP=1            run `raykv up --address ADDR` once the cluster is up
#   RAY                   the `ray` executable (default: `ray` on PATH, else the repo's .venv)
#
# Every `ray start` runs in its own process group (setsid), recorded in the state dir; `stop`
# signals exactly those groups, never other Ray clusters on the host (no `ray stop`).
set -euo pipefail

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 # otherwise Ray swaps 127.0.0.1 for the host address
export RAY_USAGE_STATS_ENABLED=0
ip=127.0.0.1
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cluster_dir="${RAYKV_CLUSTER_DIR:-/tmp/raykv-cluster-$(id -u)}"
state_dir="$cluster_dir/state"
log_dir="$cluster_dir/logs"
ray_tmp="$cluster_dir/ray"

die() { echo "local.sh: $*" >&2; exit 1; }

ray_bin() {
  if [ -n "${RAY:-}" ]; then echo "$RAY"
  elif command -v ray >/dev/null; then command -v ray
  elif [ -x "$repo_root/.venv/bin/ray" ]; then echo "$repo_root/.venv/bin/ray"
  else die "no 'ray' executable: pip install 'ray[default]' or set RAY=/path/to/ray"; fi
}

python_bin() { # the interpreter next to `ray`, so the port probe runs without extra deps
  local py; py="$(dirname "$(ray_bin)")/python"
  if [ -x "$py" ]; then echo "$py"; else command -v python3; fi
}

free_ports() { # N distinct ports the kernel calls free right now (held open together)
  "$(python_bin)" - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# `ray start --address=127.0.0.1:P` for a joining worker: with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# the CLI refuses to join at all, and with 1 it rewrites 127.0.0.1 to the host's outward address,
# where the loopback-bound GCS does not listen. So run the same CLI with the variable at 1 and
# the rewrite turned off: the worker dials exactly the address given.
join_loopback_py='
import sys
import ray._private.services as services
services.resolve_ip_for_localhost = lambda host: host
from ray.scripts.scripts import main
sys.argv = ["ray", *sys.argv[1:]]
main()
'

# Ray's token auth, decided once for every node: a `ray start --head` turns it on by itself
# where a token file exists, a joining `ray start` does not, and the two would refuse each
# other. On unless the caller chose (RAY_AUTH_MODE); the token is created if missing.
auth_setup() {
  export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
  if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
    "$(ray_bin)" get-auth-token --generate >/dev/null 2>&1 \
      || die "could not create Ray's auth token (ray get-auth-token --generate)"
  fi
}

gpu_count() {
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L | grep -c '^GPU '
  else echo 0; fi
}

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

# start_node NAME RESOURCES_JSON NUM_CPUS NUM_GPUS CUDA_DEVICES [extra ray start args...]
start_node() {
  local name="$1" resources="$2" cpus="$3" gpus="$4" devices="$5"; shift 5
  local p; read -r -a p <<<"$(free_ports 6)"
  local metrics="${p[0]}"
  local args=(
    start --node-ip-address="$ip" --temp-dir="$ray_tmp" --disable-usage-stats
    --num-cpus="$cpus" --num-gpus="$gpus" --resources="$resources"
    --object-store-memory="${RAYKV_OBJECT_STORE_BYTES:-268435456}"
    --node-manager-port="${p[1]}" --object-manager-port="${p[2]}"
    --dashboard-agent-listen-port="${p[3]}" --dashboard-agent-grpc-port="${p[4]}"
    --runtime-env-agent-port="${p[5]}" --metrics-export-port="$metrics"
    --min-worker-port=0 --max-worker-port=0 # workers bind kernel-chosen ports: no collisions
    "$@"
  )
  local launcher=(env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "$(ray_bin)")
  [ "$name" = head ] ||
    launcher=(env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 "$(python_bin)" -c "$join_loopback_py")
  # setsid: the node's processes form one process group that `stop` can signal as a whole.
  CUDA_VISIBLE_DEVICES="$devices" setsid "${launcher[@]}" "${args[@]}" \
    >"$log_dir/$name.log" 2>&1 </dev/null &
  local pid=$!
  # setsid'd from a background job: the child is its own group leader, so pgid == pid.
  printf 'pgid=%q\nmetrics_port=%q\nresources=%q\ngpus=%q\ncuda_visible_devices=%q\n' \
    "$pid" "$metrics" "$resources" "$gpus" "$devices" >"$state_dir/$name.env"
  if ! wait "$pid"; then
    tail -n 40 "$log_dir/$name.log" >&2
    cmd_stop >/dev/null # no half-started cluster left behind
    die "ray start failed for $name (log: $log_dir/$name.log); stopped the nodes already up"
  fi
}

cmd_start() {
  ray_bin >/dev/null # fail here, not halfway, when Ray is missing
  auth_setup
  local gpus; gpus="$(gpu_count)"
  local n="${1:-}"
  if [ -z "$n" ]; then if [ "$gpus" -gt 0 ]; then n="$gpus"; else n=2; fi; fi
  [[ "$n" =~ ^[0-9]+$ ]] || die "N must be a whole number of workers, got '$n'"
  if [ -f "$state_dir/head.env" ]; then
    # shellcheck disable=SC1091
    . "$state_dir/head.env"
    group_alive "$pgid" && die "a cluster is already running in $cluster_dir ('$0 stop' first)"
  fi
  # GPUs: worker i gets the contiguous slice [i*per, (i+1)*per) of the host's GPUs.
  local per=0
  if [ "$gpus" -gt 0 ] && [ "$n" -gt 0 ]; then
    per=$((gpus / n))
    [ "$per" -ge 1 ] || die "$gpus GPUs cannot give each of $n workers its own GPU; \
start at most $gpus workers"
  fi
  [ "${#ray_tmp}" -le 60 ] || die "RAYKV_CLUSTER_DIR is too long (${#cluster_dir} chars): \
Ray's socket paths under $ray_tmp would pass the 107-byte unix limit; use a shorter path"
  rm -rf "$state_dir"; mkdir -p "$state_dir" "$log_dir" "$ray_tmp"

  local head_port="${RAYKV_HEAD_PORT:-$(free_ports 1)}"
  # The head runs a dashboard process even with --include-dashboard=false, so always give it
  # a free port (never Ray's default 8265, which another cluster on this host may hold).
  local dash=(--dashboard-host="$ip" --dashboard-port="$(free_ports 1)" --include-dashboard=true)
  [ "${RAYKV_DASHBOARD:-1}" = 1 ] || dash[2]=--include-dashboard=false
  local rc_port; rc_port="$(free_ports 1)"
  start_node head '{"raykv_head": 1}' "${RAYKV_HEAD_CPUS:-1}" 0 "" \
    --head --port="$head_port" --ray-client-server-port="$rc_port" "${dash[@]}"
  local addr="$ip:$head_port"
  echo "$addr" >"$cluster_dir/address"

  local i
  for ((i = 1; i <= n; i++)); do
    local devices="" g
    for ((g = (i - 1) * per; g < i * per; g++)); do devices="${devices:+$devices,}$g"; done
    start_node "worker-$i" "{\"raykv_node_$i\": 1}" "${RAYKV_WORKER_CPUS:-2}" "$per" "$devices" \
      --address="$addr"
  done
  echo "ray cluster up: head + $n workers at $addr (GPUs per worker: $per)"
  echo "  export RAY_ADDRESS=$addr   # then: raykv status --address $addr"
  if [ "$RAY_AUTH_MODE" = token ]; then
    echo "  token auth is on: raykv presents ~/.ray/auth_token itself; other Ray drivers need"
    echo "  export RAY_AUTH_MODE=token"
  fi
  if [ "${RAYKV_UP:-0}" = 1 ]; then
    command -v raykv >/dev/null || die "RAYKV_UP=1 but no 'raykv' on PATH"
    raykv up --address "$addr"
  fi
}

node_files() { # workers first (stop them before the head), head last
  local f
  for f in "$state_dir"/worker-*.env; do [ -e "$f" ] && echo "$f"; done
  [ -e "$state_dir/head.env" ] && echo "$state_dir/head.env"
  return 0
}

cmd_status() {
  [ -d "$state_dir" ] && [ -n "$(node_files)" ] || { echo "no local cluster in $cluster_dir"; return 0; }
  echo "address: $(cat "$cluster_dir/address" 2>/dev/null || echo '?')"
  local f
  for f in $(node_files); do
    local pgid metrics_port resources gpus cuda_visible_devices
    # shellcheck disable=SC1090
    . "$f"
    local state=stopped
    group_alive "$pgid" && state=running
    printf '  %-10s %-8s pgid=%-7s resources=%s gpus=%s metrics=http://%s:%s/metrics\n' \
      "$(basename "$f" .env)" "$state" "$pgid" "$resources" "$gpus" "$ip" "$metrics_port"
  done
}

stray_pids() {
  local d c
  for d in /proc/[0-9]*; do
    c=$(tr '\0' ' ' <"$d/cmdline" 2>/dev/null) || continue
    [[ $c == *"$ray_tmp"* ]] && echo "${d#/proc/}"
  done
  return 0
}

cmd_stop() {
  [ -d "$state_dir" ] || { echo "no local cluster in $cluster_dir"; return 0; }
  local f pgid
  for f in $(node_files); do
    # shellcheck disable=SC1090
    . "$f"
    group_alive "$pgid" && kill -TERM -- "-$pgid" 2>/dev/null || true
    # Raylets drain on SIGTERM; the GCS and the autoscaler monitor may not exit on it at all,
    # so whatever is left after the grace period gets SIGKILL (as `ray stop` does).
    local t grace=$((${RAYKV_STOP_GRACE_S:-3} * 10))
    for ((t = 0; t < grace; t++)); do group_alive "$pgid" || break; sleep 0.1; done
    group_alive "$pgid" && kill -KILL -- "-$pgid" 2>/dev/null || true
    rm -f "$f"
  done
  # A raylet or worker that left its node's process group (Ray re-parents some) still names
  # this cluster's temp dir in its argv: end those too, and wait until none is left.
  local pids
  for sig in TERM KILL; do
    for ((t = 0; t < 50; t++)); do
      pids=$(stray_pids)
      [ -z "$pids" ] && break
      # shellcheck disable=SC2086
      kill -"$sig" $pids 2>/dev/null || true
      sleep 0.1
    done
  done
  rm -f "$cluster_dir/address"
  echo "local cluster in $cluster_dir stopped (logs kept in $log_dir and $ray_tmp)"
}

case "${1:-}" in
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  address) cat "$cluster_dir/address" 2>/dev/null || die "no local cluster in $cluster_dir" ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
