"""Table versions from Python: load_version swaps a table's weights while calls run,
every answer is exactly one version's and says which (with_version), pinned versions, a kept
version unloaded, and bad arguments refused before any call."""

import asyncio
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import shardserve
import shardserve.aio
from shardserve import _safetensors


def test_load_version_swaps_under_calls_and_pins(client, name, tmp_path):
    w1, w2 = torch.randn(90, 8), torch.randn(90, 8)
    info = client.create_table(name, w1, world=2)
    assert info.version == 1
    assert [v["state"] for v in info.versions] == ["serving"]
    path = str(tmp_path / "v2.safetensors")
    _safetensors.write(path, {"weight": w2.numpy()})
    x = torch.randint(0, 90, (12, 4))
    want = {1: F.embedding_bag(x, w1, mode="sum"), 2: F.embedding_bag(x, w2, mode="sum")}
    stop, seen, bad = threading.Event(), [], []

    def loop():
        while not stop.is_set():
            try:
                out, version = client.embedding_bag(name, x, mode="sum", with_version=True)
                torch.testing.assert_close(out, want[version], rtol=0, atol=1e-5)
                seen.append(version)
            except Exception as e:  # noqa: BLE001 - counted, reported below
                bad.append(repr(e))

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        info = client.load_version(name, checkpoint=path, keep_versions=2)
        # The workers hear of the switch at their next heartbeat: the callers go on until one
        # of them has an answer of version 2 (5 s at most).
        deadline = time.monotonic() + 5
        while 2 not in seen and not bad and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not bad, bad[:3]
    assert info.version == 2 and info.checkpoint == path
    assert [v["state"] for v in info.versions] == ["kept", "serving"]
    assert 2 in seen
    # Pinned: the kept version and the serving one; unpinned: the serving one.
    for pin in (1, 2):
        out, version = client.embedding_bag(name, x, mode="sum", version=pin, with_version=True)
        assert version == pin
        torch.testing.assert_close(out, want[pin], rtol=0, atol=1e-5)
    torch.testing.assert_close(client.embedding_bag(name, x, mode="sum"), want[2],
                               rtol=0, atol=1e-5)
    info = client.unload_version(name, 1)
    assert [v["version"] for v in info.versions] == [2]
    with pytest.raises(shardserve.errors.NotFoundError):
        for _ in range(100):  # the workers unload it at their next heartbeat
            client.embedding(name, x, version=1)
            time.sleep(0.05)
    client.drop(name)


def test_the_asyncio_client_pins_and_says_versions(cluster, client, name):
    """The asyncio client takes version= and with_version= as the blocking one does."""
    weight = torch.randn(30, 4)
    client.create_table(name, weight, world=2)
    client.load_version(name, seed=5, keep_versions=2)
    x = torch.tensor([1, 2, 29])

    async def run():
        async with shardserve.aio.Client(cluster.address) as c:
            old, v_old = await c.embedding(name, x, version=1, with_version=True)
            new, v_new = await c.embedding(name, x, with_version=True)
            return old, v_old, new, v_new

    old, v_old, new, v_new = asyncio.run(run())
    assert (v_old, v_new) == (1, 2)
    torch.testing.assert_close(old, F.embedding(x, weight), rtol=0, atol=0)
    assert not torch.equal(new, old)
    client.drop(name)


def test_bad_version_arguments_are_refused_before_any_call(client, name):
    client.create_table(name, torch.randn(10, 4), world=2)
    with pytest.raises(shardserve.errors.InvalidArgumentError):
        client.embedding(name, torch.tensor([1]), version=-1)
    with pytest.raises(shardserve.errors.InvalidArgumentError):
        client.load_version(name)  # neither checkpoint nor seed
    with pytest.raises(shardserve.errors.NotFoundError):
        client.load_version("no_such_table", seed=3)
    info = client.load_version(name, seed=3)
    assert info.version == 2 and info.seed == 3
    client.drop(name)

