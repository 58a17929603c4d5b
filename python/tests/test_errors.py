"""Every kind of error a call can meet raises the shardserve.Error subclass of its gRPC code,
with the server's message, through the blocking client, the asyncio client and both Stream
APIs; and a rejected request changes nothing."""

import asyncio
import pickle

import grpc
import numpy as np
import pytest
import torch

import shardserve
from shardserve import errors


def test_every_status_code_has_its_class():
    for code in grpc.StatusCode:
        if code == grpc.StatusCode.OK:
            continue
        err = errors.error_for_code(code, "why")
        assert isinstance(err, shardserve.Error)
        assert err.code == code and err.message == "why"
        assert type(err) is not shardserve.Error, code  # a subclass of its own
        assert type(err).code_class == code
        assert str(err) == f"{code.name}: why"
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and again.code == code
    assert issubclass(shardserve.InvalidArgumentError, ValueError)
    assert issubclass(shardserve.NotFoundError, LookupError)
    assert issubclass(shardserve.DeadlineExceededError, TimeoutError)


@pytest.fixture(scope="module")
def table(client):
    weight = torch.randn(20, 8)
    client.create_table("err_emb", weight, world=2)
    client.create_table("err_lin", torch.randn(4, 8), kind="linear", bias=torch.randn(4),
                        world=2, sharding_dim=1)
    yield "err_emb", weight
    client.drop("err_emb")
    client.drop("err_lin")


# (op, args, kwargs, error class, words the message must have)
BAD_CALLS = [
    ("embedding", ("nope", [1]), {}, shardserve.NotFoundError, ["nope"]),
    ("embedding", ("err_emb", [3, 20]), {}, shardserve.InvalidArgumentError, ["20", "[0, 20)"]),
    ("embedding", ("err_emb", [-1]), {}, shardserve.InvalidArgumentError, ["-1"]),
    ("embedding_bag", ("err_emb", [1, 2, 3], [1, 2]), {}, shardserve.InvalidArgumentError,
     ["offsets"]),
    ("embedding_bag", ("err_emb", [1, 2, 3], [0, 2, 1]), {}, shardserve.InvalidArgumentError,
     ["offsets"]),
    ("embedding_bag", ("err_emb", [1, 2, 3], [0, 4]), {}, shardserve.InvalidArgumentError,
     ["offsets"]),
    ("embedding_bag", ("err_emb", [[1, 2]]), {"per_sample_weights": [[1.0, 2.0]], "mode": "mean"},
     shardserve.InvalidArgumentError, ["per_sample_weights", "sum"]),
    ("embedding_bag", ("err_emb", [[1, 2]]), {"per_sample_weights": [1.0, 2.0, 3.0],
                                              "mode": "sum"},
     shardserve.InvalidArgumentError, ["per_sample_weights"]),
    ("embedding_bag", ("err_emb", [1, 2]), {}, shardserve.InvalidArgumentError, ["offsets"]),
    ("linear", ("err_lin", np.zeros((2, 7), np.float32)), {}, shardserve.InvalidArgumentError,
     ["8"]),
    ("linear", ("err_emb", np.zeros((2, 8), np.float32)), {}, shardserve.InvalidArgumentError,
     ["err_emb"]),
    ("embedding", ("err_lin", [1]), {}, shardserve.InvalidArgumentError, ["err_lin"]),
]


def _run(via, cluster, client, op, args, kwargs):
    if via == "client":
        return getattr(client, op)(*args, **kwargs)
    if via == "stream":
        with client.stream() as s:
            return getattr(s, op)(*args, **kwargs).result()

    async def main():
        async with shardserve.aio.Client(cluster.address) as c:
            if via == "aio":
                return await getattr(c, op)(*args, **kwargs)
            async with c.stream() as s:
                return await getattr(s, op)(*args, **kwargs)

    return asyncio.run(main())


@pytest.mark.parametrize("via", ["client", "aio", "stream", "aio_stream"])
@pytest.mark.parametrize("case", range(len(BAD_CALLS)))
def test_bad_calls_raise_their_code(cluster, client, table, via, case):
    op, args, kwargs, cls, words = BAD_CALLS[case]
    with pytest.raises(cls) as e:
        _run(via, cluster, client, op, args, kwargs)
    assert e.value.code == cls.code_class
    for w in words:
        assert w in e.value.message, e.value.message


def test_rejected_requests_change_nothing(client):
    weight = torch.randn(10, 6) * 5
    client.create_table("err_norm", weight, world=2, max_norm=1.0)
    with pytest.raises(shardserve.InvalidArgumentError):
        client.embedding("err_norm", [1, 2, 10])  # one bad id: nothing renormed
    torch.testing.assert_close(client.export("err_norm"), weight, atol=0, rtol=0)
    client.drop("err_norm")


