"""Summarises a bench/run_swap.sh run: per run (swap, drop + create), the calls' errors, the p99
before the change and during it, the longest time without an answer, the time the change took,
each worker's peak resident memory against 2 x its shard, and a plot (SVG: p50 / p99 / max per
100 ms, and failed calls). Writes summary.json and the SVGs into the run's folder; Markdown on
stdout.

    python3 bench/swap_report.py bench/results/swap_<time>
"""

import csv
import gzip
import json
import os
import sys

BIN_S = 0.1


def calls(path):
    """(sent_s, done_s, latency_us, code) of every call, sorted by sending time."""
    with gzip.open(path + ".gz", "rt") if os.path.exists(path + ".gz") else open(path) as f:
        rows = [(float(r["sent_s"]), float(r["done_s"]), float(r["latency_us"]), int(r["code"]))
                for r in csv.DictReader(f)]
    return sorted(rows)


def quantile(values, q):
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def memory(path):
    """{worker: [(t, anon_kib, file_kib)]}"""
    out = {}
    if not os.path.exists(path):
        return out
    for line in open(path):
        parts = line.split()
        if len(parts) == 4 and parts[2] and parts[3]:
            out.setdefault(int(parts[1]), []).append((float(parts[0]), int(parts[2]), int(parts[3])))
    return out


def plot(rows, marks, title, path):
    end = max(s for s, _, _, _ in rows) + BIN_S
    n = int(end / BIN_S) + 1
    lat = [[] for _ in range(n)]
    bad = [0] * n
    for sent, _, us, code in rows:
        b = int(sent / BIN_S)
        if code == 0:
            lat[b].append(us / 1000)
        else:
            bad[b] += 1
    series = {
        "p50": ([quantile(l, 0.5) for l in lat], "#2ca02c"),
        "p99": ([quantile(l, 0.99) for l in lat], "#1f77b4"),
        "max": ([max(l) if l else 0 for l in lat], "#ff7f0e"),
    }
    W, H, L, R, T = 900, 420, 60, 20, 30
    ph = H - T - 140
    top = max(max(v) for v, _ in series.values()) or 1
    x = lambda t: L + (W - L - R) * t / end
    y = lambda ms: T + ph - ph * ms / top
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{L}" y="18" font-size="13">{title}</text>',
           f'<text x="5" y="{T + 10}">{top:.1f} ms</text><text x="5" y="{T + ph}">0</text>']
    for i, (name, (values, color)) in enumerate(series.items()):
        pts = " ".join(f"{x(b * BIN_S):.1f},{y(v):.1f}" for b, v in enumerate(values))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{pts}"/>')
        out.append(f'<text x="{W - 200 + 60 * i}" y="{T + 10}" fill="{color}">{name}</text>')
    y0 = H - 60
    topbad = max(max(bad), 1)
    for b, v in enumerate(bad):
        if v:
            h = 50 * v / topbad
            out.append(f'<rect x="{x(b * BIN_S):.1f}" y="{y0 - h:.1f}" width="2" height="{h:.1f}" '
                       f'fill="#d62728"/>')
    out.append(f'<text x="5" y="{y0}">failed</text><text x="5" y="{y0 - 40}">{topbad}/100ms</text>')
    for label, t in marks:
        out.append(f'<line x1="{x(t):.1f}" y1="{T}" x2="{x(t):.1f}" y2="{y0}" stroke="#888" '
                   f'stroke-dasharray="4,3"/><text x="{x(t) + 3:.1f}" y="{T + 24}">{label}</text>')
    for t in range(0, int(end) + 1, 2):
        out.append(f'<text x="{x(t):.1f}" y="{H - 40}">{t}s</text>')
    out.append(f'<text x="{L}" y="{H - 20}">x: when each call was sent; latency of the calls '
               f'sent in each 100 ms</text></svg>')
    with open(path, "w") as f:
        f.write("\n".join(out))


