#!/usr/bin/env bash
# The Grafana dashboard's queries are valid PromQL over series the servers export: each becomes a
# recording rule that Prometheus' promtool parses, and each shardserve_ series it names is in
# the tables of series of docs/operations/metrics.md.
set -euo pipefail
dashboard="${TEST_SRCDIR:?}/shardserve/deploy/grafana/shardserve.json"
metrics_doc="${TEST_SRCDIR:?}/shardserve/docs/operations/metrics.md"
rules="${TEST_TMPDIR:?}/rules.yml"
python3 - "$dashboard" "$metrics_doc" "$rules" <<'PY'
import json, re, sys
dashboard, metrics_doc, rules = sys.argv[1:]
exprs = [t["expr"] for p in json.load(open(dashboard))["panels"] for t in p["targets"]]
assert exprs, "no queries"
documented = set(re.findall(r"`(shardserve_[a-z_]+)`", open(metrics_doc).read()))
with open(rules, "w") as out:
    out.write("groups:\n  - name: dashboard\n    rules:\n")
    for i, e in enumerate(exprs):
        for name in re.findall(r"\b(shardserve_[a-z_]+?)(?:_bucket)?\b", e):
            base = re.sub(r"_bucket$", "", name)
            if base not in documented:
                sys.exit(f"query {e!r} names {base}, which docs/operations/metrics.md does not list")
        e = e.replace("$__rate_interval", "1m").replace("$job", ".*")
        out.write(f"      - record: dashboard:q{i}\n        expr: {json.dumps(e)}\n")
print(f"{len(exprs)} queries")
PY
promtool check rules "$rules"
