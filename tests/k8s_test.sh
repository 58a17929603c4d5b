#!/usr/bin/env bash
# The Kubernetes manifests: every kustomize overlay (cpu, replicas, gpu) renders with kubectl
# kustomize, every object in it is valid against the Kubernetes schemas (kubernetes-models, which
# tools/setup.sh installs from the npm registry) and keeps what the deployment promises
# (tools/k8s_validate/validate.mjs), and each overlay changes what it says it does.
set -euo pipefail
root="${TEST_SRCDIR:?}/shardserve"
work="${TEST_TMPDIR:?}"
home=$(getent passwd "$(id -u)" | cut -d: -f6)
validator="$home/.cache/shardserve-k8s-validate"
[ -d "$validator/node_modules/kubernetes-models" ] ||
  { echo "FAIL: no validator in $validator: run tools/setup.sh"; exit 1; }
# The validator is an ES module: it finds its packages beside it.
cp "$root/tools/k8s_validate/validate.mjs" "$work/"
ln -sfn "$validator/node_modules" "$work/node_modules"
# Rendered from a copy without symbolic links: kustomize keeps each file inside its root.
cp -rL "$root/deploy/k8s" "$work/k8s"
for o in cpu replicas gpu tls; do
  kubectl kustomize "$work/k8s/overlays/$o" >"$work/$o.yaml" 2>"$work/$o.err" ||
    { echo "FAIL: kustomize $o: $(cat "$work/$o.err")"; exit 1; }
done
(cd "$work" && node validate.mjs cpu.yaml replicas.yaml gpu.yaml tls.yaml)
python3 - "$work" <<'PY'
import sys, yaml
work = sys.argv[1]
def objects(overlay):
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(open(f"{work}/{overlay}.yaml"))}
def flag(container, name):
    return next(a.split("=", 1)[1] for a in container["args"] if a.startswith(f"--{name}="))
for overlay, groups, device, image in (("cpu", 1, "cpu", "shardserve:latest"),
                                       ("replicas", 2, "cpu", "shardserve:latest"),
                                       ("gpu", 1, "cuda:0", "shardserve-gpu:latest"),
                                       ("tls", 2, "cpu", "shardserve:latest")):
    o = objects(overlay)
    # Every overlay closes the ports with NetworkPolicy: workers take any port only from workers.
    policy = o["NetworkPolicy", "shardserve-workers"]["spec"]
    assert policy["ingress"][0] == {"from": [{"podSelector": {"matchLabels": {
        "app": "shardserve", "role": "worker"}}}]}, (overlay, "worker NetworkPolicy")
    assert ("NetworkPolicy", "shardserve-coordinator") in o, (overlay, "coordinator policy")
    coordinator = o["Deployment", "shardserve-coordinator"]["spec"]["template"]["spec"]["containers"][0]
    workers = o["StatefulSet", "shardserve-worker"]["spec"]
    worker = workers["template"]["spec"]["containers"][0]
    ranks = int(flag(worker, "ranks_per_group"))
    assert int(flag(coordinator, "groups")) == groups, (overlay, "groups")
    assert int(flag(coordinator, "world_size")) == ranks, (overlay, "world_size")
    assert workers["replicas"] == groups * ranks, (overlay, "replicas != groups x ranks")
    assert flag(worker, "device") == device, (overlay, "device")
    assert worker["image"] == image and coordinator["image"] == image, (overlay, "image")
    gpus = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus == 1) == (device != "cpu"), (overlay, "nvidia.com/gpu")
    tls = overlay == "tls"
    for role, c, t in (("coordinator", coordinator, o["Deployment", "shardserve-coordinator"]),
                       ("worker", worker, o["StatefulSet", "shardserve-worker"])):
        assert ("--insecure" in c["args"]) != tls, (overlay, role, "--insecure")
        if not tls:
            continue
        assert flag(c, "tls_cert") == f"/tls/{role}.pem", (overlay, role)
        assert flag(c, "tls_client_ca") == "/tls/ca.pem", (overlay, role, "mTLS")
        assert flag(c, "tokens_file") == "/tokens/tokens", (overlay, role, "roles")
        volumes = {v["name"]: v for v in t["spec"]["template"]["spec"]["volumes"]}
        keys = {i["key"] for i in volumes["tls"]["secret"]["items"]}
        assert keys == {"ca.pem", f"{role}.pem", f"{role}.key"}, (overlay, role, keys)
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tls", "/tokens"} <= mounts, (overlay, role, mounts)
        assert flag(c, "internal_listen").endswith(
            ":50061" if role == "coordinator" else ":50062"), (overlay, role, "internal port")
        probe = c["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["/usr/local/bin/shardserve", "health"] and \
            f"--tls_cert=/tls/{role}.pem" in probe, (overlay, role, probe)
    if tls:
        assert flag(worker, "coordinator") == "shardserve-coordinator:50061", overlay
        ports = {p["port"] for p in o["Service", "shardserve-coordinator"]["spec"]["ports"]}
        assert 50061 in ports, (overlay, ports)
        # The coordinator's internal port takes the workers only; its public port no worker.
        rules = o["NetworkPolicy", "shardserve-coordinator"]["spec"]["ingress"]
        internal = [r for r in rules if {"port": 50061, "protocol": "TCP"} in r.get("ports", [])]
        assert internal == [{"from": [{"podSelector": {"matchLabels": {
            "app": "shardserve", "role": "worker"}}}], "ports": [{"port": 50061, "protocol": "TCP"}]}], rules
        worker_rules = o["NetworkPolicy", "shardserve-workers"]["spec"]["ingress"]
        shard_reads = [r for r in worker_rules if {"port": 50062, "protocol": "TCP"} in r.get("ports", [])]
        assert shard_reads and all(f["podSelector"]["matchLabels"].get("role") == "coordinator"
                                   for r in shard_reads for f in r["from"]), worker_rules
    print(f"ok {overlay}: {groups} group(s) x {ranks} ranks on {device}, {image}" +
          (", mTLS" if tls else ""))
PY
echo PASS
