#!/usr/bin/env bash
# Runs a cluster from the image deploy/build_image.sh made: a coordinator and 2 workers, each a
# podman container on the host's network (otherwise apart, as pods are: the workers cannot map
# each other's memory and exchange over TCP), with mTLS and roles on every port and the internal
# API on ports of its own (certificates by deploy/make_certs.sh, mounted read-only as a Secret
# would be); then the demo's checked calls with the image's own CLI over mTLS, the TLS health
# probe, a plaintext caller refused, a scrape of every process's metrics, and a worker stopped
# with SIGTERM (it drains, then leaves). Prints what ran and what answered; exits non-zero if
# anything did not.
#   deploy/run_image.sh            (as root, after deploy/build_image.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
# runc and plain cgroupfs: crun refuses this machine's hybrid cgroup mounts. The ulimits stay
# below what the runtime may set here (it cannot raise a hard limit).
pm=(podman --storage-driver=vfs --runtime=runc --cgroup-manager=cgroupfs)
limits=(--ulimit=nofile=4096:4096 --ulimit=nproc=4096:4096)
image=${IMAGE:-shardserve:latest}
port=${PORT:-50071}
names=(shardserve-coordinator shardserve-worker-0 shardserve-worker-1)
certs=""
cleanup() {
  "${pm[@]}" rm -f -t 0 "${names[@]}" >/dev/null 2>&1 || true
  [ -z "$certs" ] || rm -rf "$certs"
}
trap cleanup EXIT
cleanup
certs=$(mktemp -d)
deploy/make_certs.sh "$certs" >/dev/null
chown -R 65534:65534 "$certs"  # the containers run as nobody
tls() {  # the TLS flags of coordinator | worker (server and client certificate, roles)
  echo "--tls_cert=/tls/$1.pem --tls_key=/tls/$1.key --tls_ca=/tls/ca.pem" \
    "--tls_client_ca=/tls/ca.pem --tokens_file=/tls/tokens"
}
caller=(--tls_ca=/tls/ca.pem --tls_cert=/tls/client.pem --tls_key=/tls/client.key)
run=("${pm[@]}" run -d --network=host "${limits[@]}" -v "$certs:/tls:ro")
plain_cli=("${pm[@]}" run --rm --network=host "${limits[@]}" --entrypoint=/usr/local/bin/shardserve
  "$image")
cli=("${pm[@]}" run --rm --network=host "${limits[@]}" -v "$certs:/tls:ro"
  --entrypoint=/usr/local/bin/shardserve "$image")
echo "== $("${cli[@]}" --version) in $image ($("${pm[@]}" image inspect "$image" \
  --format '{{.Size}}') bytes)"
# shellcheck disable=SC2046
"${run[@]}" --name shardserve-coordinator --entrypoint=/usr/local/bin/coordinator_main "$image" \
  --listen=127.0.0.1:"$port" --internal_listen=127.0.0.1:$((port + 1)) --world_size=2 \
  --metrics_listen=127.0.0.1:$((port + 100)) $(tls coordinator) >/dev/null
for r in 0 1; do
  # shellcheck disable=SC2046
  "${run[@]}" --name shardserve-worker-$r "$image" --coordinator=127.0.0.1:$((port + 1)) \
    --rank=$r --listen=127.0.0.1:0 --internal_listen=127.0.0.1:0 \
    --metrics_listen=127.0.0.1:$((port + 101 + r)) --drain_s=2 $(tls worker) >/dev/null
done
echo "== containers"
"${pm[@]}" ps --format '{{.Names}}  {{.Status}}  {{.Command}}'
echo "== the TLS health probe (shardserve health, as overlays/tls's readiness probe)"
for _ in $(seq 60); do
  "${cli[@]}" health --address=127.0.0.1:"$port" --service=shardserve.v1.group/0 \
    --deadline_ms=1000 "${caller[@]}" 2>/dev/null | grep -q "^SERVING" && break
  sleep 1
done
"${cli[@]}" health --address=127.0.0.1:"$port" --service=shardserve.v1.group/0 "${caller[@]}"
echo "== the demo's checked calls (shardserve demo, from the image, over mTLS)"
"${cli[@]}" demo --coordinator=127.0.0.1:"$port" --world=2 --deadline_ms=60000 "${caller[@]}"
echo "== a plaintext caller: refused (no TLS handshake; exit 68, its deadline)"
rc=0
"${plain_cli[@]}" tables --coordinator=127.0.0.1:"$port" --deadline_ms=1000 >/dev/null 2>&1 ||
  rc=$?
echo "exit $rc"
[ "$rc" -eq 68 ]
echo "== metrics"
for p in $((port + 100)) $((port + 101)) $((port + 102)); do
  body=$(python3 -c 'import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode())' "$p")
  echo "127.0.0.1:$p: $(grep -c '^shardserve_' <<<"$body") shardserve_ samples, e.g." \
    "$(grep -m1 -E '^shardserve_(data_calls_total|grpc_calls_total)' <<<"$body")"
done
echo "== cluster"
"${cli[@]}" cluster --coordinator=127.0.0.1:"$port" "${caller[@]}"
echo "== SIGTERM to worker 1 (drains 2 s, then leaves)"
start=$(date +%s.%N)
"${pm[@]}" stop -t 15 shardserve-worker-1 >/dev/null
echo "stopped after $(python3 -c "import sys; print(round($(date +%s.%N) - $start, 1))") s"
"${pm[@]}" logs shardserve-worker-1 2>&1 | tail -n 4
"${pm[@]}" logs shardserve-coordinator 2>&1 | grep -E "left|epoch" | tail -n 3
echo "== audit (the coordinator's admin calls and refusals)"
"${pm[@]}" logs shardserve-coordinator 2>&1 | grep -m3 "audit {" | cut -c1-240
echo "== OK: the image ran a cluster with mTLS that answered the demo's checked calls"
