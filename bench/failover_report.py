"""Summarises a bench/run_failover.sh run: per fault, the success rate, calls past their deadline,
p99 before the fault and while group 0 was out, and when it served again; a time line plot per
fault (SVG: calls and errors per 100 ms, p99 per 100 ms); throughput against groups with each
process's CPU. Writes summary.json and the SVGs into the run's folder; Markdown on stdout.

    python3 bench/failover_report.py bench/results/failover_<time>
"""

import csv
import gzip
import json
import os
import sys

DEADLINE_US = 2e6


def calls(path):
    """(sent_s, latency_us, code) of every call in `path`, or in `path`.gz (as runs keep them)."""
    opener = (lambda: gzip.open(path + ".gz", "rt")) if os.path.exists(path + ".gz") else (
        lambda: open(path))
    with opener() as f:
        return [(float(r["sent_s"]), float(r["latency_us"]), int(r["code"])) for r in csv.DictReader(f)]


def p99(latencies):
    if not latencies:
        return 0.0
    s = sorted(latencies)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def plot(rows, marks, title, path, bin_s=0.1):
    """Two panels over time: calls / errors per second, and p99 (ms, log scale)."""
    end = max(t for t, _, _ in rows) if rows else 1.0
    n = int(end / bin_s) + 1
    ok, bad, lat = [0] * n, [0] * n, [[] for _ in range(n)]
    for t, us, code in rows:
        b = int(t / bin_s)
        (ok if code == 0 else bad)[b] += 1
        lat[b].append(us)
    W, H, L, R, T = 900, 420, 60, 20, 30
    ph = (H - T - 60) / 2
    x = lambda t: L + (W - L - R) * t / end
    top = max(max(ok), max(bad), 1) / bin_s
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{L}" y="18" font-size="13">{title}</text>']

    def polyline(values, y0, scale, color):
        pts = " ".join(f"{x(i * bin_s):.1f},{y0 - scale(v):.1f}" for i, v in enumerate(values))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{pts}"/>')

    y1 = T + ph  # calls panel
    polyline([c / bin_s for c in ok], y1, lambda v: ph * v / top, "#1f77b4")
    polyline([c / bin_s for c in bad], y1, lambda v: ph * v / top, "#d62728")
    out.append(f'<text x="5" y="{T + 10}">{top:,.0f}/s</text><text x="5" y="{y1}">0</text>')
    out.append(f'<text x="{W - 220}" y="{T + 10}" fill="#1f77b4">OK calls/s</text>'
               f'<text x="{W - 140}" y="{T + 10}" fill="#d62728">failed calls/s</text>')
    import math
    y2 = T + 2 * ph + 30  # p99 panel, log scale 0.1 ms .. 2000 ms
    lo, hi = math.log10(0.1), math.log10(2000)
    scale = lambda ms: ph * (math.log10(max(ms, 0.1)) - lo) / (hi - lo)
    polyline([p99(v) / 1e3 if v else 0.1 for v in lat], y2, scale, "#ff7f0e")
    for ms in (0.1, 1, 10, 100, 1000):
        out.append(f'<text x="5" y="{y2 - scale(ms) + 4:.1f}">{ms:g} ms</text>'
                   f'<line x1="{L}" x2="{W - R}" y1="{y2 - scale(ms):.1f}" y2="{y2 - scale(ms):.1f}" '
                   f'stroke="#ddd"/>')
    out.append(f'<text x="{W - 220}" y="{y2 - ph + 10}" fill="#ff7f0e">p99 per 100 ms</text>')
    for k, (label, t) in enumerate(marks):
        if t is None or t < 0:
            continue
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{T}" y2="{y2}" stroke="#888" '
                   f'stroke-dasharray="4 3"/><text x="{x(t) + 3:.1f}" y="{T + 24 + 14 * k}">'
                   f'{label}</text>')
    for s in range(0, int(end) + 1, 5):
        out.append(f'<text x="{x(s):.1f}" y="{H - 8}">{s} s</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main(folder):
    events = json.load(open(os.path.join(folder, "events.json")))
    summary, lines = {}, []
    lines.append("| fault | calls | succeeded | past deadline | p99 steady -> while out | "
                 "group 0 serves again |")
    lines.append("|---|---|---|---|---|---|")
    for run, what in (("kill_worker", "SIGKILL, restart at 15 s"),
                      ("stop_worker", "SIGSTOP, SIGCONT at 15 s")):
        e = events[run]
        rows = calls(os.path.join(folder, run + ".csv"))
        fault, back, served = e["fault_at"], e["back_at"], e.get("group_serving_at", -1)
        out_until = (served if served > 0 else back) + 1.0
        steady = [us for t, us, _ in rows if 1.0 <= t < fault]
        during = [us for t, us, _ in rows if fault <= t < out_until]
        failed = sum(1 for _, _, c in rows if c != 0)
        # Past the deadline: ended more than 10 ms after it (the client's own scheduling aside).
        late = sum(1 for _, us, _ in rows if us > DEADLINE_US + 10e3)
        expired = sum(1 for _, _, c in rows if c == 4)
        s = {
            "calls": len(rows),
            "failed": failed,
            "success": 1 - failed / max(len(rows), 1),
            "past_deadline": late,
            "deadline_exceeded": expired,
            "codes": sorted({c for _, _, c in rows if c != 0}),
            "p99_steady_ms": p99(steady) / 1e3,
            "p99_out_ms": p99(during) / 1e3,
            "max_out_ms": max(during, default=0) / 1e3,
            "fault_at_s": fault,
            "back_at_s": back,
            "group_serving_after_s": served - back if served > 0 else None,
        }
        s["p99_ratio"] = s["p99_out_ms"] / s["p99_steady_ms"] if s["p99_steady_ms"] else None
        summary[run] = s
        plot(rows, [("fault", fault), ("back", back), ("g0 serves", served)],
             f"{what}: R = 2 x W = 2, open loop at {events['capacity']['qps_used']:.0f} calls/s",
             os.path.join(folder, run + ".svg"))
        lines.append(
            f"| worker (g0, r1) {what} | {s['calls']:,} | **{100 * s['success']:.3f} %** "
            f"({failed} failed, {expired} of them DEADLINE_EXCEEDED) | **{late}** | "
            f"{s['p99_steady_ms']:.1f} -> "
            f"{s['p99_out_ms']:.1f} ms (**{s['p99_ratio']:.2f}x**; max {s['max_out_ms']:.0f} ms) | "
            + (f"{s['group_serving_after_s']:.2f} s after it is back |"
               if s["group_serving_after_s"] is not None else "not seen |"))
    capacity = json.load(open(os.path.join(folder, "capacity.json")))
    summary["capacity_calls_per_s"] = capacity["calls_per_s"]
    summary["open_loop_qps"] = events["capacity"]["qps_used"]
    scale = {}
    for groups in (1, 2):
        run = f"scale_{groups}x1"
        r = json.load(open(os.path.join(folder, run + ".json")))
        # (CPU was read over the whole run, warm-up included: the rate of the measured part
        # stands for it.)
        scale[run] = {"bags_per_s": r["bags_per_s"], "p99_ms": r["latency"]["p99_us"] / 1e3,
                      "seconds": r["measured_s"] + 2.0, **events.get(run, {})}
    summary["scaling"] = scale
    a, b = scale["scale_1x1"], scale["scale_2x1"]
    lines.append("")
    lines.append("| cluster | bags/s | p99 | CPU s: load generator / coordinator / workers |")
    lines.append("|---|---|---|---|")
    for name, r in (("R = 1 x W = 1", a), ("R = 2 x W = 1", b)):
        cpu = sum(r.get(k, 0) for k in ("cpu_load_generator_s", "cpu_coordinator_s",
                                          "cpu_workers_s"))
        r["cpu_us_per_bag"] = 1e6 * cpu / (r["bags_per_s"] * r["seconds"])
        lines.append(f"| {name} | {r['bags_per_s']:,.0f} | {r['p99_ms']:.1f} ms | "
                     f"{r.get('cpu_load_generator_s', 0):.1f} / {r.get('cpu_coordinator_s', 0):.1f} / "
                     f"{r.get('cpu_workers_s', 0):.1f} ({r['cpu_us_per_bag']:.2f} us of CPU per bag) |")
    lines.append(f"\nR = 2 over R = 1: **{b['bags_per_s'] / a['bags_per_s']:.2f}x** bags/s")
    json.dump(summary, open(os.path.join(folder, "summary.json"), "w"), indent=1)
    print("\n".join(lines))
    print(f"\nraw: {folder}")


if __name__ == "__main__":
    main(sys.argv[1])
