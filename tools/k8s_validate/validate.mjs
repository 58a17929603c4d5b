// Validates rendered Kubernetes manifests (kubectl kustomize output, one YAML file per argument):
// every object against the Kubernetes schemas (kubernetes-models: the API's OpenAPI schemas, one
// class per kind), then what shardserve's deployment promises - probes, resources, a non-root
// read-only container, metrics ports with scrape annotations, a worker's grace period longer than
// its drain. Prints one line per object; exits 1 at the first problem. An ES module (as
// kubernetes-models is): it runs from the folder npm installed its packages in (tests/k8s_test.sh).
import fs from "fs";
import yaml from "js-yaml";

async function modelOf(apiVersion, kind) {
  try {
    return (await import(`kubernetes-models/${apiVersion}/${kind}`))[kind];  // "apps/v1", "v1"
  } catch (e) {
    throw new Error(`no schema for ${apiVersion} ${kind}`);
  }
}

function flag(args, name) {
  const a = (args || []).find((x) => x.startsWith(`--${name}=`));
  return a === undefined ? undefined : a.slice(name.length + 3);
}

// shardserve's own rules for a pod template.
function checkPod(where, template) {
  const spec = template.spec;
  const annotations = template.metadata.annotations || {};
  if (annotations["prometheus.io/scrape"] !== "true") throw new Error(`${where}: not scraped`);
  if (!spec.securityContext || spec.securityContext.runAsNonRoot !== true) {
    throw new Error(`${where}: runAsNonRoot is not set`);
  }
  for (const c of spec.containers) {
    const at = `${where} container ${c.name}`;
    if (!c.readinessProbe) throw new Error(`${at}: no readiness probe`);
    if (!c.resources || !c.resources.requests) throw new Error(`${at}: no resource requests`);
    const sc = c.securityContext || {};
    if (sc.readOnlyRootFilesystem !== true || sc.allowPrivilegeEscalation !== false) {
      throw new Error(`${at}: the root file system is writable or privileges may escalate`);
    }
    const metrics = flag(c.args, "metrics_listen");
    const port = metrics && metrics.split(":").pop();
    if (!port || String(annotations["prometheus.io/port"]) !== port ||
        !(c.ports || []).some((p) => String(p.containerPort) === port)) {
      throw new Error(`${at}: --metrics_listen, its containerPort and the scrape port differ`);
    }
    // A gRPC port is TLS, or plaintext by an explicit --insecure (rpc/security.h refuses it
    // otherwise on 0.0.0.0); never both.
    if (flag(c.args, "listen") !== undefined &&
        (flag(c.args, "tls_cert") !== undefined) === (c.args || []).includes("--insecure")) {
      throw new Error(`${at}: give either --tls_cert (with its key) or --insecure`);
    }
    const drain = flag(c.args, "drain_s");
    if (drain !== undefined && !(spec.terminationGracePeriodSeconds > Number(drain) + 2)) {
      throw new Error(`${at}: terminationGracePeriodSeconds must exceed --drain_s (${drain}) + 2`);
    }
  }
}

let objects = 0;
for (const file of process.argv.slice(2)) {
  for (const doc of yaml.loadAll(fs.readFileSync(file, "utf8"))) {
    if (!doc) continue;
    const where = `${file}: ${doc.kind} ${doc.metadata && doc.metadata.name}`;
    try {
      new (await modelOf(doc.apiVersion, doc.kind))(doc).validate();
      if (doc.spec && doc.spec.template) checkPod(where, doc.spec.template);
    } catch (e) {
      console.error(`FAIL ${where}: ${e.message}`);
      process.exit(1);
    }
    console.log(`ok ${where}`);
    ++objects;
  }
}
if (objects === 0) {
  console.error("FAIL: no objects");
  process.exit(1);
}
