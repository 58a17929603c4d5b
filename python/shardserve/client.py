"""The blocking client: data calls straight to the workers, admin calls to the coordinator.

Routing, retries and deadlines are the C++ client's (``client/client.h``): the placement map of a
table comes from the coordinator's ``DescribeTable`` and is cached; each data call goes to one of
the table's workers (round robin over its entry ranks, and over replicas once tables have them);
a call that fails with UNAVAILABLE (a rank died, the group is re-forming, the connection broke,
the worker moved) goes at once to another replica, and one without an answer after
``hedge_after`` (a hung worker) goes to another replica too; groups that fail are avoided for a
while; once every replica has failed a call, it is retried after a back-off with a fresh placement
map - as long as the call's deadline allows, and never past it.

Thread-safe: share one :class:`Client` across threads; its channels are made once per address.
"""

import concurrent.futures
import heapq
import itertools
import queue
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _codec, _common, _process, _stubs
from ._common import Options, RoutingTable, TableInfo
from .errors import (
    CancelledError,
    DeadlineExceededError,
    Error,
    InvalidArgumentError,
    UnavailableError,
    code_from_number,
    error_for_code,
    from_rpc_error,
)

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_NOT_FOUND = grpc.StatusCode.NOT_FOUND

Tensor = Any  # numpy.ndarray or torch.Tensor (torch is never imported here)


