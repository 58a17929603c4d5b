"""The data path's wire codec and tensor conversions (numpy / torch in, the same kind out).

Data calls (Embedding, EmbeddingBag, Linear, Stream) go over gRPC as raw bytes that this module
writes and reads itself, instead of through the generated protobuf classes:

- a request is written once, straight from the input array's memory (``b"".join`` over a
  memoryview: one copy into the message, none into an intermediate ``bytes`` or protobuf field);
- an answer's float rows are not copied at all: the array returned is a view of the received
  message (``np.frombuffer`` over the bytes gRPC hands back; ``torch.from_numpy`` of that view).

The layouts are those of ``proto/shardserve.proto`` (checked against the generated classes in
``tests/test_codec.py``). The decoder accepts any valid encoding of the answer messages (fields in
any order, unknown fields skipped, packed or unpacked shapes), not just the servers' own.
"""

import sys
from typing import Any, List, Optional, Tuple

import numpy as np

from .errors import InternalError, InvalidArgumentError

# proto enums (shardserve.v1.DType, PoolMode).
DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
POOL_MODES = {"sum": 1, "max": 2, "mean": 3}

# StreamRequest's oneof field numbers.
STREAM_EMBEDDING = 2
STREAM_EMBEDDING_BAG = 3
STREAM_LINEAR = 4

_SMALL_VARINTS = tuple(bytes((n,)) for n in range(128))


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL_VARINTS[n]
    if n < 0:  # int64 / int32 negatives take ten bytes, as two's complement
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(tag: int, parts: List[Any], size: int) -> Tuple[List[Any], int]:
    """A length-delimited field (tag byte, length, the parts): parts list and byte size."""
    header = bytes((tag,)) + _varint(size)
    return [header] + parts, len(header) + size


def _tensor_parts(dtype: int, array: np.ndarray) -> Tuple[List[Any], int]:
    """A ``Tensor`` message as byte parts (the data part is the array's own memory)."""
    parts: List[Any] = [b"\x08" + _varint(dtype)]
    size = len(parts[0])
    if array.ndim:
        dims = b"".join(_varint(d) for d in array.shape)
        parts.append(b"\x12" + _varint(len(dims)) + dims)
        size += len(parts[-1])
    if array.nbytes:  # proto3 leaves empty bytes out
        header = b"\x1a" + _varint(array.nbytes)
        parts.append(header)
        parts.append(memoryview(array.reshape(-1)).cast("B"))
        size += len(header) + array.nbytes
    return parts, size


def _table_part(table: str) -> bytes:
    name = table.encode("utf-8")
    return b"\x0a" + _varint(len(name)) + name


def _version_part(key: int, version: int) -> List[bytes]:
    """A pinned table version (``version``, a uint64 field); nothing for 0 (the latest)."""
    return [bytes((key,)) + _varint(version)] if version else []


def encode_embedding(table: str, ids: np.ndarray, version: int = 0) -> bytes:
    """``EmbeddingRequest{table, ids, version}``."""
    parts, size = _tensor_parts(DTYPE_INT64, ids)
    field, _ = _len_field(0x12, parts, size)
    return b"".join([_table_part(table)] + field + _version_part(0x18, version))


def encode_embedding_bag(
    table: str,
    ids: np.ndarray,
    offsets: Optional[np.ndarray],
    per_sample_weights: Optional[np.ndarray],
    mode: int,
    include_last_offset: bool,
    version: int = 0,
) -> bytes:
    """``EmbeddingBagRequest``: table, ids, offsets, per_sample_weights, mode,
    include_last_offset and version."""
    out: List[Any] = [_table_part(table)]
    for tag, dtype, array in (
        (0x12, DTYPE_INT64, ids),
        (0x1A, DTYPE_INT64, offsets),
        (0x22, DTYPE_FLOAT32, per_sample_weights),
    ):
        if array is not None:
            parts, size = _tensor_parts(dtype, array)
            out += _len_field(tag, parts, size)[0]
    if mode:
        out.append(b"\x28" + _varint(mode))
    if include_last_offset:
        out.append(b"\x30\x01")
    out += _version_part(0x38, version)
    return b"".join(out)


def encode_linear(table: str, inputs: np.ndarray, version: int = 0) -> bytes:
    """``LinearRequest{table, input, version}``."""
    parts, size = _tensor_parts(DTYPE_FLOAT32, inputs)
    field, _ = _len_field(0x12, parts, size)
    return b"".join([_table_part(table)] + field + _version_part(0x18, version))


def encode_update_rows(
    table: str, ids: np.ndarray, values: np.ndarray, op: int, bias: Optional[np.ndarray]
) -> bytes:
    """``UpdateRowsRequest{table, ids, values, bias, op}``."""
    out: List[Any] = [_table_part(table)]
    for tag, dtype, array in ((0x12, DTYPE_INT64, ids), (0x1A, DTYPE_FLOAT32, values),
                              (0x22, DTYPE_FLOAT32, bias)):
        if array is not None:
            parts, size = _tensor_parts(dtype, array)
            out += _len_field(tag, parts, size)[0]
    out.append(b"\x28" + _varint(op))
    return b"".join(out)


