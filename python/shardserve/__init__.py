"""shardserve: the Python client of a shardserve cluster.

- :class:`Client` (blocking) and :mod:`shardserve.aio` ``Client`` (asyncio):
  ``embedding``, ``embedding_bag``, ``linear`` (as ``torch.nn.functional``'s, on the served
  table's weight; numpy arrays or torch tensors in, the same kind out), ``stream()`` (pipelined
  batches), and the admin calls ``create_table``, ``drop``, ``tables``, ``describe``,
  ``export``, ``wait_table``, ``describe_cluster``.
- :mod:`shardserve.torch`: ``RemoteEmbedding``, ``RemoteEmbeddingBag``, ``RemoteLinear``,
  ``from_module`` (needs torch; nothing else here does).
- Errors: :class:`Error` and one subclass per gRPC status code (``.code``, ``.message``).

Example::

    import numpy as np, shardserve
    client = shardserve.Client("127.0.0.1:50051")
    client.create_table("emb", seed=1, rows=1000, cols=16, world=2)
    out = client.embedding_bag("emb", np.array([[1, 2], [3, 4]]), mode="sum")  # (2, 16)
"""

from . import aio, errors
from ._common import ShardInfo, TableInfo
from .client import Client, Stream, StreamFuture
from .errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Stream",
    "StreamFuture",
    "TableInfo",
    "ShardInfo",
    "aio",
    "errors",
    "Error",
    "AbortedError",
    "AlreadyExistsError",
    "CancelledError",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
]
