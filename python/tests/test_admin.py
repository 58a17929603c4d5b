"""Admin calls: create_table from tensors, arrays, modules, seeds and checkpoints; tables,
describe (the placement map, as torch.chunk splits), drop, export; blocking and asyncio."""

import asyncio
import os
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardserve
from shardserve import _safetensors


def chunks(n, world):
    """(offset, size) of each chunk, as torch.chunk makes them."""
    split = -(-n // world)
    return [(min(split * i, n), max(min(n, split * (i + 1)) - split * i, 0))
            for i in range(world)]


def test_create_from_tensor_describe_export_drop(client, name, tmp_path):
    weight = torch.randn(9, 5)
    info = client.create_table(name, weight, placements=["rank:1/cpu", "rank:0/cpu"],
                               sharding_dim=0, padding_idx=-1)
    assert info.state == "serving" and info.kind == "embedding"
    assert (info.num_rows, info.num_cols, info.sharding_dim) == (9, 5, 0)
    assert info.placements == ("rank:1/cpu", "rank:0/cpu")
    assert info.padding_idx in (-1, 8)
    assert [s.rank for s in info.shards] == [1, 0]
    assert [(s.offset, s.size) for s in info.shards] == chunks(9, 2)
    assert all(s.address.startswith("127.0.0.1:") for s in info.shards)
    assert info.checkpoint and os.path.isabs(info.checkpoint)
    described = client.describe(name)
    assert described.shards == info.shards and described.generation == info.generation
    assert name in [t.name for t in client.tables()]
    torch.testing.assert_close(client.export(name), weight, atol=0, rtol=0)
    path = str(tmp_path / "out.safetensors")
    got = client.export(name, path, numpy=True)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, weight.numpy())
    np.testing.assert_array_equal(_safetensors.read(path)["weight"], weight.numpy())
    client.drop(name)
    with pytest.raises(shardserve.NotFoundError):
        client.describe(name)
    with pytest.raises(shardserve.NotFoundError):
        client.embedding(name, [0])


def test_create_from_numpy_and_seed(client, name):
    weight = np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32)
    client.create_table(name, weight, world=2)
    np.testing.assert_array_equal(client.embedding(name, np.array([5, 0])), weight[[5, 0]])
    client.drop(name)
    info = client.create_table(name, seed=11, rows=50, cols=8, world=2, sharding_dim=0)
    assert info.seed == 11 and info.checkpoint is None
    full = client.export(name)
    x = torch.tensor([[1, 49], [7, 7]])
    torch.testing.assert_close(client.embedding_bag(name, x, mode="sum"),
                               F.embedding_bag(x, full, mode="sum"))
    # The seeded init is the same full table whatever the sharding.
    other = name + "_col"
    client.create_table(other, seed=11, rows=50, cols=8, world=2, sharding_dim=1)
    torch.testing.assert_close(client.export(other), full, atol=0, rtol=0)
    client.drop(other)
    client.drop(name)


def test_create_from_checkpoint(client, name, tmp_path):
    weight = np.random.default_rng(4).standard_normal((7, 3)).astype(np.float32)
    bias = np.arange(7, dtype=np.float32)
    path = str(tmp_path / "lin.safetensors")
    _safetensors.write(path, {"weight": weight, "bias": bias})
    info = client.create_table(name, checkpoint=path, kind="linear", rows=7, cols=3, world=2,
                               sharding_dim=0)
    assert info.kind == "linear" and info.bias and info.checkpoint == path
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(client.linear(name, x), x @ weight.T + bias, rtol=1e-5, atol=1e-5)
    state = client.export_state(name, numpy=True)
    np.testing.assert_array_equal(state["weight"], weight)
    np.testing.assert_array_equal(state["bias"], bias)
    client.drop(name)


@pytest.mark.parametrize("module", [
    nn.Embedding(12, 6, padding_idx=3, max_norm=2.0, norm_type=1.0),
    nn.EmbeddingBag(12, 6, mode="max", padding_idx=0),
    nn.Linear(6, 4),
    nn.Linear(6, 4, bias=False),
], ids=["embedding", "embedding_bag", "linear", "linear_no_bias"])
def test_create_from_module_takes_its_settings(client, name, module):
    info = client.create_table(name, module, world=2, sharding_dim=0)
    if isinstance(module, nn.Linear):
        assert info.kind == "linear" and info.bias == (module.bias is not None)
        state = client.export_state(name)
        torch.testing.assert_close(state["weight"], module.weight.detach(), atol=0, rtol=0)
        if module.bias is not None:
            torch.testing.assert_close(state["bias"], module.bias.detach(), atol=0, rtol=0)
        else:
            assert "bias" not in state
    else:
        assert info.kind == "embedding" and info.padding_idx == module.padding_idx
        assert info.max_norm == module.max_norm
        if module.max_norm is not None:
            assert info.norm_type == module.norm_type
        torch.testing.assert_close(client.export(name), module.weight.detach(), atol=0, rtol=0)
    client.drop(name)


