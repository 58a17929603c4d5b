#!/usr/bin/env bash
# Fault drill: a coordinator and 2 CPU workers on loopback, under closed-loop load from
# shardserve-load straight to the workers (4 callers, 64 bags of 20 ids, 5 s deadlines, each call
# made once - no failover retries: the drill measures how the servers fail - a 100 ms timeline),
# and in turn:
#   1. the coordinator SIGKILLed and restarted on the same port and state after each of OUTAGES
#      seconds: failed calls (target: none);
#   2. worker 1 SIGSTOPped for 10 s, then SIGCONT: how soon its peer's calls fail (UNAVAILABLE,
#      target < 2 s), and how soon after SIGCONT they succeed again;
#   3. 8 streams that send 512-bag requests and never read, for 10 s: worker 0's RSS, and other
#      clients' p99 before and meanwhile;
#   4. the coordinator's state directory on a 64 KiB tmpfs filled by CreateTable: the error, and
#      a coordinator restarted on it serves the tables it had acknowledged.
# Results in bench/results/faults_<time>/ (each load's JSON report and SVG chart, summary.json);
# a Markdown summary on stdout.
#   bench/run_faults.sh [OUTAGES]      (default "10 60 150"; "10" for a quick run)
set -euo pipefail
cd "$(dirname "$0")/.."
outages=${1:-"10 60 150"}
tools/setup.sh
bazel build -c opt //client:shardserve //client:shardserve-load //server:coordinator_main \
  //server:worker_main //bench:unread_streams >/dev/null 2>&1
bin=.bazel/bin
work=$(mktemp -d)
out=bench/results/faults_$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  umount "$work/tiny" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
port=$((20000 + RANDOM % 20000))
now() { date +%s.%N; }
start_coordinator() {  # state dir
  $bin/server/coordinator_main --listen=127.0.0.1:$port --world_size=2 --state_dir="$1" \
    >>"$work/coordinator.log" 2>&1 &
  coordinator=$!
  pids+=("$coordinator")
}
start_worker() {  # rank
  rm -f "$work/w$1.port"
  $bin/server/worker_main --coordinator=127.0.0.1:$port --rank="$1" --port_file="$work/w$1.port" \
    --drain_s=0 >>"$work/worker$1.log" 2>&1 &
  worker[$1]=$!
  pids+=("${worker[$1]}")
  for _ in $(seq 100); do [ -s "$work/w$1.port" ] && break; sleep 0.05; done
}
cli() { $bin/client/shardserve --coordinator=127.0.0.1:$port --deadline_ms=30000 "$@"; }
rss_mib() { awk '/VmRSS/ {print int($2 / 1024)}' "/proc/$1/status"; }

mkdir -p "$work/state"
start_coordinator "$work/state"
start_worker 0
start_worker 1
cli create-table --name=bench --rows=100000 --cols=128 --sharding_dim=1 --world=2 --seed=1 \
  >/dev/null
load() {  # name, seconds measured, more flags...: runs in the background; sets $load_pid, $load_t0
  load_t0=$(now)
  $bin/client/shardserve-load --coordinator=127.0.0.1:$port --table=bench --op=embedding_bag \
    --batch=64 --bag=20 --concurrency=4 --warmup_s=1 --duration_s="$2" --timeline_ms=100 \
    --deadline_ms=5000 --max_attempts=1 --progress=false --report="$out/$1.json" \
    --svg="$out/$1.svg" "${@:3}" \
    >"$out/$1.txt" 2>&1 &
  load_pid=$!
}
events="{}"
event() {  # name, key, value (seconds since the load's start, or a number)
  events=$(python3 -c "import json,sys; e=json.loads(sys.argv[1]); e.setdefault(sys.argv[2], {})[sys.argv[3]] = float(sys.argv[4]); print(json.dumps(e))" "$events" "$1" "$2" "$3")
}
since() { python3 -c "import sys; print(float(sys.argv[1]) - float(sys.argv[2]))" "$(now)" "$1"; }

# 1. Coordinator outages.
for d in $outages; do
  load "coordinator_down_${d}s" $((d + 12))
  sleep 4
  kill -9 "$coordinator"
  event "coordinator_down_${d}s" killed_at "$(since "$load_t0")"
  sleep "$d"
  start_coordinator "$work/state"
  event "coordinator_down_${d}s" restarted_at "$(since "$load_t0")"
  wait "$load_pid" || true
done

# 2. A hung worker.
load stopped_worker 24
sleep 5
kill -STOP "${worker[1]}"
event stopped_worker stopped_at "$(since "$load_t0")"
sleep 10
kill -CONT "${worker[1]}"
event stopped_worker continued_at "$(since "$load_t0")"
wait "$load_pid" || true

