#!/usr/bin/env bash
# The house's floors, checked on every include: the system headers are on every include path and
# Bazel 4 does no layering check here, so only this test makes a wrong include a failing build.
#
#   core/      speaks no gRPC or protobuf, includes nothing of ours above it; its own rooms from
#              the bottom: base < kernels, comm < table < ops < step (testing: test helpers)
#   rpc/       what servers and clients share: never server/ or client/
#   server/    worker/ and coordinator/ never include each other; common/ includes neither
#   client/    never server/
set -uo pipefail
cd "$(dirname "$0")/.."  # the runfiles tree: the sources of every package, as //:sources lists

failures=0
seen=0

# check ROOM "allowed prefixes (space-separated)" "what the rule says"
# Every workspace include ("a/b.h") of each file in ROOM must start with an allowed prefix;
# includes of other projects (absl/, grpcpp/, ATen/, ...) are not ours and are skipped, except
# that core/ may not include gRPC or protobuf at all.
check() {
  local room=$1 allowed=$2 rule=$3
  local files
  files=$(find -L "$room" -maxdepth 1 -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \) 2>/dev/null)
  [ -n "$files" ] || { echo "layering_test: no sources seen in $room" >&2; failures=$((failures + 1)); return; }
  local f
  for f in $files; do
    seen=$((seen + 1))
    while IFS= read -r inc; do
      local ok=0 a
      case "$inc" in
        core/*|rpc/*|server/*|client/*|proto/*|tests/*|bench/*) ;;
        *) continue ;;  # not ours
      esac
      for a in $allowed; do
        [[ "$inc" == "$a"* ]] && ok=1
      done
      # A test may use core's test helpers wherever it lives.
      [[ "$f" == *_test.cc && "$inc" == core/testing/* ]] && ok=1
      if [ "$ok" -eq 0 ]; then
        echo "$f includes \"$inc\": $rule" >&2
        failures=$((failures + 1))
      fi
    done < <(sed -nE 's/^\s*#\s*include\s*"([^"]+)".*/\1/p' "$f")
  done
}

# core/ and gRPC: not even the system's headers.
bad=$(grep -rnE '^\s*#\s*include\s*[<"](grpc|grpcpp|google/protobuf)' core 2>/dev/null)
if [ -n "$bad" ]; then
  echo "core/ must not include gRPC or protobuf headers:" >&2
  echo "$bad" >&2
  failures=$((failures + 1))
fi

check core/base "core/base/" "core/base includes nothing above it"
check core/kernels "core/base/ core/kernels/" "kernels sit on base only"
check core/comm "core/base/ core/comm/" "comm sits on base only"
check core/table "core/base/ core/kernels/ core/table/" "table sits on base and kernels"
check core/ops "core/base/ core/kernels/ core/comm/ core/table/ core/ops/" "ops sit below step"
check core/step "core/base/ core/kernels/ core/comm/ core/table/ core/ops/ core/step/" \
  "step is core's top room"
check core/testing "core/" "core's test helpers use core only"

check rpc "core/base/ proto/ rpc/" "rpc/ never includes server/ or client/"
check rpc/routing "core/base/ proto/ rpc/" "rpc/ never includes server/ or client/"

check server/common "core/ proto/ rpc/ server/common/" \
  "common/ is both binaries': it includes neither room"
check server/worker "core/ proto/ rpc/ server/common/ server/worker/" \
  "the worker never includes the coordinator's room"
check server/coordinator "core/ proto/ rpc/ server/common/ server/coordinator/" \
  "the coordinator never includes the worker's room"

check client "core/base/ core/table/ proto/ rpc/ client/" "client/ never includes server/"
check client/cli "core/base/ core/table/ proto/ rpc/ client/" "client/ never includes server/"
check client/load "core/base/ core/table/ proto/ rpc/ client/" "client/ never includes server/"

if [ "$failures" -gt 0 ]; then
  echo "layering_test: $failures wrong include(s) in $seen files" >&2
  exit 1
fi
[ "$seen" -gt 150 ] || { echo "layering_test: only $seen files seen" >&2; exit 1; }
echo "layering_test: $seen files, every include goes down"
