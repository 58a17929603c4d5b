#!/usr/bin/env bash
# Runs every test: installs what is missing (tools/setup.sh), then `bazel test //...`.
# Extra arguments go to bazel test (e.g. tools/test.sh --test_output=all).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1
log=$(mktemp)
bazel test --nocache_test_results //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(grep -cE '^//\S+\s+(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//\S+\s+.*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log")
rm -f "$log"
echo "$passed passed, $failed failed"
exit "$rc"
