#!/usr/bin/env bash
# Installs the Debian packages shardserve builds, tests and benchmarks with. Idempotent: packages
# already present are left alone, and apt is only asked when something is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  bazel-bootstrap bazel-rules-java bazel-platforms bazel-skylib   # offline Bazel 4 (see .bazelrc)
  g++ protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev   # gRPC + protos
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev                      # Abseil, tests
  libtorch-dev libgloo-dev                                                    # LibTorch, Gloo
  libopenblas0-openmp            # an optimised BLAS for LibTorch's CPU matmuls (linear layers)
  python3-torch                  # the PyTorch reference the benchmarks compare against
  python3-grpcio python3-protobuf python3-numpy python3-pytest  # the Python client and its tests
  python3-pip python3-setuptools python3-venv                 # pip install ./python (its test)
  redis-server libhiredis-dev    # the do-it-yourself baseline of the end-to-end benchmarks
  prometheus-cpp-dev prometheus  # metrics (prometheus-cpp), and promtool that checks them
  libgoogle-glog-dev             # the servers' logs
  libssl-dev openssl             # TLS: key checks, and the certificates of deploy/make_certs.sh
)

# kubectl (for its kustomize) and Node.js, for the Kubernetes manifests' test: Debian's, unless
# the machine has its own already.
command -v kubectl >/dev/null || packages+=(kubernetes-client)
{ command -v node && command -v npm; } >/dev/null || packages+=(nodejs npm)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -q >&2
  "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi

# The manifest validator's packages (tools/k8s_validate: the Kubernetes schemas), from the npm
# registry into ~/.cache, once per lock file.
validator="$HOME/.cache/shardserve-k8s-validate"
lock=tools/k8s_validate/package-lock.json
if ! cmp -s "$lock" "$validator/package-lock.json" || [ ! -d "$validator/node_modules" ]; then
  echo "setup: installing the manifest validator's npm packages in $validator" >&2
  mkdir -p "$validator"
  cp tools/k8s_validate/package.json "$lock" "$validator/"
  (cd "$validator" && npm ci --no-audit --no-fund --loglevel=error) >&2
fi
