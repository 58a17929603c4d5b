#!/usr/bin/env bash
# Runs the cpu overlay's pods with `podman kube play`, as far as one machine without Kubernetes
# allows: the rendered manifests (kubectl kustomize deploy/k8s/overlays/cpu) become plain pods - the
# coordinator's Deployment one pod, the worker StatefulSet's two ordinals two pods named as a
# StatefulSet names them (their ranks come from the hostname, as in the cluster) - on the host's
# network, so each pod's ports are moved apart and the coordinator's Service name becomes
# 127.0.0.1 (podman applies no hostAliases on the host's network, and has no cluster DNS). The
# containers keep the manifests' command, args, probes, security context (non-root, read-only
# root) and volumes. Then the demo's checked calls from the image, and the pods are taken down.
#   deploy/kube_play.sh            (as root, after deploy/build_image.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
conf="$work/containers.conf"
# As deploy/run_image.sh: runc and cgroupfs, and limits the runtime may set on this machine.
printf '[containers]\ndefault_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]\n' >"$conf"
pm=(env CONTAINERS_CONF="$conf" podman --storage-driver=vfs --runtime=runc
  --cgroup-manager=cgroupfs)
kubectl kustomize deploy/k8s/overlays/cpu 2>/dev/null >"$work/cpu.yaml"
python3 - "$work/cpu.yaml" "$work/pods.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
coordinator_port = 50081
out = []
def pod(name, template, args, hostname=None):
    spec = dict(template["spec"])
    spec["hostNetwork"] = True
    if hostname:
        spec["hostname"] = hostname
    container = dict(spec["containers"][0])
    container["args"] = args
    container.pop("env", None)  # status.podIP: the host's own address here
    container.pop("ports", None)  # on the host's network: the args say the ports
    for probe in ("readinessProbe", "livenessProbe"):
        container.pop(probe, None)  # podman runs no gRPC probes; the demo checks the service
    spec["containers"] = [container]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": template["metadata"]["labels"],
                         "annotations": template["metadata"].get("annotations", {})},
            "spec": spec}
def moved(args, listen, metrics):
    out = []
    for a in args:
        if a.startswith("--listen="): a = f"--listen=127.0.0.1:{listen}"
        elif a.startswith("--metrics_listen="): a = f"--metrics_listen=127.0.0.1:{metrics}"
        elif a.startswith("--advertise_host="): a = "--advertise_host=127.0.0.1"
        elif a.startswith("--coordinator="): a = f"--coordinator=127.0.0.1:{coordinator_port}"
        out.append(a)
    return out
for d in docs:
    if d["kind"] == "PersistentVolumeClaim":
        out.append(d)
    elif d["kind"] == "Deployment":
        t = d["spec"]["template"]
        out.append(pod("shardserve-coordinator", t,
                       moved(t["spec"]["containers"][0]["args"], coordinator_port, 9180)))
    elif d["kind"] == "StatefulSet":
        t = d["spec"]["template"]
        for n in range(d["spec"]["replicas"]):
            name = f"shardserve-worker-{n}"
            out.append(pod(name, t, moved(t["spec"]["containers"][0]["args"], 0, 9181 + n), name))
yaml.safe_dump_all(out, open(sys.argv[2], "w"), sort_keys=False)
print(f"kube_play: {len(out)} objects from the cpu overlay: " +
      ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in out))
PY
down() {
  "${pm[@]}" kube down "$work/pods.yaml" >/dev/null 2>&1 || true
  "${pm[@]}" volume rm -f shardserve-coordinator-state >/dev/null 2>&1 || true
}
trap 'down; rm -rf "$work"' EXIT INT TERM
down
"${pm[@]}" kube play "$work/pods.yaml"
echo "== pods"
"${pm[@]}" pod ps --format '{{.Name}}  {{.Status}}'
echo "== the demo's checked calls (shardserve demo, from the image)"
for _ in $(seq 60); do
  "${pm[@]}" run --rm --network=host --entrypoint=/usr/local/bin/shardserve shardserve:latest \
    cluster --coordinator=127.0.0.1:50081 --deadline_ms=1000 2>/dev/null | grep -q "SERVING" && break
  sleep 1
done
"${pm[@]}" run --rm --network=host --entrypoint=/usr/local/bin/shardserve shardserve:latest \
  demo --coordinator=127.0.0.1:50081 --world=2 --deadline_ms=60000
echo "== cluster"
"${pm[@]}" run --rm --network=host --entrypoint=/usr/local/bin/shardserve shardserve:latest \
  cluster --coordinator=127.0.0.1:50081
echo "== coordinator log"
"${pm[@]}" logs shardserve-coordinator-coordinator 2>&1 | tail -n 6
echo "== OK: the cpu overlay's pods answered the demo's checked calls"
