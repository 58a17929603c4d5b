#!/usr/bin/env bash
# The README's install, from a copy of the repository's python/ and proto/: a venv over Debian's
# packages (--system-site-packages: grpcio, protobuf, numpy, torch) and
# `pip install --no-build-isolation ./python` in it. No registry is asked (--no-index: the
# requirements are met by the Debian packages), the build step generates the protobuf / gRPC
# modules into the installed package, and the package imports from there.
set -euo pipefail
root="${TEST_SRCDIR:?}/shardserve"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
repo="$tmp/repo"
rm -rf "$repo" "$tmp/venv"
mkdir -p "$repo/python" "$repo/proto"
cp -rL "$root/python/shardserve" "$root/python/setup.py" "$repo/python/"
cp -L "$root/proto/shardserve.proto" "$repo/proto/"
chmod -R u+w "$repo"
if ls "$repo/python/shardserve/_proto/"shardserve_pb2*.py >/dev/null 2>&1; then
  echo "FAIL: generated modules in the source copy"; exit 1
fi
cd "$repo"
/usr/bin/python3 -m venv --system-site-packages "$tmp/venv"
"$tmp/venv/bin/pip" install --no-build-isolation --no-index --disable-pip-version-check ./python \
  >"$tmp/pip.log" 2>&1 || { cat "$tmp/pip.log"; exit 1; }
cd "$tmp"
"$tmp/venv/bin/python" - "$tmp/venv" <<'PY'
import os, sys
import shardserve
from shardserve._proto import shardserve_pb2, shardserve_pb2_grpc
target = sys.argv[1]
assert shardserve.__file__.startswith(target), shardserve.__file__
assert shardserve_pb2.DESCRIPTOR.name == "proto/shardserve.proto"
assert hasattr(shardserve_pb2_grpc, "DataServiceStub")
assert hasattr(shardserve_pb2_grpc, "AdminServiceStub")
shardserve.Client("127.0.0.1:1").close()
print("pip install test passed:", os.path.dirname(shardserve.__file__))
PY
