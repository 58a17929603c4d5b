"""Drop-in ``nn.Module``s for served tables: :class:`RemoteEmbedding`, :class:`RemoteEmbeddingBag`
and :class:`RemoteLinear` take exactly what ``nn.Embedding``, ``nn.EmbeddingBag`` and
``nn.Linear`` take in ``forward`` and return the same tensor, computed by the cluster on the
table's weight. A model swaps a local table for a served one by changing one line::

    model.bag = shardserve.torch.from_module(model.bag, client, name="user_bag")

The weight lives on the server: these modules have no parameters, and nothing flows back
through them in autograd (serving is inference). Importing this module needs torch; the rest
of the package does not.
"""

from typing import Any, Optional

import torch
from torch import Tensor, nn

from .client import Client

__all__ = ["RemoteEmbedding", "RemoteEmbeddingBag", "RemoteLinear", "from_module"]


class RemoteEmbedding(nn.Module):
    """``nn.Embedding`` served by table ``table``: ``forward(input)`` is
    ``F.embedding(input, weight, padding_idx, max_norm, norm_type)`` with the table's weight and
    settings (max_norm renorms the rows looked up in the stored table, as nn.Embedding does to
    its weight)."""

    def __init__(self, client: Client, table: str, *, deadline: Optional[float] = None) -> None:
        super().__init__()
        info = client.describe(table)
        if info.kind != "embedding":
            raise ValueError(f"table {table!r} is a {info.kind} table, not an embedding")
        self.client = client
        self.table = table
        self.deadline = deadline
        self.num_embeddings = info.num_rows
        self.embedding_dim = info.num_cols
        self.padding_idx = info.padding_idx
        self.max_norm = info.max_norm
        self.norm_type = info.norm_type if info.norm_type is not None else 2.0

    def forward(self, input: Tensor) -> Tensor:
        return self.client.embedding(self.table, input, deadline=self.deadline)

    @classmethod
    def from_module(cls, module: nn.Module, client: Client, name: str,
                    **create_table_args: Any) -> "RemoteEmbedding":
        """Uploads ``module``'s weight (and settings) as table ``name``; see
        :meth:`shardserve.Client.create_table` for the other arguments (sharding, placements)."""
        client.create_table(name, module, **create_table_args)
        return cls(client, name)

    def to_local(self) -> nn.Embedding:
        """An ``nn.Embedding`` holding the table's current weight (an export)."""
        return nn.Embedding(self.num_embeddings, self.embedding_dim,
                            padding_idx=self.padding_idx, max_norm=self.max_norm,
                            norm_type=self.norm_type,
                            _weight=self.client.export(self.table, numpy=False).clone())

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
                + (f", max_norm={self.max_norm}" if self.max_norm is not None else ""))


class RemoteEmbeddingBag(nn.Module):
    """``nn.EmbeddingBag`` served by table ``table``: ``forward(input, offsets=None,
    per_sample_weights=None)`` is ``F.embedding_bag`` with the table's weight, padding_idx and
    max_norm and this module's ``mode`` and ``include_last_offset``."""

    def __init__(self, client: Client, table: str, mode: str = "mean",
                 include_last_offset: bool = False, *,
                 deadline: Optional[float] = None) -> None:
        super().__init__()
        info = client.describe(table)
        if info.kind != "embedding":
            raise ValueError(f"table {table!r} is a {info.kind} table, not an embedding")
        self.client = client
        self.table = table
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.deadline = deadline
        self.num_embeddings = info.num_rows
        self.embedding_dim = info.num_cols
        self.padding_idx = info.padding_idx
        self.max_norm = info.max_norm
        self.norm_type = info.norm_type if info.norm_type is not None else 2.0

    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        return self.client.embedding_bag(
            self.table, input, offsets, per_sample_weights, mode=self.mode,
            include_last_offset=self.include_last_offset, deadline=self.deadline)

    @classmethod
    def from_module(cls, module: nn.Module, client: Client, name: str,
                    **create_table_args: Any) -> "RemoteEmbeddingBag":
        """Uploads ``module`` (an nn.EmbeddingBag: weight, padding_idx, max_norm) as table
        ``name``; the module's mode and include_last_offset carry over to the remote one."""
        client.create_table(name, module, **create_table_args)
        return cls(client, name, mode=module.mode,
                   include_last_offset=module.include_last_offset)

    def to_local(self) -> nn.EmbeddingBag:
        """An ``nn.EmbeddingBag`` holding the table's current weight (an export)."""
        return nn.EmbeddingBag(self.num_embeddings, self.embedding_dim, max_norm=self.max_norm,
                               norm_type=self.norm_type, mode=self.mode,
                               include_last_offset=self.include_last_offset,
                               padding_idx=self.padding_idx,
                               _weight=self.client.export(self.table, numpy=False).clone())

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}, "
                f"mode={self.mode!r}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))


class RemoteLinear(nn.Module):
    """``nn.Linear`` served by table ``table``: ``forward(input)`` is ``F.linear(input, weight,
    bias)`` on ``(*, in_features)``."""

    def __init__(self, client: Client, table: str, *, deadline: Optional[float] = None) -> None:
        super().__init__()
        info = client.describe(table)
        if info.kind != "linear":
            raise ValueError(f"table {table!r} is a {info.kind} table, not a linear layer")
        self.client = client
        self.table = table
        self.deadline = deadline
        self.out_features = info.num_rows
        self.in_features = info.num_cols
        self.has_bias = info.bias

    def forward(self, input: Tensor) -> Tensor:
        return self.client.linear(self.table, input, deadline=self.deadline)

    @classmethod
    def from_module(cls, module: nn.Module, client: Client, name: str,
                    **create_table_args: Any) -> "RemoteLinear":
        """Uploads ``module`` (an nn.Linear: weight and bias) as table ``name``."""
        create_table_args.setdefault("sharding_dim", 0)
        client.create_table(name, module, **create_table_args)
        return cls(client, name)

    def to_local(self) -> nn.Linear:
        """An ``nn.Linear`` holding the table's current weight and bias (an export)."""
        state = self.client.export_state(self.table, numpy=False)
        layer = nn.Linear(self.in_features, self.out_features, bias=self.has_bias)
        with torch.no_grad():
            layer.weight.copy_(state["weight"])
            if self.has_bias:
                layer.bias.copy_(state["bias"])
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.has_bias}, table={self.table!r}")


def from_module(module: nn.Module, client: Client, name: str, **create_table_args: Any) -> Any:
    """Uploads a local ``nn.Embedding``, ``nn.EmbeddingBag`` or ``nn.Linear`` as table ``name``
    and returns the remote module that stands for it (same forward, same results)."""
    if isinstance(module, nn.EmbeddingBag):
        return RemoteEmbeddingBag.from_module(module, client, name, **create_table_args)
    if isinstance(module, nn.Embedding):
        return RemoteEmbedding.from_module(module, client, name, **create_table_args)
    if isinstance(module, nn.Linear):
        return RemoteLinear.from_module(module, client, name, **create_table_args)
    raise TypeError(
        f"from_module: nn.Embedding, nn.EmbeddingBag or nn.Linear expected, got "
        f"{type(module).__name__}"
    )
