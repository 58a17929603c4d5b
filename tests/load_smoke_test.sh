#!/usr/bin/env bash
# shardserve-load against a real local cluster: closed loop (unary and stream) and open loop runs
# finish, report calls without errors, and write a JSON report and an SVG chart; callers whose
# calls fail back off, and the failed calls' latency is reported. And the CLI's admin commands:
# create-table again, wait, cluster, export (streamed here, or written by the coordinator).
set -euo pipefail
root="${TEST_SRCDIR:?}/shardserve"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
"$root/client/shardserve" up --workers=2 --port=0 --no_demo --server_dir="$root/server" >"$tmp/up.log" 2>&1 &
up=$!
trap 'kill $up 2>/dev/null || true; wait $up 2>/dev/null || true' EXIT
for _ in $(seq 300); do grep -q serving "$tmp/up.log" && break; sleep 0.1; done
coordinator=$(grep -o 'coordinator on [0-9.:]*' "$tmp/up.log" | awk '{print $3}' | tr -d ';')
[ -n "$coordinator" ] || { cat "$tmp/up.log"; exit 1; }
"$root/client/shardserve" create-table --coordinator="$coordinator" --name=t --rows=1000 --cols=16 \
  --world=2 --seed=1 >/dev/null
"$root/client/shardserve" create-table --coordinator="$coordinator" --name=l --kind=linear --rows=8 \
  --cols=16 --world=2 --sharding_dim=0 --seed=1 >/dev/null
# The same create-table again is fine (the same spec finds the table); wait returns at once.
"$root/client/shardserve" create-table --coordinator="$coordinator" --name=t --rows=1000 --cols=16 \
  --world=2 --seed=1 >/dev/null
"$root/client/shardserve" wait t --coordinator="$coordinator" | grep -q SERVING
# The cluster's description: one group serving, both ranks alive and serving both tables.
"$root/client/shardserve" cluster --coordinator="$coordinator" --json >"$tmp/cluster.json"
python3 - "$tmp/cluster.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
g, = c["groups"]
assert g["state"] == "GROUP_STATE_SERVING", g
assert [m["rank"] for m in g["members"]] == [0, 1], g
for m in g["members"]:
    assert m["alive"] and sorted(m["serving_tables"]) == ["l", "t"], m
print("cluster:", g["state"], len(g["members"]), "ranks")
PY
"$root/client/shardserve" cluster --coordinator="$coordinator" | grep -q "rank 1"
# export streams the file here (a relative path is fine); --on_coordinator has the coordinator
# write it: the same bytes.
(cd "$tmp" && "$root/client/shardserve" export t here.safetensors --coordinator="$coordinator") \
  >/dev/null
"$root/client/shardserve" export t "$tmp/there.safetensors" --on_coordinator \
  --coordinator="$coordinator" >/dev/null
cmp "$tmp/here.safetensors" "$tmp/there.safetensors"
# Flags that contradict each other are refused, naming both, and create nothing.
refused() {  # expected message, create-table flags...
  if out=$("$root/client/shardserve" create-table --coordinator="$coordinator" --name=bad \
      --rows=1000 --cols=16 "${@:2}" 2>&1) || ! grep -qF -- "$1" <<<"$out"; then
    echo "FAIL: create-table ${*:2}: $out"; exit 1
  fi
}
refused "--placements and --world both place the chunks" --placements=rank:0/cpu,rank:1/cpu --world=2
refused "--device=cuda:0 goes with --world" --placements=rank:0/cpu,rank:1/cpu --device=cuda:0
if "$root/client/shardserve" describe bad --coordinator="$coordinator" >/dev/null 2>&1; then
  echo "FAIL: a refused create-table created a table"; exit 1
fi
check() {  # report file: calls > 0, no errors
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["calls"] > 0, r
assert r["errors_by_code"] == {}, r["errors_by_code"]
assert r["latency"]["p99_us"] >= r["latency"]["p50_us"] > 0, r["latency"]
print(sys.argv[1], r["calls"], "calls, p50", r["latency"]["p50_us"], "us")
PY
}
load="$root/client/shardserve-load --coordinator=$coordinator --table=t --linear_table=l --warmup_s=0.3 --duration_s=1 --progress=false"
$load --op=embedding_bag --batch=8 --bag=4 --concurrency=8 --report="$tmp/closed.json" --svg="$tmp/closed.svg"
check "$tmp/closed.json"
grep -q "<polyline" "$tmp/closed.svg"
$load --op=mix --batch=4 --bag=3 --dist=zipf --stream --pipeline=4 --concurrency=2 --report="$tmp/stream.json"
check "$tmp/stream.json"
$load --op=embedding --batch=4 --bag=2 --qps=300 --report="$tmp/open.json"
check "$tmp/open.json"
# Every call fails (no such table): each caller backs off 10, 20, 40, 80, 100, 100... ms, so one
# second of 4 callers makes a few dozen calls, not tens of thousands; all are counted as failed,
# with their latency.
"$root/client/shardserve-load" --target="$coordinator" --rows=1000 --table=nope --op=embedding_bag \
  --batch=2 --bag=2 --concurrency=4 --warmup_s=0 --duration_s=1 --progress=false --backoff_ms=10 \
  --max_backoff_ms=100 --timeline_ms=100 --report="$tmp/failing.json" >/dev/null || true
python3 - "$tmp/failing.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
calls = r["calls"]
assert 8 <= calls <= 120, ("callers did not back off", calls)
assert r["errors_by_code"] == {"5": calls}, r["errors_by_code"]
assert r["failed_latency"]["count"] == calls, r["failed_latency"]
assert r["failed_latency"]["p50_us"] > 0, r["failed_latency"]
assert r["bin_s"] == 0.1 and len(r["timeline"]) >= 5, (r["bin_s"], len(r["timeline"]))
print("failing run:", calls, "calls, failed p50", r["failed_latency"]["p50_us"], "us")
PY
echo "load smoke test passed"
