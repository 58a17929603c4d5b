#!/usr/bin/env bash
# Online updates (issue 23), each against its baseline in the same run, ROUNDS interleaved rounds,
# medians reported:
#   1. durable update throughput: UpdateRows (ADD, 512 random rows of D = 128 per call, --concurrency
#      callers, every update synced to both workers' logs before its answer) vs Redis with
#      appendonly yes + appendfsync always doing the same writes (MSET of 512 rows' bytes per call,
#      as many connections);
#   2. lookups (EmbeddingBag 512 x 20, closed loop) alone, then while updates run open-loop at 20 %
#      of the rate measured in 1;
#   and the ceiling: the same update calls to a gRPC server that parses and answers them at once
#   (bench/echo_server): what gRPC and the load generator alone carry here.
# Shapes: N = 100 000 rows, D = 128, fp32, R = GROUPS replica groups (default 2) x W = 2 CPU
# workers, col-wise. With R > 1 updates go through the coordinator, which sequences one stream for
# every replica and answers once every replica synced it. Logs and Redis' AOF on this machine's
# disk.
#   bench/run_updates.sh [ROUNDS] [SECONDS] [CONCURRENCY] [GROUPS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
secs=${2:-5}
conc=${3:-16}
groups=${4:-2}
tools/setup.sh
bazel build -c opt //client:shardserve //client:shardserve-load //server:all //bench:redis_baseline //bench:echo_server >/dev/null 2>&1
bin=.bazel/bin
work=$(mktemp -d /var/tmp/shardserve-updates.XXXXXX)  # on disk, not tmpfs: fsync must mean it
out=bench/results/updates_r${groups}_$(date -u +%Y%m%dT%H%M%SZ).jsonl
mkdir -p bench/results
: > "$out"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

mkdir -p "$work/redis"
$bin/bench/echo_server --port=50096 --dim=128 >"$work/echo.log" 2>&1 &
pids+=($!)
redis-server --port 6398 --bind 127.0.0.1 --save '' --appendonly yes --appendfsync always \
  --dir "$work/redis" --daemonize no >"$work/redis.log" 2>&1 &
pids+=($!)
$bin/client/shardserve up --workers=2 --groups="$groups" --port=50161 --no_demo --state_dir="$work/state" \
  >"$work/up.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q serving "$work/up.log" 2>/dev/null && break; sleep 0.1; done
$bin/client/shardserve create-table --coordinator=127.0.0.1:50161 --name=bench --rows=100000 \
  --cols=128 --sharding_dim=1 --world=2 --seed=1 >/dev/null
sleep 1
$bin/bench/redis_baseline --port=6398 --load --rows=100000 --dim=128 >/dev/null

record() {  # case: appends the report just written, if there is one
  if [ ! -s "$work/r.json" ]; then echo "run_updates: no report for $1" >&2; return; fi
  echo "{\"case\": \"$1\", \"report\": $(cat "$work/r.json")}" >> "$out"
}
load() {  # case, flags...
  rm -f "$work/r.json"
  $bin/client/shardserve-load --coordinator=127.0.0.1:50161 --table=bench --progress=false \
    --warmup_s=1 --duration_s="$secs" --report="$work/r.json" "${@:2}" >/dev/null || true
  record "$1"
}
rate() {  # the median calls/s of case $1 so far
  python3 - "$out" "$1" <<'PY'
import json, statistics, sys
r = [json.loads(l)["report"]["calls_per_s"] for l in open(sys.argv[1]) if json.loads(l)["case"] == sys.argv[2]]
print(statistics.median(r))
PY
}
for round in $(seq "$rounds"); do
  echo "round $round" >&2
  load update --op=update --update_rows=512 --concurrency="$conc"
  rm -f "$work/r.json"
  $bin/bench/redis_baseline --port=6398 --op=mset --batch=512 --dim=128 --concurrency="$conc" \
    --warmup_s=1 --duration_s="$secs" --report="$work/r.json" >/dev/null || true
  record redis_mset
  rm -f "$work/r.json"
  $bin/client/shardserve-load --target=127.0.0.1:50096 --rows=100000 --dim=128 --table=bench \
    --progress=false --op=update --update_rows=512 --concurrency="$conc" --warmup_s=1 \
    --duration_s="$secs" --report="$work/r.json" >/dev/null || true
  record grpc_ceiling
  load reads --op=embedding_bag --batch=512 --bag=20 --concurrency=4
  qps=$(python3 -c "print(round(0.2 * $(rate update), 1))")
  # Updates at 20 % of their maximum, open loop, beside the same reads.
  $bin/client/shardserve-load --coordinator=127.0.0.1:50161 --table=bench --progress=false \
    --op=update --update_rows=512 --qps="$qps" --warmup_s=0.5 --duration_s="$((secs + 1))" \
    --report="$work/u.json" >/dev/null 2>&1 &
  upd=$!
  load reads_with_updates --op=embedding_bag --batch=512 --bag=20 --concurrency=4
  wait "$upd" || true
  [ -s "$work/u.json" ] && echo "{\"case\": \"updates_at_20pct\", \"report\": $(cat "$work/u.json")}" >> "$out"
done
python3 bench/updates_report.py "$out"
