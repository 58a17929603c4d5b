"""Online updates (issue 23) from Python: update_rows assigns and adds rows (duplicates as
index_put_), every later lookup sees them, and bad updates are refused changing nothing."""

import pytest
import torch
import torch.nn.functional as F

import shardserve


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
