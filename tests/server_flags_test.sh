#!/usr/bin/env bash
# Bad worker and coordinator flags are refused at start with a clear message (and no crash).
set -uo pipefail
worker="${TEST_SRCDIR:?}/shardserve/server/worker_main"
coordinator="${TEST_SRCDIR:?}/shardserve/server/coordinator_main"
expect_from() {  # binary, expected message, flags...
  out=$("$1" "${@:3}" 2>&1); rc=$?
  if [ $rc -ne 1 ] && [ $rc -ne 2 ] || ! grep -qF -- "$2" <<<"$out"; then
    echo "FAIL: $(basename "$1") ${*:3} -> rc $rc: $out"; exit 1
  fi
}
expect() { expect_from "$worker" "$@"; }
expect "--coordinator: the coordinator's address is required" --rank=0
expect "--rank: -1 must be >= 0" --coordinator=127.0.0.1:1 --rank=-1
expect 'device: cannot parse "tpu"' --coordinator=127.0.0.1:1 --device=tpu
# A CPU build names the GPU build; a GPU build on a machine without that GPU says so.
expect "cuda:0" --coordinator=127.0.0.1:1 --device=cuda:0
expect "--row_budget must be >= 1" --coordinator=127.0.0.1:1 --row_budget=0
expect "--max_queued_mb must be in [1, 2^30]" --coordinator=127.0.0.1:1 --max_queued_mb=0
expect "--max_stream_answer_mb: 0 must be in [1, 2^30]" --coordinator=127.0.0.1:1 \
  --max_stream_answer_mb=0
expect "--max_answer_mb: -3 must be in [1, 2^30]" --coordinator=127.0.0.1:1 --max_answer_mb=-3
expect "--copy_lanes: -1 must be in [0, 64]" --coordinator=127.0.0.1:1 --copy_lanes=-1
expect "--fail_allreduce: -1 must be >= 0" --coordinator=127.0.0.1:1 --fail_allreduce=-1
expect "--shared_memory_block_mb: -1 must be in [0, 1024]" --coordinator=127.0.0.1:1 \
  --shared_memory_block_mb=-1
expect "--heartbeat_ms: 0 must be >= 1" --coordinator=127.0.0.1:1 --heartbeat_ms=0
expect "--collective_timeout_ms: -5 must be >= 1" --coordinator=127.0.0.1:1 \
  --collective_timeout_ms=-5
expect_from "$coordinator" "--world_size: 0 must be in [1, 4096]" --listen=127.0.0.1:0 \
  --world_size=0
expect_from "$coordinator" "--world_size: 100000 must be in [1, 4096]" --listen=127.0.0.1:0 \
  --world_size=100000
expect_from "$coordinator" "--liveness_ms: 0 must be >= 1" --listen=127.0.0.1:0 --liveness_ms=0
expect_from "$coordinator" '--state_dir: cannot use "/nonexistent/state"' --listen=127.0.0.1:0 \
  --state_dir=/nonexistent/state
echo "server flags test passed"
