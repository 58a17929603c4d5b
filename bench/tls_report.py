"""The summary of a bench/run_tls.sh run (its JSON lines): TLS against plaintext per case, the
servers' CPU per bag, and the ceiling that the cipher's own rate sets.
    python3 bench/tls_report.py bench/results/tls_*.jsonl"""
import json
import statistics
import sys

by, aes = {}, None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "report" not in r:
        aes = r["value"]
        continue
    rep = r["report"]
    # the servers' CPU per bag over the whole run, the 1 s warm-up included
    bags = rep["bags_per_s"] * (rep["measured_s"] + 1)
    by.setdefault(r["case"], {}).setdefault(rep["impl"], []).append(
        (rep["bags_per_s"], rep["latency"]["p50_us"], rep["latency"]["p99_us"],
         sum(rep["errors_by_code"].values()), r.get("server_cpu_s", 0) / bags * 1e6))


def med(runs, i):
    return statistics.median(x[i] for x in runs)


print("| case | plaintext bags/s | TLS bags/s | TLS ÷ plaintext (per round) | servers' CPU per "
      "bag, plain / TLS (µs) | p50 ms plain / TLS | p99 ms plain / TLS | errors |")
print("|---|---|---|---|---|---|---|---|")
for case, impls in by.items():
    for prefix in ("", "echo-"):
        if prefix + "plain" not in impls:
            continue
        p, t = impls[prefix + "plain"], impls[prefix + "tls"]
        ratios = [b[0] / a[0] for a, b in zip(p, t)]
        cpu = f"{med(p, 4):.2f} / {med(t, 4):.2f}" if not prefix else "-"
        print(f"| {case}{' (bare gRPC echo)' if prefix else ''} | {med(p, 0):,.0f} | "
              f"{med(t, 0):,.0f} | **{statistics.median(ratios):.2f}x** "
              f"({', '.join(f'{r:.2f}' for r in ratios)}) | {cpu} | "
              f"{med(p, 1) / 1e3:.2f} / {med(t, 1) / 1e3:.2f} | "
              f"{med(p, 2) / 1e3:.2f} / {med(t, 2) / 1e3:.2f} | {sum(x[3] for x in p + t)} |")
# The least encryption can cost a 512 x 20 call: its request (10 240 int64 ids) and answer
# (512 x 128 floats) each encrypted once and decrypted once, at AES-256-GCM's rate.
call_bytes = 10240 * 8 + 512 * 128 * 4
crypto_s = 2 * call_bytes / aes if aes else 0
for case, how in (("bag_c1", "serial"), ("bag_c16", "saturated")) if aes else ():
    plain_rate = med(by[case]["plain"], 0) / 512  # calls/s
    # One caller: each call's bytes are encrypted and decrypted on its path, one step after
    # another. Sixteen: this machine's 2 cores are busy at the plaintext rate (servers and load
    # tester), and the crypto's CPU adds to each call's share of them.
    cost = 1 / plain_rate if how == "serial" else 2 / plain_rate
    print(f"ceiling {case} ({how}): AES-256-GCM {aes / 1e9:.2f} GB/s -> {crypto_s * 1e6:.0f} µs "
          f"of crypto per call beside {cost * 1e6:.0f} µs per plaintext call: at best "
          f"{cost / (cost + crypto_s):.2f}x")
print(f"\nraw: {sys.argv[1]}")
