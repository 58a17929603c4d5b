"""Fixtures of the Python client's tests: a real local cluster (coordinator + 2 workers on
loopback) for the whole session, clients on it, fresh table names, and the ways to call an op
(blocking client, asyncio client, the two Stream batch APIs, the coordinator's forwarding path)."""

import asyncio
import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shardserve  # noqa: E402
from cluster import LocalCluster  # noqa: E402

_names = itertools.count()


@pytest.fixture(scope="session")
def cluster():
    c = LocalCluster(world=2)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def client(cluster):
    with shardserve.Client(cluster.address, deadline=30) as c:
        yield c


@pytest.fixture
def name(request):
    """A table name no other test uses."""
    return f"t{next(_names)}_{request.node.name[:40]}".replace("[", "_").replace("]", "_")


VIAS = ["client", "forwarded", "aio", "stream", "aio_stream"]


class Caller:
    """Runs one data op (``embedding``, ``embedding_bag``, ``linear``) through one path."""

    def __init__(self, via: str, cluster: LocalCluster, client: shardserve.Client) -> None:
        self.via = via
        self.cluster = cluster
        self.client = client

    def __call__(self, op: str, *args, **kwargs):
        if self.via == "client":
            return getattr(self.client, op)(*args, **kwargs)
        if self.via == "forwarded":
            with shardserve.Client(self.cluster.address, direct=False, deadline=30) as c:
                return getattr(c, op)(*args, **kwargs)
        if self.via == "stream":
            with self.client.stream() as s:
                return getattr(s, op)(*args, **kwargs).result()
        return asyncio.run(self._aio(op, args, kwargs))

    async def _aio(self, op, args, kwargs):
        async with shardserve.aio.Client(self.cluster.address, deadline=30) as c:
            if self.via == "aio":
                return await getattr(c, op)(*args, **kwargs)
            async with c.stream() as s:
                return await getattr(s, op)(*args, **kwargs)


@pytest.fixture(params=VIAS)
def call(request, cluster, client):
    return Caller(request.param, cluster, client)
