"""Faults, each on a cluster of its own: a worker killed (SIGKILL) or stopped (SIGSTOP) makes
calls fail with UNAVAILABLE (or DEADLINE_EXCEEDED) within their deadline, never a hang; once the
worker is back (at a new port), the same client finds it through a fresh placement map."""

import asyncio
import concurrent.futures
import os
import signal
import time

import grpc
import pytest
import torch
import torch.nn.functional as F

import shardserve
from cluster import LocalCluster
from shardserve import _safetensors

DEADLINE = 2.0
SLACK = 0.75  # scheduling on a loaded 2-core machine


@pytest.fixture
def faulty():
    c = LocalCluster(world=2, worker_flags=["--collective_timeout_ms=1000"])
    yield c
    c.stop()


def make_table(client, name="f_emb"):
    weight = torch.randn(100, 8)
    client.create_table(name, weight, world=2)
    return name, weight


def until_serving(client, x, weight, limit=60.0):
    """Calls until the group serves again (each call within its own deadline)."""
    start = time.monotonic()
    while True:
        try:
            out = client.embedding_bag("f_emb", x, mode="sum", deadline=5)
            torch.testing.assert_close(out, F.embedding_bag(x, weight, mode="sum"))
            return
        except shardserve.UnavailableError:
            assert time.monotonic() - start < limit, "the group did not serve again"


def test_killed_worker_unavailable_within_deadline_then_recovers(faulty):
    client = shardserve.Client(faulty.address, deadline=DEADLINE)
    name, weight = make_table(client)
    x = torch.randint(0, 100, (16, 4))
    torch.testing.assert_close(client.embedding_bag(name, x, mode="sum"),
                               F.embedding_bag(x, weight, mode="sum"))
    old = client.describe(name).addresses
    faulty.kill_worker(1)
    for _ in range(3):
        t = time.monotonic()
        with pytest.raises(shardserve.UnavailableError) as e:
            client.embedding_bag(name, x, mode="sum")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t < DEADLINE + SLACK
    faulty.start_worker(1)  # a new port: the cached placement map is stale
    until_serving(client, x, weight)
    new = client.describe(name).addresses
    assert new != old and f"127.0.0.1:{faulty.worker_ports[1]}" in new
    client.close()


def test_aio_killed_worker_unavailable_within_deadline_then_recovers(faulty):
    seed_client = shardserve.Client(faulty.address)
    name, weight = make_table(seed_client)
    x = torch.randint(0, 100, (8, 3))

    async def main():
        async with shardserve.aio.Client(faulty.address, deadline=DEADLINE) as c:
            torch.testing.assert_close(await c.embedding_bag(name, x, mode="sum"),
                                       F.embedding_bag(x, weight, mode="sum"))
            faulty.kill_worker(0)
            t = time.monotonic()
            with pytest.raises(shardserve.UnavailableError):
                await c.embedding_bag(name, x, mode="sum")
            assert time.monotonic() - t < DEADLINE + SLACK
            faulty.start_worker(0)
            start = time.monotonic()
            while True:
                try:
                    out = await c.embedding_bag(name, x, mode="sum", deadline=5)
                    break
                except shardserve.UnavailableError:
                    assert time.monotonic() - start < 60
            torch.testing.assert_close(out, F.embedding_bag(x, weight, mode="sum"))

    asyncio.run(main())
    seed_client.close()


def test_stream_requests_end_within_deadline_when_a_worker_dies(faulty):
    client = shardserve.Client(faulty.address, deadline=DEADLINE)
    name, weight = make_table(client)
    x = torch.randint(0, 100, (32, 5))
    want = F.embedding_bag(x, weight, mode="sum")
    with client.stream() as s:
        torch.testing.assert_close(s.embedding_bag(name, x, mode="sum").result(), want)
        futures = [s.embedding_bag(name, x, mode="sum") for _ in range(200)]
        faulty.kill_worker(1)
        t = time.monotonic()
        futures += [s.embedding_bag(name, x, mode="sum") for _ in range(20)]
        done, not_done = concurrent.futures.wait(futures, timeout=DEADLINE + SLACK)
        assert not not_done, f"{len(not_done)} requests still pending past the deadline"
        failed = 0
        for f in futures:
            if f.exception() is None:
                torch.testing.assert_close(f.result(), want)
            else:
                failed += 1
                assert isinstance(f.exception(), (shardserve.UnavailableError,
                                                  shardserve.DeadlineExceededError))
        assert failed >= 20  # those sent after the kill could not be answered
        assert time.monotonic() - t < DEADLINE + SLACK
    faulty.start_worker(1)
    until_serving(client, x, weight)
    with client.stream() as s:  # streams to the new address
        torch.testing.assert_close(s.embedding_bag(name, x, mode="sum").result(), want)
    client.close()


