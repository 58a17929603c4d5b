#!/usr/bin/env bash
# The cost of encryption, end to end: the same cluster twice - plaintext, and `up --tls` (mTLS
# with roles on every port, the client presenting its certificate) - both up side by side, and
# the load tester's cases against each in interleaved rounds (the order alternating each round):
#   EmbeddingBag 512 x 20 ids per call, concurrency 1 / 4 / 16, and 64 callers x 1 bag, unary and
#   on streams. N = 100 000 rows, D = 128, fp32, W = 2 CPU workers, col-wise. Medians reported,
#   and TLS ÷ plaintext per round; with each run, the CPU time the cluster's processes (not the
#   load tester, which shares this machine's cores and decrypts too) spent per bag. The ceiling
#   beside them: this machine's AES-256-GCM rate (openssl speed, TLS 1.3's cipher here), what
#   encrypting and decrypting each call's bytes once costs at the least; and gRPC alone, a trivial
#   server returning the same bytes (bench/echo_server), plaintext and TLS.
#   bench/run_tls.sh [ROUNDS] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
secs=${2:-5}
tools/setup.sh
bazel build -c opt //client:shardserve //client:shardserve-load //server:all //bench:echo_server \
  >/dev/null 2>&1
bin=.bazel/bin
work=$(mktemp -d)
out=bench/results/tls_$(date -u +%Y%m%dT%H%M%SZ).jsonl
mkdir -p bench/results
: > "$out"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true
            rm -rf "$work"; }
trap cleanup EXIT

declare -A up_pid
start_cluster() {  # name, port, extra up flags
  $bin/client/shardserve up --workers=2 --port="$2" --no_demo --server_dir=$bin/server \
    --endpoints_file="$work/$1.json" "${@:3}" >"$work/up_$1.log" 2>&1 &
  up_pid[$1]=$!
  pids+=($!)
  for _ in $(seq 300); do [ -s "$work/$1.json" ] && break; sleep 0.1; done
}
cluster_cpu() {  # name: CPU seconds (user + system) of its coordinator and workers so far
  [ -n "${up_pid[$1]:-}" ] || { echo 0; return; }  # (the echo servers: not measured)
  local total=0 t
  for p in $(pgrep -P "${up_pid[$1]}"); do
    t=$(awk '{print $14 + $15}' "/proc/$p/stat")
    total=$((total + t))
  done
  echo "$total $(getconf CLK_TCK)" | awk '{printf "%.3f", $1 / $2}'
}
start_cluster plain 50161
start_cluster tls 50162 --tls
read -r ca cert key < <(python3 -c '
import json, sys
e = json.load(open(sys.argv[1]))
print(e["ca"], e["client_cert"], e["client_key"])' "$work/tls.json")
certs=$(dirname "$ca")
# The ceiling of what gRPC alone carries, plaintext and TLS: a trivial server returning the same
# bytes (bench/echo_server.cc, gRPC's callback API), TLS with the workers' certificate.
$bin/bench/echo_server --port=50197 --dim=128 >"$work/echo_plain.log" 2>&1 &
pids+=($!)
$bin/bench/echo_server --port=50198 --dim=128 --tls_cert="$certs/worker.pem" \
  --tls_key="$certs/worker.key" >"$work/echo_tls.log" 2>&1 &
pids+=($!)
declare -A flags=(
  [plain]="--coordinator=127.0.0.1:50161"
  [tls]="--coordinator=127.0.0.1:50162 --tls_ca=$ca --tls_cert=$cert --tls_key=$key"
  [echo-plain]="--target=127.0.0.1:50197 --rows=100000"
  [echo-tls]="--target=127.0.0.1:50198 --rows=100000 --tls_ca=$ca --tls_cert=$cert --tls_key=$key"
)
for impl in plain tls; do
  # shellcheck disable=SC2086
  $bin/client/shardserve create-table ${flags[$impl]} --name=bench --rows=100000 --cols=128 \
    --sharding_dim=1 --world=2 --seed=1 >/dev/null
done
sleep 0.5

load() {  # case, impl, load flags...
  rm -f "$work/r.json"
  # The servers' CPU over the whole run (warm-up included; the report's rate is the measured
  # part's: per bag, the warm-up's share cancels between the two clusters).
  local before after
  before=$(cluster_cpu "$2" 2>/dev/null || echo 0)
  # shellcheck disable=SC2086
  $bin/client/shardserve-load ${flags[$2]} --table=bench --progress=false --warmup_s=1 \
    --duration_s="$secs" --report="$work/r.json" "${@:3}" >/dev/null || true
  after=$(cluster_cpu "$2" 2>/dev/null || echo 0)
  if [ -s "$work/r.json" ]; then
    sed -i "s/\"impl\": \"[^\"]*\"/\"impl\": \"$2\"/" "$work/r.json"
    echo "{\"case\": \"$1\", \"server_cpu_s\": $(awk "BEGIN {print $after - $before}"), \"report\": $(cat "$work/r.json")}" >> "$out"
  else
    echo "run_tls: no report for $1 $2" >&2
  fi
}
for ((round = 1; round <= rounds; round++)); do
  order=(plain tls)
  ((round % 2 == 0)) && order=(tls plain)
  for impl in "${order[@]}"; do
    for c in 1 4 16; do
      load "bag_c$c" "$impl" --op=embedding_bag --batch=512 --bag=20 --concurrency=$c
    done
    load coalesce_64x1 "$impl" --op=embedding_bag --batch=1 --bag=20 --concurrency=64
    load coalesce_64x1_stream "$impl" --op=embedding_bag --batch=1 --bag=20 --concurrency=64 \
      --stream
    load bag_c16 "echo-$impl" --op=embedding_bag --batch=512 --bag=20 --concurrency=16
    load coalesce_64x1 "echo-$impl" --op=embedding_bag --batch=1 --bag=20 --concurrency=64
  done
done

aes=$(openssl speed -evp aes-256-gcm -bytes 16384 -seconds 3 2>/dev/null |
  awk '/^AES-256-GCM/ {v = $NF; sub("k", "", v); printf "%.0f", v * 1000}')  # (k = 1000 bytes)
echo "{\"case\": \"aes_256_gcm_bytes_per_s\", \"value\": $aes}" >> "$out"
/usr/bin/python3 bench/tls_report.py "$out"
