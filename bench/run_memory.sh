#!/usr/bin/env bash
# Worker memory and load time for a 2 GiB table (4 194 304 x 128 fp32) on W = 2 CPU workers: each
# worker's RSS (and peak) against its shard's bytes, and the time CreateTable takes to serve it,
# from a safetensors checkpoint and from a seed.   bench/run_memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build -c opt //client:shardserve //server:all >/dev/null 2>&1
bin=.bazel/bin
work=$(mktemp -d)
rows=4194304
cols=128
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
/usr/bin/python3 - "$work/big.safetensors" $rows $cols <<'PY'
import json, struct, sys, numpy as np
path, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
header = json.dumps({"weight": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, rows * cols * 4]}}).encode()
header += b" " * (-(len(header) + 8) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header))); f.write(header)
    rng = np.random.default_rng(0)
    for start in range(0, rows, 262144):
        f.write(rng.standard_normal((min(262144, rows - start), cols), dtype=np.float32).tobytes())
PY
$bin/client/shardserve up --workers=2 --port=50191 --no_demo >"$work/up.log" 2>&1 &
for _ in $(seq 100); do grep -q serving "$work/up.log" 2>/dev/null && break; sleep 0.1; done
rss() {  # prints "rank: RSS MiB, peak MiB" for each worker
  for pid in $(pgrep -f "worker_main.*--coordinator=127.0.0.1:50191"); do
    rank=$(tr '\0' ' ' < /proc/$pid/cmdline | grep -o -- '--rank=[0-9]*' | cut -d= -f2)
    awk -v r="$rank" '/VmRSS/{rss=$2} /VmHWM/{hwm=$2} END{printf "    rank %s: RSS %.0f MiB, peak %.0f MiB\n", r, rss/1024, hwm/1024}' /proc/$pid/status
  done
}
shard_mib=$(( rows * cols * 4 / 2 / 1048576 ))
echo "shard per worker: $shard_mib MiB; bound 1.15 x shard + 150 MiB = $(( shard_mib * 115 / 100 + 150 )) MiB"
echo "idle workers:"; rss
for init in "--checkpoint=$work/big.safetensors" "--seed=3"; do
  start=$(date +%s.%N)
  $bin/client/shardserve create-table --coordinator=127.0.0.1:50191 --name=big --rows=$rows --cols=$cols \
    --sharding_dim=1 --world=2 $init --deadline_ms=600000 >/dev/null
  end=$(date +%s.%N)
  echo "table from ${init%%=*}: serving after $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b - a}') s"; rss
  $bin/client/shardserve drop big --coordinator=127.0.0.1:50191
  sleep 1
done
