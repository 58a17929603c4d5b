#!/usr/bin/env bash
# Runs a cluster from the image deploy/build_image.sh made: a coordinator and 2 workers, each a
# podman container on the host's network (otherwise apart, as pods are: the workers cannot map
# each other's memory and exchange over TCP), then the demo's checked
# calls with the image's own CLI, a scrape of every process's metrics, and a worker stopped with
# SIGTERM (it drains, then leaves). Prints what ran and what answered; exits non-zero if anything
# did not.
#   deploy/run_image.sh            (as root, after deploy/build_image.sh)
set -euo pipefail
# runc and plain cgroupfs: crun refuses this machine's hybrid cgroup mounts. The ulimits stay
# below what the runtime may set here (it cannot raise a hard limit).
pm=(podman --storage-driver=vfs --runtime=runc --cgroup-manager=cgroupfs)
limits=(--ulimit=nofile=4096:4096 --ulimit=nproc=4096:4096)
image=${IMAGE:-shardserve:latest}
port=${PORT:-50071}
names=(shardserve-coordinator shardserve-worker-0 shardserve-worker-1)
cleanup() { "${pm[@]}" rm -f -t 0 "${names[@]}" >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup
run=("${pm[@]}" run -d --network=host "${limits[@]}")
cli=("${pm[@]}" run --rm --network=host "${limits[@]}" --entrypoint=/usr/local/bin/shardserve
  "$image")
echo "== $("${cli[@]}" --version) in $image ($("${pm[@]}" image inspect "$image" \
  --format '{{.Size}}') bytes)"
"${run[@]}" --name shardserve-coordinator --entrypoint=/usr/local/bin/coordinator_main "$image" \
  --listen=127.0.0.1:"$port" --world_size=2 --metrics_listen=127.0.0.1:$((port + 100)) >/dev/null
for r in 0 1; do
  "${run[@]}" --name shardserve-worker-$r "$image" --coordinator=127.0.0.1:"$port" --rank=$r \
    --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:$((port + 101 + r)) --drain_s=2 >/dev/null
done
echo "== containers"
"${pm[@]}" ps --format '{{.Names}}  {{.Status}}  {{.Command}}'
echo "== the demo's checked calls (shardserve demo, from the image)"
"${cli[@]}" demo --coordinator=127.0.0.1:"$port" --world=2 --deadline_ms=60000
echo "== metrics"
for p in $((port + 100)) $((port + 101)) $((port + 102)); do
  body=$(python3 -c 'import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode())' "$p")
  echo "127.0.0.1:$p: $(grep -c '^shardserve_' <<<"$body") shardserve_ samples, e.g." \
    "$(grep -m1 -E '^shardserve_(data_calls_total|grpc_calls_total)' <<<"$body")"
done
echo "== cluster"
"${cli[@]}" cluster --coordinator=127.0.0.1:"$port"
echo "== SIGTERM to worker 1 (drains 2 s, then leaves)"
start=$(date +%s.%N)
"${pm[@]}" stop -t 15 shardserve-worker-1 >/dev/null
echo "stopped after $(python3 -c "import sys; print(round($(date +%s.%N) - $start, 1))") s"
"${pm[@]}" logs shardserve-worker-1 2>&1 | tail -n 4
"${pm[@]}" logs shardserve-coordinator 2>&1 | grep -E "left|epoch" | tail -n 3
echo "== OK: the image ran a cluster that answered the demo's checked calls"
