"""The Python client's closed-loop EmbeddingBag load, as shardserve-load measures the C++ one:
``--concurrency`` callers (threads sharing one shardserve.Client, or asyncio tasks sharing one
shardserve.aio.Client) each sending calls back to back for ``--duration_s`` after a warm-up,
requests drawn from a pool of 16 pre-made id batches (uniform ids, as shardserve-load's pool).
Prints one JSON line (bags/s, latency percentiles), like shardserve-load's --report.

``--decode`` instead measures the cost of decoding one answer (µs, and µs per MiB of answer):
shardserve's zero-copy decoder against the generated protobuf class + np.frombuffer (what a
hand-rolled stub client does) and a decoder that copies the rows out.

    /usr/bin/python3 bench/python_client_bench.py --coordinator=127.0.0.1:50351 --table=bench \\
        --batch=512 --bag=20 --concurrency=4 --impl=threads --duration_s=5
"""

import argparse
import asyncio
import json
import os
import sys
import threading
import time

import numpy as np

import shardserve
from shardserve import _codec, _stubs


def percentile(sorted_us, q):
    if not sorted_us:
        return 0.0
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))]


def report(args, calls, measured, latencies):
    lat = sorted(latencies)
    return {
        "impl": f"python-{args.impl}",
        "op": "embedding_bag",
        "mode": args.mode,
        "concurrency": args.concurrency,
        "batch": args.batch,
        "bag": args.bag,
        "measured_s": round(measured, 3),
        "calls": calls,
        "calls_per_s": round(calls / measured, 1),
        "bags_per_s": round(calls * args.batch / measured, 1),
        "latency": {
            "mean_us": round(sum(lat) / max(len(lat), 1), 1),
            "p50_us": round(percentile(lat, 0.50), 1),
            "p90_us": round(percentile(lat, 0.90), 1),
            "p99_us": round(percentile(lat, 0.99), 1),
            "max_us": round(lat[-1] if lat else 0.0, 1),
        },
    }


def pool(args):
    rng = np.random.default_rng(args.seed)
    return [rng.integers(0, args.rows, (args.batch, args.bag), dtype=np.int64) for _ in range(16)]


def run_threads(args):
    client = shardserve.Client(args.coordinator, deadline=args.deadline)
    batches = pool(args)
    client.embedding_bag(args.table, batches[0], mode=args.mode)  # routes, channels
    start = time.perf_counter()
    warm_end = start + args.warmup_s
    end = warm_end + args.duration_s
    results = []

    def caller(k):
        n, lat = 0, []
        i = k
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                break
            client.embedding_bag(args.table, batches[i % 16], mode=args.mode)
            t1 = time.perf_counter()
            i += 1
            if t0 >= warm_end and t1 <= end:
                n += 1
                lat.append((t1 - t0) * 1e6)
        results.append((n, lat))

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    return report(args, sum(n for n, _ in results), args.duration_s,
                  [x for _, lat in results for x in lat])


def run_asyncio(args):
    batches = pool(args)

    async def main():
        async with shardserve.aio.Client(args.coordinator, deadline=args.deadline) as client:
            await client.embedding_bag(args.table, batches[0], mode=args.mode)
            start = time.perf_counter()
            warm_end = start + args.warmup_s
            end = warm_end + args.duration_s

            async def caller(k):
                n, lat, i = 0, [], k
                while True:
                    t0 = time.perf_counter()
                    if t0 >= end:
                        return n, lat
                    await client.embedding_bag(args.table, batches[i % 16], mode=args.mode)
                    t1 = time.perf_counter()
                    i += 1
                    if t0 >= warm_end and t1 <= end:
                        n += 1
                        lat.append((t1 - t0) * 1e6)

            return await asyncio.gather(*(caller(k) for k in range(args.concurrency)))

    results = asyncio.run(main())
    return report(args, sum(n for n, _ in results), args.duration_s,
                  [x for _, lat in results for x in lat])


def run_decode(args):
    """Decoding cost of one real answer (fetched raw from a worker)."""
    pb, _ = _stubs.load()
    client = shardserve.Client(args.coordinator, deadline=args.deadline)
    ids = pool(args)[0]
    address = client.describe(args.table).addresses[0]
    raw = client._endpoint(address).unary["embedding_bag"](
        _codec.encode_embedding_bag(args.table, ids, None, None, _codec.pool_mode(args.mode),
                                    False), timeout=args.deadline)
    mib = len(raw) / (1 << 20)

    def per_call(fn, n=2000):
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    def protobuf_decode():
        out = pb.TensorResponse.FromString(raw).output
        return np.frombuffer(out.data, np.float32).reshape(tuple(out.shape))

    def copying_decode():
        return _codec.decode_tensor_response(raw).copy()

    cases = {
        "shardserve_zero_copy": lambda: _codec.decode_tensor_response(raw),
        "shardserve_to_torch": None,
        "protobuf_frombuffer": protobuf_decode,
        "copy_out": copying_decode,
    }
    try:
        import torch

        cases["shardserve_to_torch"] = lambda: torch.from_numpy(
            _codec.decode_tensor_response(raw))
    except ImportError:
        del cases["shardserve_to_torch"]
    out = {"impl": "decode", "answer_bytes": len(raw), "answer_mib": round(mib, 4)}
    for name, fn in cases.items():
        us = per_call(fn)
        out[name] = {"us_per_answer": round(us, 2), "us_per_mib": round(us / mib, 2)}
    client.close()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--coordinator", default="127.0.0.1:50051")
    p.add_argument("--table", default="bench")
    p.add_argument("--rows", type=int, default=100000)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--bag", type=int, default=20)
    p.add_argument("--mode", default="sum")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--impl", choices=["threads", "asyncio"], default="threads")
    p.add_argument("--warmup_s", type=float, default=1.0)
    p.add_argument("--duration_s", type=float, default=5.0)
    p.add_argument("--deadline", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--decode", action="store_true", help="measure answer decoding instead")
    p.add_argument("--report", help="also write the JSON here")
    args = p.parse_args()
    if args.decode:
        result = run_decode(args)
    elif args.impl == "threads":
        result = run_threads(args)
    else:
        result = run_asyncio(args)
    line = json.dumps(result)
    print(line)
    if args.report:
        with open(args.report, "w") as f:
            f.write(line + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip gRPC's slow teardown of the channels' threads


if __name__ == "__main__":
    main()
