"""The hand-written wire codec (shardserve/_codec.py) against the generated protobuf classes:
what it writes parses as the same message, what protobuf writes (or any valid encoding) it
reads, and a malformed answer is an INTERNAL error, never a wrong array."""

import numpy as np
import pytest

import shardserve
from shardserve import _codec, _stubs

pb, _ = _stubs.load()
rng = np.random.default_rng(42)


def tensor(message):
    dtype = {pb.FLOAT32: np.float32, pb.INT64: np.int64}[message.dtype]
    return np.frombuffer(message.data, dtype=dtype).reshape(tuple(message.shape))


@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (2, 0, 5), (2, 3, 4)])
def test_embedding_request_parses_as_protobuf(shape):
    ids = rng.integers(-(2**62), 2**62, size=shape, dtype=np.int64)
    msg = pb.EmbeddingRequest.FromString(_codec.encode_embedding("tablé", ids))
    assert msg.table == "tablé"
    assert msg.ids.dtype == pb.INT64
    assert tuple(msg.ids.shape) == shape
    np.testing.assert_array_equal(tensor(msg.ids), ids)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("last", [False, True])
def test_embedding_bag_request_parses_as_protobuf(mode, last):
    ids = rng.integers(0, 1000, size=300, dtype=np.int64)
    offsets = np.array([0, 5, 5, 299], dtype=np.int64)
    weights = rng.random(300, dtype=np.float32)
    raw = _codec.encode_embedding_bag("t", ids, offsets, weights, _codec.pool_mode(mode), last)
    msg = pb.EmbeddingBagRequest.FromString(raw)
    assert msg.mode == {"sum": pb.POOL_MODE_SUM, "mean": pb.POOL_MODE_MEAN,
                        "max": pb.POOL_MODE_MAX}[mode]
    assert msg.include_last_offset == last
    np.testing.assert_array_equal(tensor(msg.ids), ids)
    np.testing.assert_array_equal(tensor(msg.offsets), offsets)
    np.testing.assert_array_equal(tensor(msg.per_sample_weights), weights)
    bare = pb.EmbeddingBagRequest.FromString(
        _codec.encode_embedding_bag("t", ids.reshape(30, 10), None, None, 1, False))
    assert not bare.HasField("offsets") and not bare.HasField("per_sample_weights")


def test_linear_and_stream_requests_parse_as_protobuf():
    x = rng.standard_normal((5, 129)).astype(np.float32)
    inner = _codec.encode_linear("lin", x)
    msg = pb.StreamRequest.FromString(
        _codec.encode_stream_request(2**40 + 3, _codec.STREAM_LINEAR, inner))
    assert msg.id == 2**40 + 3 and msg.WhichOneof("op") == "linear"
    assert msg.linear.table == "lin"
    np.testing.assert_array_equal(tensor(msg.linear.input), x)
    for field, op in ((_codec.STREAM_EMBEDDING, "embedding"),
                      (_codec.STREAM_EMBEDDING_BAG, "embedding_bag")):
        ids = np.arange(6, dtype=np.int64).reshape(2, 3)
        inner = (_codec.encode_embedding("e", ids) if op == "embedding" else
                 _codec.encode_embedding_bag("e", ids, None, None, 2, False))
        msg = pb.StreamRequest.FromString(_codec.encode_stream_request(1, field, inner))
        assert msg.WhichOneof("op") == op


@pytest.mark.parametrize("shape", [(0, 16), (1,), (3, 7), (2, 3, 128)])
def test_decodes_protobuf_answers(shape):
    values = rng.standard_normal(shape).astype(np.float32)
    msg = pb.TensorResponse()
    msg.output.dtype = pb.FLOAT32
    msg.output.shape.extend(shape)
    msg.output.data = values.tobytes()
    out = _codec.decode_tensor_response(msg.SerializeToString())
    assert out.shape == shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, values)
    stream = pb.StreamResponse(id=77, output=msg.output)
    rid, code, message, arr = _codec.decode_stream_response(stream.SerializeToString())
    assert (rid, code, message) == (77, 0, "")
    np.testing.assert_array_equal(arr, values)


def test_decodes_any_valid_encoding():
    """Fields in another order, an unpacked shape, unknown fields of every wire type."""
    values = np.arange(6, dtype=np.float32)
    data = values.tobytes()
    t = (b"\x1a" + bytes([len(data)]) + data  # data first
         + b"\x10\x02\x10\x03"  # shape unpacked: 2, 3
         + b"\x08\x01"  # dtype FLOAT32
         + b"\x28\x05" + b"\x31" + b"\0" * 8 + b"\x3d" + b"\0" * 4 + b"\x42\x02hi")  # unknowns
    raw = b"\x10\x07" + b"\x0a" + bytes([len(t)]) + t
    out = _codec.decode_tensor_response(raw)
    np.testing.assert_array_equal(out, values.reshape(2, 3))


def test_decoded_answer_is_a_writable_view_that_keeps_the_message_alive():
    values = np.arange(12, dtype=np.float32)
    msg = pb.TensorResponse()
    msg.output.dtype = pb.FLOAT32
    msg.output.shape.extend([3, 4])
    msg.output.data = values.tobytes()
    raw = msg.SerializeToString()
    out = _codec.decode_tensor_response(raw)
    assert out.flags.writeable and not out.flags.owndata
    address = out.__array_interface__["data"][0]
    start = np.frombuffer(raw, np.uint8).__array_interface__["data"][0]
    assert start <= address < start + len(raw)  # a view of the received bytes: no copy
    del raw, msg
    np.testing.assert_array_equal(out, values.reshape(3, 4))


def test_stream_error_answer():
    raw = pb.StreamResponse(id=5, code=5, message='table "x" not found').SerializeToString()
    assert _codec.decode_stream_response(raw) == (5, 5, 'table "x" not found', None)
    err = shardserve.errors.error_for_code(shardserve.errors.code_from_number(5), "m")
    assert isinstance(err, shardserve.NotFoundError)


@pytest.mark.parametrize("raw", [
    b"\x0a\x05\x08\x01\x12\x01",  # cut short
    b"\x0a\x04\x08\x02\x12\x00",  # INT64 output
    b"\x0a\x09\x08\x01\x12\x01\x04\x1a\x02ab",  # 2 bytes for 4 floats
    b"\x0a\x02\x08\x01\x0b",  # wire type 3 (groups): not ours
    b"",  # no output
])
def test_malformed_answers_are_internal_errors(raw):
    with pytest.raises(shardserve.InternalError) as e:
        _codec.decode_tensor_response(raw)
    assert e.value.code.name == "INTERNAL"


def test_inputs_of_the_wrong_kind_are_refused_before_sending():
    with pytest.raises(shardserve.InvalidArgumentError):
        _codec.as_ids(np.array([1.5]), "ids")
    with pytest.raises(shardserve.InvalidArgumentError):
        _codec.as_ids(np.array([True]), "ids")
    with pytest.raises(shardserve.InvalidArgumentError):
        _codec.as_floats(np.array(["a"]), "input")
    with pytest.raises(shardserve.InvalidArgumentError):
        _codec.as_ids(object(), "ids")
    with pytest.raises(shardserve.InvalidArgumentError) as e:
        _codec.pool_mode("median")
    assert "median" in e.value.message
    big_endian = np.arange(4, dtype=">i8")
    np.testing.assert_array_equal(_codec.as_ids(big_endian, "ids")[0], np.arange(4))
