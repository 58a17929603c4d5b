#!/usr/bin/env bash
# End-to-end benchmarks over gRPC on loopback, each against its baseline in the same run:
#   1. EmbeddingBag 512 x 20 ids per call, concurrency 1/4/16 vs Redis MGET + client-side pooling
#   2. Embedding of 10 240 ids per call vs Redis MGET
#   3. response bandwidth, client -> worker, vs a trivial gRPC server returning the same bytes (on
#      gRPC's callback API, and on one completion-queue thread); and the coordinator-forwarded path
#   4. 64 concurrent callers with one bag each: step-loop coalescing vs one request per step (and
#      vs one request per rank per step), with unary calls and with each caller on a stream; the
#      trivial servers' rates are the ceiling (what gRPC alone carries here, unary and on streams)
# Shapes: N = 100 000 rows, D = 128, fp32, W = 2 CPU workers, col-wise. ROUNDS interleaved rounds,
# medians reported.   bench/run_e2e.sh [ROUNDS] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
secs=${2:-5}
tools/setup.sh
bazel build -c opt //client:shardserve //client:shardserve-load //server:all //bench:redis_baseline //bench:echo_server >/dev/null 2>&1
bin=.bazel/bin
work=$(mktemp -d)
out=bench/results/e2e_$(date -u +%Y%m%dT%H%M%SZ).jsonl
mkdir -p bench/results
: > "$out"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

redis-server --port 6399 --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$work/redis.log" 2>&1 &
pids+=($!)
$bin/bench/echo_server --port=50099 --dim=128 >"$work/echo.log" 2>&1 &
pids+=($!)
$bin/bench/echo_server --port=50098 --dim=128 --api=async >"$work/echo_async.log" 2>&1 &
pids+=($!)
start_cluster() {  # port, extra up flags; sets $cluster_pid
  $bin/client/shardserve up --workers=2 --port="$1" --no_demo "${@:2}" >"$work/up$1.log" 2>&1 &
  cluster_pid=$!
  pids+=($cluster_pid)
  for _ in $(seq 100); do grep -q serving "$work/up$1.log" 2>/dev/null && break; sleep 0.1; done
  $bin/client/shardserve create-table --coordinator=127.0.0.1:"$1" --name=bench --rows=100000 \
    --cols=128 --sharding_dim=1 --world=2 --seed=1 >/dev/null
  sleep 0.5
}
start_cluster 50151
$bin/bench/redis_baseline --port=6399 --load --rows=100000 --dim=128 >/dev/null

