#!/usr/bin/env bash
# Bad worker flags are refused at start with a clear message (and no crash).
set -uo pipefail
worker="${TEST_SRCDIR:?}/shardserve/server/worker_main"
expect() {  # expected message, flags...
  out=$("$worker" "${@:2}" 2>&1); rc=$?
  if [ $rc -ne 1 ] && [ $rc -ne 2 ] || ! grep -qF -- "$1" <<<"$out"; then
    echo "FAIL: worker ${*:2} -> rc $rc: $out"; exit 1
  fi
}
expect "--coordinator: the coordinator's address is required" --rank=0
expect "--rank: -1 must be >= 0" --coordinator=127.0.0.1:1 --rank=-1
expect 'device: cannot parse "tpu"' --coordinator=127.0.0.1:1 --device=tpu
# A CPU build names the GPU build; a GPU build on a machine without that GPU says so.
expect "cuda:0" --coordinator=127.0.0.1:1 --device=cuda:0
expect "--row_budget must be >= 1" --coordinator=127.0.0.1:1 --row_budget=0
expect "--max_queued_mb must be in [1, 2^30]" --coordinator=127.0.0.1:1 --max_queued_mb=0
expect "--copy_lanes: -1 must be in [0, 64]" --coordinator=127.0.0.1:1 --copy_lanes=-1
expect "--fail_allreduce: -1 must be >= 0" --coordinator=127.0.0.1:1 --fail_allreduce=-1
echo "worker flags test passed"
