"""The wire message codec: every message between swarm processes is a CBOR map with a type and a protocol version.

``{"t": "forward", "v": 1, ...}`` — ``t`` names the message, ``v`` is the sender's protocol version. Only the major
version is compared: a peer of another version is refused with a message that says to upgrade, instead of being
misread. Tensors travel as raw bytes with dtype and shape (see :func:`tensor_to_wire`); nothing received is ever
unpickled or given to ``torch.load`` — cbor2 decodes plain data only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import cbor2

from swarm.errors import ProtocolError

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1

# dtype name on the wire -> bytes per element. Only these: they are what stages compute in and what token ids are.
# A name outside this table is refused before any torch call sees it.
_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}

# 256 MiB, the tunnel's message cap (swarm.tunnel.noise.MAX_MESSAGE_SIZE): a bigger tensor could not have arrived.
_MAX_TENSOR_BYTES = 256 * 1024 * 1024
_MAX_DIMS = 8


def encode(msg: Mapping[str, Any]) -> bytes:
    """CBOR bytes of ``msg`` with the protocol version added; ``msg["t"]`` names the message type."""
    t = msg.get("t")
    if not isinstance(t, str) or not t:
        raise ProtocolError(f"a wire message needs a type in key 't' (a non-empty string), got {t!r}")
    try:
        return cbor2.dumps({**msg, "v": PROTOCOL_VERSION})
    except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
        raise ProtocolError(f"wire message {t!r} holds a value CBOR cannot carry: {exc}") from exc


def decode(data: bytes) -> dict[str, Any]:
    """The map in ``data``; ProtocolError if it is not a swarm wire message of our major version."""
    try:
        # No tag hook and no object hook: unknown CBOR tags stay inert CBORTag values. cbor2 still decodes its
        # standard tags (datetime, set, Decimal, UUID, even re.compile for tag 35) — never arbitrary classes, but
        # handlers must check the type of every field they read rather than trust it.
        msg = cbor2.loads(data)
    except (cbor2.CBORDecodeError, ValueError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"received {len(data)} bytes that are not a CBOR message: {exc}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"a wire message is a CBOR map, received a {type(msg).__name__}")
    t = msg.get("t")
    if not isinstance(t, str) or not t:
        raise ProtocolError(f"a wire message needs a type in key 't' (a non-empty string), got {t!r}")
    v = msg.get("v")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(f"wire message {t!r} has no protocol version (key 'v'), got {v!r}")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"the peer speaks swarm protocol version {v}, this program speaks version {PROTOCOL_VERSION}; "
            "install the same swarm version on the leader and every fellow"
        )
    return msg


def tensor_to_wire(t: "torch.Tensor") -> dict[str, Any]:
    """``{"dtype", "shape", "data"}`` for a tensor: raw little-endian bytes of a contiguous CPU copy."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ProtocolError(f"tensors of dtype {name} cannot travel; allowed: {', '.join(_DTYPE_SIZES)}")
    t = t.detach().to("cpu").contiguous()
    # Viewing as uint8 works for every dtype, bfloat16 included (numpy has no bfloat16, so .numpy() would fail).
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": name, "shape": list(t.shape), "data": data}


def tensor_from_wire(d: Mapping[str, Any]) -> "torch.Tensor":
    """The tensor described by a :func:`tensor_to_wire` map; ProtocolError if anything does not add up."""
    import torch

    if not isinstance(d, Mapping):
        raise ProtocolError(f"a tensor on the wire is a map, received a {type(d).__name__}")
    name, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if name not in _DTYPE_SIZES:
        raise ProtocolError(f"tensor dtype {name!r} is not accepted; allowed: {', '.join(_DTYPE_SIZES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise ProtocolError(f"tensor shape {shape!r} is not a list of at most {_MAX_DIMS} non-negative integers")
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"tensor data must be a byte string, received a {type(data).__name__}")
    expected = math.prod(shape) * _DTYPE_SIZES[name]
    if expected > _MAX_TENSOR_BYTES:
        raise ProtocolError(f"tensor of shape {shape} would need {expected} bytes, more than a message can carry")
    if len(data) != expected:
        raise ProtocolError(
            f"tensor of dtype {name} and shape {shape} needs {expected} bytes of data, received {len(data)}"
        )
    dtype = getattr(torch, name)
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # frombuffer shares memory with its buffer and warns on read-only bytes; copying into a bytearray (one copy, as
    # a clone would be) gives the caller a tensor it owns and may write to. Works for bfloat16, which numpy lacks.
    # Byte order: little-endian on both sides, as on every platform torch ships for.
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
