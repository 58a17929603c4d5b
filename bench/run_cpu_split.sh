#!/usr/bin/env bash
# Where the CPU goes for 64 concurrent callers with one bag each (bench/results/HISTORY.md):
# for each server - the coalescing cluster, the one-request-per-step cluster, and the bare gRPC
# servers - runs the load (unary calls, then one stream per caller) and reads every process's CPU
# from /proc over the middle of the run. Prints bags/s, how busy the machine was, and CPU
# microseconds per bag for the load generator and for the server's processes. Every process
# shares this machine's cores, so bags/s <= cores / (CPU per bag, all processes). The lines also go
# to bench/results/cpu_split_*.txt.
#   bench/run_cpu_split.sh [ROUNDS] [BUILD_DIR]   (default 1 round; this tree's opt build)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
if [ $# -ge 2 ]; then
  bin=$2
else
  tools/setup.sh
  bazel build -c opt //client:shardserve //client:shardserve-load //server:all \
    //bench:echo_server >/dev/null 2>&1
  bin=.bazel/bin
fi
work=$(mktemp -d)
out=bench/results/cpu_split_$(date -u +%Y%m%dT%H%M%SZ).txt
mkdir -p bench/results
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

start() {  # server: sets $server_pid and $target (flags for the load generator)
  case $1 in
    bare-grpc-*)
      "$bin/bench/echo_server" --port=50189 --dim=128 --api="${1#bare-grpc-}" >"$work/s.log" 2>&1 &
      server_pid=$!
      target="--target=127.0.0.1:50189 --rows=100000"
      sleep 0.5
      ;;
    *)
      local flags=()
      [ "$1" = one-request-per-step ] && flags=(--one_request_per_step)
      "$bin/client/shardserve" up --workers=2 --port=50188 --no_demo "${flags[@]}" \
        >"$work/s.log" 2>&1 &
      server_pid=$!
      for _ in $(seq 100); do grep -q serving "$work/s.log" 2>/dev/null && break; sleep 0.1; done
      "$bin/client/shardserve" create-table --coordinator=127.0.0.1:50188 --name=bench \
        --rows=100000 --cols=128 --sharding_dim=1 --world=2 --seed=1 >/dev/null
      target="--coordinator=127.0.0.1:50188"
      sleep 0.5
      ;;
  esac
  pids+=("$server_pid")
}

for ((round = 1; round <= rounds; round++)); do
  for server in shardserve one-request-per-step bare-grpc-callback bare-grpc-async; do
    start "$server"
    for mode in unary stream; do
      stream=()
      [ "$mode" = stream ] && stream=(--stream)
      # shellcheck disable=SC2086  # $target is two flags
      "$bin/client/shardserve-load" $target --table=bench --progress=false --warmup_s=1 \
        --duration_s=6 --report="$work/r.json" --op=embedding_bag --batch=1 --bag=20 \
        --concurrency=64 "${stream[@]}" >/dev/null 2>&1 &
      load=$!
      sleep 3
      /usr/bin/python3 - "$load" "$server_pid" 3 >"$work/cpu.txt" <<'PY'
import os, sys, time
load, server, secs = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def stat(pid):  # the fields after the command name
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
def tree(root):  # the process and its descendants
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                kids.setdefault(int(stat(p)[1]), []).append(int(p))
            except OSError:
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out
def ticks(pids):
    t = 0
    for p in pids:
        try:
            f = stat(p)
            t += int(f[11]) + int(f[12])  # utime + stime
        except OSError:
            pass
    return t
def busy():
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(f) - f[3] - f[4]
groups = {"load": [load], "server": tree(server)}
a = {k: ticks(v) for k, v in groups.items()}
b0 = busy()
time.sleep(secs)
b = {k: ticks(v) for k, v in groups.items()}
hz = os.sysconf("SC_CLK_TCK")
print((busy() - b0) / hz / secs, *((b[k] - a[k]) / hz / secs for k in ("load", "server")))
PY
      wait "$load" || true
      cpu=$(cat "$work/cpu.txt")
      /usr/bin/python3 - "$server" "$mode" "$work/r.json" "$cpu" <<'PY' | tee -a "$out"
import json, sys
server, mode, report, cpu = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
rate = json.load(open(report))["bags_per_s"]
machine, load, srv = (float(x) for x in cpu)
print(f"{server:22s} {mode:6s} {rate:9,.0f} bags/s  busy cores {machine:4.2f}  "
      f"CPU per bag: load generator {load / rate * 1e6:5.1f} us, server {srv / rate * 1e6:5.1f} us")
PY
    done
    kill "$server_pid"; wait "$server_pid" 2>/dev/null || true
  done
done
