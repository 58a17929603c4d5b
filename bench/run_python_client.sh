#!/usr/bin/env bash
# The Python client's EmbeddingBag against the C++ load tester (shardserve-load), on the same
# local cluster in the same run: 512 bags x 20 ids per call, mode sum, concurrency 1 and 4
# (Python: threads sharing one shardserve.Client, and asyncio tasks sharing one
# shardserve.aio.Client; C++: asynchronous call chains). ROUNDS interleaved rounds (the order of
# the implementations turns each round), SECONDS each after 1 s of warm-up; medians at the end.
# Then the decode cost of one answer per MiB (zero-copy vs the generated protobuf class).
# Shapes: N = 100 000 rows, D = 128, fp32, W = 2 CPU workers, col-wise (as bench/run_e2e.sh).
#   bench/run_python_client.sh [ROUNDS] [SECONDS]     (BAZEL="flock LOCK bazel" to share a lock)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
secs=${2:-5}
port=${PORT:-50361}
tools/setup.sh
${BAZEL:-bazel} build -c opt //client:shardserve //client:shardserve-load //server:all \
  //proto:shardserve_py_gen >/dev/null 2>&1
bin=.bazel/bin
work=$(mktemp -d)
out=bench/results/python_client_$(date -u +%Y%m%dT%H%M%SZ).jsonl
mkdir -p bench/results
: > "$out"
cluster_pid=
cleanup() {
  [ -n "$cluster_pid" ] && kill "$cluster_pid" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# The package as the tests use it: python/shardserve plus the genrule's generated modules.
mkdir -p "$work/site"
cp -r python/shardserve "$work/site/"
cp "$bin/proto/shardserve_pb2.py" "$bin/proto/shardserve_pb2_grpc.py" \
  "$work/site/shardserve/_proto/"
export PYTHONPATH="$work/site"

$bin/client/shardserve up --workers=2 --port="$port" --no_demo >"$work/up.log" 2>&1 &
cluster_pid=$!
for _ in $(seq 100); do grep -q serving "$work/up.log" 2>/dev/null && break; sleep 0.1; done
$bin/client/shardserve create-table --coordinator=127.0.0.1:"$port" --name=bench --rows=100000 \
  --cols=128 --sharding_dim=1 --world=2 --seed=1 >/dev/null
sleep 0.5

record() {  # case: appends the report just written
  if [ ! -s "$work/r.json" ]; then
    echo "run_python_client: no report for $1" >&2
    return
  fi
  echo "{\"case\": \"$1\", \"report\": $(cat "$work/r.json")}" >> "$out"
}
cpp() {  # concurrency
  rm -f "$work/r.json"
  $bin/client/shardserve-load --coordinator=127.0.0.1:"$port" --table=bench --op=embedding_bag \
    --batch=512 --bag=20 --mode=sum --concurrency="$1" --progress=false --warmup_s=1 \
    --duration_s="$secs" --report="$work/r.json" >/dev/null || true
  record "bag_c$1"
}
py() {  # impl, concurrency
  rm -f "$work/r.json"
  /usr/bin/python3 bench/python_client_bench.py --coordinator=127.0.0.1:"$port" --table=bench \
    --batch=512 --bag=20 --mode=sum --concurrency="$2" --impl="$1" --warmup_s=1 \
    --duration_s="$secs" --report="$work/r.json" >/dev/null || true
  record "bag_c$2"
}
for ((round = 1; round <= rounds; round++)); do
  for c in 1 4; do
    if ((round % 2)); then
      cpp "$c"; py threads "$c"; py asyncio "$c"
    else
      py asyncio "$c"; py threads "$c"; cpp "$c"
    fi
  done
done
rm -f "$work/r.json"
/usr/bin/python3 bench/python_client_bench.py --coordinator=127.0.0.1:"$port" --table=bench \
  --batch=512 --bag=20 --decode --report="$work/r.json" >/dev/null
record decode

/usr/bin/python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rates = {}
for r in rows:
    if r["case"] == "decode":
        d = r["report"]
        print(f"decode of one {d['answer_bytes']} B answer ({d['answer_mib']} MiB):")
        for k, v in d.items():
            if isinstance(v, dict):
                print(f"  {k:22s} {v['us_per_answer']:8.2f} us/answer "
                      f"{v['us_per_mib']:8.2f} us/MiB")
        continue
    rates.setdefault((r["case"], r["report"]["impl"]), []).append(r["report"]["bags_per_s"])
summary = {}
for c in ("bag_c1", "bag_c4"):
    base = statistics.median(rates.get((c, "shardserve"), [0]))
    for impl in ("shardserve", "python-threads", "python-asyncio"):
        v = rates.get((c, impl), [])
        if not v:
            continue
        m = statistics.median(v)
        ratio = m / base if base else 0
        summary[f"{c}/{impl}"] = {"median_bags_per_s": m, "vs_cpp": round(ratio, 3), "runs": v}
        print(f"{c} {impl:15s} median {m:10.0f} bags/s  {ratio:5.2f}x C++  ({len(v)} runs)")
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"case": "summary", "report": summary}) + "\n")
PY
echo "results: $out"
