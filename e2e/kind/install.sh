#!/usr/bin/env bash
# install.sh: creates a kind cluster (cluster.yaml), loads tessera's image archive into it and installs the
# chart with the simulated backend (8 simulated H100s on the worker). Needs Docker, kind, helm and kubectl;
# never run in this repository's CI, which has no Docker (see README.md).
#
#   e2e/kind/install.sh                     # cluster "tessera", node image kindest/node:v1.37.2
#   KIND_CLUSTER=dev KIND_NODE_IMAGE=kindest/node:v1.37.2 e2e/kind/install.sh
#   kind delete cluster --name tessera      # removes it again
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cluster="${KIND_CLUSTER:-tessera}"
node_image="${KIND_NODE_IMAGE:-kindest/node:v1.37.2}"
archive="${IMAGE_ARCHIVE:-$repo/target/image/tessera-kind.tar}"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/Cargo.toml" | head -1)"
# The archive names the image with its full name: the CRI resolves the chart's short `tessera` to
# docker.io/library/tessera, and kind imports the image under the name in the archive.
image="docker.io/library/tessera"

for tool in docker kind helm kubectl; do
  command -v "$tool" > /dev/null || { echo "error: $tool not found in PATH (install.sh needs docker, kind, helm, kubectl)" >&2; exit 1; }
done

echo "==> image archive $archive ($image:$version)"
(cd "$repo" && IMAGE_REF="$image:$version" IMAGE_ARCHIVE="$archive" make image)

echo "==> kind cluster $cluster ($node_image)"
if kind get clusters | grep -qxF "$cluster"; then
  echo "kind cluster $cluster exists; reusing it"
else
  kind create cluster --name "$cluster" --image "$node_image" --config "$repo/e2e/kind/cluster.yaml" --wait 120s
fi
kind load image-archive "$archive" --name "$cluster"

echo "==> helm install tessera (simulated backend)"
helm upgrade --install tessera "$repo/deployments/helm/tessera" \
  --kube-context "kind-$cluster" --namespace tessera-system --create-namespace \
  --set backend=simulated \
  --set image.repository="$image" --set image.tag="$version" --set image.pullPolicy=Never \
  --set 'simulated.gpus[0].model=H100-SXM5-80GB' --set 'simulated.gpus[0].count=8' \
  --wait --timeout 5m

kubectl --context "kind-$cluster" -n tessera-system rollout status daemonset/tessera-kubelet-plugin --timeout 120s
kubectl --context "kind-$cluster" get resourceslices
echo "tessera is installed on kind cluster $cluster; try:"
echo "  kubectl --context kind-$cluster apply -f $repo/deployments/examples/namespace.yaml -f $repo/deployments/examples/whole-h100/"
