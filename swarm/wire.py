"""The wire message codec: every message between swarm processes is a CBOR map with a type and a protocol version.

``{"t": "forward", "v": 1, ...}`` — ``t`` names the message, ``v`` is the sender's protocol version. Only the major
version is compared: a peer of another version is refused with a message that says to upgrade, instead of being
misread. Tensors travel as raw bytes with dtype and shape (see :func:`tensor_to_wire`); nothing received is ever
unpickled or given to ``torch.load`` — cbor2 decodes plain data only.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, dataclass_transform

import cbor2

from swarm.errors import ProtocolError

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1  # bump when a message changes so that an older peer would misread it

# The control link's envelope: messages whose form stays the same across protocol versions, so that a fellow and a
# leader on different protocols still enrol, stay alive, see each other's versions and agree on an update (`swarm
# update`). Every other message is read only at PROTOCOL_VERSION, and the leader sends a fellow on another protocol
# nothing else (swarm.leader.planning.placement refuses such a fellow). Never change these messages incompatibly.
ENVELOPE_TYPES = frozenset({"hello", "welcome", "refused", "alive", "heartbeat", "update", "updating", "current",
                            "update_failed"})

# dtype name on the wire -> bytes per element. Only these: they are what stages compute in, what token ids are, and
# int8 for the packed keys and values a drain hands over (swarm.stage.kv_handover).
# A name outside this table is refused before any torch call sees it.
_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1}

# 256 MiB, the tunnel's message cap (swarm.tunnel.noise.MAX_MESSAGE_SIZE): a bigger tensor could not have arrived.
_MAX_TENSOR_BYTES = 256 * 1024 * 1024
_MAX_DIMS = 8


def encode(msg: Any) -> bytes:
    """CBOR bytes of ``msg`` with the protocol version added: a typed message (see :func:`message`), or a map whose
    ``msg["t"]`` names the message type."""
    wire_type = getattr(msg, "TYPE", None)
    if wire_type is not None and dataclasses.is_dataclass(msg):
        msg = {"t": wire_type, **to_map(msg)}
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
        raise ProtocolError(f"a wire message needs a type in key 't' (a non-empty string), got {_show(t)}")
    if len(t) > 64:
        raise ProtocolError(f"a wire message type has at most 64 characters, got {len(t)}")
    v = msg.get("v")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(f"wire message {t!r} has no protocol version (key 'v'), got {_show(v)}")
    if v != PROTOCOL_VERSION and t not in ENVELOPE_TYPES:
        raise ProtocolError(
            f"the peer speaks swarm protocol version {_show(v)}, this program speaks version {PROTOCOL_VERSION}; "
            "install the same swarm version on the leader and every fellow"
        )
    return msg


def _show(value: Any) -> str:
    """A short, safe description of a received value for an error message: repr() of a CBOR bignum of 5000 digits
    raises ValueError (Python's int-to-string limit), and a megabyte string does not belong in a log line."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails: say what it is
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def unpack(data: bytes) -> Any:
    """A received message: its typed form when its type is registered (see :func:`message`), else the plain map."""
    msg = decode(data)
    return parse(msg) if msg["t"] in _MESSAGES else msg



def tensor_to_wire(t: torch.Tensor) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}`` for a tensor: raw little-endian bytes of a contiguous CPU copy."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ProtocolError(f"tensors of dtype {name} cannot travel; allowed: {', '.join(_DTYPE_SIZES)}")
    t = t.detach().to("cpu").contiguous()
    # Viewing as uint8 works for every dtype, bfloat16 included (numpy has no bfloat16, so .numpy() would fail).
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": name, "shape": list(t.shape), "data": data}


def tensor_from_wire(d: Mapping[str, Any]) -> torch.Tensor:
    """The tensor described by a :func:`tensor_to_wire` map; ProtocolError if anything does not add up."""
    import torch

    if not isinstance(d, Mapping):
        raise ProtocolError(f"a tensor on the wire is a map, received a {type(d).__name__}")
    name, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if name not in _DTYPE_SIZES:
        raise ProtocolError(f"tensor dtype {_show(name)} is not accepted; allowed: {', '.join(_DTYPE_SIZES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40 for n in shape)
    ):
        raise ProtocolError(f"tensor shape {_show(shape)} is not a list of at most {_MAX_DIMS} non-negative integers")
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