def summarise(folder, run, e, shard_kib):
    rows = calls(os.path.join(folder, run + ".csv"))
    start, done = e["start_at"], e["done_at"]
    steady = [us for s, _, us, code in rows if 1.0 <= s < start - 0.2 and code == 0]
    window = [us for s, _, us, code in rows if start <= s < done + 1.0]
    # The longest time without an answer (between consecutive OK answers) after the start.
    ok_done = sorted(d for s, d, _, code in rows if code == 0 and d >= start - 1)
    mem = memory(os.path.join(folder, run + ".memory.txt"))
    workers = {}
    for w, samples in mem.items():
        before = [a for t, a, _ in samples if t < start]
        workers[w] = {
            "anon_before_mib": (max(before) if before else 0) / 1024,
            "anon_peak_mib": max(a for _, a, _ in samples) / 1024,
            "file_peak_mib": max(f for _, _, f in samples) / 1024,
        }
    r = {
        "calls": len(rows),
        "errors": sum(1 for *_, code in rows if code != 0),
        "steady_p99_ms": quantile(steady, 0.99) / 1000,
        "window_p50_ms": quantile(window, 0.5) / 1000,
        "window_p99_ms": quantile(window, 0.99) / 1000,
        "window_max_ms": max(window, default=0) / 1000,
        "p99_ratio": (quantile(window, 0.99) / quantile(steady, 0.99)) if steady else 0,
        "change_s": done - start,
        "longest_gap_s": max((b - a for a, b in zip(ok_done, ok_done[1:])), default=0.0),
        "steal_s": e.get("steal_s", 0.0),
        "workers": workers,
    }
    version = os.path.join(folder, run + ".version.json")
    if os.path.exists(version):
        info = json.load(open(version))
        serving = [v for v in info.get("versions", []) if v.get("state") == "VERSION_STATE_SERVING"]
        if serving:
            r["load_to_switch_ms"] = int(serving[0].get("load_ms", 0))
            r["mode"] = serving[0].get("mode")
    kind = run.rsplit("_", 1)[0]
    marks = [({"swap": "load-version", "copy": "copy"}.get(kind, "drop"), start),
             ({"swap": "switched", "copy": "copied"}.get(kind, "created"), done)]
    plot(rows, marks, f"{run}: open loop, 64 x 20 bags", os.path.join(folder, run + ".svg"))
    return r


def median(values):
    s = sorted(values)
    return s[len(s) // 2] if s else 0.0


def main(folder):
    events = json.load(open(os.path.join(folder, "events.json")))
    shard_kib = events["rows"] * events["cols"] * 4 / 2 / 1024
    summary = {"qps": events["qps"], "shard_mib": shard_kib / 1024, "runs": {}, "median": {}}
    for run in sorted(k for k in events if isinstance(events[k], dict)):
        summary["runs"][run] = summarise(folder, run, events[run], shard_kib)
    for kind in ("swap", "drop_create", "copy"):
        runs = [r for name, r in summary["runs"].items() if name.rsplit("_", 1)[0] == kind]
        if not runs:
            continue
        m = {key: median([r[key] for r in runs])
             for key in ("steady_p99_ms", "window_p99_ms", "window_max_ms", "p99_ratio",
                         "change_s", "longest_gap_s")}
        m["errors"] = sum(r["errors"] for r in runs)
        m["calls"] = sum(r["calls"] for r in runs)
        m["runs"] = len(runs)
        if kind == "swap":
            m["load_to_switch_ms"] = median([r.get("load_to_switch_ms", 0) for r in runs])
            m["anon_peak_mib"] = max(p["anon_peak_mib"] for r in runs for p in r["workers"].values())
            m["anon_before_mib"] = max(p["anon_before_mib"] for r in runs
                                       for p in r["workers"].values())
        summary["median"][kind] = m
    json.dump(summary, open(os.path.join(folder, "summary.json"), "w"), indent=2)
    s, d = summary["median"]["swap"], summary["median"]["drop_create"]
    c = summary["median"].get("copy")
    print(f"open loop at {summary['qps']} calls/s; shard {summary['shard_mib']:.0f} MiB per "
          f"worker; loads paced to {events.get('load_mb_per_s', 256)} MiB/s; medians of "
          f"{s['runs']} runs each\n")
    print("| | errors | steady p99 | p99 during | ratio | max during | longest gap | change took |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [("LoadVersion (swap)", s), ("DropTable + CreateTable", d)]
    if c:
        rows.append(("ceiling: the loads' memory writes alone, outside shardserve", c))
    for name, r in rows:
        print(f"| {name} | {r['errors']} of {r['calls']} | {r['steady_p99_ms']:.2f} ms | "
              f"{r['window_p99_ms']:.2f} ms | {r['p99_ratio']:.2f}x | {r['window_max_ms']:.1f} ms | "
              f"{r['longest_gap_s'] * 1000:.0f} ms | {r['change_s']:.2f} s |")
    print(f"\nLoadVersion to switch: {s['load_to_switch_ms']:.0f} ms (median); workers' anonymous "
          f"memory: {s['anon_before_mib']:.0f} MiB before, {s['anon_peak_mib']:.0f} MiB at the "
          f"peak of any swap, 2 x shard = {2 * summary['shard_mib']:.0f} MiB\n")
    print("| run | errors | steady p99 | p99 during | ratio | max | gap | switch | steal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in summary["runs"].items():
        print(f"| {name} | {r['errors']} | {r['steady_p99_ms']:.2f} ms | {r['window_p99_ms']:.2f} ms | "
              f"{r['p99_ratio']:.2f}x | {r['window_max_ms']:.1f} ms | "
              f"{r['longest_gap_s'] * 1000:.0f} ms | "
              f"{r.get('load_to_switch_ms', r['change_s'] * 1000):.0f} ms | {r['steal_s']:.2f} s |")


if __name__ == "__main__":
    main(sys.argv[1])
