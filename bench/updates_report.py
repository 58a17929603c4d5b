"""Summarises a bench/run_updates.sh run: medians over rounds, and the ratios the targets name."""
import json
import statistics
import sys

runs = {}
for line in open(sys.argv[1]):
    entry = json.loads(line)
    runs.setdefault(entry["case"], []).append(entry["report"])


def med(case, key, sub=None):
    values = [r[sub][key] if sub else r[key] for r in runs.get(case, [])]
    return statistics.median(values) if values else float("nan")


ours = med("update", "rows_per_s")
redis = med("redis_mset", "rows_per_s")
print(f"durable updates, 512 rows/call: shardserve {ours:,.0f} rows/s "
      f"(p50 {med('update', 'p50_us', 'latency'):,.0f} us, p99 {med('update', 'p99_us', 'latency'):,.0f} us)"
      f" vs Redis appendfsync always {redis:,.0f} rows/s "
      f"(p50 {med('redis_mset', 'p50_us', 'latency'):,.0f} us, p99 {med('redis_mset', 'p99_us', 'latency'):,.0f} us)"
      f": {ours / redis:.2f}x (target >= 5x)")
ceiling = med("grpc_ceiling", "rows_per_s")
print(f"ceiling: the same calls to a gRPC server that only parses them: {ceiling:,.0f} rows/s "
      f"({ceiling / redis:.2f}x Redis; shardserve reaches {ours / ceiling:.0%} of it)")
fanout = med("durable_fanout", "rows_per_s")
print(f"ceiling: each of the R x W ranks sent its share straight from the client, logged and "
      f"synced, nothing else: {fanout:,.0f} rows/s ({fanout / redis:.2f}x Redis; shardserve "
      f"reaches {ours / fanout:.0%} of it)")
ordered = med("ordered_fanout", "rows_per_s")
print(f"ceiling: the same, each update first given its place by a sequencer, and each rank "
      f"checking and applying it in that order before it logs: {ordered:,.0f} rows/s "
      f"(p50 {med('ordered_fanout', 'p50_us', 'latency'):,.0f} us, "
      f"p99 {med('ordered_fanout', 'p99_us', 'latency'):,.0f} us; {ordered / redis:.2f}x Redis; "
      f"shardserve reaches {ours / ordered:.0%} of it)")
alone = med("reads", "bags_per_s")
mixed = med("reads_with_updates", "bags_per_s")
p99_alone = med("reads", "p99_us", "latency")
p99_mixed = med("reads_with_updates", "p99_us", "latency")
print(f"lookups alone {alone:,.0f} bags/s (p99 {p99_alone:,.0f} us); with updates at 20 %: "
      f"{mixed:,.0f} bags/s (p99 {p99_mixed:,.0f} us): {mixed / alone:.0%} of the read-only rate "
      f"(target >= 70 %), p99 {p99_mixed / p99_alone:.2f}x (target <= 2x); updates then "
      f"{med('updates_at_20pct', 'rows_per_s'):,.0f} rows/s")
for fan, what in (("same", "at shardserve's rate"), ("own", "at 20 % of its own rate")):
    got = med(f"reads_with_ordered_fanout_{fan}", "bags_per_s")
    p99 = med(f"reads_with_ordered_fanout_{fan}", "p99_us", "latency")
    print(f"ceiling: the same lookups beside the ordered fan-out's updates {what} "
          f"({med(f'ordered_fanout_{fan}', 'rows_per_s'):,.0f} rows/s): {got:,.0f} bags/s "
          f"(p99 {p99:,.0f} us): {got / alone:.0%} of the read-only rate, p99 {p99 / p99_alone:.2f}x")
errors = {case: sum(sum(r["errors_by_code"].values()) for r in reports)
          for case, reports in runs.items()}
print("failed calls by case: " + ", ".join(f"{c} {n}" for c, n in errors.items()))
