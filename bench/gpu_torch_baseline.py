#!/usr/bin/env python3
"""PyTorch on the same GPU, the baseline of bench/gpu_bench (run on the device machine).

F.embedding_bag (sum) over N x D with B bags of L ids, and F.linear, timed with CUDA events
(median of --iters), inputs already on the GPU and random (as bench/gpu_bench's); prints one JSON
line per op.
"""
import argparse
import json

import torch
import torch.nn.functional as F


def median_ms(fn, iters):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bags", type=int, default=65536)
    p.add_argument("--bag", type=int, default=32)
    p.add_argument("--linear_rows", type=int, default=65536)
    p.add_argument("--linear_in", type=int, default=1024)
    p.add_argument("--linear_out", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda:0")
    table = torch.rand(a.rows, a.dim, device=dev) * 2 - 1
    ids = torch.randint(0, a.rows, (a.bags, a.bag), device=dev)
    with torch.no_grad():
        ms = median_ms(lambda: F.embedding_bag(ids, table, mode="sum"), a.iters)
        print(json.dumps({"impl": f"torch-{torch.__version__}", "op": "embedding_bag", "ms": round(ms, 3),
                          "bags_per_s": round(a.bags / (ms / 1e3))}))
        x = torch.rand(a.linear_rows, a.linear_in, device=dev) * 2 - 1
        w = torch.rand(a.linear_out, a.linear_in, device=dev) * 2 - 1
        b = torch.rand(a.linear_out, device=dev) * 2 - 1
        ms = median_ms(lambda: F.linear(x, w, b), a.iters)
        xh = x.cpu()
        ms_up = median_ms(lambda: F.linear(xh.to(dev, non_blocking=False), w, b), max(3, a.iters // 4))
        print(json.dumps({"impl": f"torch-{torch.__version__}", "op": "linear", "ms": round(ms, 3),
                          "ms_including_upload": round(ms_up, 3)}))


if __name__ == "__main__":
    main()
