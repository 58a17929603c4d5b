#!/usr/bin/env bash
# core/ never speaks gRPC or protobuf and never reaches up into server/ or client/: the system
# headers are on every include path, so only this check makes that a failing build, not a habit.
set -euo pipefail
cd "$(dirname "$0")"
bad=$(grep -nE '^\s*#\s*include\s*[<"](grpc|grpcpp|google/protobuf|proto/|server/|client/)' \
  -- *.h *.cc *.cu 2>/dev/null || true)
if [ -n "$bad" ]; then
  echo "core/ must not include gRPC, protobuf, proto/, server/ or client/ headers:" >&2
  echo "$bad" >&2
  exit 1
fi
count=$(ls -- *.h *.cc | wc -l)
[ "$count" -gt 20 ] || { echo "layering_test: only $count files seen" >&2; exit 1; }
echo "core/: $count files, no gRPC, protobuf or upper-layer includes"
