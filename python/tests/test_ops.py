"""Every data op, through every client path (blocking, forwarded by the coordinator, asyncio,
the blocking and asyncio Stream batch APIs), equals PyTorch's op on the same, unsharded weight:
col- and row-wise sharding, permuted placements, uneven chunks, every input shape, modes,
offsets, include_last_offset, per_sample_weights, padding_idx, max_norm."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import shardserve

# Uneven chunks on purpose: 37 rows split 19 + 18 row-wise, 11 columns 6 + 5 col-wise.
ROWS, COLS = 37, 11
LAYOUTS = [
    (1, ("rank:0/cpu", "rank:1/cpu")),
    (1, ("rank:1/cpu", "rank:0/cpu")),
    (0, ("rank:0/cpu", "rank:1/cpu")),
    (0, ("rank:1/cpu", "rank:0/cpu")),
]
LAYOUT_IDS = ["col", "col-permuted", "row", "row-permuted"]


def check(got, want, atol=1e-5, rtol=1e-5):
    assert isinstance(got, torch.Tensor), type(got)
    assert got.dtype == torch.float32
    assert tuple(got.shape) == tuple(want.shape), (tuple(got.shape), tuple(want.shape))
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def tables(client):
    """Embedding tables (weight, padding_idx) per layout, made once for the module."""
    made = {}
    gen = torch.Generator().manual_seed(1234)
    for (dim, placements), layout in zip(LAYOUTS, LAYOUT_IDS):
        for padding_idx in (None, 5, -2):
            weight = torch.randn(ROWS, COLS, generator=gen)
            name = f"ops_{layout}_{padding_idx}".replace("-", "m")
            client.create_table(name, weight, sharding_dim=dim, placements=list(placements),
                                padding_idx=padding_idx)
            made[(layout, padding_idx)] = (name, weight)
    yield made
    for name, _ in made.values():
        client.drop(name)


def ids(*shape, high=ROWS, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("padding_idx", [None, 5, -2])
def test_embedding(call, tables, layout, padding_idx):
    name, weight = tables[(layout, padding_idx)]
    for shape in [(), (9,), (4, 5), (2, 3, 4), (0,), (3, 0)]:
        x = ids(*shape, seed=len(shape))
        if x.numel():
            x.view(-1)[0] = 5  # the padding row is looked up like any other by F.embedding
        check(call("embedding", name, x), F.embedding(x, weight, padding_idx=padding_idx),
              atol=0, rtol=0)


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("padding_idx", [None, 5, -2])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag(call, tables, layout, padding_idx, mode):
    name, weight = tables[(layout, padding_idx)]
    pad = None if padding_idx is None else padding_idx % ROWS

    def want(x, offsets=None, **kw):
        return F.embedding_bag(x, weight, offsets, mode=mode, padding_idx=padding_idx, **kw)

    # 2-D: bags x ids, some ids the padding row, one bag only padding.
    x = ids(6, 4, seed=1)
    if pad is not None:
        x[0, 1] = pad
        x[2, :] = pad
    check(call("embedding_bag", name, x, mode=mode), want(x))
    # 1-D with offsets: empty bags at the front, the middle and the end.
    flat = ids(10, seed=2)
    if pad is not None:
        flat[3] = pad
    offsets = torch.tensor([0, 0, 3, 3, 7, 10])
    check(call("embedding_bag", name, flat, offsets, mode=mode), want(flat, offsets))
    check(call("embedding_bag", name, flat, offsets, mode=mode, include_last_offset=True),
          want(flat, offsets, include_last_offset=True))
    # One bag per id, and no ids at all.
    single = torch.arange(0, 10, dtype=torch.long)
    check(call("embedding_bag", name, single, single, mode=mode), want(single, single))
    empty = torch.zeros(0, dtype=torch.long)
    check(call("embedding_bag", name, empty, torch.tensor([0, 0]), mode=mode),
          want(empty, torch.tensor([0, 0])))
    if mode == "sum":
        w2 = torch.rand(6, 4, generator=torch.Generator().manual_seed(3))
        check(call("embedding_bag", name, x, per_sample_weights=w2, mode="sum"),
              want(x, per_sample_weights=w2))
        w1 = torch.rand(10, generator=torch.Generator().manual_seed(4))
        check(call("embedding_bag", name, flat, offsets, w1, mode="sum"),
              want(flat, offsets, per_sample_weights=w1))
        check(call("embedding_bag", name, flat, offsets, w1, "sum", True),
              want(flat, offsets, per_sample_weights=w1, include_last_offset=True))


def test_embedding_bag_default_mode_is_mean(client, tables):
    name, weight = tables[("col", None)]
    x = ids(3, 5, seed=9)
    check(client.embedding_bag(name, x), F.embedding_bag(x, weight))


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("norm_type", [2.0, 1.5])
def test_max_norm_renorms_the_stored_rows(call, client, name, layout, norm_type):
    dim, placements = LAYOUTS[LAYOUT_IDS.index(layout)]
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7)) * 3
    client.create_table(name, weight, sharding_dim=dim, placements=list(placements),
                        max_norm=1.0, norm_type=norm_type)
    local = weight.clone()  # F.embedding renorms this in place, as the server its shards
    x = ids(5, 3, seed=11)
    check(call("embedding", name, x), F.embedding(x, local, max_norm=1.0, norm_type=norm_type))
    x2 = ids(4, 6, seed=12)
    check(call("embedding_bag", name, x2, mode="sum"),
          F.embedding_bag(x2, local, mode="sum", max_norm=1.0, norm_type=norm_type))
    assert not torch.equal(local, weight)  # the test renormed something
    check(client.export(name), local)
    client.drop(name)


LINEAR_IN, LINEAR_OUT = 13, 9


@pytest.fixture(scope="module")
def linear_tables(client):
    made = {}
    gen = torch.Generator().manual_seed(99)
    for (dim, placements), layout in zip(LAYOUTS, LAYOUT_IDS):
        for bias in (True, False):
            weight = torch.randn(LINEAR_OUT, LINEAR_IN, generator=gen)
            b = torch.randn(LINEAR_OUT, generator=gen) if bias else None
            name = f"lin_{layout}_{bias}"
            client.create_table(name, weight, kind="linear", bias=b, sharding_dim=dim,
                                placements=list(placements))
            made[(layout, bias)] = (name, weight, b)
    yield made
    for name, _, _ in made.values():
        client.drop(name)


@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear(call, linear_tables, layout, bias):
    name, weight, b = linear_tables[(layout, bias)]
    gen = torch.Generator().manual_seed(5)
    for shape in [(LINEAR_IN,), (6, LINEAR_IN), (2, 3, LINEAR_IN), (0, LINEAR_IN)]:
        x = torch.randn(*shape, generator=gen)
        # Row-wise sums partial products across ranks: float rounding differs from one matmul.
        check(call("linear", name, x), F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


def test_numpy_in_numpy_out(client, tables, linear_tables):
    name, weight = tables[("row-permuted", 5)]
    x = np.array([[1, 5, 7], [0, 0, 36]], dtype=np.int32)
    out = client.embedding(name, x)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(out, F.embedding(torch.from_numpy(x).long(), weight).numpy())
    bag = client.embedding_bag(name, x.ravel(), np.array([0, 2]), mode="max")
    assert isinstance(bag, np.ndarray)
    np.testing.assert_allclose(
        bag, F.embedding_bag(torch.from_numpy(x.ravel()).long(), weight, torch.tensor([0, 2]),
                             mode="max", padding_idx=5).numpy(), rtol=1e-6, atol=1e-6)
    lname, lw, lb = linear_tables[("col", True)]
    xin = np.random.default_rng(0).standard_normal((4, LINEAR_IN))  # float64: cast to fp32
    out = client.linear(lname, xin)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_allclose(out, F.linear(torch.from_numpy(xin).float(), lw, lb).numpy(),
                               rtol=1e-4, atol=1e-4)
    # Lists go in as numpy.
    out = client.embedding(name, [[1, 2], [3, 4]])
    assert isinstance(out, np.ndarray) and out.shape == (2, 2, COLS)


def test_results_are_writable_views_of_the_answer(client, tables):
    name, weight = tables[("col", None)]
    out = client.embedding(name, np.array([1, 2, 3]))
    assert out.flags.writeable and not out.flags.owndata  # no copy of the answer was made
    out *= 2  # as a local F.embedding result could be
    np.testing.assert_array_equal(out, 2 * weight[[1, 2, 3]].numpy())
    t = client.embedding(name, torch.tensor([4, 5]))
    t.add_(1)
    torch.testing.assert_close(t, weight[[4, 5]] + 1)


def test_torch_inputs_int32_noncontiguous_and_requires_grad(client, tables, linear_tables):
    name, weight = tables[("col-permuted", None)]
    x = torch.arange(20, dtype=torch.int32).reshape(4, 5).t()  # not contiguous
    check(client.embedding(name, x), F.embedding(x.long(), weight), atol=0, rtol=0)
    lname, lw, lb = linear_tables[("row", True)]
    xin = torch.randn(3, LINEAR_IN, requires_grad=True)
    check(client.linear(lname, xin), F.linear(xin, lw, lb).detach(), atol=1e-4, rtol=1e-4)


def test_many_concurrent_callers_get_their_own_answers(client, tables):
    """Threads sharing one client (coalesced into common steps) each get their own rows."""
    import concurrent.futures

    name, weight = tables[("row", None)]

    def one(seed):
        x = ids(16, 3, seed=seed)
        return torch.allclose(client.embedding_bag(name, x, mode="sum"),
                              F.embedding_bag(x, weight, mode="sum"), atol=1e-5, rtol=1e-5)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(64)))


def test_stream_pipelines_many_requests(client, tables, linear_tables):
    """Many requests in flight on one session, mixed ops and tables, each matched to its own
    answer (out of order on the wire or not)."""
    name, weight = tables[("col", 5)]
    lname, lw, lb = linear_tables[("row-permuted", True)]
    inputs = [ids(8, 4, seed=s) for s in range(40)]
    xs = [torch.randn(2, LINEAR_IN, generator=torch.Generator().manual_seed(s)) for s in range(40)]
    with client.stream(max_in_flight=16) as s:
        bags = [s.embedding_bag(name, x, mode="mean") for x in inputs]
        lins = [s.linear(lname, x) for x in xs]
        embs = [s.embedding(name, x) for x in inputs]
        for x, f in zip(inputs, bags):
            check(f.result(), F.embedding_bag(x, weight, mode="mean", padding_idx=5))
        for x, f in zip(xs, lins):
            check(f.result(), F.linear(x, lw, lb), atol=1e-4, rtol=1e-4)
        for x, f in zip(inputs, embs):
            check(f.result(), F.embedding(x, weight), atol=0, rtol=0)


def test_aio_stream_pipelines_many_requests(cluster, tables):
    import asyncio

    name, weight = tables[("row", -2)]
    inputs = [ids(8, 4, seed=s) for s in range(64)]

    async def main():
        async with shardserve.aio.Client(cluster.address) as c:
            async with c.stream(max_in_flight=8) as s:
                return await asyncio.gather(*(s.embedding_bag(name, x, mode="max")
                                              for x in inputs))

    for x, out in zip(inputs, asyncio.run(main())):
        check(out, F.embedding_bag(x, weight, mode="max", padding_idx=-2))


def test_aio_concurrent_tasks(cluster, tables):
    import asyncio

    name, weight = tables[("col-permuted", 5)]
    inputs = [ids(5, 2, seed=s) for s in range(32)]

    async def main():
        async with shardserve.aio.Client(cluster.address) as c:
            return await asyncio.gather(*(c.embedding_bag(name, x, mode="sum") for x in inputs))

    for x, out in zip(inputs, asyncio.run(main())):
        check(out, F.embedding_bag(x, weight, mode="sum", padding_idx=5))
