"""Online updates from Python: update_rows assigns and adds rows (duplicates as
index_put_), every later lookup sees them, and bad updates are refused changing nothing."""

import time

import pytest
import torch
import torch.nn.functional as F

import shardserve
from cluster import LocalCluster


def test_update_rows_then_lookups_see_them(client, name):
    w = torch.randn(30, 6)
    client.create_table(name, w, world=2)
    ids = torch.tensor([3, 9, 3])
    rows = torch.randn(3, 6)
    version, sequence = client.update_rows(name, ids, rows, op="assign")
    assert (version, sequence) == (1, 1)
    w[3], w[9] = rows[2], rows[1]  # the last of duplicate ids wins
    deltas = torch.randn(4, 6)
    add_ids = torch.tensor([9, 9, 0, 29])
    assert client.update_rows(name, add_ids, deltas) == (1, 2)  # op="add" by default
    w.index_put_((add_ids,), deltas, accumulate=True)
    x = torch.arange(30)
    assert torch.equal(client.embedding(name, x), F.embedding(x, w))
    assert torch.equal(torch.as_tensor(client.export(name)), w)


def test_updates_read_the_placement_map_once(client, name, monkeypatch):
    client.create_table(name, torch.zeros(10, 4), world=2)
    asked = []
    real = client._admin_call_until

    def counting(method, *args, **kwargs):
        asked.append(method)
        return real(method, *args, **kwargs)

    monkeypatch.setattr(client, "_admin_call_until", counting)
    for i in range(5):
        assert client.update_rows(name, torch.tensor([1]), torch.ones(1, 4)) == (1, i + 1)
    assert asked.count("DescribeTable") <= 1  # the map, read once at the first call
    assert torch.equal(client.embedding(name, torch.tensor([1])), torch.full((1, 4), 5.0))


def test_an_update_after_its_workers_restarted_elsewhere_finds_them():
    cluster = LocalCluster(world=2)  # no --data_dir: the group reloads the base
    try:
        with shardserve.Client(cluster.address, deadline=30) as client:
            client.create_table("moved", torch.zeros(10, 4), world=2)
            assert client.update_rows("moved", torch.tensor([1]), torch.ones(1, 4)) == (1, 1)
            old = list(cluster.worker_ports)
            for worker in (0, 1):
                cluster.kill_worker(worker)
            for worker in (0, 1):
                cluster.start_worker(worker)
            assert cluster.worker_ports != old
            cluster.wait_until_groups_serve()
            new = {f"127.0.0.1:{port}" for port in cluster.worker_ports}
            deadline = time.monotonic() + 30
            while True:  # until the coordinator maps the table to the new workers, serving
                info = client.describe("moved")
                if info.state == "serving" and set(info.addresses) == new:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            # The client's map still names the old ports: the update never left, and goes on
            # to where a fresh map says.
            assert client.update_rows("moved", torch.tensor([1]), torch.ones(1, 4)) == (1, 1)
            assert torch.equal(client.embedding("moved", torch.tensor([1])), torch.ones(1, 4))
    finally:
        cluster.stop()


def test_bad_updates_change_nothing(client, name):
    w = torch.randn(10, 4)
    client.create_table(name, w, world=2)
    with pytest.raises(shardserve.InvalidArgumentError, match="out of range"):
        client.update_rows(name, torch.tensor([10]), torch.randn(1, 4))
    with pytest.raises(shardserve.InvalidArgumentError, match="values.shape"):
        client.update_rows(name, torch.tensor([1]), torch.randn(1, 5))
    with pytest.raises(shardserve.InvalidArgumentError, match="not finite"):
        client.update_rows(name, torch.tensor([1]), torch.full((1, 4), float("nan")))
    with pytest.raises(shardserve.InvalidArgumentError, match="op"):
        client.update_rows(name, torch.tensor([1]), torch.randn(1, 4), op="set")
    assert torch.equal(torch.as_tensor(client.export(name)), w)
