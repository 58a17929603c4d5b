#!/usr/bin/env bash
# Runs the Python client's pytest suite (python/tests) under Bazel: the package from python/ with
# the generated modules of //proto:shardserve_py_gen in its _proto/, and the server binaries from
# the runfiles. Extra arguments go to pytest.
set -euo pipefail
root="${TEST_SRCDIR:?}/shardserve"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
site="$tmp/site"
rm -rf "$site"
mkdir -p "$site"
cp -rL "$root/python/shardserve" "$site/"
cp -L "$root/proto/shardserve_pb2.py" "$root/proto/shardserve_pb2_grpc.py" \
  "$site/shardserve/_proto/"
chmod -R u+w "$site"
export PYTHONPATH="$site"
export SHARDSERVE_SERVER_DIR="$root/server"
export SHARDSERVE_CHECKPOINT_DIR="$tmp/checkpoints"
export TMPDIR="$tmp"
export PYTHONDONTWRITEBYTECODE=1
cd "$tmp"
# Debian's python3 (grpcio, protobuf, numpy, torch, pytest), not whatever python3 is on PATH.
exec /usr/bin/python3 -m pytest -p no:cacheprovider -q -ra --durations=10 "$root/python/tests" "$@"
