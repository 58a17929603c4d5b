"""The asyncio client (``grpc.aio``): the methods of :class:`shardserve.Client` as coroutines,
and a pipelined batch API over the ``Stream`` RPC.

Routing, retries and deadlines are those of the blocking client (see ``shardserve.client``).
Channels are made on first use, inside the running event loop; use one client per loop::

    async with shardserve.aio.Client("127.0.0.1:50051") as client:
        out = await client.embedding_bag("emb", ids, mode="sum")
        async with client.stream() as s:
            outs = await asyncio.gather(*(s.embedding_bag("emb", b, mode="sum") for b in batches))
"""

import asyncio
import itertools
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc
import grpc.aio

from . import _codec, _common, _process, _stubs
from ._common import Options, RoutingTable, TableInfo
from .client import _answer, _as_kind, _encode_bag, _give_up, _version
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

__all__ = ["Client", "Stream"]

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_NOT_FOUND = grpc.StatusCode.NOT_FOUND

Tensor = Any


class _Endpoint:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.unary = {
            name: channel.unary_unary(path) for name, path in _common.DATA_METHODS.items()
        }
        self.stream = channel.stream_stream(_common.STREAM_METHOD)


class Client:
    """A shardserve client for asyncio; arguments as :class:`shardserve.Client`'s.

    Every method is a coroutine; ``await client.close()`` (or ``async with``) closes the
    channels.
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
        self._pb, self._pb_grpc = _stubs.load()
        self.coordinator = coordinator
        self.options = Options(deadline, max_attempts, backoff, direct, hedge_after)
        self.checkpoint_dir = checkpoint_dir
        self._channel_options = _common.channel_options(channel_options, tls_server_name)
        self._credentials = _common.credentials(tls_ca, tls_cert, tls_key, token)
        self._routes = RoutingTable()
        self._endpoints: Dict[str, _Endpoint] = {}
        self._admin_channel: Optional[grpc.aio.Channel] = None
        self._admin: Any = None
        self._forward: Optional[_Endpoint] = None

    @classmethod
    def from_endpoints(cls, path: str, **kwargs: Any) -> "Client":
        """See :meth:`shardserve.Client.from_endpoints`."""
        return cls(**{**_common.read_endpoints(path), **kwargs})

    async def close(self) -> None:
        """Closes every channel; calls in flight fail with CANCELLED."""
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            await endpoint.channel.close()
        if self._admin_channel is not None:
            await self._admin_channel.close()
            self._admin_channel = None

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # --- data calls ---------------------------------------------------------------------------

    async def embedding(self, table: str, ids: Tensor, *, version: int = 0,
                        with_version: bool = False, deadline: Optional[float] = None) -> Any:
        """See :meth:`shardserve.Client.embedding`."""
        array, device = _codec.as_ids(ids, "ids")
        answer = await self._call(
            "embedding", table, _codec.encode_embedding(table, array, _version(version)), deadline
        )
        return _answer(answer, _codec.Kind(device), with_version)

    async def embedding_bag(
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
        """See :meth:`shardserve.Client.embedding_bag`."""
        request, kind = _encode_bag(table, ids, offsets, per_sample_weights, mode,
                                    include_last_offset, _version(version))
        answer = await self._call("embedding_bag", table, request, deadline)
        return _answer(answer, kind, with_version)

    async def linear(self, table: str, input: Tensor, *, version: int = 0,
                     with_version: bool = False, deadline: Optional[float] = None) -> Any:
        """See :meth:`shardserve.Client.linear`."""
        array, device = _codec.as_floats(input, "input")
        answer = await self._call(
            "linear", table, _codec.encode_linear(table, array, _version(version)), deadline
        )
        return _answer(answer, _codec.Kind(device), with_version)

    def stream(self, *, max_in_flight: int = 1024, deadline: Optional[float] = None) -> "Stream":
        """A pipelined batch session over the ``Stream`` RPC (see :class:`Stream`)."""
        return Stream(self, max_in_flight=max_in_flight, deadline=deadline)

    # --- admin calls ----------------------------------------------------------------------------

    async def create_table(
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
        """See :meth:`shardserve.Client.create_table` (same arguments)."""
        spec, _ = _common.build_spec(
            self._pb, name, weight, kind=kind, bias=bias, num_rows=rows, num_cols=cols,
            seed=seed, checkpoint=checkpoint, sharding_dim=sharding_dim, placements=placements,
            world=world, device=device, padding_idx=padding_idx, max_norm=max_norm,
            norm_type=norm_type, checkpoint_dir=self.checkpoint_dir,
        )
        deadline_at = time.monotonic() + self._timeout(deadline)
        info = await self._admin_call_until(
            "CreateTable", self._pb.CreateTableRequest(table=spec), deadline_at)
        self._routes.forget(name)
        while (info.state in _common.WAITING_STATES
               and deadline_at - time.monotonic() > _common.LEAST_WAIT):
            info = await self._admin_call_until(
                "WaitTable", self._pb.WaitTableRequest(name=name), deadline_at)
        _common.raise_if_failed(info)
        return _common.table_info(info)

    async def wait_table(self, table: str, *, timeout: Optional[float] = None) -> TableInfo:
        """See :meth:`shardserve.Client.wait_table`."""
        deadline_at = time.monotonic() + self._timeout(timeout)
        return _common.table_info(await self._admin_call_until(
            "WaitTable", self._pb.WaitTableRequest(name=table), deadline_at))

    async def drop(self, table: str, *, deadline: Optional[float] = None) -> None:
        """See :meth:`shardserve.Client.drop`."""
        await self._admin_call("DropTable", self._pb.DropTableRequest(name=table), deadline)
        self._routes.forget(table)

    async def tables(self, *, deadline: Optional[float] = None) -> List[TableInfo]:
        """See :meth:`shardserve.Client.tables`."""
        response = await self._admin_call("ListTables", self._pb.ListTablesRequest(), deadline)
        return [_common.table_info(t) for t in response.tables]

    async def describe(self, table: str, *, deadline: Optional[float] = None) -> TableInfo:
        """See :meth:`shardserve.Client.describe`."""
        return _common.table_info(await self._admin_call(
            "DescribeTable", self._pb.DescribeTableRequest(name=table), deadline))

    async def export(self, table: str, path: Optional[str] = None, *,
                     numpy: Optional[bool] = None, deadline: Optional[float] = None) -> Tensor:
        """See :meth:`shardserve.Client.export`."""
        return (await self.export_state(table, path, numpy=numpy, deadline=deadline))["weight"]

    async def export_state(self, table: str, path: Optional[str] = None, *,
                           numpy: Optional[bool] = None,
                           deadline: Optional[float] = None) -> Dict[str, Tensor]:
        """See :meth:`shardserve.Client.export_state`."""
        _common.check_export_target(path)
        buf = await self._export_bytes(table, time.monotonic() + self._timeout(deadline))
        return _as_kind(_common.finish_export(table, buf, path), numpy)

    async def describe_cluster(self, *, deadline: Optional[float] = None) -> Any:
        """See :meth:`shardserve.Client.describe_cluster`."""
        return await self._admin_call("DescribeCluster", self._pb.DescribeClusterRequest(),
                                      deadline)

    async def _export_bytes(self, table: str, deadline_at: float) -> bytearray:
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
                call = self._admin_stub().ExportTableStream(request, timeout=remaining,
                                                            wait_for_ready=True)
                async for chunk in call:
                    assembly.add(chunk)
                return assembly.finish()
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            if err.code != _UNAVAILABLE:
                raise err
            last = err
            await _sleep_until_next(opts.backoff_after(attempts - 1), deadline_at)
        raise _give_up(last, attempts, started)

    # --- internals ------------------------------------------------------------------------------

    def _timeout(self, deadline: Optional[float]) -> float:
        return self.options.deadline if deadline is None else deadline

    def _admin_stub(self) -> Any:
        if self._admin is None:
            self._admin_channel = self._channel(self.coordinator)
            self._admin = self._pb_grpc.AdminServiceStub(self._admin_channel)
            self._forward = _Endpoint(self._admin_channel)
        return self._admin

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=self._channel_options)
        return grpc.aio.secure_channel(address, self._credentials, options=self._channel_options)

    def _endpoint(self, address: str) -> _Endpoint:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            endpoint = self._endpoints[address] = _Endpoint(self._channel(address))
        return endpoint

    async def _admin_call(self, method: str, request: Any, deadline: Optional[float]) -> Any:
        return await self._admin_call_until(method, request,
                                            time.monotonic() + self._timeout(deadline))

    async def _admin_call_until(self, method: str, request: Any, deadline_at: float) -> Any:
        opts = self.options
        rpc = getattr(self._admin_stub(), method)
        started = time.monotonic()
        last: Optional[Error] = None
        attempts = 0
        while attempts < opts.max_attempts:
            remaining = deadline_at - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            try:
                return await rpc(request, timeout=remaining, wait_for_ready=True)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            if err.code != _UNAVAILABLE:
                raise err
            last = err
            await _sleep_until_next(opts.backoff_after(attempts - 1), deadline_at)
        raise _give_up(last, attempts, started)

    async def route(self, table: str, refresh: bool, deadline_at: float,
                    avoid: Sequence[int] = ()) -> Tuple[str, int, bool]:
        """See :meth:`shardserve.Client.route`."""
        if refresh or not self._routes.has(table):
            self._routes.update(table, _common.table_info(await self._admin_call_until(
                "DescribeTable", self._pb.DescribeTableRequest(name=table), deadline_at)))
        picked = self._routes.pick(table, avoid)
        if picked is None:
            raise UnavailableError(f'table "{table}" has no workers yet')
        return picked

    async def _call(self, method: str, table: str, request: bytes,
                    deadline: Optional[float]) -> bytes:
        opts = self.options
        started = time.monotonic()
        deadline_at = started + self._timeout(deadline)
        refresh = False
        tried: List[int] = []
        last: Optional[Error] = None
        attempts = 0
        while attempts < opts.max_attempts:
            remaining = deadline_at - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            try:
                if not opts.direct:
                    self._admin_stub()
                    return await self._forward.unary[method](request, timeout=max(remaining, 1e-3))
                address, group, probe = await self.route(table, refresh, deadline_at, tried)
                refresh = False
                return await self._attempt(method, table, request, (address, group, probe), tried,
                                           deadline_at)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
            except Error as e:
                err = e
            if err.code == _NOT_FOUND:
                self._routes.forget(table)
            if err.code != _UNAVAILABLE:
                raise err
            last = err
            if opts.direct and self._routes.others(table, tried):
                continue  # another replica at once
            tried.clear()
            refresh = True
            await _sleep_until_next(opts.backoff_after(attempts - 1), deadline_at)
        raise _give_up(last, attempts, started)

    async def _attempt(self, method: str, table: str, request: bytes,
                       route: Tuple[str, int, bool], tried: List[int],
                       deadline_at: float) -> bytes:
        """See :meth:`shardserve.Client._attempt`: one attempt, hedged on another replica when
        it has no answer after the hedge delay; the first answer wins."""
        def start(address: str) -> "asyncio.Task[bytes]":
            remaining = max(deadline_at - time.monotonic(), 1e-3)
            call = self._endpoint(address).unary[method](request, timeout=remaining)
            return asyncio.ensure_future(call)

        hedge = self.options.hedge_after
        if (hedge <= 0 or deadline_at - time.monotonic() <= hedge
                or not self._routes.others(table, tried + [route[1]])):
            # Nowhere to hedge to (one group, say): the plain call, which costs least.
            remaining = max(deadline_at - time.monotonic(), 1e-3)
            try:
                answer = await self._endpoint(route[0]).unary[method](request, timeout=remaining)
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                self._routes.ended(table, route[1], route[2], err, tried)
                raise err from None
            self._routes.ended(table, route[1], route[2], None, tried)
            return answer
        attempts = {start(route[0]): route}
        done, _ = await asyncio.wait(list(attempts), timeout=hedge)
        group = route[1]
        if not done:
            # A hung worker: its group is suspect, and the call goes to another replica too.
            other = self._routes.hedge(table, group, tried + [group])
            if other is not None:
                attempts[start(other[0])] = other
        error: Optional[Error] = None
        pending = set(attempts)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                _, g, _ = attempts[task]
                try:
                    answer, error = task.result(), None
                except grpc.RpcError as e:
                    answer, error = None, from_rpc_error(e)
                if not self._routes.decides(table, g, error, tried):
                    continue
                for other in pending:
                    other.cancel()
                    self._routes.abandoned(table, attempts[other][1], attempts[other][2])
                if error is not None:
                    raise error
                return answer
        raise error if error is not None else UnavailableError("no attempt answered")


async def _sleep_until_next(delay: float, deadline_at: float) -> None:
    delay = min(delay, deadline_at - time.monotonic())
    if delay > 0:
        await asyncio.sleep(delay)


class _WorkerStream:
    """One gRPC ``Stream`` to one worker: writes serialised by a lock, a reader task that hands
    each answer to the owning :class:`Stream`."""

    def __init__(self, owner: "Stream", address: str, endpoint: _Endpoint) -> None:
        self.owner = owner
        self.address = address
        self.call = endpoint.stream()  # no deadline: each request has its own
        self._write_lock = asyncio.Lock()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def send(self, request: bytes) -> None:
        async with self._write_lock:
            await self.call.write(request)

    async def half_close(self) -> None:
        async with self._write_lock:
            try:
                await self.call.done_writing()
            except (grpc.RpcError, grpc.aio.UsageError):
                pass

    async def _read(self) -> None:
        error: Optional[Error] = None
        try:
            while True:
                answer = await self.call.read()
                if answer is grpc.aio.EOF:
                    break
                self.owner._on_answer(self, answer)
        except grpc.RpcError as e:
            error = from_rpc_error(e)
        except asyncio.CancelledError:
            error = CancelledError("stream closed before the answer came")
        self.owner._on_stream_end(self, error)


class _StreamCall:
    __slots__ = ("table", "op_field", "request", "kind", "future", "deadline_at", "attempts",
                 "refresh", "group", "tried", "hedged", "request_id", "next")

    def __init__(self, table: str, op_field: int, request: bytes, kind: _codec.Kind,
                 future: "asyncio.Future[Any]", deadline_at: float) -> None:
        self.table = table
        self.op_field = op_field
        self.request = request
        self.kind = kind
        self.future = future
        self.deadline_at = deadline_at
        self.attempts = 0
        self.refresh = False
        self.group = -1  # the replica of the attempt in flight
        self.tried: List[int] = []  # groups that failed it since the last back-off
        self.hedged = False  # sent to a second replica while the first had not answered
        self.request_id = -1  # of the attempt in flight
        self.next: Optional[Tuple[str, int, bool]] = None  # where the next attempt goes (a hedge)


class Stream:
    """The asyncio form of :class:`shardserve.client.Stream`: each method is a coroutine that
    sends one request on a shared stream and returns its answer; run many at once (tasks,
    ``asyncio.gather``) to pipeline them. Use ``async with client.stream() as s``."""

    def __init__(self, client: Client, *, max_in_flight: int = 1024,
                 deadline: Optional[float] = None) -> None:
        if max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight: {max_in_flight} must be >= 1")
        self._client = client
        self._deadline = client._timeout(deadline)
        self._workers: Dict[str, _WorkerStream] = {}
        self._pending: Dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._slots = asyncio.Semaphore(max_in_flight)
        self._closed = False
        self._retries: set = set()  # retry tasks (the loop holds tasks only weakly)

    async def __aenter__(self) -> "Stream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def embedding(self, table: str, ids: Tensor) -> Tensor:
        """:meth:`shardserve.Client.embedding`, pipelined."""
        array, device = _codec.as_ids(ids, "ids")
        return await self._run(table, _codec.STREAM_EMBEDDING,
                               _codec.encode_embedding(table, array), _codec.Kind(device))

    async def embedding_bag(
        self,
        table: str,
        ids: Tensor,
        offsets: Optional[Tensor] = None,
        per_sample_weights: Optional[Tensor] = None,
        mode: str = "mean",
        include_last_offset: bool = False,
    ) -> Tensor:
        """:meth:`shardserve.Client.embedding_bag`, pipelined."""
        request, kind = _encode_bag(table, ids, offsets, per_sample_weights, mode,
                                    include_last_offset)
        return await self._run(table, _codec.STREAM_EMBEDDING_BAG, request, kind)

    async def linear(self, table: str, input: Tensor) -> Tensor:
        """:meth:`shardserve.Client.linear`, pipelined."""
        array, device = _codec.as_floats(input, "input")
        return await self._run(table, _codec.STREAM_LINEAR, _codec.encode_linear(table, array),
                               _codec.Kind(device))

    async def close(self) -> None:
        """No new requests; the streams are closed (requests in flight fail with CANCELLED;
        awaiting them before closing gets their answers)."""
        if self._closed:
            return
        self._closed = True
        workers = list(self._workers.values())
        self._workers.clear()
        for w in workers:
            await w.half_close()
            w.call.cancel()
        for w in workers:
            try:
                await w.reader
            except asyncio.CancelledError:
                pass
        for call, _ in list(self._pending.values()):
            self._finish(call, error=CancelledError("stream closed before the answer came"))
        self._pending.clear()

    # --- internals ------------------------------------------------------------------------------

    async def _run(self, table: str, op_field: int, request: bytes, kind: _codec.Kind) -> Any:
        if self._closed:
            raise CancelledError("stream is closed")
        deadline_at = time.monotonic() + self._deadline
        try:
            await asyncio.wait_for(self._slots.acquire(), self._deadline)
        except asyncio.TimeoutError:
            raise DeadlineExceededError(
                "stream: no room for another request in flight before the deadline") from None
        future = asyncio.get_running_loop().create_future()
        call = _StreamCall(table, op_field, request, kind, future, deadline_at)
        try:
            await self._send(call)
            return await asyncio.wait_for(asyncio.shield(future),
                                          max(deadline_at - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise DeadlineExceededError("stream request: the deadline passed") from None
        finally:
            self._slots.release()
            if not future.done():
                future.cancel()  # an answer that comes later is dropped

    async def _send(self, call: _StreamCall) -> None:
        if call.future.done():
            return
        call.attempts += 1
        call.group = -1
        try:
            address, call.group, _ = call.next or await self._client.route(
                call.table, call.refresh, call.deadline_at, call.tried)
            call.next = None
            call.refresh = False
            if self._closed:
                raise CancelledError("stream closed before the request was sent")
            worker = self._workers.get(address)
            if worker is None:
                worker = _WorkerStream(self, address, self._client._endpoint(address))
                self._workers[address] = worker
            request_id = next(self._ids)
            self._pending[request_id] = (call, worker)
            call.request_id = request_id
            hedge = self._client.options.hedge_after
            if (hedge > 0 and not call.hedged
                    and self._client._routes.others(call.table, call.tried + [call.group])):
                asyncio.get_running_loop().call_later(hedge, self._hedge, call, request_id)
        except Error as e:
            self._failed(call, e)
            return
        try:
            await worker.send(_codec.encode_stream_request(request_id, call.op_field,
                                                           call.request))
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            # The stream ended under the write; its reader fails what it still holds, and this
            # request is no longer among those.
            if self._pending.pop(request_id, None) is not None:
                self._failed(call, UnavailableError(f"stream to {address} broke: {e}"))

    def _on_answer(self, worker: _WorkerStream, answer: bytes) -> None:
        try:
            request_id, code, message, output = _codec.decode_stream_response(answer)
        except Error:
            return
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
        if self._workers.get(worker.address) is worker:
            del self._workers[worker.address]
        lost = [rid for rid, (_, w) in self._pending.items() if w is worker]
        calls = [self._pending.pop(rid)[0] for rid in lost]
        if error is None:
            error = UnavailableError(f"stream to {worker.address} ended with answers outstanding")
        if self._closed:
            error = CancelledError("stream closed before the answer came")
        for call in calls:
            self._failed(call, error)

    def _failed(self, call: _StreamCall, error: Error) -> None:
        if call.future.done():
            return
        if error.code == _NOT_FOUND:
            self._client._routes.forget(call.table)
        opts = self._client.options
        routes = self._client._routes
        if error.code == _UNAVAILABLE and not self._closed:
            if call.hedged and call.request_id in self._pending:
                return  # its hedge, on another replica, may still answer
            if call.group >= 0:
                routes.failed(call.table, call.group)
                call.tried.append(call.group)
            if call.attempts < opts.max_attempts and routes.others(call.table, call.tried):
                self._retry(call)  # another replica at once
                return
            call.tried.clear()
            delay = opts.backoff_after(call.attempts - 1)
            if call.attempts < opts.max_attempts and time.monotonic() + delay < call.deadline_at:
                call.refresh = True
                loop = asyncio.get_running_loop()
                loop.call_later(delay, self._retry, call)
                return
            error = UnavailableError(f"{error.message} (gave up after {call.attempts} attempt(s))")
        self._finish(call, error=error)

    def _hedge(self, call: _StreamCall, request_id: int) -> None:
        """See :meth:`shardserve.client.Stream._hedge`."""
        if call.future.done() or call.hedged or call.request_id != request_id:
            return
        call.next = self._client._routes.hedge(call.table, call.group,
                                               call.tried + [call.group])
        if call.next is None:
            return
        call.tried.append(call.group)
        call.hedged = True
        self._retry(call)

    def _retry(self, call: _StreamCall) -> None:
        task = asyncio.get_running_loop().create_task(self._send(call))
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    @staticmethod
    def _finish(call: _StreamCall, value: Any = None, error: Optional[Error] = None) -> None:
        if call.future.done():
            return
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(value)
