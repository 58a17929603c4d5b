#!/usr/bin/env bash
# Online updates, each against its baseline in the same run, ROUNDS interleaved rounds,
# medians reported:
#   1. durable update throughput: UpdateRows (ADD, 512 random rows of D = 128 per call, --concurrency
#      callers, every update synced to both workers' logs before its answer) vs Redis with
#      appendonly yes + appendfsync always doing the same writes (MSET of 512 rows' bytes per call,
#      as many connections);
#   2. lookups (EmbeddingBag 512 x 20, closed loop) alone, then while updates run open-loop at 20 %
#      of the rate measured in 1; and beside the ordered fan-out's updates (below), at the same
#      rate and at 20 % of the fan-out's own;
#   and two ceilings: the same update calls to a gRPC server that parses and answers them at once
#   (bench/echo_server): what gRPC and the load generator alone carry here; and the durable
#   fan-out: every one of the R x W ranks sent its share of each update (512 rows x D / W floats)
#   straight from the client, appending it to its own log with one fdatasync per batch before it
#   answers (echo_server --log_dir): the least work any design does that keeps every replica's
#   every rank durable, with no checks, ordering, agreement or applying. And the ordered fan-out
#   (bench/fanout_client): the same shares, each update first given its place in one stream by a
#   sequencer (echo_server --sequencer), and each rank (echo_server --shard_rows) checking it and
#   adding it to its shard in that order before it logs and syncs it: the least design that gives
#   every replica the same stream, which an exact replicated service needs.
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
bazel build -c opt //client:shardserve //client:shardserve-load //server:all //bench:redis_baseline //bench:echo_server //bench:fanout_client >/dev/null 2>&1
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
ranks=$((groups * 2))
for r in $(seq "$ranks"); do  # the durable fan-out's ranks, each with its own log
  mkdir -p "$work/fanout$r"
  $bin/bench/echo_server --port=$((50110 + r)) --dim=64 --log_dir="$work/fanout$r" \
    >"$work/fanout$r.log" 2>&1 &
  pids+=($!)
done
# The ordered fan-out: a sequencer, and a rank per shard, each holding its N x D / W shard.
$bin/bench/echo_server --port=50120 --sequencer >"$work/sequencer.log" 2>&1 &
pids+=($!)
ordered=()
for r in $(seq "$ranks"); do
  mkdir -p "$work/ordered$r"
  $bin/bench/echo_server --port=$((50120 + r)) --dim=64 --shard_rows=100000 \
    --log_dir="$work/ordered$r" >"$work/ordered$r.log" 2>&1 &
  pids+=($!)
  ordered+=("127.0.0.1:$((50120 + r))")
done
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
# Unrecorded warm-ups of both ordered paths: a first run's logs and shards are cold (the ordered
# fan-out's first round once ran at 14 % of its rate), and 20 % of each rate is taken from the
# rounds measured so far.
$bin/client/shardserve-load --coordinator=127.0.0.1:50161 --table=bench --progress=false \
  --op=update --update_rows=512 --concurrency="$conc" --warmup_s=0 --duration_s=3 >/dev/null 2>&1 || true
$bin/bench/fanout_client --sequencer=127.0.0.1:50120 --ranks="$(IFS=,; echo "${ordered[*]}")" \
  --world=2 --rows=100000 --dim=128 --update_rows=512 --concurrency="$conc" --warmup_s=0 \
  --duration_s=3 >/dev/null 2>&1 || true
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
  fan=()
  for r in $(seq "$ranks"); do
    rm -f "$work/f$r.json"
    $bin/client/shardserve-load --target=127.0.0.1:$((50110 + r)) --rows=100000 --dim=64 \
      --table=bench --progress=false --op=update --update_rows=512 --concurrency="$conc" \
      --warmup_s=1 --duration_s="$secs" --report="$work/f$r.json" >/dev/null 2>&1 &
    fan+=($!)
  done
  wait "${fan[@]}" || true
  # One update is done when every rank has its share: the ranks' mean rate (at least what they
  # carry together), their slowest p50 and p99.
  python3 - "$work" "$ranks" >> "$out" <<'PY'
import json, os, sys
paths = [f"{sys.argv[1]}/f{r}.json" for r in range(1, int(sys.argv[2]) + 1)]
if not all(os.path.getsize(p) if os.path.exists(p) else 0 for p in paths):
    sys.exit(print("run_updates: no report for durable_fanout", file=sys.stderr))
reports = [json.load(open(p)) for p in paths]
errors = {}
for r in reports:
    for code, n in r["errors_by_code"].items(): errors[code] = errors.get(code, 0) + n
print(json.dumps({"case": "durable_fanout", "report": {
    "rows_per_s": sum(r["rows_per_s"] for r in reports) / len(reports),
    "per_rank_rows_per_s": [r["rows_per_s"] for r in reports],
    "latency": {k: max(r["latency"][k] for r in reports) for k in ("p50_us", "p99_us")},
    "errors_by_code": errors}}))
PY
  rm -f "$work/r.json"
  $bin/bench/fanout_client --sequencer=127.0.0.1:50120 --ranks="$(IFS=,; echo "${ordered[*]}")" \
    --world=2 --rows=100000 --dim=128 --update_rows=512 --concurrency="$conc" --warmup_s=1 \
    --duration_s="$secs" --report="$work/r.json" >/dev/null 2>&1 || true
  record ordered_fanout
  # The ceilings' logs are flushed before the lookups, so that their write-back does not land on
  # the lookups' measurements.
  sync
  sleep 1
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
  # The same reads beside the ordered fan-out's updates, at shardserve's rate (what the least
  # ordered design's CPU per update would leave these lookups), then at 20 % of its own rate (the
  # target's measure, held to the least design).
  for fan in same:"$qps" own:"$(python3 -c "print(round(0.2 * $(rate ordered_fanout), 1))")"; do
    rm -f "$work/u.json"
    $bin/bench/fanout_client --sequencer=127.0.0.1:50120 --ranks="$(IFS=,; echo "${ordered[*]}")" \
      --world=2 --rows=100000 --dim=128 --update_rows=512 --qps="${fan#*:}" --warmup_s=0.5 \
      --duration_s="$((secs + 1))" --report="$work/u.json" >/dev/null 2>&1 &
    upd=$!
    load "reads_with_ordered_fanout_${fan%%:*}" --op=embedding_bag --batch=512 --bag=20 --concurrency=4
    wait "$upd" || true
    [ -s "$work/u.json" ] && echo "{\"case\": \"ordered_fanout_${fan%%:*}\", \"report\": $(cat "$work/u.json")}" >> "$out"
  done
done
python3 bench/updates_report.py "$out"
