#!/usr/bin/env python3
"""The unsharded op on the whole table, single-threaded: what one process does without sharding.

Runs F.embedding_bag / F.embedding / F.linear (PyTorch, Debian's python3-torch) on the full weight
for the same global batch the sharded benchmark serves in one step (world x batch), and prints one
JSON line shaped like bench/sharded_ops_bench's.
Example: /usr/bin/python3 bench/unsharded_baseline.py --op embedding_bag --world 2 --batch 512 --bag 20
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=["embedding", "embedding_bag", "linear"], default="embedding_bag")
    p.add_argument("--world", type=int, default=2, help="the global batch is world * batch")
    p.add_argument("--rows", type=int, default=100000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--out", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--bag", type=int, default=20)
    p.add_argument("--mode", default="sum")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = a.world * a.batch
    if a.op == "linear":
        w = torch.randn(a.out, a.dim, generator=g)
        b = torch.randn(a.out, generator=g)
        xs = [torch.randn(rows, a.dim, generator=g) for _ in range(8)]
        call = lambda x: F.linear(x, w, b)  # noqa: E731
    else:
        w = torch.randn(a.rows, a.dim, generator=g)
        xs = [torch.randint(0, a.rows, (rows, a.bag), generator=g) for _ in range(8)]
        if a.op == "embedding":
            call = lambda x: F.embedding(x, w)  # noqa: E731
        else:
            call = lambda x: F.embedding_bag(x, w, mode=a.mode)  # noqa: E731
    with torch.no_grad():
        for i in range(a.warmup):
            call(xs[i % 8])
        t = time.perf_counter()
        for i in range(a.iters):
            call(xs[i % 8])
        per = (time.perf_counter() - t) / a.iters
    n = rows * (a.bag if a.op == "embedding" else 1)
    rec = {"impl": "torch-1.13-unsharded-1thread", "op": a.op, "world": a.world, "rows": a.rows,
           "dim": a.dim, "batch_per_rank": a.batch, "bag": a.bag, "mode": a.mode,
           "per_step_ms": round(per * 1e3, 4),
           "bags_per_s" if a.op == "embedding_bag" else "rows_per_s": round(n / per)}
    if a.op == "linear":
        rec["out"] = a.out
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