def test_checkpoints_get_fresh_names(client, name, tmp_path):
    """A table dropped and created again gets a new checkpoint file: the old one may still back
    the old table's generation on some worker."""
    c = shardserve.Client(client.coordinator, checkpoint_dir=str(tmp_path))
    first = c.create_table(name, torch.zeros(4, 2), world=2).checkpoint
    c.drop(name)
    second = c.create_table(name, torch.ones(4, 2), world=2).checkpoint
    assert first != second and os.path.dirname(first) == str(tmp_path)
    torch.testing.assert_close(c.embedding(name, torch.tensor([0])), torch.ones(1, 2))
    c.drop(name)
    c.close()


def test_aio_admin(cluster, name):
    weight = torch.randn(8, 4)

    async def main():
        async with shardserve.aio.Client(cluster.address) as c:
            info = await c.create_table(name, weight, world=2, sharding_dim=0)
            assert info.state == "serving"
            assert name in [t.name for t in await c.tables()]
            assert (await c.describe(name)).shards == info.shards
            exported = await c.export(name)
            await c.drop(name)
            with pytest.raises(shardserve.NotFoundError):
                await c.describe(name)
            with pytest.raises(TypeError):
                await c.create_table(name, weight, worlds=2)
            return exported

    torch.testing.assert_close(asyncio.run(main()), weight, atol=0, rtol=0)


def test_create_is_idempotent_answers_loading_in_time_and_wait_table_waits(client, name):
    """A create whose deadline runs out while the table loads answers "loading" (not a deadline
    error), a retry of it finds the same table, and wait_table waits until it serves."""
    big = dict(seed=5, rows=2_000_000, cols=64, world=2)  # 512 MB from a seed: loads a while
    started = time.monotonic()
    info = client.create_table(name, **big, deadline=1.0)
    assert time.monotonic() - started < 1.0
    assert info.state in ("loading", "serving")
    again = client.create_table(name, **big, deadline=1.0)
    assert again.generation == info.generation
    with pytest.raises(shardserve.AlreadyExistsError) as e:
        client.create_table(name, **dict(big, cols=32), deadline=5)
    assert "num_cols: 64 -> 32" in e.value.message
    assert client.wait_table(name, timeout=60).state == "serving"
    assert client.wait_table(name, timeout=0.01).state == "serving"

    async def aio():
        async with shardserve.aio.Client(client.coordinator) as c:
            assert (await c.create_table(name, **big)).state == "serving"
            return (await c.wait_table(name)).generation

    assert asyncio.run(aio()) == info.generation
    client.drop(name)
    with pytest.raises(shardserve.NotFoundError):
        client.wait_table(name)


def test_export_streams_the_file_the_coordinator_would_write(client, name, tmp_path):
    """export needs no shared file system: the coordinator streams the table's file to the
    client, which writes it here too when given a path - the bytes ExportTable writes on the
    coordinator's machine."""
    weight = torch.randn(300, 7)
    client.create_table(name, weight, world=2, sharding_dim=1)
    here = tmp_path / "here.safetensors"
    torch.testing.assert_close(client.export(name, str(here)), weight, atol=0, rtol=0)
    there = tmp_path / "there.safetensors"
    pb, _ = shardserve._stubs.load()
    client._admin.ExportTable(pb.ExportTableRequest(name=name, path=str(there)), timeout=30)
    assert here.read_bytes() == there.read_bytes()

    async def aio():
        async with shardserve.aio.Client(client.coordinator) as c:
            return await c.export(name, numpy=True)

    np.testing.assert_array_equal(asyncio.run(aio()), weight.numpy())
    with pytest.raises(shardserve.InvalidArgumentError):  # a directory is no file to write
        client.export(name, str(tmp_path))
    client.drop(name)


def test_describe_cluster_lists_every_worker(client, cluster):
    info = client.describe_cluster()
    (group,) = info.groups
    assert group.state == 1 and group.world_size == 2 and group.epoch > 0  # GROUP_STATE_SERVING
    assert [m.rank for m in group.members] == [0, 1]
    for m in group.members:
        assert m.alive and m.device == "cpu" and m.epoch == group.epoch
        assert m.address.startswith("127.0.0.1:")

    async def aio():
        async with shardserve.aio.Client(cluster.address) as c:
            return await c.describe_cluster()

    assert [m.address for m in asyncio.run(aio()).groups[0].members] == [
        m.address for m in group.members
    ]
