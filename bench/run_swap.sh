#!/usr/bin/env bash
# Version swap under load: W = 2 CPU workers on loopback, a 2 097 152 x 128 embedding
# table (1 GiB of float32, col-wise: 512 MiB per worker) created from a safetensors checkpoint,
# and open-loop EmbeddingBag load (64 bags x 20 ids, 2 s deadlines) straight to the workers at
# about half the cluster's capacity (measured first, closed loop). Three times (this machine is a
# shared VM: medians of the repetitions count), each under 20 s of load, at t = 5 s:
#   1. swap: `shardserve load-version` to a second 1 GiB checkpoint (loaded beside the serving
#      version, switched at a step every rank agrees on);
#   2. drop + create: today's way - DropTable, then CreateTable of the same name from that
#      checkpoint;
#   3. copy (the ceiling): no change to the table; two processes outside shardserve, at the
#      loaders' nice (10), each write 512 MiB of fresh memory at the loaders' pace (256 MiB/s, in
#      1 MiB chunks) - the memory traffic a swap cannot avoid - to show what that alone does to
#      the serving p99 on this machine.
# Each run keeps every call (CSV, gzipped); each worker's resident memory (anonymous, and file
# pages of the mapped checkpoint) is sampled every 50 ms. Targets: zero errors during the swap,
# its p99 <= 1.5 x the steady p99; the time from LoadVersion to the switch; the workers' peak
# anonymous memory against 2 x their shard.
# Each run also records the CPU time the hypervisor took from this VM (steal) as a noise gauge.
# Results in bench/results/swap_<time>/: the runs' reports, calls, memory samples, summary.json
# and a plot per run (p50 / p99 / max per 100 ms; calls and errors); Markdown on stdout.
#   [LOAD_MB_PER_S=256] bench/run_swap.sh [rows] [repetitions]   (the workers' --load_mb_per_s,
#   and the copiers' pace)
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build -c opt --copt=-O3 //client:shardserve //client:shardserve-load \
  //server:coordinator_main //server:worker_main >/dev/null 2>&1
bin=.bazel/bin
rows=${1:-2097152}
reps=${2:-3}
pace=${LOAD_MB_PER_S:-256}
cols=128
work=$(mktemp -d)
out=bench/results/swap_$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
now() { date +%s.%N; }
since() { python3 -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$(now)" "$1"; }

# Two checkpoints of different weights (finite random floats; a 1 MiB block per seed, repeated).
make_checkpoint() {  # path, seed
  python3 - "$1" "$2" "$rows" "$cols" <<'EOF'
import array, json, random, struct, sys
path, seed, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
random.seed(seed)
block = array.array("f", (random.uniform(-1, 1) for _ in range(1 << 18))).tobytes()
size = rows * cols * 4
header = json.dumps({"weight": {"dtype": "F32", "shape": [rows, cols],
                                "data_offsets": [0, size]}}).encode()
header += b" " * (-len(header) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header)
    left = size
    while left > 0:
        f.write(block[:min(left, len(block))])
        left -= len(block)
EOF
}
make_checkpoint "$work/v1.safetensors" 1
make_checkpoint "$work/v2.safetensors" 2
sync  # written back now, not during the runs
cat "$work"/v*.safetensors >/dev/null  # in the page cache, as a checkpoint just written is

port=$((20000 + RANDOM % 20000))
mkdir -p "$work/state"
$bin/server/coordinator_main --listen=127.0.0.1:$port --world_size=2 --state_dir="$work/state" \
  >>"$work/coordinator.log" 2>&1 &
pids+=($!)
declare -A worker
for w in 0 1; do
  $bin/server/worker_main --coordinator=127.0.0.1:$port --rank=$w --port_file="$work/w$w.port" \
    --drain_s=0 --load_mb_per_s="$pace" ${WORKER_FLAGS:-} >>"$work/worker$w.log" 2>&1 &
  worker[$w]=$!
  pids+=("${worker[$w]}")
done
cli() { $bin/client/shardserve --coordinator=127.0.0.1:$port --deadline_ms=120000 "$@"; }
create() {
  cli create-table --name=bench --rows="$rows" --cols=$cols --sharding_dim=1 --world=2 \
    --checkpoint="$1" >/dev/null
}
load() {  # name, flags...
  $bin/client/shardserve-load --coordinator=127.0.0.1:$port --table=bench --op=embedding_bag \
    --batch=64 --bag=20 --timeline_ms=100 --deadline_ms=2000 --progress=false \
    --report="$out/$1.json" "${@:2}" >"$out/$1.txt" 2>&1
}
memory() {  # run, t0: samples "t worker anon_kib file_kib" every 50 ms until $work/stop exists
  python3 - "$work/stop" "$2" "${worker[0]}" "${worker[1]}" >"$out/$1.memory.txt" <<'EOF'
import os, sys, time
stop, t0, pids = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
while not os.path.exists(stop):
    for w, pid in enumerate(pids):
        try:
            fields = dict(l.split(":", 1) for l in open(f"/proc/{pid}/status"))
            print(f"{time.time() - t0:.3f} {w} {fields['RssAnon'].split()[0]} "
                  f"{fields['RssFile'].split()[0]}", flush=True)
        except (OSError, KeyError):
            pass
    time.sleep(0.05)
EOF
}
for w in 0 1; do
  for _ in $(seq 200); do [ -s "$work/w$w.port" ] && break; sleep 0.05; done
done
create "$work/v1.safetensors"
load capacity --concurrency=8 --warmup_s=2 --duration_s=8
qps=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['calls_per_s'] / 2))" \
  "$out/capacity.json")
