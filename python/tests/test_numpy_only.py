"""The numpy-only path: in a process where ``import torch`` fails, the package imports, every
call works on numpy arrays (blocking, asyncio, streams, admin, export), and results equal
PyTorch's ops (checked here, in the test process, on the same weights)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import torch
import torch.nn.functional as F

CHILD = textwrap.dedent(
    """
    import sys

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")

    sys.meta_path.insert(0, BlockTorch())
    import asyncio
    import numpy as np
    import shardserve

    address, out = sys.argv[1], sys.argv[2]
    try:
        import shardserve.torch
        raise SystemExit("shardserve.torch imported without torch")
    except ImportError:
        pass
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((25, 6)).astype(np.float32)
    lw = rng.standard_normal((3, 6)).astype(np.float32)
    lb = rng.standard_normal(3).astype(np.float32)
    ids = rng.integers(0, 25, (4, 5))
    flat = rng.integers(0, 25, 9)
    offsets = np.array([0, 2, 2, 7])
    psw = rng.random(9).astype(np.float32)
    x = rng.standard_normal((2, 6)).astype(np.float32)
    c = shardserve.Client(address)
    c.create_table("np_emb", weight, placements=["rank:1/cpu", "rank:0/cpu"], padding_idx=3)
    c.create_table("np_lin", lw, kind="linear", bias=lb, world=2, sharding_dim=1)
    last = np.array([0, 2, 2, 7, 9])  # include_last_offset: ends with the number of ids
    got = {
        "emb": c.embedding("np_emb", ids),
        "bag_mean": c.embedding_bag("np_emb", ids),
        "bag_max": c.embedding_bag("np_emb", flat, offsets, mode="max"),
        "bag_psw": c.embedding_bag("np_emb", flat, last, psw, mode="sum",
                                   include_last_offset=True),
        "lin": c.linear("np_lin", x),
        "export": c.export("np_emb"),
    }
    with c.stream() as s:
        got["stream_bag"] = s.embedding_bag("np_emb", ids, mode="sum").result()

    async def main():
        async with shardserve.aio.Client(address) as a:
            got["aio_lin"] = await a.linear("np_lin", x)
            async with a.stream() as s:
                got["aio_stream_emb"] = await s.embedding("np_emb", flat)

    asyncio.run(main())
    for k, v in got.items():
        assert type(v) is np.ndarray and v.dtype == np.float32, (k, type(v))
    assert "torch" not in sys.modules
    c.drop("np_emb")
    c.drop("np_lin")
    np.savez(out, weight=weight, lw=lw, lb=lb, ids=ids, flat=flat, offsets=offsets, last=last,
             psw=psw,
             x=x, **got)
    """
)


def test_numpy_only_process(cluster, tmp_path):
    out = str(tmp_path / "got.npz")
    proc = subprocess.run([sys.executable, "-c", CHILD, cluster.address, out],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = {k: torch.from_numpy(v) for k, v in np.load(out).items()}
    w = r["weight"]
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r["emb"], F.embedding(r["ids"], w, padding_idx=3), atol=0, rtol=0)
    torch.testing.assert_close(r["bag_mean"], F.embedding_bag(r["ids"], w, padding_idx=3),
                               **close)
    torch.testing.assert_close(
        r["bag_max"], F.embedding_bag(r["flat"], w, r["offsets"], mode="max", padding_idx=3),
        **close)
    torch.testing.assert_close(
        r["bag_psw"], F.embedding_bag(r["flat"], w, r["last"], mode="sum", padding_idx=3,
                                      per_sample_weights=r["psw"], include_last_offset=True),
        **close)
    torch.testing.assert_close(r["stream_bag"],
                               F.embedding_bag(r["ids"], w, mode="sum", padding_idx=3), **close)
    torch.testing.assert_close(r["aio_stream_emb"], F.embedding(r["flat"], w), atol=0, rtol=0)
    lin = F.linear(r["x"], r["lw"], r["lb"])
    torch.testing.assert_close(r["lin"], lin, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r["aio_lin"], lin, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r["export"], w, atol=0, rtol=0)
