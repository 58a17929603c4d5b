#!/usr/bin/env bash
# Command-line conventions (rpc/cli.h) on every binary: --help lists exactly the binary's (or
# the subcommand's) flags with defaults and exits 0; --version names the commit; usage errors exit
# 2; a call that fails exits 64 + its gRPC code; --json answers parse; `up --endpoints_file`
# writes every address, and `up` removes its temporary folder when it stops.
set -uo pipefail
bin="${TEST_SRCDIR:?}/shardserve"
shardserve="$bin/client/shardserve"
fail() { echo "FAIL: $*"; exit 1; }
expect_rc() {  # rc, command...
  local want=$1; shift
  out=$("$@" 2>&1); rc=$?
  [ "$rc" -eq "$want" ] || fail "$* -> rc $rc, want $want: $out"
}
for b in server/worker_main server/coordinator_main client/shardserve client/shardserve-load; do
  expect_rc 0 "$bin/$b" --help
  grep -q "^usage: " <<<"$out" || fail "$b --help: no usage line: $out"
  grep -q "(default: " <<<"$out" || fail "$b --help: no defaults: $out"
  expect_rc 0 "$bin/$b" --version
  grep -Eq "^shardserve [0-9]+\.[0-9]+\.[0-9]+ \(commit [0-9a-f]{12}(-dirty)?\)$" <<<"$out" ||
    fail "$b --version: $out"
  expect_rc 2 "$bin/$b" --no_such_flag=1
  grep -q "unknown flag --no_such_flag" <<<"$out" || fail "$b: $out"
done
expect_rc 0 "$bin/server/worker_main" --help
grep -q -- "--drain_s (default: 5)" <<<"$out" || fail "worker --help: $out"
grep -q -- "--metrics_listen (default: \"\")" <<<"$out" || fail "worker --help: $out"
grep -q -- "--world_size" <<<"$out" && fail "worker --help lists the coordinator's flags: $out"
expect_rc 2 "$bin/server/worker_main" --rank=abc
expect_rc 2 "$bin/server/worker_main" --coordinator
expect_rc 2 "$bin/server/worker_main" --coordinator=127.0.0.1:1 stray
expect_rc 2 "$bin/server/worker_main" --norank 5  # --noX is for bool flags only
expect_rc 2 "$bin/server/coordinator_main" --groups=x
# Each subcommand lists its own flags, and only those.
expect_rc 0 "$shardserve" up --help
grep -q -- "--workers (default: 2)" <<<"$out" || fail "up --help: $out"
grep -q -- "--ids " <<<"$out" && fail "up --help lists bag's flags: $out"
expect_rc 0 "$shardserve" bag --help
for f in --ids --offsets --weights --mode --include_last_offset --table --deadline_ms; do
  grep -q -- "$f (default" <<<"$out" || fail "bag --help lacks $f: $out"
done
grep -q -- "--workers" <<<"$out" && fail "bag --help lists up's flags: $out"
expect_rc 0 "$shardserve" --help
grep -q "up | demo | create-table" <<<"$out" || fail "shardserve --help: $out"
for cmd in up demo create-table wait tables describe drop export load-version versions \
    unload-version add-replica cluster health embedding bag linear update; do
  expect_rc 0 "$shardserve" "$cmd" --help
  grep -q "^usage: shardserve $cmd" <<<"$out" || fail "$cmd --help: $out"
  grep -q -- "--coordinator\|--workers" <<<"$out" || fail "$cmd --help lists no flags: $out"
done
expect_rc 2 "$shardserve"
expect_rc 2 "$shardserve" frobnicate
expect_rc 2 "$shardserve" describe
expect_rc 2 "$shardserve" bag --table=t --ids='[1,' --coordinator=127.0.0.1:1
# Nothing listens on port 1: the client retries until its deadline, DEADLINE_EXCEEDED (4) -> 68.
expect_rc 68 "$shardserve" tables --coordinator=127.0.0.1:1 --deadline_ms=300

work="$TEST_TMPDIR/cli"
mkdir -p "$work"
"$shardserve" up --port=0 --no_demo --endpoints_file="$work/endpoints.json" \
  --server_dir="$bin/server" >"$work/up.log" 2>&1 &
