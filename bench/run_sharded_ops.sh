#!/usr/bin/env bash
# Side-by-side benchmark of the in-process sharded ops against PyTorch 1.13's own sharded op and the
# unsharded single-thread op, in one run: ROUNDS rounds, the three alternating, medians reported.
#
#   bench/run_sharded_ops.sh [ROUNDS]            (default 5)
# Writes the raw JSON lines to bench/results/ and prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
baseline=bench/torch_sharded_baseline.py  # PyTorch's own sharded op, as a user would run it
bazel build -c opt //bench:sharded_ops_bench >/dev/null
bin=.bazel/bin/bench/sharded_ops_bench
mkdir -p bench/results
out=bench/results/sharded_ops_$(date -u +%Y%m%dT%H%M%SZ).jsonl
: > "$out"

run_case() {  # name, shardserve flags, python flags
  local name=$1 ours=$2 theirs=$3
  for ((i = 1; i <= rounds; i++)); do
    echo "{\"case\": \"$name\", \"round\": $i, \"result\": $($bin $ours)}" >> "$out"
    echo "{\"case\": \"$name\", \"round\": $i, \"result\": $(/usr/bin/python3 "$baseline" $theirs)}" >> "$out"
    echo "{\"case\": \"$name\", \"round\": $i, \"result\": $(/usr/bin/python3 bench/unsharded_baseline.py $theirs)}" >> "$out"
  done
}

run_case embedding_bag_col \
  "--op=embedding_bag --sharding=col --world=2 --rows=100000 --dim=128 --batch=512 --bag=20 --mode=sum" \
  "--op embedding_bag --world 2 --rows 100000 --dim 128 --batch 512 --bag 20 --mode sum"
run_case linear_col \
  "--op=linear --sharding=col --world=2 --dim=128 --out=1024 --batch=512" \
  "--op linear --world 2 --dim 128 --out 1024 --batch 512"

/usr/bin/python3 - "$out" <<'PY'
import json, statistics, sys
by = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    res = r["result"]
    rate = res.get("bags_per_s") or res.get("rows_per_s")
    by.setdefault(r["case"], {}).setdefault(res["impl"], []).append((res["per_step_ms"], rate))
print("| case | impl | median per step (ms) | median rate (/s) | shardserve ÷ impl |")
print("|---|---|---|---|---|")
for case, impls in by.items():
    ours = statistics.median(r for _, r in impls["shardserve"])
    for impl, runs in impls.items():
        ms = statistics.median(m for m, _ in runs)
        rate = statistics.median(r for _, r in runs)
        print(f"| {case} | {impl} | {ms:.3f} | {rate:,.0f} | {ours / rate:.2f}x |")
print(f"\nraw: {sys.argv[1]}")
PY
