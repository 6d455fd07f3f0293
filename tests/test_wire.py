"""The wire codec: CBOR maps with a type and a version, tensors as raw bytes with dtype and shape."""

from __future__ import annotations

import cbor2
import pytest

from swarm import wire
from swarm.errors import ProtocolError

torch = pytest.importorskip("torch")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def test_map_round_trip_adds_the_version():
    msg = {"t": "forward", "request": 7, "tokens": [1, 2, 3], "text": "héllo", "blob": b"\x00\xff",
           "nested": {"a": None}}
    data = wire.encode(msg)
    out = wire.decode(data)
    assert out == {**msg, "v": wire.PROTOCOL_VERSION}
    assert "v" not in msg  # the caller's map is left alone


@pytest.mark.parametrize("msg", [{}, {"t": ""}, {"t": 3}, {"type": "x"}])
def test_encode_needs_a_type(msg):
    with pytest.raises(ProtocolError, match="'t'"):
        wire.encode(msg)


def test_encode_refuses_values_cbor_cannot_carry():
    with pytest.raises(ProtocolError, match="CBOR"):
        wire.encode({"t": "x", "obj": object()})


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "not a CBOR"),
        (b"\xff\xfe garbage", "not a CBOR"),
        (cbor2.dumps([1, 2, 3]), "map"),
        (cbor2.dumps("t"), "map"),
        (cbor2.dumps({"v": 1}), "'t'"),
        (cbor2.dumps({"t": 5, "v": 1}), "'t'"),
        (cbor2.dumps({"t": "x"}), "version"),
        (cbor2.dumps({"t": "x", "v": True}), "version"),
        (cbor2.dumps({"t": "x", "v": 2}), "version 2"),
    ],
)
def test_decode_refuses_what_is_not_a_message(data, words):
    with pytest.raises(ProtocolError, match=words):
        wire.decode(data)


def test_unknown_tags_stay_inert_data():
    # A tag swarm does not know must not reach any hook that builds objects: it comes back as a plain CBORTag.
    data = cbor2.dumps({"t": "x", "v": 1, "odd": cbor2.CBORTag(4242, b"payload")})
    msg = wire.decode(data)
    assert isinstance(msg["odd"], cbor2.CBORTag) and msg["odd"].value == b"payload"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_round_trip(dtype):
    source = (torch.randn(2, 3, 5) * 1000).to(dtype)[:, :, ::2]  # not contiguous on purpose
    msg = wire.decode(wire.encode({"t": "hidden", "x": wire.tensor_to_wire(source)}))
    assert msg["x"]["dtype"] == str(dtype).removeprefix("torch.")
    assert msg["x"]["shape"] == [2, 3, 3]
    out = wire.tensor_from_wire(msg["x"])
    assert out.dtype == dtype and out.shape == source.shape
    assert torch.equal(out, source)
    out += 1  # the caller owns a writable tensor


def test_empty_and_scalar_tensors():
    for t in (torch.zeros(0, 4), torch.tensor(3.5), torch.tensor([7], dtype=torch.int64)):
        assert torch.equal(wire.tensor_from_wire(wire.tensor_to_wire(t)), t)


def test_tensor_of_other_dtype_cannot_travel():
    with pytest.raises(ProtocolError, match="float64"):
        wire.tensor_to_wire(torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"dtype": "float32", "shape": [2, 3], "data": b"\x00" * 23}, "needs 24 bytes"),
        ({"dtype": "bfloat16", "shape": [4], "data": b"\x00" * 10}, "needs 8 bytes"),
        ({"dtype": "float64", "shape": [1], "data": b"\x00" * 8}, "not accepted"),
        ({"dtype": "object", "shape": [1], "data": b"\x00" * 8}, "not accepted"),
        ({"dtype": "int32", "shape": [-1], "data": b""}, "shape"),
        ({"dtype": "int32", "shape": "4", "data": b"\x00" * 16}, "shape"),
        ({"dtype": "int32", "shape": [True], "data": b"\x00" * 4}, "shape"),
        ({"dtype": "int32", "shape": [1], "data": "abcd"}, "byte string"),
        ({"dtype": "float32", "shape": [1 << 20, 1 << 20], "data": b""}, "more than a message"),
        ([1, 2], "map"),
    ],
)
def test_bad_tensors_are_refused(bad, words):
    with pytest.raises(ProtocolError, match=words):
        wire.tensor_from_wire(bad)


def test_huge_integers_anywhere_are_a_protocol_error_not_a_value_error():
    """A CBOR bignum of 5000 digits in the type or version field used to escape as ValueError (Python refuses to
    print such an int) instead of the ProtocolError every reader handles."""
    import cbor2

    from swarm.errors import ProtocolError

    huge = 10**5000
    for message in ({"t": huge, "v": 1}, {"t": "x", "v": huge}, {"t": "x" * 10_000, "v": 1}):
        with pytest.raises(ProtocolError):
            wire.decode(cbor2.dumps(message))
    with pytest.raises(ProtocolError):
        wire.parse({"t": huge})
    with pytest.raises(ProtocolError):
        wire.tensor_from_wire({"dtype": "float32", "shape": [huge], "data": b""})
    with pytest.raises(ProtocolError):
        wire.tensor_from_wire({"dtype": huge, "shape": [1], "data": b""})
