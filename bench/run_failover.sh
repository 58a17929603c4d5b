#!/usr/bin/env bash
# Failover drill: R = 2 groups x W = 2 CPU workers on loopback, the benchmark table
# (100 000 x 128, col-wise) on both groups, and open-loop load from shardserve-load straight to the
# workers at about half the cluster's capacity (measured first, closed loop), EmbeddingBag of 64
# bags x 20 ids, 2 s deadlines. In turn:
#   1. worker (group 0, rank 1) SIGKILLed at t = 5 s and started again at t = 15 s;
#   2. the same worker SIGSTOPped at t = 5 s and continued at t = 15 s (hung: its sockets stay
#      open, nothing fails - only the clients' hedges and the coordinator's liveness find it).
# Targets: >= 99.9 % of calls succeed, none ends past its deadline, p99 while group 0 is out <= 3x
# the steady p99 before the fault; and the time until group 0 serves again.
# Then throughput against groups: R = 2 x W = 1 and R = 1 x W = 1 under the same closed-loop load,
# with each process's CPU seconds (the load generator shares the 2 cores).
# Results in bench/results/failover_<time>/: each run's report JSON, every call of the fault runs
# (CSV, gzipped), a time line plot per fault (SVG: calls and errors per 100 ms, p99),
# summary.json; Markdown on stdout.
#   bench/run_failover.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build -c opt --copt=-O3 //client:shardserve //client:shardserve-load \
  //server:coordinator_main //server:worker_main >/dev/null 2>&1
bin=.bazel/bin
work=$(mktemp -d)
out=bench/results/failover_$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
now() { date +%s.%N; }
since() { python3 -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$(now)" "$1"; }

port=0
cluster_up() {  # groups, ranks per group
  port=$((20000 + RANDOM % 20000))
  $bin/server/coordinator_main --listen=127.0.0.1:$port --groups="$1" --world_size="$2" \
    >>"$work/coordinator.log" 2>&1 &
  pids+=($!)
  for ((w = 0; w < $1 * $2; w++)); do start_worker "$w" "$2"; done
  cli create-table --name=bench --rows=100000 --cols=128 --sharding_dim=1 --world="$2" --seed=1 \
    >/dev/null
}
cluster_down() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}
declare -A worker
start_worker() {  # worker number, ranks per group
  rm -f "$work/w$1.port"
  $bin/server/worker_main --coordinator=127.0.0.1:$port --group=$(($1 / $2)) --rank=$(($1 % $2)) \
    --port_file="$work/w$1.port" --drain_s=0 >>"$work/worker$1.log" 2>&1 &
  worker[$1]=$!
  pids+=("${worker[$1]}")
  for _ in $(seq 100); do [ -s "$work/w$1.port" ] && break; sleep 0.05; done
}
cli() { $bin/client/shardserve --coordinator=127.0.0.1:$port --deadline_ms=30000 "$@"; }
load() {  # name, flags...
  $bin/client/shardserve-load --coordinator=127.0.0.1:$port --table=bench --op=embedding_bag \
    --batch=64 --bag=20 --timeline_ms=100 --deadline_ms=2000 --progress=false \
    --report="$out/$1.json" --svg="$out/$1.load.svg" "${@:2}" \
    >"$out/$1.txt" 2>&1
}
# When group 0 serves again (polled every 100 ms from the coordinator), in seconds since $2.
watch_group0() {  # file, t0
  ( while :; do
      if cli cluster --json 2>/dev/null | python3 -c "import json,sys; c=json.load(sys.stdin); sys.exit(0 if c['groups'][0]['state']=='GROUP_STATE_SERVING' else 1)"; then
        since "$2" >"$1"; exit 0
      fi
      sleep 0.1
    done ) &
  watcher=$!
}
events="{}"
event() {  # run, key, value
  events=$(python3 -c "import json,sys; e=json.loads(sys.argv[1]); e.setdefault(sys.argv[2], {})[sys.argv[3]] = float(sys.argv[4]); print(json.dumps(e))" "$events" "$1" "$2" "$3")
}

# --- R = 2 x W = 2: capacity, then the faults at half of it.
cluster_up 2 2
load capacity --concurrency=8 --warmup_s=2 --duration_s=8
qps=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['calls_per_s'] / 2))" \
  "$out/capacity.json")
event capacity qps_used "$qps"
all_serving() {  # every group formed and serving, within 30 s
  for _ in $(seq 300); do
    cli cluster --json 2>/dev/null | python3 -c "import json,sys; c=json.load(sys.stdin); sys.exit(0 if all(g['state']=='GROUP_STATE_SERVING' for g in c['groups']) else 1)" && return 0
    sleep 0.1
  done
  return 1
}
for fault in kill stop; do
  run="${fault}_worker"
  all_serving
  sleep 3  # settled: a restarted worker's first steps and loads are over
  t0=$(now)
  load "$run" --qps="$qps" --warmup_s=0 --duration_s=25 --calls_csv="$out/$run.csv" &
  loader=$!
  sleep 5
  if [ "$fault" = kill ]; then kill -9 "${worker[1]}"; else kill -STOP "${worker[1]}"; fi
  event "$run" fault_at "$(since "$t0")"
  sleep 10
  if [ "$fault" = kill ]; then wait "${worker[1]}" 2>/dev/null || true; start_worker 1 2
  else kill -CONT "${worker[1]}"; fi
  event "$run" back_at "$(since "$t0")"
  watch_group0 "$work/served" "$t0"
  wait "$loader" || true
  wait "$watcher" 2>/dev/null || true
  event "$run" group_serving_at "$(cat "$work/served" 2>/dev/null || echo -1)"
  rm -f "$work/served"
  sleep 2
done
cluster_down

# --- Throughput against groups: R = 1 x W = 1 and R = 2 x W = 1, the same load.
cpu_of() {  # pid -> utime + stime in seconds
  awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat" 2>/dev/null || echo 0
}
for groups in 1 2; do
  cluster_up "$groups" 1
  run="scale_${groups}x1"
  declare -A before=()
  for p in "${pids[@]}"; do before[$p]=$(cpu_of "$p"); done
  load "$run" --concurrency=8 --warmup_s=2 --duration_s=10 &
  loader=$!
  sleep 0.2
  loader_pid=$(pgrep -n -f "report=$out/$run.json" || echo "")
  lcpu=0
  while kill -0 "$loader" 2>/dev/null; do
    [ -n "$loader_pid" ] && lcpu=$(cpu_of "$loader_pid")
    sleep 0.2
  done
  wait "$loader" || true
  coordinator_cpu=$(python3 -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$(cpu_of "${pids[0]}")" "${before[${pids[0]}]}")
  workers_cpu=0
  for p in "${pids[@]:1}"; do
    workers_cpu=$(python3 -c "import sys; print(float(sys.argv[1]) + float(sys.argv[2]) - float(sys.argv[3]))" "$workers_cpu" "$(cpu_of "$p")" "${before[$p]}")
  done
  event "$run" cpu_load_generator_s "$lcpu"
  event "$run" cpu_coordinator_s "$coordinator_cpu"
  event "$run" cpu_workers_s "$workers_cpu"
  cluster_down
done
echo "$events" >"$out/events.json"

/usr/bin/python3 bench/failover_report.py "$out"
gzip "$out"/*.csv  # (the report reads them either way)
