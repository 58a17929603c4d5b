#!/usr/bin/env bash
# What an idle cluster costs, and the latency of sparse traffic: starts `shardserve up --workers=2`
# with the benchmark table (N = 100 000 x D = 128, col-wise), measures both workers' CPU over 5 s
# of idleness (clock ticks from /proc), then runs open-loop EmbeddingBag traffic (16 bags of 20
# ids per call) at 2, 20, 200 and 2000 calls/s.
#   bench/run_idle.sh [BUILD_DIR]   (default: this tree's opt build; pass another build's
#                                    bin directory, with client/ and server/, to compare)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ge 1 ]; then
  bin=$1
else
  tools/setup.sh
  bazel build -c opt //client:shardserve //client:shardserve-load //server:all >/dev/null 2>&1
  bin=.bazel/bin
fi
work=$(mktemp -d)
"$bin/client/shardserve" up --workers=2 --port=50191 --no_demo >"$work/up.log" 2>&1 &
up=$!
trap 'kill $up 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q serving "$work/up.log" 2>/dev/null && break; sleep 0.1; done
"$bin/client/shardserve" create-table --coordinator=127.0.0.1:50191 --name=bench --rows=100000 \
  --cols=128 --sharding_dim=1 --world=2 --seed=1 >/dev/null
sleep 1
workers=$(pgrep -f "worker_main.*50191" | tr '\n' ' ')
ticks() { local t=0; for p in $workers; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $t; }
before=$(ticks)
sleep 5
echo "idle: both workers used $(( $(ticks) - before )) clock ticks ($(getconf CLK_TCK)/s) in 5 s"
for qps in 2 20 200 2000; do
  secs=5
  [ "$qps" = 2 ] && secs=10
  "$bin/client/shardserve-load" --coordinator=127.0.0.1:50191 --table=bench --op=embedding_bag \
    --batch=16 --bag=20 --qps=$qps --progress=false --warmup_s=1 --duration_s=$secs | head -1
done