record() {  # case, impl (empty: as reported): appends the report just written, if there is one
  if [ ! -s "$work/r.json" ]; then
    echo "run_e2e: no report for $1 ${2:-}" >&2
    return
  fi
  [ -n "$2" ] && sed -i "s/\"impl\": \"[^\"]*\"/\"impl\": \"$2\"/" "$work/r.json"
  echo "{\"case\": \"$1\", \"report\": $(cat "$work/r.json")}" >> "$out"
}
load() {  # case, impl (empty: shardserve), port, flags...
  rm -f "$work/r.json"
  $bin/client/shardserve-load --coordinator=127.0.0.1:"$3" --table=bench --progress=false \
    --warmup_s=1 --duration_s="$secs" --report="$work/r.json" "${@:4}" >/dev/null || true
  record "$1" "$2"
}
echo_load() {  # case, flags...: against both trivial servers
  for api in callback async; do
    port=50099
    [ "$api" = async ] && port=50098
    rm -f "$work/r.json"
    $bin/client/shardserve-load --target=127.0.0.1:$port --rows=100000 --table=bench \
      --progress=false --warmup_s=1 --duration_s="$secs" --report="$work/r.json" "${@:2}" \
      >/dev/null || true
    record "$1" "bare-grpc-echo-$api"
  done
}
redis() {  # case, flags...
  rm -f "$work/r.json"
  $bin/bench/redis_baseline --port=6399 --warmup_s=1 --duration_s="$secs" --report="$work/r.json" "${@:2}" >/dev/null || true
  record "$1" ""
}
for ((round = 1; round <= rounds; round++)); do
  for c in 1 4 16; do
    load "bag_c$c" "" 50151 --op=embedding_bag --batch=512 --bag=20 --concurrency=$c
    redis "bag_c$c" --op=embedding_bag --batch=512 --bag=20 --concurrency=$c
  done
  for c in 1 4; do
    load "emb10240_c$c" "" 50151 --op=embedding --batch=512 --bag=20 --concurrency=$c
    redis "emb10240_c$c" --op=embedding --batch=512 --bag=20 --concurrency=$c
  done
  echo_load "bandwidth_c4" --op=embedding --batch=512 --bag=20 --concurrency=4
  load "bandwidth_c4" "" 50151 --op=embedding --batch=512 --bag=20 --concurrency=4
  load "bandwidth_c4" shardserve-via-coordinator 50151 --op=embedding --batch=512 --bag=20 \
    --concurrency=4 --via_coordinator
  echo_load "coalesce_64x1" --op=embedding_bag --batch=1 --bag=20 --concurrency=64
  load "coalesce_64x1" "" 50151 --op=embedding_bag --batch=1 --bag=20 --concurrency=64
  echo_load "coalesce_64x1_stream" --op=embedding_bag --batch=1 --bag=20 --concurrency=64 --stream
  load "coalesce_64x1_stream" "" 50151 --op=embedding_bag --batch=1 --bag=20 --concurrency=64 \
    --stream
  # The baseline clusters run only while measured (idle workers still cost a few % of CPU): one
  # request per step (the group runs one request a step, the ranks taking turns: no coalescing),
  # and one request per rank per step (each of the 2 ranks brings one: a step carries two).
  # (In result files before e2e_20261201T025712Z, shardserve-one-request-per-step is the latter.)
  for baseline in one-request-per-step:--one_request_per_step \
                  one-request-per-rank-per-step:--row_budget=1; do
    start_cluster 50152 "${baseline#*:}"
    for mode in "" _stream; do
      load "coalesce_64x1$mode" "shardserve-${baseline%%:*}" 50152 --op=embedding_bag --batch=1 \
        --bag=20 --concurrency=64 ${mode:+--stream}
    done
    kill "$cluster_pid"; wait "$cluster_pid" 2>/dev/null || true
  done
done

/usr/bin/python3 - "$out" <<'PY'
import json, statistics, sys
by = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    rep = r["report"]
    rate_key = next(k for k in rep if k.endswith("_per_s") and k != "calls_per_s")
    by.setdefault(r["case"], {}).setdefault(rep["impl"], []).append(
        (rep[rate_key], rep["latency"]["p50_us"], rep["latency"]["p99_us"], rate_key, sum(rep["errors_by_code"].values())))
print("| case | impl | median rate | p50 (ms) | p99 (ms) | errors | shardserve ÷ impl |")
print("|---|---|---|---|---|---|---|")
for case, impls in by.items():
    ours = statistics.median(x[0] for x in impls.get("shardserve", [(0,)]))
    for impl, runs in impls.items():
        rate = statistics.median(x[0] for x in runs)
        print(f"| {case} | {impl} | {rate:,.0f} {runs[0][3].replace('_per_s','')}/s | "
              f"{statistics.median(x[1] for x in runs)/1e3:.2f} | {statistics.median(x[2] for x in runs)/1e3:.2f} | "
              f"{sum(x[4] for x in runs)} | {ours / rate if rate else 0:.2f}x |")
for case, impls in by.items():
    for name in ("one-request-per-step", "one-request-per-rank-per-step"):
        base = impls.get("shardserve-" + name)
        if not base:
            continue
        # coalescing: the ratio of each round's pair, and their median
        ratios = [a[0] / b[0] for a, b in zip(impls["shardserve"], base)]
        print(f"{case} over {name}: per-round ratios {', '.join(f'{r:.2f}x' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")
        echoes = [impls[k] for k in impls if k.startswith("bare-grpc-echo")]
        if echoes:  # the most any coalescing could reach: gRPC alone over the baseline
            ceilings = [max(e[i][0] for e in echoes) / b[0] for i, b in enumerate(base)]
            print(f"{case}: bare gRPC ÷ {name}, per round "
                  f"{', '.join(f'{r:.2f}x' for r in ceilings)}; median {statistics.median(ceilings):.2f}x")
print(f"\nraw: {sys.argv[1]}")
PY
