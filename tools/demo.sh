#!/usr/bin/env bash
# The main job: installs what is missing, then runs the sharded ops on 2 CPU ranks (Gloo on
# loopback) over a demo embedding table and linear layer, checked against unsharded LibTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec bazel run //core:sharded_ops_demo -- "$@"