def test_client_side_refusals(client, table):
    with pytest.raises(shardserve.InvalidArgumentError):
        client.embedding("err_emb", np.array([1.0]))
    with pytest.raises(shardserve.InvalidArgumentError):
        client.embedding_bag("err_emb", [[1]], mode="median")
    with pytest.raises(shardserve.InvalidArgumentError):
        shardserve.Client("")


def test_admin_errors(client, table, tmp_path):
    with pytest.raises(shardserve.AlreadyExistsError) as e:
        client.create_table("err_emb", seed=1, rows=4, cols=4, world=2)
    assert "err_emb" in e.value.message
    with pytest.raises(shardserve.NotFoundError):
        client.describe("nope")
    with pytest.raises(shardserve.NotFoundError):
        client.drop("nope")
    with pytest.raises(shardserve.NotFoundError):
        client.export("nope")
    with pytest.raises(shardserve.InvalidArgumentError) as e:
        client.create_table("bad", seed=1, rows=4, cols=4, world=3)
    assert "3 placements" in e.value.message
    with pytest.raises(shardserve.InvalidArgumentError) as e:
        client.create_table("bad", seed=1, rows=4, cols=4, world=2, sharding_dim=2)
    with pytest.raises(shardserve.InvalidArgumentError):
        client.create_table("bad", seed=1, rows=0, cols=4, world=2)
    with pytest.raises(shardserve.NotFoundError) as e:  # no such checkpoint file
        client.create_table("bad", checkpoint=str(tmp_path / "none.safetensors"), rows=4,
                            cols=4, world=2)
    assert "none.safetensors" in e.value.message
    (tmp_path / "junk.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")
    with pytest.raises(shardserve.InvalidArgumentError):  # no "weight" in it
        client.create_table("bad", checkpoint=str(tmp_path / "junk.safetensors"), rows=4,
                            cols=4, world=2)
    with pytest.raises(shardserve.InvalidArgumentError) as e:
        client.export("err_emb", str(tmp_path / "no" / "such" / "dir.safetensors"))
    assert "does not exist" in e.value.message
    with pytest.raises(shardserve.InvalidArgumentError):  # two sources of the weight
        client.create_table("bad", torch.zeros(2, 2), seed=1, world=2)
    assert "bad" not in [t.name for t in client.tables()]


def test_resource_exhausted(client):
    client.create_table("err_wide", seed=1, rows=10, cols=1024, world=2)
    with pytest.raises(shardserve.ResourceExhaustedError) as e:
        client.embedding("err_wide", np.zeros((1 << 17) + 1, np.int64))  # 2^27 + 1024 floats
    assert "limit" in e.value.message
    client.drop("err_wide")


def test_deadline_exceeded(client, table):
    with pytest.raises(shardserve.DeadlineExceededError):
        client.embedding("err_emb", [1], deadline=1e-6)

    async def main(addr):
        async with shardserve.aio.Client(addr) as c:
            await c.embedding("err_emb", [1], deadline=1e-6)

    with pytest.raises(shardserve.DeadlineExceededError):
        asyncio.run(main(client.coordinator))


def test_unreachable_coordinator_is_a_deadline_not_a_hang():
    import socket
    import time

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    c = shardserve.Client(f"127.0.0.1:{port}", deadline=0.5)
    t = time.monotonic()
    with pytest.raises((shardserve.DeadlineExceededError, shardserve.UnavailableError)):
        c.embedding("t", [1])
    assert time.monotonic() - t < 1.5
    c.close()


def test_failed_precondition_while_a_table_is_created_then_it_serves(client):
    """Lookups of a table that is still being created (not loaded on every rank) are refused at
    once with FAILED_PRECONDITION (or, once some rank holds it, UNAVAILABLE "being loaded");
    the table serves once created."""
    import threading
    import time

    creating = threading.Thread(target=client.create_table, args=("err_big",),
                                kwargs=dict(seed=3, rows=1_000_000, cols=128, world=2))
    creating.start()
    impatient = shardserve.Client(client.coordinator, deadline=0.5, max_attempts=1)
    refused = []
    while creating.is_alive():
        t = time.monotonic()
        try:
            impatient.embedding("err_big", [1])
            break  # served already
        except shardserve.NotFoundError:
            time.sleep(0.01)  # not registered yet
        except (shardserve.FailedPreconditionError, shardserve.UnavailableError) as e:
            assert "err_big" in e.message and time.monotonic() - t < 1.0, e
            refused.append(e.code)
    creating.join()
    impatient.close()
    assert refused, "no lookup came while the 512 MiB table loaded"
    assert client.describe("err_big").state == "serving"
    assert client.embedding("err_big", [1, 2]).shape == (2, 128)
    client.drop("err_big")
