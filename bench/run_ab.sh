#!/usr/bin/env bash
# A/B of two builds side by side: the in-process sharded ops and the main end-to-end cases, with
# the builds alternating in every round, so that both see the same machine. For checking that a
# change leaves performance as it was.
#   bench/run_ab.sh BIN_A BIN_B [ROUNDS] [SECONDS]     (CASES="bag_c1 ..." runs those cases only)
# BIN_A and BIN_B each hold opt builds of shardserve, shardserve-load, coordinator_main,
# worker_main and sharded_ops_bench (e.g. copied from .bazel/bin of two checkouts built with -c
# opt). Raw JSON lines in bench/results/ab_<time>.jsonl; a Markdown table (medians; B ÷ A) on
# stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
a=$(realpath "$1")
b=$(realpath "$2")
rounds=${3:-5}
secs=${4:-5}
out=bench/results/ab_$(date -u +%Y%m%dT%H%M%SZ).jsonl
mkdir -p bench/results
: >"$out"
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
start_cluster() {  # bin dir, port
  "$1/shardserve" up --workers=2 --port="$2" --no_demo --server_dir="$1" >"$work/up$2.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 200); do grep -q serving "$work/up$2.log" 2>/dev/null && break; sleep 0.1; done
  grep -q serving "$work/up$2.log" || { cat "$work/up$2.log" >&2; exit 1; }
  "$1/shardserve" create-table --coordinator=127.0.0.1:"$2" --name=bench --rows=100000 \
    --cols=128 --sharding_dim=1 --world=2 --seed=1 >/dev/null
}
start_cluster "$a" 50161
start_cluster "$b" 50162
record() {  # case, build, report file
  [ -s "$3" ] || { echo "run_ab: no report for $1 $2" >&2; return; }
  echo "{\"case\": \"$1\", \"build\": \"$2\", \"report\": $(cat "$3")}" >>"$out"
}
e2e() {  # case, flags...
  for build in A B; do
    local bin=$a port=50161
    [ "$build" = B ] && bin=$b port=50162
    rm -f "$work/r.json"
    "$bin/shardserve-load" --coordinator=127.0.0.1:$port --table=bench --progress=false \
      --warmup_s=1 --duration_s="$secs" --report="$work/r.json" "${@:2}" >/dev/null || true
    record "$1" "$build" "$work/r.json"
  done
}
ops() {  # case, flags...
  for build in A B; do
    local bin=$a
    [ "$build" = B ] && bin=$b
    "$bin/sharded_ops_bench" "${@:2}" >"$work/o.json"
    record "$1" "$build" "$work/o.json"
  done
}
cases=${CASES:-"ops_embedding_bag_col ops_linear_col bag_c1 bag_c16 emb10240_c4 coalesce_64x1 coalesce_64x1_stream"}
want() { [[ " $cases " == *" $1 "* ]]; }
for ((round = 1; round <= rounds; round++)); do
  want ops_embedding_bag_col && ops ops_embedding_bag_col --op=embedding_bag --sharding=col --world=2 --rows=100000 --dim=128 \
    --batch=512 --bag=20 --mode=sum
  want ops_linear_col && ops ops_linear_col --op=linear --sharding=col --world=2 --dim=128 --out=1024 --batch=512
  want bag_c1 && e2e bag_c1 --op=embedding_bag --batch=512 --bag=20 --concurrency=1
  want bag_c16 && e2e bag_c16 --op=embedding_bag --batch=512 --bag=20 --concurrency=16
  want emb10240_c4 && e2e emb10240_c4 --op=embedding --batch=512 --bag=20 --concurrency=4
  want coalesce_64x1 && e2e coalesce_64x1 --op=embedding_bag --batch=1 --bag=20 --concurrency=64
  want coalesce_64x1_stream && e2e coalesce_64x1_stream --op=embedding_bag --batch=1 --bag=20 --concurrency=64 --stream
done
/usr/bin/python3 - "$out" <<'PY'
import json, statistics, sys
by = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    rep = r["report"]
    if "per_step_ms" in rep:  # sharded_ops_bench
        rate = rep.get("bags_per_s") or rep.get("rows_per_s")
        p99 = None
    else:
        rate = next(v for k, v in rep.items() if k.endswith("_per_s") and k != "calls_per_s")
        p99 = rep["latency"]["p99_us"]
    by.setdefault(r["case"], {}).setdefault(r["build"], []).append((rate, p99))
print("| case | A median rate | B median rate | B ÷ A (median of rounds) | per-round B ÷ A | p99 A / B (ms) |")
print("|---|---|---|---|---|---|")
for case, builds in by.items():
    A, B = builds["A"], builds["B"]
    ratios = [b[0] / a[0] for a, b in zip(A, B)]
    p99 = ""
    if A[0][1] is not None:
        p99 = f"{statistics.median(x[1] for x in A) / 1e3:.2f} / {statistics.median(x[1] for x in B) / 1e3:.2f}"
    print(f"| {case} | {statistics.median(x[0] for x in A):,.0f} | {statistics.median(x[0] for x in B):,.0f} | "
          f"**{statistics.median(ratios):.2f}x** | {', '.join(f'{r:.2f}' for r in ratios)} | {p99} |")
print(f"\nraw: {sys.argv[1]}")
PY