up=$!
trap 'kill $up 2>/dev/null; wait $up 2>/dev/null' EXIT
for _ in $(seq 300); do [ -s "$work/endpoints.json" ] && break; sleep 0.1; done
[ -s "$work/endpoints.json" ] || fail "no endpoints file: $(cat "$work/up.log")"
read -r coordinator metrics work_dir < <(python3 -c '
import json, sys
e = json.load(open(sys.argv[1]))
assert len(e["workers"]) == 2 and all(w["address"] and w["metrics"] for w in e["workers"])
print(e["coordinator"]["address"], e["coordinator"]["metrics"], e["work_dir"])' \
  "$work/endpoints.json") || fail "endpoints: $(cat "$work/endpoints.json")"
[ -d "$work_dir" ] || fail "no work dir $work_dir"
python3 -c 'import sys, urllib.request; urllib.request.urlopen(f"http://{sys.argv[1]}/metrics")' \
  "$metrics" || fail "no metrics at $metrics"
c=(--coordinator="$coordinator")
expect_rc 0 "$shardserve" create-table "${c[@]}" --name=t --rows=10 --cols=4 --world=2 --seed=1 \
  --json
python3 -c 'import json, sys; assert json.loads(sys.argv[1])["state"] == "TABLE_STATE_SERVING"' \
  "$out" || fail "create-table --json: $out"
for cmd in "tables" "describe t" "cluster" "wait t"; do
  expect_rc 0 "$shardserve" $cmd "${c[@]}" --json
  python3 -c 'import json, sys; json.loads(sys.argv[1])' "$out" || fail "$cmd --json: $out"
done
expect_rc 0 "$shardserve" export t "$work/t.safetensors" "${c[@]}" --json
python3 -c 'import json, sys; assert int(json.loads(sys.argv[1])["bytes"]) > 160' "$out" ||
  fail "export --json: $out"
expect_rc 69 "$shardserve" describe nosuch "${c[@]}"  # NOT_FOUND (5)
expect_rc 69 "$shardserve" drop nosuch "${c[@]}"
expect_rc 67 "$shardserve" bag --table=t --ids='[[10]]' "${c[@]}"  # INVALID_ARGUMENT (3)
expect_rc 0 "$shardserve" demo "${c[@]}" --world=2  # the demo's checked calls, on this cluster
grep -q "^OK: 2-worker cluster" <<<"$out" || fail "demo: $out"
# Versions: load-version switches (progress on stderr, the result on stdout), answers say their
# version, a pinned call gets the kept one, and versions lists them.
expect_rc 0 "$shardserve" load-version t "${c[@]}" --seed=7 --keep_versions=2
grep -q 'table "t" serves version 2 (beside, switched in [0-9]* ms)' <<<"$out" ||
  fail "load-version: $out"
expect_rc 0 "$shardserve" bag --table=t --ids='[[1,2]]' "${c[@]}"
grep -q '"version": 2}' <<<"$out" || fail "bag after load-version: $out"
v2=$out
expect_rc 0 "$shardserve" bag --table=t --ids='[[1,2]]' --table_version=1 "${c[@]}"
grep -q '"version": 1}' <<<"$out" || fail "bag pinned to version 1: $out"
[ "$out" != "$v2" ] || fail "versions 1 and 2 answer alike: $out"
expect_rc 0 "$shardserve" versions t "${c[@]}"
grep -q "^version 1 .*KEPT .*seed 1" <<<"$out" || fail "versions: $out"
grep -q "^version 2 .*SERVING .*seed 7 .*group 0: 2 ranks serving" <<<"$out" || fail "versions: $out"
expect_rc 0 "$shardserve" versions t "${c[@]}" --json
python3 -c 'import json, sys; assert [v["version"] for v in json.loads(sys.argv[1])] == ["1", "2"]' \
  "$out" || fail "versions --json: $out"
expect_rc 0 "$shardserve" unload-version t 1 "${c[@]}"
expect_rc 73 "$shardserve" unload-version t 2 "${c[@]}"  # the serving one: FAILED_PRECONDITION (9)
expect_rc 2 "$shardserve" unload-version t x "${c[@]}"
expect_rc 70 "$shardserve" add-replica t 0 "${c[@]}"  # on its one group already: ALREADY_EXISTS
expect_rc 67 "$shardserve" add-replica t 1 "${c[@]}"  # no group 1: INVALID_ARGUMENT
expect_rc 2 "$shardserve" add-replica t "${c[@]}"
expect_rc 67 "$shardserve" load-version t "${c[@]}" --checkpoint=relative.safetensors  # INVALID_ARG.
# Updates: assign then add (duplicates summed); lookups see them and say the sequence.
expect_rc 0 "$shardserve" update --table=t --op=assign --ids='[1,1]' \
  --values='[[9,9,9,9],[1,2,3,4]]' "${c[@]}"
[ "$out" = '{"version": 2, "sequence": 1}' ] || fail "update assign: $out"
expect_rc 0 "$shardserve" update --table=t --op=add --ids='[1,1]' \
  --values='[[0.5,0.5,0.5,0.5],[1,1,1,1]]' "${c[@]}"
[ "$out" = '{"version": 2, "sequence": 2}' ] || fail "update add: $out"
expect_rc 0 "$shardserve" embedding --table=t --ids='[1]' "${c[@]}"
grep -q '"values": \[\[2.5, 3.5, 4.5, 5.5\]\], "version": 2, "sequence": 2}' <<<"$out" ||
  fail "embedding after updates: $out"
expect_rc 67 "$shardserve" update --table=t --op=add --ids='[10]' --values='[[1,1,1,1]]' "${c[@]}"
grep -q "ids\[0\]: 10 is out of range" <<<"$out" || fail "bad update: $out"
expect_rc 2 "$shardserve" update --table=t --op=set --ids='[1]' --values='[[1,1,1,1]]' "${c[@]}"
expect_rc 0 "$shardserve" drop t "${c[@]}" --json
python3 -c 'import json, sys; json.loads(sys.argv[1])' "$out" || fail "drop --json: $out"
kill "$up"
wait "$up"
for _ in $(seq 50); do [ -d "$work_dir" ] || break; sleep 0.1; done
[ -d "$work_dir" ] && fail "up left $work_dir behind"

# up --tls: mTLS with roles on every port; the endpoints file names what a caller needs, and
# every caller (CLI, load tester) without it is refused.
expect_rc 2 "$shardserve" tables --token_file="$work/t.safetensors"  # a token needs --tls_ca
grep -q "needs TLS" <<<"$out" || fail "--token_file without --tls_ca: $out"
expect_rc 2 "$shardserve" up --tls_dir="$work"  # --tls_dir goes with --tls
rm -f "$work/endpoints.json"
"$shardserve" up --tls --port=0 --no_demo --endpoints_file="$work/endpoints.json" \
  --server_dir="$bin/server" >"$work/up_tls.log" 2>&1 &
up=$!
for _ in $(seq 300); do [ -s "$work/endpoints.json" ] && break; sleep 0.1; done
[ -s "$work/endpoints.json" ] || fail "no endpoints file: $(cat "$work/up_tls.log")"
read -r coordinator ca cert key < <(python3 -c '
import json, sys
e = json.load(open(sys.argv[1]))
print(e["coordinator"]["address"], e["ca"], e["client_cert"], e["client_key"])' \
  "$work/endpoints.json") || fail "endpoints: $(cat "$work/endpoints.json")"
c=(--coordinator="$coordinator" --tls_ca="$ca" --tls_cert="$cert" --tls_key="$key")
expect_rc 0 "$shardserve" create-table "${c[@]}" --name=t --rows=100 --cols=4 --world=2 --seed=1
expect_rc 0 "$shardserve" bag --table=t --ids='[[1,2]]' "${c[@]}"
expect_rc 0 "$shardserve" demo "${c[@]}" --world=2
grep -q "^OK: 2-worker cluster" <<<"$out" || fail "demo over TLS: $out"
"$bin/client/shardserve-load" "${c[@]}" --table=t --batch=8 --bag=4 --warmup_s=0 \
  --duration_s=1 --progress=false --report="$work/load_tls.json" >"$work/load_tls.log" 2>&1 ||
  fail "load over TLS: $(cat "$work/load_tls.log")"
python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
assert r["calls"] > 0 and not r["errors_by_code"], r' "$work/load_tls.json" ||
  fail "load over TLS: $(cat "$work/load_tls.json")"
# Plaintext against TLS: no connection, so the deadline (4) -> 68.
expect_rc 68 "$shardserve" tables --coordinator="$coordinator" --deadline_ms=500
# The health probe over mTLS (what the Kubernetes tls overlay's probes run), and without TLS.
expect_rc 0 "$shardserve" health "${c[@]}" --service=shardserve.v1.group/0
[ "$out" = SERVING ] || fail "health: $out"
expect_rc 78 "$shardserve" health --address="$coordinator" --deadline_ms=500  # UNAVAILABLE (14)
kill "$up"
wait "$up"
echo PASS