# --- typed messages ---------------------------------------------------------------------------------------------------
#
# Every message of the ring, of a request's life and of the control link (swarm.control_messages, control_links) --
# all but the hello that opens a link -- is a frozen dataclass registered under its wire type. Decoding
# checks each field against its annotation (str, int, float, bool, bytes, list[X], X | None, nested records), so a
# handler never meets a field of the wrong type: a peer that sends one gets a ProtocolError naming the field.

_MESSAGES: dict[str, type] = {}
_HINTS: dict[type, dict[str, Any]] = {}


# dataclass_transform: type checkers see the frozen dataclass each of these decorators makes of its class (its
# __init__ from the fields), as they would under @dataclasses.dataclass(frozen=True).
@dataclass_transform(frozen_default=True)
def message(wire_type: str):
    """Register a dataclass as the message ``wire_type``: ``encode_message(m)`` / ``decode_message(data)``."""

    def register(cls):
        if wire_type in _MESSAGES:
            raise ValueError(f"wire type {wire_type!r} is registered twice")
        cls = dataclasses.dataclass(frozen=True)(cls) if not dataclasses.is_dataclass(cls) else cls
        cls.TYPE = wire_type
        _MESSAGES[wire_type] = cls
        return cls

    return register


@dataclass_transform(frozen_default=True)
def record(cls):
    """A dataclass that travels inside messages (a field of a message, or an item of a list field)."""
    return dataclasses.dataclass(frozen=True)(cls)


def type_of(message_or_class: Any) -> str:
    """The wire type a typed message (or its class) was registered under (see :func:`message`)."""
    return message_or_class.TYPE


def decode_message(data: bytes) -> Any:
    """The typed message in ``data``; ProtocolError for anything malformed or of an unknown type."""
    return parse(decode(data))


def parse(raw: Mapping[str, Any]) -> Any:
    """A decoded map as its typed message (see :func:`decode`); ProtocolError when its fields do not fit."""
    t = raw.get("t")
    cls = _MESSAGES.get(t) if isinstance(t, str) else None
    if cls is None:
        raise ProtocolError(f"unknown wire message type {_show(t)}")
    return _from_map(cls, raw, raw["t"])


def from_map(cls: type, raw: Any, where: str | None = None) -> Any:
    """A record (see :func:`record`) from its map, every field checked."""
    return _from_map(cls, raw, where or cls.__name__)


def to_map(obj: Any) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(obj):
        out[field.name] = _to_value(getattr(obj, field.name))
    return out


def _to_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return to_map(value)
    if isinstance(value, (list, tuple)):
        return [_to_value(v) for v in value]
    return value


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _from_map(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ProtocolError(f"{where} must be a map, received a {type(raw).__name__}")
    hints = _hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        if field.name not in raw:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{where} lacks the field {field.name!r}")
            continue
        values[field.name] = _check(raw[field.name], hints[field.name], f"{where}.{field.name}")
    return cls(**values)


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        last_error = None
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(value, option, where)
            except ProtocolError as exc:
                last_error = exc
        raise last_error or ProtocolError(f"{where} may not be empty")
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be a list, received a {type(value).__name__}")
        (item,) = typing.get_args(hint)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be a map, received a {type(value).__name__}")
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _from_map(hint, value, where)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where} must be a number, received a {type(value).__name__}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where} must be an integer, received a {type(value).__name__}")
        if not -(1 << 63) <= value < (1 << 63):
            raise ProtocolError(f"{where} is out of range")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where} must be true or false, received a {type(value).__name__}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where} must be a string, received a {type(value).__name__}")
        return value
    if hint is bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise ProtocolError(f"{where} must be a byte string, received a {type(value).__name__}")
        return bytes(value)
    if hint is Any:
        return value
    raise TypeError(f"wire messages cannot declare a field of type {hint!r} ({where})")


# The message types: registered when these modules are imported (they import this module's decorators).
from swarm import control_links, control_messages, handover_messages, messages  # noqa: E402,F401
