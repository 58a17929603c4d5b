#!/usr/bin/env bash
# Runs every test: installs what is missing (tools/setup.sh), then `bazel test //...`.
# Extra arguments go to bazel test (e.g. tools/test.sh --test_output=all).
# Prints, at the end: each target's time (slowest first), the test cases that were skipped where
# they ran (a skipped case is not a pass: it is listed here), and the whole run's time.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
tools/setup.sh || exit 1
log=$(mktemp)
marker=$(mktemp)  # test logs newer than this are this run's
bazel test --nocache_test_results //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# The GPU build (workers with --device=cuda:N) must keep compiling and linking on every run.
if [ "$rc" -eq 0 ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  bazel build --config=cuda //server:worker_main 2>&1 | tail -n 2
  rc=${PIPESTATUS[0]}
fi
passed=$(grep -cE '^//\S+\s+(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//\S+\s+.*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log")

echo
echo "Time per test target (slowest first):"
sed -nE 's/^(\/\/\S+)\s+(\(cached\) )?([A-Z ]+) in ([0-9.]+)s.*/\4 \1 \3/p' "$log" |
  sort -rn | awk '{ printf "  %7.1f s  %s  %s\n", $1, $2, $3; total += $1 }
                  END { printf "  %7.1f s  in all (one target at a time)\n", total }'

# gtest prints "[  SKIPPED ] Suite.Case" for a case that called GTEST_SKIP (no GPU, no mount).
skipped=$(find -L .bazel/testlogs -name test.log -newer "$marker" 2>/dev/null |
  xargs -r grep -hE '^\[  SKIPPED \] [A-Za-z_0-9]+\.[A-Za-z_0-9/]+' 2>/dev/null |
  sed -E 's/^\[  SKIPPED \] ([^ ]+).*/\1/' | sort -u)
if [ -n "$skipped" ]; then
  echo "Skipped where they ran (not counted as passed cases):"
  echo "$skipped" | sed 's/^/  /'
fi
rm -f "$log" "$marker"
elapsed=$(( $(date +%s) - started ))
echo "$passed passed, $failed failed, $(echo -n "$skipped" | grep -c .) case(s) skipped;" \
  "$((elapsed / 60)) min $((elapsed % 60)) s in all"
exit "$rc"