def decode_update_response(buf: bytes) -> Tuple[int, int]:
    """``UpdateRowsResponse``: (version, sequence)."""
    version = sequence = 0
    try:
        pos, end = 0, len(buf)
        while pos < end:
            key, pos = _read_varint(buf, pos)
            if key == 0x08:
                version, pos = _read_varint(buf, pos)
            elif key == 0x10:
                sequence, pos = _read_varint(buf, pos)
            else:
                pos = _skip(buf, pos, key & 7)
    except IndexError:
        raise InternalError("malformed answer: cut short") from None
    return version, sequence


def encode_stream_request(request_id: int, op_field: int, request: bytes) -> bytes:
    """``StreamRequest{id, <op>}`` around an encoded Embedding/EmbeddingBag/Linear request."""
    return b"".join(
        (b"\x08", _varint(request_id), bytes((op_field << 3 | 2,)), _varint(len(request)), request)
    )


# --- decoding -------------------------------------------------------------------------------


def _read_varint(buf: bytes, pos: int) -> Tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    result = b & 0x7F
    shift = 7
    while True:
        pos += 1
        b = buf[pos]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos + 1
        shift += 7
        if shift > 63:
            raise InternalError("malformed answer: varint over 10 bytes")


def _skip(buf: bytes, pos: int, wire: int) -> int:
    if wire == 0:
        return _read_varint(buf, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        n, pos = _read_varint(buf, pos)
        return pos + n
    if wire == 5:
        return pos + 4
    raise InternalError(f"malformed answer: wire type {wire}")


def _parse_tensor(buf: bytes, pos: int, end: int) -> Tuple[int, List[int], int, int]:
    """A ``Tensor`` in buf[pos:end]: (dtype, shape, data offset in buf, data length)."""
    dtype = 0
    shape: List[int] = []
    data_at = data_len = 0
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 1 and wire == 0:
            dtype, pos = _read_varint(buf, pos)
        elif field == 2 and wire == 2:  # packed shape
            n, pos = _read_varint(buf, pos)
            stop = pos + n
            while pos < stop:
                d, pos = _read_varint(buf, pos)
                shape.append(d - (1 << 64) if d >= 1 << 63 else d)
        elif field == 2 and wire == 0:  # unpacked shape (also valid protobuf)
            d, pos = _read_varint(buf, pos)
            shape.append(d - (1 << 64) if d >= 1 << 63 else d)
        elif field == 3 and wire == 2:
            data_len, pos = _read_varint(buf, pos)
            data_at = pos
            pos += data_len
        else:
            pos = _skip(buf, pos, wire)
    if pos != end:
        raise InternalError("malformed answer: a tensor runs past its message")
    return dtype, shape, data_at, data_len


class _ReceivedRows:
    """Lends a region of a received answer to numpy as a writable array.

    gRPC hands an answer over as an immutable ``bytes`` object that nothing else refers to; the
    array made from this holder keeps it alive (as its ``base``) and may be written in place, as
    the result of ``F.embedding`` may. numpy refuses to make a writable array from ``bytes``
    directly (``np.frombuffer`` gives a read-only one), hence the array-interface holder.
    """

    __slots__ = ("__array_interface__", "_owner")

    def __init__(self, interface: dict, owner: bytes) -> None:
        self.__array_interface__ = interface
        self._owner = owner


def _float_view(buf: bytes, shape: List[int], data_at: int, data_len: int) -> np.ndarray:
    count = 1
    for d in shape:
        if d < 0:
            raise InternalError(f"answer tensor has a negative dimension: {shape}")
        count *= d
    if data_len != count * 4 or data_at + data_len > len(buf):
        raise InternalError(
            f"answer tensor does not match its shape: {data_len} bytes for shape {shape}"
        )
    if count == 0:
        return np.zeros(shape, dtype=np.float32)
    view = np.frombuffer(buf, dtype="<f4", count=count, offset=data_at)
    interface = dict(view.__array_interface__)
    interface["data"] = (interface["data"][0], False)
    interface["shape"] = tuple(shape)
    return np.asarray(_ReceivedRows(interface, buf))


def decode_tensor_response(buf: bytes) -> np.ndarray:
    """The float32 output of a ``TensorResponse``, as a zero-copy view of ``buf``."""
    try:
        pos, end = 0, len(buf)
        found = None
        while pos < end:
            key, pos = _read_varint(buf, pos)
            if key == 0x0A:
                n, pos = _read_varint(buf, pos)
                found = _parse_tensor(buf, pos, pos + n)
                pos += n
            else:
                pos = _skip(buf, pos, key & 7)
    except IndexError:
        raise InternalError("malformed answer: cut short") from None
    if found is None:
        raise InternalError("answer has no output tensor")
    dtype, shape, data_at, data_len = found
    if dtype != DTYPE_FLOAT32:
        raise InternalError(f"answer tensor has dtype {dtype}, not FLOAT32")
    return _float_view(buf, shape, data_at, data_len)


def response_version(buf: bytes) -> int:
    """The table version a ``TensorResponse`` says its answer came from (0: not said)."""
    try:
        pos, end = 0, len(buf)
        while pos < end:
            key, pos = _read_varint(buf, pos)
            if key == 0x10:
                return _read_varint(buf, pos)[0]
            pos = _skip(buf, pos, key & 7)
    except IndexError:
        raise InternalError("malformed answer: cut short") from None
    return 0


def decode_stream_response(buf: bytes) -> Tuple[int, int, str, Optional[np.ndarray]]:
    """A ``StreamResponse``: (id, code, message, output or None when code != 0)."""
    request_id = code = 0
    message = ""
    found = None
    try:
        pos, end = 0, len(buf)
        while pos < end:
            key, pos = _read_varint(buf, pos)
            if key == 0x08:
                request_id, pos = _read_varint(buf, pos)
            elif key == 0x12:
                n, pos = _read_varint(buf, pos)
                found = _parse_tensor(buf, pos, pos + n)
                pos += n
            elif key == 0x18:
                code, pos = _read_varint(buf, pos)
                if code >= 1 << 63:
                    code -= 1 << 64
            elif key == 0x22:
                n, pos = _read_varint(buf, pos)
                message = bytes(buf[pos : pos + n]).decode("utf-8", "replace")
                pos += n
            else:
                pos = _skip(buf, pos, key & 7)
    except IndexError:
        raise InternalError("malformed stream answer: cut short") from None
    if code != 0:
        return request_id, code, message, None
    if found is None:
        raise InternalError(f"stream answer {request_id} has no output tensor")
    dtype, shape, data_at, data_len = found
    if dtype != DTYPE_FLOAT32:
        raise InternalError(f"answer tensor has dtype {dtype}, not FLOAT32")
    return request_id, 0, "", _float_view(buf, shape, data_at, data_len)


# --- numpy / torch inputs and outputs ----------------------------------------------------------


class Kind:
    """What the caller passed (and so gets back): numpy, or torch on some device."""

    __slots__ = ("torch_device",)

    def __init__(self, torch_device: Any = None) -> None:
        self.torch_device = torch_device  # None: numpy

    def wrap(self, array: np.ndarray) -> Any:
        if self.torch_device is None:
            return array
        import torch  # already imported: the caller passed a tensor

        tensor = torch.from_numpy(array)
        if self.torch_device.type != "cpu":
            tensor = tensor.to(self.torch_device)
        return tensor


NUMPY = Kind()


def _torch_tensor_type() -> Any:
    # torch is looked up, never imported: a caller who passed a tensor has imported it already,
    # and the numpy-only path must not pay for (or need) the import.
    module = sys.modules.get("torch")
    return getattr(module, "Tensor", None) if module is not None else None


def to_numpy(value: Any, what: str) -> Tuple[np.ndarray, Optional[Any]]:
    """(numpy view or array, torch device or None) of a numpy array, torch tensor or sequence."""
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and isinstance(value, tensor_type):
        device = value.device
        value = value.detach()
        if device.type != "cpu":
            value = value.cpu()
        return value.contiguous().numpy(), device
    if isinstance(value, np.ndarray):
        return value, None
    if isinstance(value, (list, tuple, int, float)) or np.isscalar(value):
        array = np.asarray(value)
        if array.size == 0 and array.dtype == np.float64:
            array = array.astype(np.int64)  # [] has no dtype of its own; take it as ids
        return array, None
    raise InvalidArgumentError(
        f"{what}: expected a numpy array, a torch tensor or a sequence, got {type(value).__name__}"
    )


def as_ids(value: Any, what: str) -> Tuple[np.ndarray, Optional[Any]]:
    """Contiguous int64 ids (as F.embedding takes: any integer dtype; not floats or bools)."""
    array, device = to_numpy(value, what)
    if array.dtype != np.int64:
        if not np.issubdtype(array.dtype, np.integer):
            raise InvalidArgumentError(f"{what}: integer ids expected, got dtype {array.dtype}")
        array = array.astype(np.int64)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype("<i8")
    return array, device


def as_floats(value: Any, what: str) -> Tuple[np.ndarray, Optional[Any]]:
    """Contiguous float32 values (any floating dtype is converted; the weights are fp32)."""
    array, device = to_numpy(value, what)
    if array.dtype != np.float32:
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise InvalidArgumentError(f"{what}: floating values expected, got dtype {array.dtype}")
        array = array.astype(np.float32)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype("<f4")
    return array, device


def pool_mode(mode: str) -> int:
    """PoolMode number of F.embedding_bag's mode string."""
    try:
        return POOL_MODES[mode]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"mode: {mode!r} is not one of 'sum', 'mean', 'max'"
        ) from None
