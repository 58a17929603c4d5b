#!/usr/bin/env bash
# Installs the Debian packages shardserve builds, tests and benchmarks with. Idempotent: packages
# already present are left alone, and apt is only asked when something is missing.
set -euo pipefail

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
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}" >&2
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q >&2
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
