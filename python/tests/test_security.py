"""The Python clients against a cluster with mTLS and roles on every port (rpc/security.h):
TLS calls that answer exactly, and the refusals a caller without the right certificate, token or
role gets, as the client's exceptions."""

import asyncio
import json
import os
import time

import numpy as np
import pytest

import shardserve
import shardserve.aio
from cluster import LocalCluster

READ_TOKEN = "reader-token-0123456789"


@pytest.fixture(scope="module")
def tls_cluster():
    c = LocalCluster(world=2, tls=True)
    with open(os.path.join(c.certs, "tokens"), "a") as f:
        f.write(f"token {READ_TOKEN} reader read\n")
    yield c
    c.stop()


def tls_args(cluster, cert=True):
    args = {"tls_ca": os.path.join(cluster.certs, "ca.pem")}
    if cert:
        args["tls_cert"] = os.path.join(cluster.certs, "client.pem")
        args["tls_key"] = os.path.join(cluster.certs, "client.key")
    return args


def bag_reference(weight, ids, offsets):
    bounds = list(offsets) + [len(ids)]
    return np.stack([weight[ids[a:b]].sum(0) for a, b in zip(bounds[:-1], bounds[1:])])


def test_calls_over_mtls_answer_exactly(tls_cluster):
    weight = np.random.default_rng(3).standard_normal((500, 8)).astype(np.float32)
    ids, offsets = np.array([1, 2, 499, 7, 0], np.int64), np.array([0, 3], np.int64)
    with shardserve.Client(tls_cluster.address, deadline=30, **tls_args(tls_cluster)) as c:
        c.create_table("mtls", weight, world=2)
        want = bag_reference(weight, ids, offsets)
        np.testing.assert_allclose(c.embedding_bag("mtls", ids, offsets, mode="sum"), want, rtol=1e-6)
        with shardserve.Client(tls_cluster.address, direct=False, deadline=30,
                               **tls_args(tls_cluster)) as forwarded:
            np.testing.assert_allclose(forwarded.embedding_bag("mtls", ids, offsets, mode="sum"), want,
                                       rtol=1e-6)

    async def aio():
        async with shardserve.aio.Client(tls_cluster.address, deadline=30,
                                         **tls_args(tls_cluster)) as a:
            return await a.embedding_bag("mtls", ids, offsets, mode="sum")

    np.testing.assert_allclose(asyncio.run(aio()), want, rtol=1e-6)

    # What `shardserve up --tls --endpoints_file` writes names all a client needs.
    endpoints = os.path.join(tls_cluster.work, "endpoints.json")
    with open(endpoints, "w") as f:
        json.dump({"coordinator": {"address": tls_cluster.address},
                   "ca": tls_args(tls_cluster)["tls_ca"],
                   "client_cert": tls_args(tls_cluster)["tls_cert"],
                   "client_key": tls_args(tls_cluster)["tls_key"]}, f)
    with shardserve.Client.from_endpoints(endpoints, deadline=30) as c:
        np.testing.assert_allclose(c.embedding_bag("mtls", ids, offsets, mode="sum"), want, rtol=1e-6)


def test_callers_without_certificate_token_or_role_are_refused(tls_cluster):
    weight = np.ones((10, 4), np.float32)
    with shardserve.Client(tls_cluster.address, deadline=30, **tls_args(tls_cluster)) as admin:
        admin.create_table("guarded", weight, world=2)

    # Plaintext, or TLS without a client certificate: no connection (the deadline ends it).
    for args in ({}, tls_args(tls_cluster, cert=False)):
        with shardserve.Client(tls_cluster.address, deadline=2, max_attempts=2, **args) as c:
            started = time.monotonic()
            with pytest.raises((shardserve.UnavailableError, shardserve.DeadlineExceededError)):
                c.describe("guarded")
            assert time.monotonic() - started < 10

    # A reader's token reads, but may not drop or export.
    with shardserve.Client(tls_cluster.address, deadline=10, token=READ_TOKEN,
                           **tls_args(tls_cluster)) as reader:
        assert reader.describe("guarded").name == "guarded"
        np.testing.assert_array_equal(reader.embedding("guarded", [1, 2]), weight[[1, 2]])
        with pytest.raises(shardserve.PermissionDeniedError, match="reader .roles: read."):
            reader.drop("guarded")
        with pytest.raises(shardserve.PermissionDeniedError):
            reader.export("guarded")
    with shardserve.Client(tls_cluster.address, deadline=10, token="guessed-token-0123456789",
                           **tls_args(tls_cluster)) as guesser:
        with pytest.raises(shardserve.UnauthenticatedError, match="unknown token"):
            guesser.embedding("guarded", [1])
    with shardserve.Client(tls_cluster.address, deadline=10, **tls_args(tls_cluster)) as admin:
        assert admin.describe("guarded").state == "serving"  # nothing changed


def test_bad_security_arguments_are_refused_before_any_call(tls_cluster):
    with pytest.raises(shardserve.InvalidArgumentError, match="need TLS"):
        shardserve.Client(tls_cluster.address, token=READ_TOKEN)
    with pytest.raises(shardserve.InvalidArgumentError, match="go together"):
        shardserve.Client(tls_cluster.address, tls_ca=tls_args(tls_cluster)["tls_ca"],
                          tls_cert=tls_args(tls_cluster)["tls_cert"])
    with pytest.raises(shardserve.InvalidArgumentError, match="cannot read"):
        shardserve.Client(tls_cluster.address, tls_ca="/nonexistent/ca.pem")
