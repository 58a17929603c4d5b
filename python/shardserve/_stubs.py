"""Loads the generated protobuf / gRPC modules, with a message that says how to make them."""

from types import ModuleType
from typing import Tuple

_cache: Tuple[ModuleType, ModuleType] = ()  # type: ignore[assignment]


def load() -> Tuple[ModuleType, ModuleType]:
    """(shardserve_pb2, shardserve_pb2_grpc)."""
    global _cache
    if not _cache:
        try:
            from ._proto import shardserve_pb2, shardserve_pb2_grpc
        except ImportError as e:
            raise ImportError(
                "shardserve: the generated protobuf modules (shardserve/_proto/shardserve_pb2*.py) "
                "are missing. Install the package with `pip install --no-build-isolation ./python` "
                "(its build step runs protoc and grpc_python_plugin), or build "
                "//proto:shardserve_py_gen with Bazel and put its outputs there."
            ) from e
        _cache = (shardserve_pb2, shardserve_pb2_grpc)
    return _cache
