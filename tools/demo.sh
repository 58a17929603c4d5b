#!/usr/bin/env bash
# The main job: installs what is missing, then starts a local cluster on CPU - a coordinator on
# port 50051 and 2 workers (Gloo on loopback) - creates a demo embedding table and a demo linear
# layer, runs Embedding, EmbeddingBag and Linear calls through the public API (direct and via the
# coordinator), checks them against the unsharded result, and keeps serving until interrupted.
# Extra arguments go to `shardserve up` (e.g. --exit_after_demo, --workers=4, --port=0).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec bazel run //client:shardserve -- up --workers=2 --port=50051 "$@"