events="{\"qps\": $qps, \"rows\": $rows, \"cols\": $cols, \"load_mb_per_s\": $pace}"
event() {  # run, key, value
  events=$(python3 -c "import json,sys; e=json.loads(sys.argv[1]); e.setdefault(sys.argv[2], {})[sys.argv[3]] = float(sys.argv[4]); print(json.dumps(e))" "$events" "$1" "$2" "$3")
}
steal() { awk '/^cpu / {print $9}' /proc/stat; }
# Writes N bytes of fresh memory at PACE MiB/s in 1 MiB chunks (what one worker's loader writes).
copier='
import sys, time
n, chunk, rate = int(sys.argv[1]), 1 << 20, int(sys.argv[2]) << 20
block = bytes(range(256)) * (chunk // 256)
buf = bytearray()
start = time.monotonic()
for done in range(0, n, chunk):
    buf += block[:min(chunk, n - done)]
    time.sleep(max(0.0, start + (done + chunk) / rate - time.monotonic()))
'

current=v1
for rep in $(seq "$reps"); do
  for kind in swap drop_create copy; do
    run="${kind}_$rep"
    next=$([ "$current" = v1 ] && echo v2 || echo v1)
    sleep 3
    rm -f "$work/stop"
    steal0=$(steal)
    t0=$(now)
    memory "$run" "$t0" &
    sampler=$!
    load "$run" --qps="$qps" --warmup_s=0 --duration_s=20 --calls_csv="$out/$run.csv" &
    loader=$!
    sleep 5
    event "$run" start_at "$(since "$t0")"
    if [ "$kind" = swap ]; then
      cli load-version bench --checkpoint="$work/$next.safetensors" --json >"$out/$run.version.json"
    elif [ "$kind" = copy ]; then
      copiers=()
      for _ in 0 1; do
        nice -n 10 python3 -c "$copier" "$((rows * cols * 2))" "$pace" &
        copiers+=($!)
      done
      wait "${copiers[@]}"
      next=$current
    else
      cli drop bench >/dev/null
      event "$run" dropped_at "$(since "$t0")"
      create "$work/$next.safetensors"
    fi
    event "$run" done_at "$(since "$t0")"
    current=$next
    wait "$loader" || true
    touch "$work/stop"
    wait "$sampler" || true
    event "$run" steal_s "$(python3 -c "import os,sys; print((int(sys.argv[1]) - int(sys.argv[2])) / os.sysconf('SC_CLK_TCK'))" "$(steal)" "$steal0")"
    gzip -f "$out/$run.csv"
  done
done
echo "$events" >"$out/events.json"
python3 bench/swap_report.py "$out"
