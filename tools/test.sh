#!/usr/bin/env bash
# Runs every test: installs what is missing (tools/setup.sh), then `bazel test //...`.
# Extra arguments go to bazel test (e.g. tools/test.sh --test_output=all).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1
log=$(mktemp)
bazel test --nocache_test_results //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# The GPU build (workers with --device=cuda:N) must keep compiling and linking on every run.
if [ "$rc" -eq 0 ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  bazel build --config=cuda //server:worker_main 2>&1 | tail -n 2
  rc=${PIPESTATUS[0]}
fi
passed=$(grep -cE '^//\S+\s+(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//\S+\s+.*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log")
rm -f "$log"
echo "$passed passed, $failed failed"
exit "$rc"
