#!/usr/bin/env bash
# Renders every kustomization under deploy/k8s (overlays and examples; the
# base and components are rendered through them) with `kubectl kustomize`
# and validates every rendered object against the Kubernetes OpenAPI schemas
# offline (validate_k8s.js, npm package kubernetes-models).
#
# usage: k8s_schemas_test.sh DEPLOY_K8S_DIR NPM_DIR
#   NPM_DIR: where kubernetes-models and js-yaml are installed (once; later
#   runs reuse them). Exit 77 (skipped) if kubectl (with kustomize v5),
#   node or npm is missing.
set -euo pipefail
k8s=$1
npm_dir=$2
here=$(cd "$(dirname "$0")" && pwd)
# Pinned, so that a run today and a run next year check the same schemas.
models_version=4.5.1
yaml_version=4.1.0

for tool in kubectl node npm; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIP: $tool is not installed; cannot render or validate the manifests"
    exit 77
  fi
done

# Components and `labels` need kustomize v5 (kubectl 1.27 or later).
kustomize=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v//p')
if [[ -z $kustomize || ${kustomize%%.*} -lt 5 ]]; then
  echo "SKIP: kubectl's kustomize is '${kustomize:-unknown}'; v5 (kubectl >= 1.27) is needed"
  exit 77
fi

installed() {
  node -e "process.exit(require('$npm_dir/node_modules/$1/package.json').version === '$2' ? 0 : 1)" \
    2>/dev/null
}
if ! installed kubernetes-models "$models_version" || ! installed js-yaml "$yaml_version"; then
  echo "installing kubernetes-models@$models_version js-yaml@$yaml_version into $npm_dir"
  mkdir -p "$npm_dir"
  npm install --prefix "$npm_dir" --no-audit --no-fund --no-save --loglevel=error \
    "kubernetes-models@$models_version" "js-yaml@$yaml_version"
fi

out=$(mktemp -d -t localsgd-k8s.XXXXXX)
trap 'rm -rf "$out"' EXIT
rendered=()
while IFS= read -r kustomization; do
  dir=$(dirname "$kustomization")
  rel=${dir#"$k8s"/}
  case $rel in base | components/*) continue ;; esac
  file="$out/${rel//\//_}.yaml"
  echo "kubectl kustomize $rel"
  kubectl kustomize "$dir" > "$file"
  rendered+=("$file")
done < <(find "$k8s" -name kustomization.yaml | sort)
if ((${#rendered[@]} < 3)); then
  echo "FAIL: expected at least overlays/single, overlays/sharded and an example"
  exit 1
fi
NODE_PATH="$npm_dir/node_modules" node "$here/validate_k8s.js" "${rendered[@]}"
