"""What the blocking and the asyncio clients share: options, the routing table, table
descriptions, table specs made from tensors or modules, checkpoints and exports.

Nothing here does I/O on a network; the clients own their channels and their retry loops.
"""

import itertools
import json
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _safetensors
from .errors import (
    CancelledError,
    DeadlineExceededError,
    Error,
    InternalError,
    InvalidArgumentError,
    UnavailableError,
    code_from_number,
    error_for_code,
)

# Like the C++ side's (rpc/grpc_settings.h): a request may carry 2^26 ids and an answer 2^27
# floats, far over gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 1 << 30

CHANNEL_OPTIONS: Tuple[Tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Our own retry loop (refreshing the placement map between attempts) does what gRPC's
    # transparent retries would; two layers of retries would overrun the caller's deadline.
    ("grpc.enable_retries", 0),
)

DATA_METHODS = {
    "embedding": "/shardserve.v1.DataService/Embedding",
    "embedding_bag": "/shardserve.v1.DataService/EmbeddingBag",
    "linear": "/shardserve.v1.DataService/Linear",
}
STREAM_METHOD = "/shardserve.v1.DataService/Stream"
UPDATE_METHOD = "/shardserve.v1.DataService/UpdateRows"  # workers only; never retried


def channel_options(extra: Optional[Sequence[Tuple[str, Any]]],
                    tls_server_name: Optional[str] = None) -> List[Tuple[str, Any]]:
    options = dict(CHANNEL_OPTIONS)
    if tls_server_name:
        options["grpc.ssl_target_name_override"] = tls_server_name
    options.update(dict(extra or ()))
    return list(options.items())


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgumentError(f"{what}: cannot read {path}: {e.strerror}") from None


def credentials(tls_ca: Optional[str], tls_cert: Optional[str], tls_key: Optional[str],
                token: Optional[str]) -> Optional[Any]:
    """The channel credentials of a client (None: plaintext), as the C++ binaries' --tls_ca,
    --tls_cert, --tls_key and --token_file make them (rpc/security.h): TLS that verifies
    the servers against ``tls_ca``, the client certificate for mTLS, a bearer token."""
    if not tls_ca:
        if tls_cert or tls_key or token:
            raise InvalidArgumentError(
                "tls_cert, tls_key and token need TLS: give tls_ca (gRPC sends no token in "
                "plaintext)")
        return None
    if bool(tls_cert) != bool(tls_key):
        raise InvalidArgumentError("tls_cert and tls_key go together")
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca, "tls_ca"),
        private_key=_read(tls_key, "tls_key") if tls_key else None,
        certificate_chain=_read(tls_cert, "tls_cert") if tls_cert else None)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