def test_aio_stream_requests_end_within_deadline_when_a_worker_dies(faulty):
    seed_client = shardserve.Client(faulty.address)
    name, weight = make_table(seed_client)
    x = torch.randint(0, 100, (16, 5))
    want = F.embedding_bag(x, weight, mode="sum")

    async def main():
        async with shardserve.aio.Client(faulty.address, deadline=DEADLINE) as c:
            async with c.stream() as s:
                torch.testing.assert_close(await s.embedding_bag(name, x, mode="sum"), want)
                tasks = [asyncio.ensure_future(s.embedding_bag(name, x, mode="sum"))
                         for _ in range(100)]
                await asyncio.sleep(0)
                faulty.kill_worker(0)
                t = time.monotonic()
                tasks += [asyncio.ensure_future(s.embedding_bag(name, x, mode="sum"))
                          for _ in range(20)]
                results = await asyncio.wait_for(
                    asyncio.gather(*tasks, return_exceptions=True), DEADLINE + SLACK)
                assert time.monotonic() - t < DEADLINE + SLACK
        failed = 0
        for r in results:
            if isinstance(r, BaseException):
                failed += 1
                assert isinstance(r, (shardserve.UnavailableError,
                                      shardserve.DeadlineExceededError)), repr(r)
            else:
                torch.testing.assert_close(r, want)
        assert failed >= 20

    asyncio.run(main())
    seed_client.close()


def test_stopped_worker_is_a_deadline_not_a_hang(faulty):
    client = shardserve.Client(faulty.address, deadline=1.0)
    name, weight = make_table(client)
    x = torch.randint(0, 100, (4, 2))
    client.embedding_bag(name, x, mode="sum")
    faulty.kill_worker(1, signal.SIGSTOP)
    try:
        for _ in range(3):
            t = time.monotonic()
            with pytest.raises((shardserve.DeadlineExceededError,
                                shardserve.UnavailableError)):
                client.embedding_bag(name, x, mode="sum")
            assert time.monotonic() - t < 1.0 + SLACK
    finally:
        faulty.kill_worker(1, signal.SIGCONT)
    until_serving(client, x, weight)
    client.close()


def test_stream_requests_to_a_stopped_worker_end_at_their_deadline(faulty):
    """Nobody waits on result(): the futures still end at their deadline (the stream's
    watchdog), so concurrent.futures.wait returns in time."""
    client = shardserve.Client(faulty.address, deadline=1.0)
    name, weight = make_table(client)
    x = torch.randint(0, 100, (4, 2))
    with client.stream() as s:
        s.embedding_bag(name, x, mode="sum").result()
        faulty.kill_worker(1, signal.SIGSTOP)
        try:
            t = time.monotonic()
            futures = [s.embedding_bag(name, x, mode="sum") for _ in range(50)]
            done, not_done = concurrent.futures.wait(futures, timeout=1.0 + SLACK)
            assert not not_done and time.monotonic() - t < 1.0 + SLACK
            for f in futures:
                e = f.exception()
                assert e is None or isinstance(e, (shardserve.DeadlineExceededError,
                                                   shardserve.UnavailableError)), repr(e)
            assert any(f.exception() is not None for f in futures)
        finally:
            faulty.kill_worker(1, signal.SIGCONT)
    until_serving(client, x, weight)
    client.close()


def test_worker_that_cannot_load_a_table_fails_precondition(faulty, tmp_path):
    """A restarted worker that cannot load the table (its checkpoint was replaced by a file of
    another shape) leaves it FAILED: calls get FAILED_PRECONDITION at once, saying why."""
    client = shardserve.Client(faulty.address, deadline=DEADLINE,
                               checkpoint_dir=str(tmp_path))
    weight = torch.randn(10, 4)
    info = client.create_table("f_ckpt", weight, world=2)
    _safetensors.write(info.checkpoint, {"weight": torch.zeros(3, 3).numpy()})
    faulty.kill_worker(1)
    faulty.start_worker(1)
    start = time.monotonic()
    while client.describe("f_ckpt").state != "failed":
        assert time.monotonic() - start < 30, client.describe("f_ckpt")
        time.sleep(0.05)
    assert client.describe("f_ckpt").error
    with pytest.raises(shardserve.FailedPreconditionError) as e:
        client.embedding("f_ckpt", [1])
    assert "f_ckpt" in e.value.message
    assert os.path.exists(info.checkpoint)
    client.close()
