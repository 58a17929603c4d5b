"""Replica groups from Python: a cluster of 2 groups x 1 rank, a table on both. A
worker killed or hung while calls run costs no call - through the blocking client, the asyncio
client and both Stream APIs - and every replica answers the same."""

import asyncio
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import shardserve
from cluster import LocalCluster

DEADLINE = 3.0


@pytest.fixture
def replicated():
    c = LocalCluster(world=1, groups=2)
    yield c
    c.stop()


def make_table(client, name="r_emb"):
    weight = torch.randn(120, 8)
    info = client.create_table(name, weight, world=1)
    return name, weight, info


def check(out, x, weight):
    torch.testing.assert_close(out, F.embedding_bag(x, weight, mode="sum"), rtol=0, atol=1e-5)


def test_describe_lists_every_replica_and_each_answers_the_same(replicated):
    with shardserve.Client(replicated.address, deadline=DEADLINE) as client:
        name, weight, info = make_table(client)
        assert [r.group for r in info.replicas] == [0, 1]
        assert all(r.state == "serving" for r in info.replicas)
        assert info.replicas[1].addresses == [f"127.0.0.1:{replicated.worker_ports[1]}"]
        assert set(info.addresses) == {f"127.0.0.1:{p}" for p in replicated.worker_ports}
        x = torch.randint(0, 120, (16, 5))
        answers = {tuple(client.embedding_bag(name, x, mode="max").flatten().tolist())
                   for _ in range(6)}  # round robin: both replicas answered
        assert len(answers) == 1


def test_add_replica_refuses_what_it_cannot_add(replicated):
    with shardserve.Client(replicated.address, deadline=DEADLINE) as client:
        name, _, _ = make_table(client, "r_add")
        with pytest.raises(shardserve.AlreadyExistsError, match="group 1 already"):
            client.add_replica(name, 1)  # on every group already
        with pytest.raises(shardserve.InvalidArgumentError, match="out of range"):
            client.add_replica(name, 2)
        with pytest.raises(shardserve.NotFoundError):
            client.add_replica("r_none", 1)
        assert [r.group for r in client.describe(name).replicas] == [0, 1]


def run_callers(client, name, x, weight, stop, failures, n=3):
    def loop():
        with client.stream() as s:
            while not stop.is_set():
                for fn in (lambda: client.embedding_bag(name, x, mode="sum"),
                           lambda: s.embedding_bag(name, x, mode="sum").result()):
                    try:
                        check(fn(), x, weight)
                    except Exception as e:  # noqa: BLE001 - counted, reported below
                        failures.append(repr(e))
    threads = [threading.Thread(target=loop) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


async def aio_callers(address, name, x, weight, stop, failures):
    async with shardserve.aio.Client(address, deadline=DEADLINE) as c:
        async with c.stream() as s:
            while not stop.is_set():
                for coro in (c.embedding_bag(name, x, mode="sum"),
                             s.embedding_bag(name, x, mode="sum")):
                    try:
                        check(await coro, x, weight)
                    except Exception as e:  # noqa: BLE001
                        failures.append(repr(e))


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_worker_killed_or_hung_costs_no_call(replicated, fault):
    client = shardserve.Client(replicated.address, deadline=DEADLINE)
    name, weight, _ = make_table(client)
    x = torch.randint(0, 120, (8, 4))
    stop, failures = threading.Event(), []
    threads = run_callers(client, name, x, weight, stop, failures)
    aio = threading.Thread(target=lambda: asyncio.run(
        aio_callers(replicated.address, name, x, weight, stop, failures)))
    aio.start()
    time.sleep(0.5)
    if fault == "kill":
        replicated.kill_worker(0)
        time.sleep(1.5)
        replicated.start_worker(0)
    else:  # hung: sockets open, nothing fails; calls sent to it are hedged to group 1
        replicated.kill_worker(0, signal.SIGSTOP)
        time.sleep(1.5)
        replicated.kill_worker(0, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while client.describe(name).replicas[0].state != "serving":
        assert time.monotonic() < deadline, "group 0 did not serve again"
        time.sleep(0.1)
    time.sleep(0.5)
    stop.set()
    for t in threads + [aio]:
        t.join()
    assert failures == []
    client.close()


def test_updates_reach_every_replica_in_one_order(replicated):
    # The coordinator sequences a replicated table's updates: every replica answers with them,
    # and both report the same update sequence.
    with shardserve.Client(replicated.address, deadline=10) as client:
        name, weight, _ = make_table(client, "r_upd")
        ids = torch.tensor([5, 7, 5])
        rows = torch.randn(3, 8)
        assert client.update_rows(name, ids, rows, op="assign") == (1, 1)
        weight[5], weight[7] = rows[2], rows[1]  # the last of duplicate ids wins
        add_ids = torch.tensor([7, 7, 0])
        deltas = torch.randn(3, 8)
        assert client.update_rows(name, add_ids, deltas) == (1, 2)
        weight.index_put_((add_ids,), deltas, accumulate=True)
        x = torch.arange(120)
        for _ in range(6):  # round robin: both replicas answer
            assert torch.equal(client.embedding(name, x), F.embedding(x, weight))
        with pytest.raises(shardserve.InvalidArgumentError, match="out of range"):
            client.update_rows(name, torch.tensor([120]), torch.randn(1, 8))
        assert client.update_rows(name, torch.tensor([1]), torch.randn(1, 8)) == (1, 3)