# 3. Streams that never read, beside a load of other clients.
sleep 2
load readers_before 5
wait "$load_pid" || true
rss_before=$(rss_mib "${worker[0]}")
w0=$(cat "$work/w0.port")
$bin/bench/unread_streams --target=127.0.0.1:$w0 --table=bench --rows=100000 --streams=8 \
  --requests=400 --seconds=10 >"$out/unread_streams.json" 2>&1 &
unread=$!
sleep 2
load readers_during 6
wait "$load_pid" || true
rss_during=$(rss_mib "${worker[0]}")
wait "$unread" || true
event unread_streams rss_before_mib "$rss_before"
event unread_streams rss_during_mib "$rss_during"

# 4. A full state disk.
mkdir -p "$work/tiny"
full=skipped
if mount -t tmpfs -o size=64k tmpfs "$work/tiny" 2>/dev/null; then
  kill -9 "$coordinator"
  cp "$work/state/tables.pb" "$work/tiny/"
  start_coordinator "$work/tiny"
  sleep 1
  made=0
  err=""
  for i in $(seq 1000); do
    if ! err=$(cli create-table --name="t${i}_$(printf '%0200d' 0)" --rows=4 --cols=4 --world=2 \
                --seed=1 2>&1 >/dev/null); then
      break
    fi
    made=$i
  done
  kill -9 "$coordinator"
  start_coordinator "$work/tiny"
  sleep 2
  listed=$(cli tables 2>/dev/null | grep -c '^t[0-9]' || true)
  full=$(python3 -c "import json,sys; print(json.dumps({'created': int(sys.argv[1]), 'error': sys.argv[2], 'listed_after_restart': int(sys.argv[3])}))" "$made" "$err" "$listed")
fi
echo "$full" >"$out/full_disk.json"
echo "$events" >"$out/events.json"

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
events = json.load(open(os.path.join(out, "events.json")))
def report(name):
    return json.load(open(os.path.join(out, name + ".json")))
def errors(r):
    return sum(r["errors_by_code"].values())
rows, summary = [], {}
for name in sorted(events):
    if not name.startswith("coordinator_down_"):
        continue
    r = report(name)
    summary[name] = {"calls": r["calls"], "failed": errors(r), "p99_us": r["latency"]["p99_us"]}
    rows.append(f"| {name.replace('_', ' ')} | {r['calls']:,} calls | **{errors(r)} failed** | "
                f"p99 {r['latency']['p99_us'] / 1000:.1f} ms |")
r = report("stopped_worker")
stop, cont = events["stopped_worker"]["stopped_at"], events["stopped_worker"]["continued_at"]
bins = r["timeline"]
width = r["bin_s"]
first_error = next((b["t"] for b in bins if b["t"] + width > stop and b["errors"] > 0), None)
back = next((b["t"] for b in bins if b["t"] > cont and b["calls"] > 0 and b["errors"] == 0), None)
summary["stopped_worker"] = {"stopped_at": stop, "continued_at": cont,
                             "first_error_after_s": None if first_error is None else first_error - stop,
                             "serving_again_after_s": None if back is None else back - cont,
                             "errors_by_code": r["errors_by_code"],
                             "failed_latency": r["failed_latency"]}
rows.append(f"| worker 1 SIGSTOP 10 s | calls fail {summary['stopped_worker']['first_error_after_s']:.1f} s "
            f"after the stop, codes {r['errors_by_code']} (failed calls' max "
            f"{r['failed_latency']['max_us'] / 1e6:.2f} s) | serving again "
            f"{summary['stopped_worker']['serving_again_after_s']:.1f} s after SIGCONT | |")
before, during = report("readers_before"), report("readers_during")
unread = json.load(open(os.path.join(out, "unread_streams.json")))
u = events["unread_streams"]
summary["unread_streams"] = {"rss_before_mib": u["rss_before_mib"], "rss_during_mib": u["rss_during_mib"],
                             "p99_before_us": before["latency"]["p99_us"],
                             "p99_during_us": during["latency"]["p99_us"],
                             "errors_during": errors(during), **unread}
rows.append(f"| 8 streams never read, 10 s | worker RSS {u['rss_before_mib']:.0f} -> "
            f"{u['rss_during_mib']:.0f} MiB | other clients' p99 {before['latency']['p99_us'] / 1000:.1f} -> "
            f"{during['latency']['p99_us'] / 1000:.1f} ms, {errors(during)} failed | "
            f"{unread['answers']} of {unread['streams'] * unread['requests']} answers once read |")
full = json.load(open(os.path.join(out, "full_disk.json"))) if open(os.path.join(out, "full_disk.json")).read().strip() != "skipped" else None
summary["full_disk"] = full
if full:
    rows.append(f"| 64 KiB state disk filled | {full['created']} tables created, then: "
                f"`{full['error'][:90]}` | restarted coordinator lists {full['listed_after_restart']} | |")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print("| drill | result | | |")
print("|---|---|---|---|")
print("\n".join(rows))
print(f"\nraw: {out}")
PY
