#!/usr/bin/env python3
"""Writes bench/results/README.md: an index of the raw result files, by benchmark and date, with
the script that wrote each kind (HISTORY.md beside them, written by hand, is their dated account).
Run it after adding results: bench/index_results.py"""
import os
import re
from collections import defaultdict

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WHAT = {
    "e2e": ("bench/run_e2e.sh", "end to end over gRPC: vs Redis, bare gRPC, one request per step"),
    "sharded_ops": ("bench/run_sharded_ops.sh", "in-process sharded ops vs PyTorch's and the unsharded op"),
    "cpu_split": ("bench/run_cpu_split.sh", "CPU per bag by process, 64 single-bag callers"),
    "gpu": ("tools/device_check.sh, .device/run.sh", "GPU checks and benchmarks on an H200"),
    "python_client": ("bench/run_python_client.sh", "the Python client vs the C++ load tester"),
    "faults": ("bench/run_faults.sh", "fault drill: coordinator outages, a hung worker, unread streams, a full disk"),
    "ab": ("bench/run_ab.sh", "two builds side by side (a change's performance check)"),
    "failover": ("bench/run_failover.sh", "replica groups: a worker killed or hung under load; throughput against groups"),
    "updates": ("bench/run_updates.sh", "online updates vs Redis appendfsync always; lookups beside updates"),
    "updates_r1": ("bench/run_updates.sh ... 1", "the same with one replica group"),
    "updates_r2": ("bench/run_updates.sh ... 2", "the same with two replica groups, with the fan-out ceilings"),
    "updates_ab": ("bench/run_updates_ab.sh", "two builds side by side: lookups beside updates, CPU per update"),
}
groups = defaultdict(list)
for name in sorted(os.listdir(HERE)):
    if name in ("README.md", "HISTORY.md"):
        continue
    m = re.match(r"([a-z0-9_]+?)_(\d{8}T\d{4,6}Z)", name)
    groups[m.group(1) if m else "other"].append((m.group(2) if m else "", name))
lines = ["# Benchmark results (raw)", "",
         "The raw files behind BENCHMARKS.md and [HISTORY.md](HISTORY.md), by benchmark, newest",
         "first. Both cite the file of each figure; this index is written by",
         "`bench/index_results.py`.", ""]
for kind in sorted(groups):
    script, what = WHAT.get(kind, ("", ""))
    lines.append(f"## {kind}" + (f" - {what}" if what else ""))
    lines.append("")
    if script:
        lines.append(f"Written by `{script}`.")
        lines.append("")
    for stamp, name in sorted(groups[kind], reverse=True):
        lines.append(f"- [{name}]({name})")
    lines.append("")
open(os.path.join(HERE, "README.md"), "w").write("\n".join(lines))
