"""Where a hedge goes, against real gRPC servers in this process: a coordinator that describes a
table on two replica groups, and each group's one worker, which answers EmbeddingBag with its
group's number after a set delay. A hedge's guess goes only to a replica that serves: a draining
one may still hold the version before a swap (rpc/routing/replica_caller.h says the same of the C++
client)."""

import asyncio
import struct
import time
from concurrent import futures

import grpc
import pytest
import torch

import shardserve
from shardserve import _common, _stubs

pb, _ = _stubs.load()
SERVING, DRAINING = 2, 5  # TableState


def _serve(handlers):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(*handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _info(name, addresses, states):
    """The TableInfo of a table on one worker per group: group g at addresses[g], in states[g]."""
    info = pb.TableInfo(state=SERVING)
    info.spec.name, info.spec.num_rows, info.spec.num_cols = name, 10, 1
    for g, address in enumerate(addresses):
        r = info.replicas.add(group=g, state=states[g])
        r.shards.add(rank=0, address=address, offset=0, size=1)
    info.shards.extend(info.replicas[0].shards)
    return info


def _worker(group, delay):
    output = pb.Tensor(dtype=pb.FLOAT32, shape=[1, 1], data=struct.pack("<f", group))

    def bag(request, context):
        time.sleep(delay)
        return pb.TensorResponse(output=output)

    def stream(requests, context):
        for r in requests:
            time.sleep(delay)
            yield pb.StreamResponse(id=r.id, output=output)
    return _serve(("shardserve.v1.DataService", {
        "EmbeddingBag": grpc.unary_unary_rpc_method_handler(
            bag, request_deserializer=pb.EmbeddingBagRequest.FromString,
            response_serializer=pb.TensorResponse.SerializeToString),
        "Stream": grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=pb.StreamRequest.FromString,
            response_serializer=pb.StreamResponse.SerializeToString)}))


@pytest.fixture
def replicas():
    """(set_states, coordinator address): group 0 answers after 0.3 s, group 1 at once."""
    workers = [_worker(0, 0.3), _worker(1, 0.0)]
    states = [SERVING, SERVING]

    def describe(request, context):
        return _info(request.name, [address for _, address in workers], states)
    coordinator = _serve(("shardserve.v1.AdminService", {
        "DescribeTable": grpc.unary_unary_rpc_method_handler(
            describe, request_deserializer=pb.DescribeTableRequest.FromString,
            response_serializer=pb.TableInfo.SerializeToString)}))

    def set_states(*s):
        states[:] = s
    yield set_states, coordinator[1]
    for server, _ in workers + [coordinator]:
        server.stop(None)


IDS = torch.zeros(1, 1, dtype=torch.long)
APIS = ["unary", "stream", "aio", "aio_stream"]


def _answers(address, api, n=6):
    """The groups that answered n calls, one after another, through the client API ``api``."""
    def group(t):
        return int(t.item())
    if api in ("unary", "stream"):
        with shardserve.Client(address, deadline=5, hedge_after=0.05) as client:
            if api == "unary":
                return [group(client.embedding_bag("t", IDS)) for _ in range(n)]
            with client.stream() as s:
                return [group(s.embedding_bag("t", IDS).result()) for _ in range(n)]

    async def run():
        async with shardserve.aio.Client(address, deadline=5, hedge_after=0.05) as client:
            if api == "aio":
                return [group(await client.embedding_bag("t", IDS)) for _ in range(n)]
            async with client.stream() as s:
                return [group(await s.embedding_bag("t", IDS)) for _ in range(n)]
    return asyncio.run(run())


@pytest.mark.parametrize("api", APIS)
def test_a_hedge_never_guesses_a_draining_replica(replicas, api):
    set_states, address = replicas
    set_states(SERVING, DRAINING)
    # Every call goes to group 0, the one that serves; it is slow, but the draining group 1 is
    # no place to hedge to, so group 0 answers each.
    assert _answers(address, api) == [0] * 6


@pytest.mark.parametrize("api", APIS)
def test_a_hedge_goes_to_another_serving_replica(replicas, api):
    _, address = replicas
    # Both serve: calls sent to slow group 0 are hedged to group 1, which answers first.
    assert _answers(address, api) == [1] * 6


def test_hedges_fail_over_to_any_replica_once_a_group_failed():
    routes = _common.RoutingTable(cooldown=60)
    routes.update("t", _common.table_info(_info("t", ["a:1", "b:1"], [SERVING, DRAINING])))
    assert routes.hedge("t", 0, [0]) is None  # a guess: group 1 does not serve
    assert routes.pick("t") == ("a:1", 0, False)  # and group 0 was not made suspect
    routes.failed("t", 0)  # group 0 failed a call: a hedge now is failover, to any replica
    assert routes.hedge("t", 0, [0]) == ("b:1", 1, False)


def test_guesses_are_budgeted_to_about_one_call_in_ten():
    routes = _common.RoutingTable(cooldown=60)
    routes.update("t", _common.table_info(_info("t", ["a:1", "b:1"], [SERVING, SERVING])))
    for _ in range(5):
        routes.pick("t")
    assert routes.hedge("t", 0, [0]) == ("b:1", 1, False)  # the window's first hedge
    routes.succeeded("t", 0)
    assert routes.hedge("t", 0, [0]) is None  # 5 calls: no second one
    assert routes.pick("t", [1]) == ("a:1", 0, False)  # (and group 0 was not made suspect)
    for _ in range(14):
        routes.pick("t")
    assert routes.hedge("t", 0, [0]) == ("b:1", 1, False)  # 20 calls: a second one
    # Failover (group 0 failed a call) is no guess: it needs no budget.
    assert routes.hedge("t", 0, [0]) == ("b:1", 1, False)
