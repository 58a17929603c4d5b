"""Just enough of the safetensors format for checkpoints and exports: F32 tensors, written
atomically, read back with one read into memory that numpy owns.

Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON
header ``{"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...}`` (padded with spaces to
a multiple of 8 bytes, so the data is aligned), then the raw little-endian data.
"""

import json
import os
import struct
import tempfile
from typing import Any, Dict, Mapping, Sequence

import numpy as np

from .errors import InternalError

_DTYPES = {"F32": np.dtype("<f4"), "I64": np.dtype("<i8")}
_NAMES = {v: k for k, v in _DTYPES.items()}


def write(path: str, tensors: Mapping[str, np.ndarray]) -> None:
    """Writes ``tensors`` to ``path`` (a temporary file in the same directory, renamed into place,
    so a reader never sees half a file). Arrays must be F32 or I64."""
    header: Dict[str, object] = {}
    arrays = []
    offset = 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = _NAMES.get(array.dtype.newbyteorder("<"))
        if dtype is None:
            raise ValueError(f"safetensors: {name}: dtype {array.dtype} not supported")
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        arrays.append(array)
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    pieces = [struct.pack("<Q", len(text)), text]
    pieces += [memoryview(array.reshape(-1)).cast("B") for array in arrays]
    _write_atomically(path, pieces)


def write_bytes(path: str, data: bytes) -> None:
    """Writes a whole file's bytes (an export streamed from the coordinator) to ``path``, as
    :func:`write` does: never half a file. Refuses a path that is anything but a regular file."""
    if os.path.exists(path) and not os.path.isfile(path):
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"path {path!r}: exists and is not a regular file")
    _write_atomically(path, [data])


def _write_atomically(path: str, pieces: Sequence[Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".shardserve-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
        os.chmod(tmp, 0o644)  # workers (maybe other users) read it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read(path: str) -> Dict[str, np.ndarray]:
    """Every tensor of the file at ``path``, as writable arrays over one buffer read at once."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got != size:
        raise InternalError(f"safetensors file {path!r}: {got} of {size} bytes read")
    return parse(buf, f"safetensors file {path!r}")


def parse(buf: bytearray, what: str) -> Dict[str, np.ndarray]:
    """Every tensor of a safetensors file held in ``buf``, as writable arrays over it. ``what``
    names the file in errors."""
    size = len(buf)
    if size < 8:
        raise InternalError(f"{what}: {size} bytes, too short for a safetensors file")
    (header_len,) = struct.unpack_from("<Q", buf, 0)
    if header_len > size - 8:
        raise InternalError(f"{what}: header length {header_len} too large")
    header = json.loads(bytes(buf[8 : 8 + header_len]).decode("utf-8"))
    base = 8 + header_len
    out: Dict[str, np.ndarray] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise InternalError(f"{what}: {name}: dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        shape = tuple(int(d) for d in entry["shape"])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != count * dtype.itemsize or base + end > size:
            raise InternalError(f"{what}: {name}: bad data_offsets")
        out[name] = np.frombuffer(buf, dtype=dtype, count=count, offset=base + begin).reshape(
            shape
        )
    return out