def read_endpoints(path: str) -> Dict[str, Any]:
    """The client arguments that ``shardserve up --endpoints_file=PATH`` names: the
    coordinator's address and, with ``--tls``, the CA and the client certificate and key."""
    try:
        with open(path) as f:
            endpoints = json.load(f)
        kwargs: Dict[str, Any] = {"coordinator": endpoints["coordinator"]["address"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidArgumentError(f"{path}: not an endpoints file of `shardserve up`: {e}") \
            from None
    for key, arg in (("ca", "tls_ca"), ("client_cert", "tls_cert"), ("client_key", "tls_key")):
        if endpoints.get(key):
            kwargs[arg] = endpoints[key]
    return kwargs


@dataclass(frozen=True)
class Options:
    """Per-client settings, shared by :class:`shardserve.Client` and ``shardserve.aio.Client``.

    Attributes:
        deadline: seconds per call, retries included (the C++ client's default, 10 s).
        max_attempts: attempts per call, the first included.
        backoff: seconds before the first retry; doubled after each (up to 64x).
        direct: send data calls straight to the workers (False: to the coordinator, which
            forwards each call whole to one worker; one extra hop).
        hedge_after: seconds without an answer after which a call goes to another replica
            too (0: never).
    """

    deadline: float = 10.0
    max_attempts: int = 8
    backoff: float = 0.025
    direct: bool = True
    hedge_after: float = 0.05

    def backoff_after(self, attempt: int) -> float:
        return self.backoff * (1 << min(attempt, 6))


class RoutingTable:
    """Table name -> where its calls may go: the entry ranks of each of its replicas.

    The C++ client's routing (``rpc/routing/replica_router.h``): calls go round robin over the entry
    ranks of the replicas that serve; a group that failed a call (UNAVAILABLE, or no answer
    within the hedge delay) is suspect for ``cooldown`` seconds, then gets one call at a time (a
    probe) until one succeeds; suspect and not-serving replicas are used only when no other is
    left (with one group, every call still goes to it). Health is kept across map refreshes.
    Thread-safe.
    """

    def __init__(self, cooldown: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._cooldown = cooldown
        self._routes: Dict[str, "_Routes"] = {}
        # The hedge budget (as the C++ ReplicaCaller's): attempts routed and hedges sent in the
        # current one-second window; a guess fits while hedges are at most a tenth of the calls.
        self._window_start = 0.0
        self._window_calls = 0
        self._window_hedges = 0

    def has(self, table: str) -> bool:
        with self._lock:
            return table in self._routes

    def pick(self, table: str, avoid: Sequence[int] = ()) -> Optional[Tuple[str, int, bool]]:
        """(address, group, probe) for the next call on ``table``, other than in the groups of
        ``avoid``; None when the map is not cached or no replica is left."""
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= 1.0:
                self._window_start, self._window_calls, self._window_hedges = now, 0, 0
            self._window_calls += 1
        return self._pick(table, avoid, serving_only=False)

    def _pick(self, table: str, avoid: Sequence[int],
              serving_only: bool) -> Optional[Tuple[str, int, bool]]:
        """pick's choice (with ``serving_only``, never a replica the map calls not serving)."""
        now = time.monotonic()
        with self._lock:
            routes = self._routes.get(table)
            if routes is None:
                return None
            usable = [r for r in routes.replicas if r.addresses and r.group not in avoid]
            tier = [
                r for r in usable
                if r.serving and r.suspect and not r.probing and now >= r.suspect_until
            ][:1]
            probe = bool(tier)
            if not tier:
                tier = [r for r in usable if r.serving and not r.suspect]
            if not tier and not serving_only:
                tier = usable
            if not tier:
                return None
            k = next(routes.counter) % sum(len(r.addresses) for r in tier)
            for r in tier:
                if k < len(r.addresses):
                    if probe:
                        r.probing = True
                    return r.addresses[k], r.group, probe
                k -= len(r.addresses)
        return None

    def hedge(self, table: str, group: int,
              avoid: Sequence[int]) -> Optional[Tuple[str, int, bool]]:
        """Where a call that ``group`` has not answered within the hedge delay goes too, other
        than in the groups of ``avoid`` (None: nowhere, and nothing changes); ``group`` is then
        suspect. A guess goes only to a replica that serves: a draining one may still hold the
        version before a swap, and its answer would go back a version; and only within the
        budget (about one call in ten over a second), so that a slow cluster is not sent double
        its load. Once ``group`` is known to have failed, a hedge is failover, and any replica
        will do, whatever the budget."""
        with self._lock:
            slow = self._find(table, group)
            failover = slow is not None and slow.suspect
            if not failover and self._window_hedges > self._window_calls // 10:
                return None
        picked = self._pick(table, avoid, serving_only=not failover)
        if picked is not None:
            with self._lock:
                self._window_hedges += 0 if failover else 1
            self.failed(table, group)
        return picked

    def replicated(self, table: str) -> Optional[bool]:
        """Whether ``table`` is on several replica groups, as its cached map says (None: no map
        cached)."""
        with self._lock:
            routes = self._routes.get(table)
            return None if routes is None else len(routes.replicas) > 1

    def others(self, table: str, avoid: Sequence[int]) -> bool:
        """Whether ``table`` has a replica with an address outside the groups of ``avoid``."""
        with self._lock:
            routes = self._routes.get(table)
            return routes is not None and any(
                r.addresses and r.group not in avoid for r in routes.replicas
            )

    def update(self, table: str, info: "TableInfo") -> None:
        with self._lock:
            old = self._routes.get(table)
            routes = _Routes(
                [_Replica(r.group, r.state == "serving", list(r.addresses)) for r in info.replicas],
                # Keep the position in the rotation, so refreshes do not all restart at rank 0.
                old.counter if old is not None else itertools.count(),
            )
            for r in routes.replicas:
                for o in old.replicas if old is not None else ():
                    if o.group == r.group:
                        r.suspect, r.suspect_until, r.probing = o.suspect, o.suspect_until, o.probing
            self._routes[table] = routes

    def succeeded(self, table: str, group: int) -> None:
        with self._lock:
            r = self._find(table, group)
            if r is not None:
                r.suspect = r.probing = False

    def failed(self, table: str, group: int) -> None:
        with self._lock:
            r = self._find(table, group)
            if r is not None:
                r.suspect, r.probing = True, False
                r.suspect_until = time.monotonic() + self._cooldown

    def abandoned(self, table: str, group: int, probe: bool) -> None:
        if probe:
            with self._lock:
                r = self._find(table, group)
                if r is not None:
                    r.probing = False

    def ended(self, table: str, group: int, probe: bool, error: Optional[Error],
              tried: List[int]) -> None:
        """A call's one attempt (not hedged) ended with ``error`` (None: an answer), and this is
        what it says of the group: UNAVAILABLE fails it (and adds it to ``tried``); the call's own
        deadline or cancellation says nothing (a probe is given back); anything else - an answer,
        or an error of the request's own - means the group answered."""
        if isinstance(error, UnavailableError):
            self.failed(table, group)
            tried.append(group)
        elif isinstance(error, (DeadlineExceededError, CancelledError)):
            self.abandoned(table, group, probe)
        else:
            self.succeeded(table, group)

    def decides(self, table: str, group: int, error: Optional[Error], tried: List[int]) -> bool:
        """One attempt of a hedged call ended with ``error`` (None: an answer): whether it decides
        the call. UNAVAILABLE fails the group (added to ``tried``) and does not - another attempt
        may still answer; anything else means the group answered, and does."""
        if isinstance(error, UnavailableError):
            self.failed(table, group)
            tried.append(group)
            return False
        self.succeeded(table, group)
        return True

    def forget(self, table: str) -> None:
        with self._lock:
            self._routes.pop(table, None)

    def _find(self, table: str, group: int) -> Optional["_Replica"]:
        routes = self._routes.get(table)
        for r in routes.replicas if routes is not None else ():
            if r.group == group:
                return r
        return None


@dataclass
class _Replica:
    group: int
    serving: bool
    addresses: List[str]
    suspect: bool = False
    suspect_until: float = 0.0
    probing: bool = False


@dataclass
class _Routes:
    replicas: List[_Replica]
    counter: "itertools.count[int]"


# --- table descriptions -----------------------------------------------------------------------

_KIND_NAMES = {1: "linear", 2: "embedding"}
_KIND_NUMBERS = {"linear": 1, "embedding": 2}
_STATE_NAMES = {
    0: "unspecified",
    1: "loading",
    2: "serving",
    3: "unavailable",
    4: "failed",
    5: "draining",
}


@dataclass(frozen=True)
class ShardInfo:
    """One chunk of a table: the rank that holds it, where, and which slice of the sharding dim."""

    rank: int
    device: str
    address: str
    offset: int
    size: int


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica group's copy of a table: its state ("serving", ...), the generation its
    workers hold it by, and its shards (placement order)."""

    group: int
    state: str
    generation: int
    shards: Tuple[ShardInfo, ...]

    @property
    def addresses(self) -> List[str]:
        """The distinct worker addresses of this replica, in placement order."""
        seen: List[str] = []
        for shard in self.shards:
            if shard.address and shard.address not in seen:
                seen.append(shard.address)
        return seen


@dataclass(frozen=True)
class TableInfo:
    """A table as the cluster holds it (``DescribeTable`` / ``ListTables``).

    ``num_rows``/``num_cols`` are num_embeddings/embedding_dim for embeddings and
    out_features/in_features for linear layers. ``state`` is one of "loading", "serving",
    "unavailable", "failed" (then ``error`` says why, and ``error_code`` is its google.rpc.Code
    number). ``shards`` are in placement (chunk) order, one per placement (ranks without a
    placement hold nothing and are not listed). ``replicas`` lists each group that holds the
    table (``shards`` are the first serving replica's). ``proto`` is the ``shardserve.v1.TableInfo``
    message itself.
    """

    name: str
    kind: str
    num_rows: int
    num_cols: int
    sharding_dim: int
    placements: Tuple[str, ...]
    padding_idx: Optional[int]
    max_norm: Optional[float]
    norm_type: Optional[float]
    bias: bool
    seed: Optional[int]
    checkpoint: Optional[str]
    generation: int
    state: str
    error: str
    shards: Tuple[ShardInfo, ...]
    replicas: Tuple["ReplicaInfo", ...] = ()
    error_code: int = 0  # state "failed": the load error's google.rpc.Code number
    version: int = 0  # the serving version (1 on creation, one more per load_version)
    # The versions loaded, loading or last failed: {"version", "state" ("serving", "kept",
    # "loading", "failed"), "source", "error"}, in version order.
    versions: Tuple[Dict[str, Any], ...] = ()
    proto: Any = field(default=None, repr=False, compare=False)

    @property
    def addresses(self) -> List[str]:
        """The distinct worker addresses of the table, in placement order, replica by replica."""
        seen: List[str] = []
        for replica in self.replicas:
            for address in replica.addresses:
                if address not in seen:
                    seen.append(address)
        return seen


def _shards(shards: Any) -> Tuple[ShardInfo, ...]:
    return tuple(ShardInfo(s.rank, s.device, s.address, s.offset, s.size) for s in shards)


def table_info(message: Any) -> TableInfo:
    spec = message.spec
    init = spec.WhichOneof("init")
    return TableInfo(
        name=spec.name,
        kind=_KIND_NAMES.get(spec.kind, "unspecified"),
        num_rows=spec.num_rows,
        num_cols=spec.num_cols,
        sharding_dim=spec.sharding.dim,
        placements=tuple(spec.sharding.placements),
        padding_idx=spec.padding_idx if spec.HasField("padding_idx") else None,
        max_norm=spec.max_norm if spec.HasField("max_norm") else None,
        norm_type=spec.norm_type if spec.HasField("norm_type") else None,
        bias=spec.kind == 1 and not spec.no_bias,
        seed=spec.seed if init == "seed" else None,
        checkpoint=spec.checkpoint if init == "checkpoint" else None,
        generation=spec.generation,
        state=_STATE_NAMES.get(message.state, str(message.state)),
        error=message.error,
        shards=_shards(message.shards),
        replicas=tuple(
            ReplicaInfo(
                r.group, _STATE_NAMES.get(r.state, str(r.state)), r.generation, _shards(r.shards)
            )
            for r in message.replicas
        )
        # (A coordinator that knows no replicas: its one group.)
        or (ReplicaInfo(0, _STATE_NAMES.get(message.state, str(message.state)),
                        spec.generation, _shards(message.shards)),),
        error_code=message.error_code,
        version=spec.version,
        versions=tuple(
            {
                "version": v.version,
                "state": _VERSION_STATES.get(v.state, str(v.state)),
                "source": v.source,
                "error": v.error,
            }
            for v in message.versions
        ),
        proto=message,
    )


_VERSION_STATES = {1: "loading", 2: "serving", 3: "kept", 4: "failed"}


# TableInfo.state numbers a create waits on: LOADING, UNAVAILABLE.
WAITING_STATES = (1, 3)
FAILED_STATE = 4
# Below this many seconds left, a WaitTable would answer at once (the coordinator answers a
# margin, at least 50 ms, before the call's deadline): a create stops waiting.
LEAST_WAIT = 0.1


def raise_if_failed(message: Any) -> None:
    """A TableInfo message in state FAILED as the Error of its load error's code."""
    if message.state == FAILED_STATE:
        raise error_for_code(
            code_from_number(message.error_code),
            f'table "{message.spec.name}" could not be loaded: {message.error}',
        )


# --- table specs from tensors and modules -------------------------------------------------------


def default_checkpoint_dir() -> str:
    return os.environ.get("SHARDSERVE_CHECKPOINT_DIR") or os.path.join(
        tempfile.gettempdir(), "shardserve-checkpoints"
    )


def _module_fields(source: Any) -> Tuple[Optional[str], Dict[str, Any]]:
    """(kind, spec fields) of an nn.Embedding / nn.EmbeddingBag / nn.Linear, else (None, {})."""
    cls = type(source).__name__
    module = type(source).__module__
    if not module.startswith("torch.nn"):
        return None, {}
    if cls in ("Embedding", "EmbeddingBag"):
        return "embedding", {
            "weight": source.weight,
            "padding_idx": getattr(source, "padding_idx", None),
            "max_norm": source.max_norm,
            "norm_type": source.norm_type,
        }
    if cls == "Linear":
        return "linear", {"weight": source.weight, "bias": source.bias}
    return None, {}


def _array(value: Any, what: str) -> np.ndarray:
    from ._codec import to_numpy

    array, _ = to_numpy(value, what)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise InvalidArgumentError(f"{what}: floating values expected, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype="<f4")


def build_spec(
    pb: Any,
    name: str,
    source: Any,
    *,
    kind: Optional[str],
    bias: Any,
    num_rows: Optional[int],
    num_cols: Optional[int],
    seed: Optional[int],
    checkpoint: Optional[str],
    sharding_dim: int,
    placements: Optional[Sequence[str]],
    world: Optional[int],
    device: str,
    padding_idx: Optional[int],
    max_norm: Optional[float],
    norm_type: Optional[float],
    checkpoint_dir: Optional[str],
) -> Tuple[Any, Optional[str]]:
    """(TableSpec, path of the checkpoint written for it or None). See Client.create_table."""
    module_kind, fields = _module_fields(source) if source is not None else (None, {})
    if module_kind is not None:
        source = fields["weight"]
        kind = kind or module_kind
        if module_kind == "linear":
            if bias is None:
                bias = fields["bias"] if fields["bias"] is not None else False
        else:  # the module's own settings, unless given here
            if padding_idx is None:
                padding_idx = fields["padding_idx"]
            if max_norm is None:
                max_norm = fields["max_norm"]
                if norm_type is None and max_norm is not None:
                    norm_type = fields["norm_type"]
    kind = kind or "embedding"
    if kind not in _KIND_NUMBERS:
        raise InvalidArgumentError(f"kind: {kind!r} is not 'embedding' or 'linear'")
    if sum(x is not None for x in (source, seed, checkpoint)) != 1:
        raise InvalidArgumentError(
            "create_table: give exactly one of a weight (tensor, array or module), seed= or "
            "checkpoint="
        )
    if placements is not None and world is not None:
        raise InvalidArgumentError("placements and world both place the chunks: give one of them")

    spec = pb.TableSpec(name=name, kind=_KIND_NUMBERS[kind], dtype=pb.FLOAT32)
    spec.sharding.dim = sharding_dim
    if placements is None and world is not None:
        placements = [f"rank:{r}/{device}" for r in range(world)]
    spec.sharding.placements.extend(placements or ())
    if padding_idx is not None:
        spec.padding_idx = int(padding_idx)
    if max_norm is not None:
        spec.max_norm = float(max_norm)
        if norm_type is not None:
            spec.norm_type = float(norm_type)

    written = None
    if source is not None:
        weight = _array(source, "weight")
        if weight.ndim != 2:
            raise InvalidArgumentError(f"weight: 2-D expected, got shape {list(weight.shape)}")
        spec.num_rows, spec.num_cols = weight.shape
        tensors = {"weight": weight}
        if kind == "linear":
            if bias is not None and bias is not False:
                b = _array(bias, "bias")
                if b.shape != (weight.shape[0],):
                    raise InvalidArgumentError(
                        f"bias: shape [{weight.shape[0]}] expected, got {list(b.shape)}"
                    )
                tensors["bias"] = b
            else:
                spec.no_bias = True
        directory = checkpoint_dir or default_checkpoint_dir()
        os.makedirs(directory, exist_ok=True)
        # A fresh name per table creation: the old file may still back a table of the same name
        # (a worker that restarts reloads its shard from it).
        written = os.path.abspath(
            os.path.join(directory, f"{name}-{uuid.uuid4().hex[:12]}.safetensors")
        )
        _safetensors.write(written, tensors)
        spec.checkpoint = written
    else:
        if num_rows is None or num_cols is None:
            raise InvalidArgumentError("create_table with seed= or checkpoint= needs rows, cols")
        spec.num_rows, spec.num_cols = int(num_rows), int(num_cols)
        if kind == "linear" and bias is False:
            spec.no_bias = True
        if seed is not None:
            spec.seed = int(seed)
        else:
            spec.checkpoint = os.path.abspath(checkpoint)
    return spec, written


class ExportAssembly:
    """The file an ExportTableStream sends, put together from its chunks: each must continue the
    file where the last ended, within the size the first announced."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.buf: Optional[bytearray] = None
        self.written = 0

    def add(self, chunk: Any) -> None:
        data = chunk.data
        if self.buf is None:
            self.buf = bytearray(chunk.file_bytes)
        if (chunk.offset != self.written or chunk.file_bytes != len(self.buf)
                or self.written + len(data) > len(self.buf)):
            raise InternalError(
                f"export of {self.table!r}: a chunk of {len(data)} bytes at offset "
                f"{chunk.offset} of {chunk.file_bytes} after {self.written} bytes"
            )
        self.buf[self.written : self.written + len(data)] = data
        self.written += len(data)

    def finish(self) -> bytearray:
        if self.buf is None or self.written != len(self.buf):
            total = 0 if self.buf is None else len(self.buf)
            raise InternalError(
                f"export of {self.table!r}: the stream ended after {self.written} of {total} bytes"
            )
        return self.buf


def check_export_target(path: Optional[str]) -> None:
    """Refuses, before anything is streamed, a ``path`` an export may not write here: in a
    directory that does not exist, or over anything but a regular file (a FIFO would block)."""
    if path is None:
        return
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise InvalidArgumentError(f"path {path!r}: directory {directory!r} does not exist")
    if os.path.exists(target) and not os.path.isfile(target):
        raise InvalidArgumentError(f"path {path!r}: exists and is not a regular file")


def finish_export(table: str, buf: bytearray, path: Optional[str]) -> Dict[str, np.ndarray]:
    """The tensors of an exported file (views into ``buf``), written to ``path`` here first if
    given."""
    if path is not None:
        _safetensors.write_bytes(os.path.abspath(path), buf)
    return _safetensors.parse(buf, f"export of {table!r}")
