"""shardserve.torch: the remote modules' forward takes what nn.Embedding / nn.EmbeddingBag /
nn.Linear take and returns the same tensor; a model with a served table gives the output of the
same model with its local one."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardserve.torch as sst


def test_remote_embedding_equals_local(client, name):
    local = nn.Embedding(30, 8, padding_idx=2)
    remote = sst.from_module(local, client, name, world=2, sharding_dim=1)
    assert isinstance(remote, sst.RemoteEmbedding)
    assert (remote.num_embeddings, remote.embedding_dim, remote.padding_idx) == (30, 8, 2)
    x = torch.randint(0, 30, (4, 7))
    with torch.no_grad():
        torch.testing.assert_close(remote(x), local(x), atol=0, rtol=0)
    torch.testing.assert_close(remote.to_local().weight, local.weight.detach())
    assert name in repr(remote)
    client.drop(name)


def test_remote_embedding_with_max_norm_renorms_like_local(client, name):
    local = nn.Embedding(20, 6, max_norm=1.0)
    with torch.no_grad():
        local.weight.mul_(4)
    remote = sst.from_module(local, client, name, world=2, placements=None)
    x = torch.randint(0, 20, (3, 5))
    with torch.no_grad():
        want = local(x)  # renorms local.weight in place
    torch.testing.assert_close(remote(x), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(remote.to_local().weight, local.weight.detach(),
                               atol=1e-6, rtol=1e-5)
    client.drop(name)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_remote_embedding_bag_equals_local(client, name, mode, include_last_offset):
    local = nn.EmbeddingBag(40, 10, mode=mode, include_last_offset=include_last_offset,
                            padding_idx=0)
    remote = sst.RemoteEmbeddingBag.from_module(
        local, client, name, placements=["rank:1/cpu", "rank:0/cpu"], sharding_dim=0)
    assert remote.mode == mode and remote.include_last_offset == include_last_offset
    flat = torch.randint(0, 40, (15,))
    flat[2] = 0
    offsets = torch.tensor([0, 4, 4, 9, 15]) if include_last_offset else torch.tensor([0, 4, 4, 9])
    with torch.no_grad():
        torch.testing.assert_close(remote(flat, offsets), local(flat, offsets))
        if not include_last_offset:
            x2 = torch.randint(0, 40, (5, 3))
            torch.testing.assert_close(remote(x2), local(x2))
        if mode == "sum":
            w = torch.rand(15)
            torch.testing.assert_close(remote(flat, offsets, w), local(flat, offsets, w))
            torch.testing.assert_close(remote(flat, offsets, per_sample_weights=w),
                                       local(flat, offsets, per_sample_weights=w))
    client.drop(name)


@pytest.mark.parametrize("sharding_dim", [0, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_remote_linear_equals_local(client, name, sharding_dim, bias):
    local = nn.Linear(12, 5, bias=bias)
    remote = sst.from_module(local, client, name, world=2, sharding_dim=sharding_dim)
    assert isinstance(remote, sst.RemoteLinear)
    assert (remote.in_features, remote.out_features, remote.has_bias) == (12, 5, bias)
    for shape in [(12,), (3, 12), (2, 4, 12)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(remote(x), local(x), atol=1e-4, rtol=1e-4)
    back = remote.to_local()
    torch.testing.assert_close(back.weight, local.weight.detach(), atol=0, rtol=0)
    client.drop(name)


def test_wrong_kind_of_table_is_refused(client, name):
    client.create_table(name, seed=1, rows=4, cols=3, kind="linear", world=2)
    with pytest.raises(ValueError):
        sst.RemoteEmbedding(client, name)
    with pytest.raises(TypeError):
        sst.from_module(nn.ReLU(), client, name + "x", world=2)
    client.drop(name)


class Ranker(nn.Module):
    """A small recommendation model: pooled id features + dense features -> MLP score."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(500, 16, mode="sum")
        self.dense = nn.Linear(4, 16)
        self.mlp = nn.Sequential(nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids, offsets, dense):
        return self.mlp(torch.cat([self.bag(ids, offsets), F.relu(self.dense(dense))], dim=1))


def test_model_with_remote_embedding_bag_gives_the_local_output(client, name):
    torch.manual_seed(0)
    model = Ranker().eval()
    ids = torch.randint(0, 500, (64,))
    offsets = torch.tensor([0, 3, 10, 10, 20, 33, 40, 64 - 1])
    dense = torch.randn(len(offsets), 4)
    with torch.no_grad():
        want = model(ids, offsets, dense)
        model.bag = sst.from_module(model.bag, client, name, world=2)  # the one-line swap
        got = model(ids, offsets, dense)
    assert isinstance(model.bag, sst.RemoteEmbeddingBag)
    assert got.shape == want.shape == (len(offsets), 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    client.drop(name)
