#!/usr/bin/env bash
# A/B of two builds on the update path's cost to lookups, the builds alternating: for a change
# that should leave lookups beside updates better off (the target of lookups beside updates).
#   bench/run_updates_ab.sh BIN_A BIN_B [SETS] [ROUNDS] [QPS]      (default 3 3 126)
# Each set starts, for A then B, a fresh R = 2 x W = 2 cluster (`shardserve up --state_dir` on
# /var/tmp, this machine's disk) with the 100 000 x 128 table of bench/run_updates.sh, then ROUNDS
# rounds of: EmbeddingBag 512 x 20, 4 callers, 5 s alone; the same beside updates (ADD, 512 rows)
# open loop at QPS (126: 20 % of ~630 updates/s, this VM's rate at 16 callers). Then updates at
# QPS alone for 8 s, with every server process's CPU (/proc/PID/stat) per update.
# BIN_A and BIN_B each hold opt builds of shardserve, shardserve-load, coordinator_main and
# worker_main (as for bench/run_ab.sh). Raw JSON lines in bench/results/updates_ab_<time>.jsonl;
# medians by build on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
a=$(realpath "$1")
b=$(realpath "$2")
sets=${3:-3}
rounds=${4:-3}
qps=${5:-126}
out=bench/results/updates_ab_$(date -u +%Y%m%dT%H%M%SZ).jsonl
mkdir -p bench/results
: >"$out"
work=$(mktemp -d /var/tmp/shardserve-updates-ab.XXXXXX)  # on disk: fsync must mean it
up=
cleanup() { [ -n "$up" ] && kill "$up" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
load() {  # bin, report, flags...
  "$1/shardserve-load" --coordinator=127.0.0.1:50171 --table=bench --progress=false \
    --report="$2" "${@:3}" >/dev/null 2>&1 || true
}
record() {  # case, build, set, report file
  [ -s "$4" ] || { echo "run_updates_ab: no report for $1 $2" >&2; return; }
  echo "{\"case\": \"$1\", \"build\": \"$2\", \"set\": $3, \"report\": $(cat "$4")}" >>"$out"
}
cpu_ticks() {  # the server processes' user + system clock ticks, summed
  local total=0
  for p in $(pgrep -P "$up"); do total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
  echo "$total"
}
for set in $(seq "$sets"); do
  for build in A B; do
    bin=$a
    [ "$build" = B ] && bin=$b
    rm -rf "$work/state"
    "$bin/shardserve" up --workers=2 --groups=2 --port=50171 --no_demo --server_dir="$bin" \
      --state_dir="$work/state" >"$work/up.log" 2>&1 &
    up=$!
    for _ in $(seq 200); do grep -q serving "$work/up.log" 2>/dev/null && break; sleep 0.1; done
    grep -q serving "$work/up.log" || { cat "$work/up.log" >&2; exit 1; }
    "$bin/shardserve" create-table --coordinator=127.0.0.1:50171 --name=bench --rows=100000 \
      --cols=128 --sharding_dim=1 --world=2 --seed=1 >/dev/null
    sleep 1
    echo "set $set, build $build" >&2
    for round in $(seq "$rounds"); do
      load "$bin" "$work/r.json" --op=embedding_bag --batch=512 --bag=20 --concurrency=4 \
        --warmup_s=1 --duration_s=5
      record reads "$build" "$set" "$work/r.json"
      load "$bin" "$work/u.json" --op=update --update_rows=512 --qps="$qps" --warmup_s=0.5 \
        --duration_s=6 &
      writer=$!
      load "$bin" "$work/r.json" --op=embedding_bag --batch=512 --bag=20 --concurrency=4 \
        --warmup_s=1 --duration_s=5
      wait "$writer" || true
      record reads_with_updates "$build" "$set" "$work/r.json"
    done
    # CPU per update: the servers' ticks over a timed run of updates alone (the loader's own
    # warm-up is outside the window: it starts before the first reading).
    load "$bin" "$work/u.json" --op=update --update_rows=512 --qps="$qps" --warmup_s=0 \
      --duration_s=9 &
    writer=$!
    sleep 0.5
    t0=$(cpu_ticks)
    s0=$(date +%s.%N)
    sleep 8
    t1=$(cpu_ticks)
    s1=$(date +%s.%N)
    wait "$writer" || true
    python3 -c "import json; print(json.dumps({'ms_per_update': ($t1 - $t0) * 10.0 / ($qps * ($s1 - $s0)), 'qps': $qps}))" >"$work/c.json"
    record cpu_per_update "$build" "$set" "$work/c.json"
    kill "$up"
    wait "$up" 2>/dev/null || true
    up=
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def of(case, build):
    return [r["report"] for r in rows if r["case"] == case and r["build"] == build]
print("| build | lookups beside updates / alone (rounds) | p99 ratio (rounds) | CPU per update (sets) |")
print("|---|---|---|---|")
for build in ("A", "B"):
    alone, beside = of("reads", build), of("reads_with_updates", build)
    rate = [w["calls_per_s"] / r["calls_per_s"] for r, w in zip(alone, beside)]
    p99 = [w["latency"]["p99_us"] / r["latency"]["p99_us"] for r, w in zip(alone, beside)]
    cpu = [c["ms_per_update"] for c in of("cpu_per_update", build)]
    if not rate:
        continue
    print(f"| {build} | **{100 * statistics.median(rate):.0f} %** ({', '.join(f'{100 * x:.0f}' for x in rate)}) "
          f"| **{statistics.median(p99):.2f}x** ({', '.join(f'{x:.2f}' for x in p99)}) "
          f"| {statistics.median(cpu) if cpu else float('nan'):.2f} ms ({', '.join(f'{x:.2f}' for x in cpu)}) |")
PY