class _Endpoint:
    """One address's channel and its data methods, as raw-bytes callables (see _codec)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.unary = {
            name: channel.unary_unary(path) for name, path in _common.DATA_METHODS.items()
        }
        self.unary["update_rows"] = channel.unary_unary(_common.UPDATE_METHOD)
        self.stream = channel.stream_stream(_common.STREAM_METHOD)


def _give_up(last: Optional[Error], attempts: int, started: float) -> Error:
    if last is None:
        return DeadlineExceededError("the deadline passed before the first attempt")
    return UnavailableError(
        f"{last.message} (gave up after {attempts} attempt(s) in "
        f"{time.monotonic() - started:.3f} s)"
    )


class Client:
    """A shardserve client (blocking).

    Args:
        coordinator: the coordinator's ``host:port``.
        deadline: seconds per call, retries included (default 10).
        max_attempts: attempts per call, the first included (default 8).
        backoff: seconds before the first retry, doubled after each (default 0.025).
        direct: send data calls straight to workers (default); False sends them to the
            coordinator, which forwards them (for clients that cannot reach the workers).
        hedge_after: seconds without an answer after which a call also goes to another
            replica that serves (a hung worker fails nothing; the first answer wins), for about
            one call in ten at most; 0: never.
        checkpoint_dir: where :meth:`create_table` writes checkpoints of tensors and modules
            (default: ``$SHARDSERVE_CHECKPOINT_DIR`` or ``<tmp>/shardserve-checkpoints``). The
            coordinator and every worker read the file by its absolute path, so it must be
            readable there: the same machine, or a file system they all mount at that path.
        channel_options: extra gRPC channel options (message limits are 1 GiB by default).
        tls_ca: a PEM file of the CA that signs the servers: calls use TLS (default: plaintext).
        tls_cert, tls_key: PEM client certificate and key (mTLS).
        token: a bearer token sent on every call (needs ``tls_ca``).
        tls_server_name: the name the servers' certificates must carry (default: the host of
            the address called).
        tune_malloc: set glibc's malloc up for large answers, process-wide, as the C++ binaries
            do (see ``shardserve._process``; about half the client's CPU per 256 KiB answer).
            ``SHARDSERVE_TUNE_MALLOC=0`` switches it off too.

    Data calls take numpy arrays, torch tensors or nested sequences, and return the kind they
    were given (torch in, torch out; otherwise numpy), float32, as PyTorch's op would on the
    whole, unsharded weight. The result shares the received message's memory (no copy), and
    is writable.
    """

    def __init__(
        self,
        coordinator: str,
        *,
        deadline: float = 10.0,
        max_attempts: int = 8,
        backoff: float = 0.025,
        direct: bool = True,
        hedge_after: float = 0.05,
        checkpoint_dir: Optional[str] = None,
        channel_options: Optional[Sequence[Any]] = None,
        tune_malloc: bool = True,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        token: Optional[str] = None,
        tls_server_name: Optional[str] = None,
    ) -> None:
        if not coordinator:
            raise InvalidArgumentError("coordinator address is empty")
        if tune_malloc:
            _process.tune_malloc()
        self._pb, pb_grpc = _stubs.load()
        self.coordinator = coordinator
        self.options = Options(deadline, max_attempts, backoff, direct, hedge_after)
        self.checkpoint_dir = checkpoint_dir
        self._channel_options = _common.channel_options(channel_options, tls_server_name)
        self._credentials = _common.credentials(tls_ca, tls_cert, tls_key, token)
        self._admin_channel = self._channel(coordinator)
        self._admin = pb_grpc.AdminServiceStub(self._admin_channel)
        self._forward = _Endpoint(self._admin_channel)
        self._routes = RoutingTable()
        self._lock = threading.Lock()
        self._endpoints: Dict[str, _Endpoint] = {}

    @classmethod
    def from_endpoints(cls, path: str, **kwargs: Any) -> "Client":
        """A client of the cluster that ``shardserve up --endpoints_file=PATH`` describes: its
        coordinator, and with ``up --tls`` the CA and the client certificate; ``kwargs`` as
        the constructor's."""
        return cls(**{**_common.read_endpoints(path), **kwargs})

    # --- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Closes every channel. Calls in flight fail with CANCELLED."""
        with self._lock:
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            endpoint.channel.close()
        self._admin_channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- data calls -------------------------------------------------------------------------

    def embedding(
        self,
        table: str,
        ids: Tensor,
        *,
        version: int = 0,
        with_version: bool = False,
        deadline: Optional[float] = None,
    ) -> Any:
        """``F.embedding(ids, weight, padding_idx, max_norm, norm_type)`` with the table's
        weight and settings: shape ``ids.shape + (embedding_dim,)``. ``ids``: integers, any
        shape. With ``max_norm``, the rows looked up are renormed in the stored table, as
        ``F.embedding`` renorms its weight.

        Every data call takes ``version=N`` to pin a table version (default 0: the latest
        serving; NOT_FOUND when it is not loaded), and ``with_version=True`` to return
        ``(result, version)``: the version the answer came from."""
        array, device = _codec.as_ids(ids, "ids")
        answer = self._call(
            "embedding", table, _codec.encode_embedding(table, array, _version(version)), deadline
        )
        return _answer(answer, _codec.Kind(device), with_version)

    def embedding_bag(
        self,
        table: str,
        ids: Tensor,
        offsets: Optional[Tensor] = None,
        per_sample_weights: Optional[Tensor] = None,
        mode: str = "mean",
        include_last_offset: bool = False,
        *,
        version: int = 0,
        with_version: bool = False,
        deadline: Optional[float] = None,
    ) -> Any:
        """``F.embedding_bag(ids, weight, offsets, mode=mode, per_sample_weights=...,
        include_last_offset=..., padding_idx=<the table's>)`` (and the table's max_norm).

        ``ids``: 2-D (bags x ids), or 1-D with ``offsets``; ``mode``: "sum", "mean" or "max";
        ``per_sample_weights`` (ids' shape) only with "sum". Shape ``(bags, embedding_dim)``.
        ``version``, ``with_version``: as :meth:`embedding`.
        """
        request = _encode_bag(table, ids, offsets, per_sample_weights, mode, include_last_offset,
                              _version(version))
        answer = self._call("embedding_bag", table, request[0], deadline)
        return _answer(answer, request[1], with_version)

    def linear(
        self,
        table: str,
        input: Tensor,
        *,
        version: int = 0,
        with_version: bool = False,
        deadline: Optional[float] = None,
    ) -> Any:
        """``F.linear(input, weight, bias)``: ``input`` is ``(*, in_features)``; the result is
        ``(*, out_features)``. ``version``, ``with_version``: as :meth:`embedding`."""
        array, device = _codec.as_floats(input, "input")
        answer = self._call(
            "linear", table, _codec.encode_linear(table, array, _version(version)), deadline
        )
        return _answer(answer, _codec.Kind(device), with_version)

    def update_rows(
        self,
        table: str,
        ids: Tensor,
        values: Tensor,
        *,
        op: str = "add",
        bias: Optional[Tensor] = None,
        deadline: Optional[float] = None,
    ) -> Tuple[int, int]:
        """Changes rows of the table's serving version online (``UpdateRows``): ``op="assign"``
        sets them (duplicate ids: the last wins), ``op="add"`` adds ``values`` to them (duplicates
        summed, as ``index_put_(accumulate=True)``). ``ids`` is ``(k,)``, ``values``
        ``(k, num_cols)``, ``bias`` (a linear layer's, optional) ``(k,)``. Returns ``(version,
        sequence)``: the version updated and its update sequence after the call. Sent once, never
        retried: after an error it was applied whole or not at all (an ``add`` sent again would
        add twice) - except once when a stale placement map made sure that nothing changed (no
        connection to the worker it named, or a refusal as the table is replicated now). A table
        on several replica groups takes it through the coordinator, which applies it to every
        replica in one order. Where it goes comes from the cached placement map: no
        ``DescribeTable`` per call."""
        code = {"assign": 1, "add": 2}.get(op)
        if code is None:
            raise InvalidArgumentError(f'op: "{op}" is not "assign" or "add"')
        id_array, _ = _codec.as_ids(ids, "ids")
        value_array, _ = _codec.as_floats(values, "values")
        bias_array = None if bias is None else _codec.as_floats(bias, "bias")[0]
        request = _codec.encode_update_rows(table, id_array, value_array, code, bias_array)
        deadline_at = time.monotonic() + self._timeout(deadline)

        def target(fresh: bool) -> Tuple[str, Optional[bool]]:
            # The coordinator when calls go through it, or for a table on several replica groups
            # (it sequences one stream for all of them); else a worker of the table's group. From
            # the cached placement map: no DescribeTable per update.
            if not self.options.direct:
                return self.coordinator, None
            address, _, _ = self.route(table, fresh, deadline_at)
            replicated = self._routes.replicated(table)
            return (self.coordinator if replicated else address), replicated

        address, replicated = target(False)
        try:
            answer = self._endpoint(address).unary["update_rows"](
                request, timeout=max(deadline_at - time.monotonic(), 1e-3))
        except grpc.RpcError as e:
            error = from_rpc_error(e)
            # Sent once, never retried - except when a stale map made sure it changed nothing:
            # it never left (no connection to the worker the map named: it moved, e.g. restarted
            # elsewhere), or a worker refused it as the table is on several replica groups now
            # (dropped and created again; FAILED_PRECONDITION). It goes once more where a fresh
            # map says.
            unsent = (e.code() == grpc.StatusCode.UNAVAILABLE and
                      (e.details() or "").startswith("failed to connect to all addresses"))
            refused = e.code() == grpc.StatusCode.FAILED_PRECONDITION and not replicated
            if not self.options.direct or not (unsent or refused):
                raise error from None
            fresh, now = target(True)
            if (refused and not now) or (unsent and fresh == address):
                raise error from None
            address = fresh
            try:
                answer = self._endpoint(address).unary["update_rows"](
                    request, timeout=max(deadline_at - time.monotonic(), 1e-3))
            except grpc.RpcError as e2:
                raise from_rpc_error(e2) from None
        return _codec.decode_update_response(answer)

    def stream(self, *, max_in_flight: int = 1024, deadline: Optional[float] = None) -> "Stream":
        """A pipelined batch session over the ``Stream`` RPC (see :class:`Stream`)."""
        return Stream(self, max_in_flight=max_in_flight, deadline=deadline)

    # --- admin calls --------------------------------------------------------------------------

    def create_table(
        self,
        name: str,
        weight: Any = None,
        *,
        kind: Optional[str] = None,
        bias: Any = None,
        rows: Optional[int] = None,
        cols: Optional[int] = None,
        seed: Optional[int] = None,
        checkpoint: Optional[str] = None,
        sharding_dim: int = 1,
        placements: Optional[Sequence[str]] = None,
        world: Optional[int] = None,
        device: str = "cpu",
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: Optional[float] = None,
        deadline: Optional[float] = None,
    ) -> TableInfo:
        """Creates a table and returns once every rank serves it (state "serving"; "loading" or
        "unavailable" if the deadline ran out first: the table stays created and goes on loading,
        :meth:`wait_table` waits for it). Idempotent: the same spec again (a retry) finds the
        table and waits for it the same way; another spec under the name is ALREADY_EXISTS. (A
        weight given as a tensor or module is written to a new checkpoint file on every call, so
        only retries inside this call are the same spec.)

        The weight comes from exactly one of:

        - ``weight``: a 2-D torch tensor or numpy array (``kind`` "embedding", the default, or
          "linear" with an optional ``bias``), or an ``nn.Embedding`` / ``nn.EmbeddingBag``
          (its padding_idx, max_norm and norm_type are taken unless given here) or an
          ``nn.Linear`` (its bias). The client writes it as a safetensors checkpoint under
          ``checkpoint_dir`` (a new file per call), which the coordinator and the workers read
          by absolute path: it must be readable on their machines, and kept while the table
          exists (a worker that restarts reloads its shard from it).
        - ``seed=S`` with ``rows``, ``cols``: the server's seeded init (nn.Embedding's N(0, 1),
          nn.Linear's kaiming-uniform), the same whatever the world size.
        - ``checkpoint=PATH`` with ``rows``, ``cols``: an existing safetensors file holding
          "weight" (and "bias" for a linear layer), readable by every worker.

        Sharding: ``sharding_dim`` of the ``(rows, cols)`` weight (1: columns, "col-wise" for
        embeddings; for linear layers 0 splits outputs, 1 splits inputs), over ``placements``
        (``["rank:1/cpu", "rank:0/cpu"]``: chunk i on the i-th placement) or ``world=W``
        (``rank:0..W-1`` on ``device``): at most the cluster's world size, each a different rank
        (ranks without a placement hold nothing and still serve calls).
        ``bias=False`` (or a linear ``kind`` without a bias) makes a linear layer without bias.
        Errors: ALREADY_EXISTS, INVALID_ARGUMENT (bad spec, naming the field), and the error of a
        rank that could not load the table (e.g. RESOURCE_EXHAUSTED).
        """
        spec, _ = _common.build_spec(
            self._pb, name, weight, kind=kind, bias=bias, num_rows=rows, num_cols=cols,
            seed=seed, checkpoint=checkpoint, sharding_dim=sharding_dim, placements=placements,
            world=world, device=device, padding_idx=padding_idx, max_norm=max_norm,
            norm_type=norm_type, checkpoint_dir=self.checkpoint_dir,
        )
        deadline_at = time.monotonic() + self._timeout(deadline)
        info = self._admin_call_until(
            "CreateTable", self._pb.CreateTableRequest(table=spec), deadline_at
        )
        self._routes.forget(name)
        # The coordinator answered a margin before the deadline: wait for what is left of it.
        while (info.state in _common.WAITING_STATES
               and deadline_at - time.monotonic() > _common.LEAST_WAIT):
            info = self._admin_call_until(
                "WaitTable", self._pb.WaitTableRequest(name=name), deadline_at
            )
        _common.raise_if_failed(info)
        return _common.table_info(info)

    def wait_table(self, table: str, *, timeout: Optional[float] = None) -> TableInfo:
        """Waits up to ``timeout`` seconds (default: the client's deadline) until every rank
        serves ``table`` or a rank could not load it, and returns its :class:`TableInfo` then:
        state "serving", "failed" (``error``, ``error_code``), or as it is when the time ran out
        (the coordinator answers a little before the end of ``timeout``). NOT_FOUND."""
        deadline_at = time.monotonic() + self._timeout(timeout)
        return _common.table_info(self._admin_call_until(
            "WaitTable", self._pb.WaitTableRequest(name=table), deadline_at
        ))

    def load_version(
        self,
        table: str,
        *,
        checkpoint: Optional[str] = None,
        seed: Optional[int] = None,
        keep_versions: int = 1,
        allow_gap: bool = False,
        deadline: Optional[float] = None,
    ) -> TableInfo:
        """Loads ``table``'s next version from ``checkpoint`` (a safetensors file every worker
        can read) or ``seed`` while the serving version serves, and returns once every replica
        switched to it (``info.version``), within ``deadline`` (the client's by default; when it
        runs out first the load goes on, and ``info.versions`` shows it "loading"). Its shape and
        sharding stay the table's. ``keep_versions``: versions kept loaded for pinned calls,
        counting the new one. ``allow_gap``: with one replica and no room for two copies, unload
        the serving version first (calls fail meanwhile). Raises the error of a rank that could
        not load it (the serving version stays everywhere), RESOURCE_EXHAUSTED (no room and no
        ``allow_gap``), FAILED_PRECONDITION (another load runs), NOT_FOUND."""
        if (checkpoint is None) == (seed is None):
            raise InvalidArgumentError("load_version: give exactly one of checkpoint= and seed=")
        request = self._pb.LoadVersionRequest(
            name=table, keep_versions=keep_versions, allow_gap=allow_gap
        )
        if checkpoint is not None:
            request.checkpoint = checkpoint
        else:
            request.seed = seed
        deadline_at = time.monotonic() + self._timeout(deadline)
        return _common.table_info(self._admin_call_until("LoadVersion", request, deadline_at))

    def unload_version(
        self, table: str, version: int, *, deadline: Optional[float] = None
    ) -> TableInfo:
        """Unloads a kept version of ``table`` (not the serving one)."""
        return _common.table_info(self._admin_call(
            "UnloadVersion", self._pb.UnloadVersionRequest(name=table, version=version), deadline
        ))

    def add_replica(
        self, table: str, group: int, *, deadline: Optional[float] = None
    ) -> TableInfo:
        """Places a replica of ``table`` on ``group`` too: it serves once recovered from another
        replica; the returned description lists it, not serving yet."""
        info = _common.table_info(self._admin_call(
            "AddReplica", self._pb.AddReplicaRequest(name=table, group=group), deadline
        ))
        self._routes.forget(table)
        return info

    def drop(self, table: str, *, deadline: Optional[float] = None) -> None:
        """Drops a table (NOT_FOUND if there is none). Checkpoints written by create_table are
        left where they are."""
        self._admin_call("DropTable", self._pb.DropTableRequest(name=table), deadline)
        self._routes.forget(table)

    def tables(self, *, deadline: Optional[float] = None) -> List[TableInfo]:
        """Every table of the cluster."""
        response = self._admin_call("ListTables", self._pb.ListTablesRequest(), deadline)
        return [_common.table_info(t) for t in response.tables]

    def describe(self, table: str, *, deadline: Optional[float] = None) -> TableInfo:
        """One table's spec, state and placement map (NOT_FOUND if there is none)."""
        return _common.table_info(
            self._admin_call("DescribeTable", self._pb.DescribeTableRequest(name=table), deadline)
        )

    def export(
        self,
        table: str,
        path: Optional[str] = None,
        *,
        numpy: Optional[bool] = None,
        deadline: Optional[float] = None,
    ) -> Tensor:
        """The table's full weight, ``(rows, cols)`` float32 (see :meth:`export_state`)."""
        return self.export_state(table, path, numpy=numpy, deadline=deadline)["weight"]

    def export_state(
        self,
        table: str,
        path: Optional[str] = None,
        *,
        numpy: Optional[bool] = None,
        deadline: Optional[float] = None,
    ) -> Dict[str, Tensor]:
        """``{"weight": ..., "bias": ...}`` (bias only for a linear layer that has one), as a
        state dict of the module the table stands for.

        The coordinator streams the table's safetensors file to this client (ExportTableStream:
        no file system is shared); with ``path``, the client also writes it there, on this
        machine. Every shard comes from the same creation of the table (ABORTED if it was created
        again meanwhile). ``numpy``: True for numpy arrays, False for torch tensors, None
        (default) for torch when it is installed.
        """
        _common.check_export_target(path)
        buf = self._export_bytes(table, time.monotonic() + self._timeout(deadline))
        return _as_kind(_common.finish_export(table, buf, path), numpy)

    def describe_cluster(self, *, deadline: Optional[float] = None) -> Any:
        """The coordinator's view of the workers, a ``shardserve.v1.ClusterInfo`` message: each
        group's epoch and state, and every member (rank, address, device, alive, epoch, tables
        held and served)."""
        return self._admin_call("DescribeCluster", self._pb.DescribeClusterRequest(), deadline)

    def _export_bytes(self, table: str, deadline_at: float) -> bytearray:
        """The exported file's bytes; the whole stream again after UNAVAILABLE (the coordinator
        sends nothing before it has read every shard)."""
        request = self._pb.ExportTableStreamRequest(name=table)
        opts = self.options
        started = time.monotonic()
        last: Optional[Error] = None
        attempts = 0
        while attempts < opts.max_attempts:
            remaining = deadline_at - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            assembly = _common.ExportAssembly(table)
            try:
                for chunk in self._admin.ExportTableStream(
                        request, timeout=remaining, wait_for_ready=True):
                    assembly.add(chunk)
                return assembly.finish()
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            if err.code != _UNAVAILABLE:
                raise err
            last = err
            _sleep_until_next(opts.backoff_after(attempts - 1), deadline_at)
        raise _give_up(last, attempts, started)

    # --- internals ------------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(address, options=self._channel_options)
        return grpc.secure_channel(address, self._credentials, options=self._channel_options)

    def _endpoint(self, address: str) -> _Endpoint:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            with self._lock:
                endpoint = self._endpoints.get(address)
                if endpoint is None:
                    endpoint = self._endpoints[address] = _Endpoint(self._channel(address))
        return endpoint

    def _admin_call(self, method: str, request: Any, deadline: Optional[float]) -> Any:
        """An admin call; waits for the coordinator (within the deadline) and retries
        UNAVAILABLE, as the C++ client's CallAdmin."""
        return self._admin_call_until(method, request, time.monotonic() + self._timeout(deadline))

    def _admin_call_until(self, method: str, request: Any, deadline_at: float) -> Any:
        opts = self.options
        rpc = getattr(self._admin, method)
        started = time.monotonic()
        last: Optional[Error] = None
        attempts = 0
        while attempts < opts.max_attempts:
            remaining = deadline_at - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            try:
                return rpc(request, timeout=remaining, wait_for_ready=True)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            if err.code != _UNAVAILABLE:
                raise err
            last = err
            _sleep_until_next(opts.backoff_after(attempts - 1), deadline_at)
        raise _give_up(last, attempts, started)

    def _timeout(self, deadline: Optional[float]) -> float:
        return self.options.deadline if deadline is None else deadline

    def route(
        self, table: str, refresh: bool, deadline_at: float, avoid: Sequence[int] = ()
    ) -> Tuple[str, int, bool]:
        """(address, group, probe) for a call on ``table``, other than in the groups of
        ``avoid`` (reading the placement map first when ``refresh``, or when none is cached)."""
        if refresh or not self._routes.has(table):
            self._routes.update(table, _common.table_info(self._admin_call_until(
                "DescribeTable", self._pb.DescribeTableRequest(name=table), deadline_at)))
        picked = self._routes.pick(table, avoid)
        if picked is None:
            raise UnavailableError(f'table "{table}" has no workers yet')
        return picked

    def _call(self, method: str, table: str, request: bytes, deadline: Optional[float]) -> bytes:
        opts = self.options
        started = time.monotonic()
        deadline_at = started + self._timeout(deadline)
        refresh = False
        tried: List[int] = []  # groups that failed this call since the last back-off
        last: Optional[Error] = None
        attempts = 0
        while attempts < opts.max_attempts:
            if deadline_at - time.monotonic() <= 0:
                break
            attempts += 1
            group = None
            try:
                if not opts.direct:
                    remaining = deadline_at - time.monotonic()
                    return self._forward.unary[method](request, timeout=max(remaining, 1e-3))
                address, group, probe = self.route(table, refresh, deadline_at, tried)
                refresh = False
                return self._attempt(method, table, request, address, group, probe, tried,
                                     deadline_at)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            except Error as e:  # from the route's DescribeTable, or a replica's answer
                err = e
            if err.code == _NOT_FOUND:
                self._routes.forget(table)  # created again elsewhere, maybe
            if err.code != _UNAVAILABLE:
                raise err
            last = err
            if opts.direct and self._routes.others(table, tried):
                continue  # another replica at once
            # Every replica failed it (or the map is stale): read the map again after a back-off.
            tried.clear()
            refresh = True
            _sleep_until_next(opts.backoff_after(attempts - 1), deadline_at)
        raise _give_up(last, attempts, started)

    def _attempt(self, method: str, table: str, request: bytes, address: str, group: int,
                 probe: bool, tried: List[int], deadline_at: float) -> bytes:
        """One attempt at ``address`` - and, if it has no answer after the hedge delay, the same
        request to another replica too, the first answer winning. Failed groups are added to
        ``tried``; the error raised is the last attempt's."""
        remaining = max(deadline_at - time.monotonic(), 1e-3)
        hedge = self.options.hedge_after
        if hedge <= 0 or remaining <= hedge or not self._routes.others(table, tried + [group]):
            # Nowhere to hedge to (one group, say): the plain blocking call, which costs least.
            try:
                answer = self._endpoint(address).unary[method](request, timeout=remaining)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                self._routes.ended(table, group, probe, err, tried)
                raise err from None
            self._routes.ended(table, group, probe, None, tried)
            return answer
        first = self._endpoint(address).unary[method].future(request, timeout=remaining)
        attempts = [(first, group, probe)]
        try:
            first.result(timeout=hedge)
        except grpc.FutureTimeoutError:
            # A hung worker (its sockets open, nothing fails): its group is suspect, and the
            # call goes to another replica too.
            hedge_to = self._routes.hedge(table, group, tried + [group])
            if hedge_to is not None:
                other, other_group, other_probe = hedge_to
                remaining = max(deadline_at - time.monotonic(), 1e-3)
                attempts.append((
                    self._endpoint(other).unary[method].future(request, timeout=remaining),
                    other_group, other_probe))
        except grpc.RpcError:
            pass
        done = threading.Event()
        for future, _, _ in attempts:
            future.add_done_callback(lambda _f: done.set())
        error: Optional[Error] = None
        pending = list(attempts)
        while pending:
            done.wait()
            done.clear()
            for entry in [a for a in pending if a[0].done()]:
                pending.remove(entry)
                future, g, _ = entry
                try:
                    answer, error = future.result(), None
                except grpc.RpcError as e:
                    answer, error = None, from_rpc_error(e)
                if not self._routes.decides(table, g, error, tried):
                    continue
                for other, other_group, other_probe in pending:
                    other.cancel()
                    self._routes.abandoned(table, other_group, other_probe)
                if error is not None:
                    raise error
                return answer
        raise error if error is not None else UnavailableError("no attempt answered")


def _sleep_until_next(delay: float, deadline_at: float) -> None:
    delay = min(delay, deadline_at - time.monotonic())
    if delay > 0:
        time.sleep(delay)


def _encode_bag(
    table: str,
    ids: Tensor,
    offsets: Optional[Tensor],
    per_sample_weights: Optional[Tensor],
    mode: str,
    include_last_offset: bool,
    version: int = 0,
) -> Any:
    """(request bytes, Kind of the result) of an embedding_bag call."""
    ids_array, device = _codec.as_ids(ids, "ids")
    offsets_array = None if offsets is None else _codec.as_ids(offsets, "offsets")[0]
    weights = (
        None
        if per_sample_weights is None
        else _codec.as_floats(per_sample_weights, "per_sample_weights")[0]
    )
    request = _codec.encode_embedding_bag(
        table, ids_array, offsets_array, weights, _codec.pool_mode(mode), bool(include_last_offset),
        version,
    )
    return request, _codec.Kind(device)


def _version(version: Any) -> int:
    """A pinned table version, checked (0: the latest)."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 1 << 64:
        raise InvalidArgumentError(f"version: {version!r} must be an integer >= 0 (0: the latest)")
    return version


def _answer(answer: bytes, kind: Any, with_version: bool) -> Any:
    """A data call's result (and the table version it came from, ``with_version``)."""
    result = kind.wrap(_codec.decode_tensor_response(answer))
    return (result, _codec.response_version(answer)) if with_version else result


def _as_kind(arrays: Mapping[str, np.ndarray], numpy: Optional[bool]) -> Dict[str, Tensor]:
    """numpy arrays as they are (numpy=True), or as torch tensors (False; None: if torch is
    installed)."""
    torch = None
    if not numpy:
        try:
            import torch
        except ImportError:
            if numpy is False:
                raise
    if torch is None:
        return dict(arrays)
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


# --- the pipelined batch API over Stream ----------------------------------------------------------


class StreamFuture(concurrent.futures.Future):
    """The answer of one request on a :class:`Stream`. ``result()`` waits at most until the
    request's deadline and then raises :class:`~shardserve.DeadlineExceededError`."""

    def __init__(self, deadline_at: float) -> None:
        super().__init__()
        self.deadline_at = deadline_at

    def result(self, timeout: Optional[float] = None) -> Any:
        remaining = max(self.deadline_at - time.monotonic(), 0.0)
        if timeout is not None and timeout < remaining:
            return super().result(timeout)  # concurrent.futures.TimeoutError, as any Future
        try:
            return super().result(remaining)
        except concurrent.futures.TimeoutError:
            self.set_exception_once(DeadlineExceededError("stream request: the deadline passed"))
            return super().result(0)

    def set_exception_once(self, error: BaseException) -> bool:
        try:
            self.set_exception(error)
            return True
        except concurrent.futures.InvalidStateError:
            return False

    def set_result_once(self, value: Any) -> bool:
        try:
            self.set_result(value)
            return True
        except concurrent.futures.InvalidStateError:
            return False


class _StreamCall:
    """One request of a Stream, across its attempts."""

    __slots__ = ("table", "op_field", "request", "kind", "future", "attempts", "refresh", "last",
                 "request_id", "released", "group", "tried", "hedged", "next")

    def __init__(self, table: str, op_field: int, request: bytes, kind: _codec.Kind,
                 future: StreamFuture) -> None:
        self.table = table
        self.op_field = op_field
        self.request = request
        self.kind = kind
        self.future = future
        self.attempts = 0
        self.refresh = False
        self.last: Optional[Error] = None
        self.request_id: Optional[int] = None  # of the attempt in flight
        self.released = False  # its in-flight slot given back
        self.group = -1  # the replica of the attempt in flight
        self.tried: List[int] = []  # groups that failed it since the last back-off
        self.hedged = False  # sent to a second replica while the first had not answered
        self.next: Optional[Tuple[str, int, bool]] = None  # where the next attempt goes (a hedge)


class _WorkerStream:
    """One gRPC ``Stream`` to one worker: requests written from a queue by gRPC's thread,
    answers read by a thread of ours and handed to the owning :class:`Stream`."""

    _END = object()

    def __init__(self, owner: "Stream", address: str, endpoint: _Endpoint) -> None:
        self.owner = owner
        self.address = address
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        # No gRPC deadline on the stream itself: it lives as long as the session; each request
        # has its own deadline (StreamFuture.result).
        self.call = endpoint.stream(self._requests())
        self._reader = threading.Thread(
            target=self._read, name=f"shardserve-stream-{address}", daemon=True
        )
        self._reader.start()

    def _requests(self) -> Any:
        while True:
            item = self._queue.get()
            if item is _WorkerStream._END:
                return
            yield item

    def send(self, request: bytes) -> None:
        self._queue.put(request)

    def half_close(self) -> None:
        self._queue.put(_WorkerStream._END)

    def join(self, timeout: Optional[float]) -> None:
        self._reader.join(timeout)

    def _read(self) -> None:
        error: Optional[Error] = None
        try:
            for answer in self.call:
                self.owner._on_answer(self, answer)
        except grpc.RpcError as e:
            error = from_rpc_error(e)
        self.owner._on_stream_end(self, error)


class Stream:
    """Many requests in flight on ``Stream`` RPCs, answers matched by id.

    Each method sends one request and returns a :class:`StreamFuture` at once; the requests of
    all threads go out pipelined (one gRPC stream per worker, opened on first use, requests
    spread round robin over each table's workers). At most ``max_in_flight`` requests wait for
    answers; a further call blocks until one comes. Each request has the session's ``deadline``
    (the client's by default) from when it is sent; one that fails with UNAVAILABLE (answered
    so, or its stream broke) is sent again, with a fresh placement map, while that allows::

        with client.stream() as s:
            futures = [s.embedding_bag("emb", ids, mode="sum") for ids in batches]
            outputs = [f.result() for f in futures]

    A request whose deadline passes unanswered (a worker that hangs) fails with
    DEADLINE_EXCEEDED then, whether or not anyone waits on it, so ``concurrent.futures.wait`` and
    ``as_completed`` work on these futures.

    Thread-safe. ``close()`` (or leaving the ``with`` block) waits for the answers in flight.
    """

    def __init__(self, client: Client, *, max_in_flight: int = 1024,
                 deadline: Optional[float] = None) -> None:
        if max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight: {max_in_flight} must be >= 1")
        self._client = client
        self._deadline = client._timeout(deadline)
        self._lock = threading.Lock()
        self._workers: Dict[str, _WorkerStream] = {}
        self._pending: Dict[int, Any] = {}  # request id -> (_StreamCall, _WorkerStream)
        self._ids = itertools.count(1)
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._closed = False
        # Deadlines of the requests sent, for the watchdog thread (started with the first).
        # Heap of (time, number, _StreamCall, request id): the call's deadline (request id None),
        # or when its attempt of that request id is hedged.
        self._expiry: List[Any] = []
        self._expiry_changed = threading.Condition(self._lock)
        self._watchdog: Optional[threading.Thread] = None

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- requests ---------------------------------------------------------------------------

    def embedding(self, table: str, ids: Tensor) -> StreamFuture:
        """:meth:`Client.embedding`, pipelined."""
        array, device = _codec.as_ids(ids, "ids")
        return self._start(table, _codec.STREAM_EMBEDDING,
                           _codec.encode_embedding(table, array), _codec.Kind(device))

    def embedding_bag(
        self,
        table: str,
        ids: Tensor,
        offsets: Optional[Tensor] = None,
        per_sample_weights: Optional[Tensor] = None,
        mode: str = "mean",
        include_last_offset: bool = False,
    ) -> StreamFuture:
        """:meth:`Client.embedding_bag`, pipelined."""
        request, kind = _encode_bag(table, ids, offsets, per_sample_weights, mode,
                                    include_last_offset)
        return self._start(table, _codec.STREAM_EMBEDDING_BAG, request, kind)

    def linear(self, table: str, input: Tensor) -> StreamFuture:
        """:meth:`Client.linear`, pipelined."""
        array, device = _codec.as_floats(input, "input")
        return self._start(table, _codec.STREAM_LINEAR, _codec.encode_linear(table, array),
                           _codec.Kind(device))

    def close(self, timeout: Optional[float] = None) -> None:
        """Ends the session: no new requests; waits (up to ``timeout``, default the deadline)
        for the answers in flight, then closes the streams. Unanswered requests fail with
        CANCELLED."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._expiry_changed.notify_all()
            calls = [call for call, _ in self._pending.values()]
        wait = self._deadline if timeout is None else timeout
        concurrent.futures.wait([c.future for c in calls], timeout=wait)
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for w in workers:
            w.half_close()
        for w in workers:
            w.call.cancel()
            w.join(1.0)
        with self._lock:
            left, self._pending = list(self._pending.values()), {}
        for call, _ in left:
            self._finish(call, error=CancelledError("stream closed before the answer came"))

    # --- internals ----------------------------------------------------------------------------

    def _start(self, table: str, op_field: int, request: bytes, kind: _codec.Kind) -> StreamFuture:
        if self._closed:
            raise CancelledError("stream is closed")
        deadline_at = time.monotonic() + self._deadline
        if not self._slots.acquire(timeout=self._deadline):
            raise DeadlineExceededError(
                "stream: no room for another request in flight before the deadline"
            )
        future = StreamFuture(deadline_at)
        call = _StreamCall(table, op_field, request, kind, future)
        with self._lock:
            heapq.heappush(self._expiry, (deadline_at, next(self._ids), call, None))
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                  name="shardserve-stream-deadlines")
                self._watchdog.start()
            self._expiry_changed.notify()
        self._send(call)
        return future

    def _watch(self) -> None:
        """Fails the requests whose deadline passed without an answer, and hedges those without
        one after the hedge delay."""
        while True:
            with self._expiry_changed:
                while not self._closed:
                    wait = self._expiry[0][0] - time.monotonic() if self._expiry else None
                    if wait is not None and wait <= 0:
                        break
                    self._expiry_changed.wait(wait)
                if self._closed:
                    return
                now = time.monotonic()
                expired, hedges = [], []
                while self._expiry and self._expiry[0][0] <= now:
                    _, _, call, hedge_of = heapq.heappop(self._expiry)
                    if call.future.done():
                        continue
                    if hedge_of is not None:
                        hedges.append((call, hedge_of))
                        continue
                    if call.request_id is not None:
                        self._pending.pop(call.request_id, None)  # a late answer is dropped
                    expired.append(call)
            for call in expired:
                self._finish(call, error=DeadlineExceededError(
                    "stream request: the deadline passed without an answer"))
            for call, request_id in hedges:
                self._hedge(call, request_id)

    def _hedge(self, call: _StreamCall, request_id: int) -> None:
        """No answer to ``request_id`` after the hedge delay (a hung worker): its group is
        suspect, and the call goes to another replica too; the first answer wins."""
        if call.future.done() or call.hedged or call.request_id != request_id:
            return
        call.next = self._client._routes.hedge(call.table, call.group,
                                               call.tried + [call.group])
        if call.next is None:
            return
        call.tried.append(call.group)
        call.hedged = True
        self._send(call)

    def _send(self, call: _StreamCall) -> None:
        """One attempt of ``call`` (on this thread, or a retry timer's)."""
        if call.future.done():  # its deadline passed while it waited for the retry
            self._release(call)
            return
        call.attempts += 1
        call.group = -1
        try:
            address, call.group, _ = call.next or self._client.route(
                call.table, call.refresh, call.future.deadline_at, call.tried)
            call.next = None
            call.refresh = False
            request_id = next(self._ids)
            with self._lock:
                if self._closed:
                    raise CancelledError("stream closed before the request was sent")
                worker = self._workers.get(address)
                if worker is None:
                    worker = _WorkerStream(self, address, self._client._endpoint(address))
                    self._workers[address] = worker
                self._pending[request_id] = (call, worker)
                call.request_id = request_id
                hedge = self._client.options.hedge_after
                if (hedge > 0 and not call.hedged
                        and self._client._routes.others(call.table, call.tried + [call.group])):
                    heapq.heappush(self._expiry, (time.monotonic() + hedge, next(self._ids), call,
                                                  request_id))
                    self._expiry_changed.notify()
            worker.send(_codec.encode_stream_request(request_id, call.op_field, call.request))
        except Error as e:
            self._failed(call, e)

    def _on_answer(self, worker: _WorkerStream, answer: bytes) -> None:
        try:
            request_id, code, message, output = _codec.decode_stream_response(answer)
        except Error:
            return  # an answer we cannot read; its request fails when the stream ends
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        call = entry[0]
        if code == 0:
            self._client._routes.succeeded(call.table, call.group)
            self._finish(call, value=call.kind.wrap(output))
        else:
            self._failed(call, error_for_code(code_from_number(code), message))

    def _on_stream_end(self, worker: _WorkerStream, error: Optional[Error]) -> None:
        with self._lock:
            if self._workers.get(worker.address) is worker:
                del self._workers[worker.address]
            lost = [rid for rid, (_, w) in self._pending.items() if w is worker]
            calls = [self._pending.pop(rid)[0] for rid in lost]
            closing = self._closed
        if error is None:
            error = UnavailableError(f"stream to {worker.address} ended with answers outstanding")
        if closing:
            error = CancelledError("stream closed before the answer came")
        for call in calls:
            self._failed(call, error)

    def _failed(self, call: _StreamCall, error: Error) -> None:
        """Retries ``call`` after a back-off if it failed with UNAVAILABLE and its deadline and
        attempts allow; otherwise fails it."""
        if error.code == _NOT_FOUND:
            self._client._routes.forget(call.table)
        opts = self._client.options
        routes = self._client._routes
        if error.code == _UNAVAILABLE and not self._closed:
            with self._lock:
                if call.hedged and call.request_id in self._pending:
                    return  # its hedge, on another replica, may still answer
            call.last = error
            if call.group >= 0:
                routes.failed(call.table, call.group)
                call.tried.append(call.group)
            if call.attempts < opts.max_attempts and routes.others(call.table, call.tried):
                self._send(call)  # another replica at once
                return
            call.tried.clear()
            delay = opts.backoff_after(call.attempts - 1)
            in_time = time.monotonic() + delay < call.future.deadline_at
            if call.attempts < opts.max_attempts and in_time:
                call.refresh = True
                timer = threading.Timer(delay, self._send, (call,))
                timer.daemon = True
                timer.start()
                return
            error = UnavailableError(f"{error.message} (gave up after {call.attempts} attempt(s))")
        self._finish(call, error=error)

    def _finish(self, call: _StreamCall, value: Any = None, error: Optional[Error] = None) -> None:
        if error is not None:
            call.future.set_exception_once(error)
        else:
            call.future.set_result_once(value)
        self._release(call)

    def _release(self, call: _StreamCall) -> None:
        """Gives ``call``'s in-flight slot back (once, whichever path ends it)."""
        with self._lock:
            if call.released:
                return
            call.released = True
        self._slots.release()
