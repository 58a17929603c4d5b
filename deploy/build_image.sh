#!/usr/bin/env bash
# Builds the release binaries and the container image `shardserve:latest` (needs a Docker engine).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build -c opt //server:coordinator_main //server:worker_main //client:shardserve
mkdir -p deploy/bin
cp -f .bazel/bin/server/coordinator_main .bazel/bin/server/worker_main .bazel/bin/client/shardserve deploy/bin/
docker build -f deploy/Dockerfile -t "${IMAGE:-shardserve:latest}" .
