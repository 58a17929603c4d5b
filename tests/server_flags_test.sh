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
expect "--group: -1 must be >= 0" --coordinator=127.0.0.1:1 --group=-1
expect "--retired_data_grace: -1s must be >= 0" --coordinator=127.0.0.1:1 \
  --retired_data_grace=-1s
expect "--drain_s: -1 must be in [0, 3600]" --coordinator=127.0.0.1:1 --drain_s=-1
expect '--metrics_listen: "9100" is not HOST:PORT' --coordinator=127.0.0.1:1 \
  --listen=127.0.0.1:0 --metrics_listen=9100
expect_from "$coordinator" '--metrics_listen: "nohost:x" is not HOST:PORT' \
  --listen=127.0.0.1:0 --metrics_listen=nohost:x
expect_from "$coordinator" "--metrics_listen: cannot listen on 192.0.2.1:0" \
  --listen=127.0.0.1:0 --metrics_listen=192.0.2.1:0
expect "--ranks_per_group goes with --rank_from_hostname" --coordinator=127.0.0.1:1 \
  --ranks_per_group=2
expect "--ranks_per_group: -1 must be >= 0" --coordinator=127.0.0.1:1 --rank_from_hostname \
  --ranks_per_group=-1
expect_from "$coordinator" "--groups: 0 must be in [1, 1024]" --listen=127.0.0.1:0 --groups=0
# A StatefulSet pod's ordinal N is rank N % W of group N / W (in a UTS namespace of its own, where
# this test may set the hostname; skipped where it may not).
if unshare -u true 2>/dev/null; then
  out=$(unshare -u sh -c "hostname shardserve-worker-3 && timeout 3 '$worker' \
      --coordinator=127.0.0.1:1 --rank_from_hostname --ranks_per_group=2 --listen=127.0.0.1:0" \
      2>&1)
  grep -q "worker group 1 rank 1 serving" <<<"$out" || { echo "FAIL: ordinal 3: $out"; exit 1; }
else
  echo "skipped: the ordinal -> (group, rank) check needs a UTS namespace"
fi
expect_from "$coordinator" "--world_size: 0 must be in [1, 4096]" --listen=127.0.0.1:0 \
  --world_size=0
expect_from "$coordinator" "--world_size: 100000 must be in [1, 4096]" --listen=127.0.0.1:0 \
  --world_size=100000
expect_from "$coordinator" "--liveness_ms: 0 must be >= 1" --listen=127.0.0.1:0 --liveness_ms=0
expect_from "$coordinator" '--state_dir: cannot use "/nonexistent/state"' --listen=127.0.0.1:0 \
  --state_dir=/nonexistent/state
echo "server flags test passed"
