"""A sans-IO Noise session: bytes in, bytes out, no sockets and no trio (in the style of h11).

Pattern ``Noise_IK_25519_ChaChaPoly_BLAKE2s``: the initiator already knows the responder's static key (the leader
vouched for it), so the handshake is one round trip and the initiator's own static key travels encrypted in
message 1. The responder learns that key from message 1 and asks ``allow`` whether the leader vouched for it before
it answers.

States and transitions (anything else raises RuntimeError: that is a bug in the caller, not in the peer)::

    initiator:  NEW --start()--> SENT_HELLO --receive_handshake(msg2)--> OPEN
    responder:  NEW --receive_handshake(msg1) -> msg2--> OPEN
    any state   --peer breaks the handshake or a frame fails authentication--> DEAD

Framing. A Noise transport message holds at most 65535 bytes including its 16-byte tag (Noise spec §3), so a
message is cut into frames; each frame is one Noise ciphertext whose plaintext is a 1-byte flag (more follows /
last) followed by a chunk of the message. The flag is inside the ciphertext, so a relay cannot truncate or splice
messages without failing authentication.

Nonces are implicit (a counter on each side, Noise spec §5.1): frames must be delivered in order, once, over a
reliable ordered stream (TCP, the leader's relay, a QUIC stream) — never over raw datagrams. A lost, repeated or
reordered frame fails authentication exactly like a changed one, and the session is dead afterwards.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from noise.connection import Keypair, NoiseConnection

from swarm.errors import FrameCorrupted, HandshakeFailed, PeerRejected, ProtocolError
from swarm.tunnel.keys import KEY_SIZE, fingerprint

PROTOCOL_NAME = b"Noise_IK_25519_ChaChaPoly_BLAKE2s"
# Mixed into the handshake hash: a peer speaking another swarm protocol version fails the handshake cleanly instead
# of misreading frames later.
PROLOGUE = b"swarm/1"

MAX_NOISE_MESSAGE = 65535  # Noise spec §3: every handshake and transport message is at most 65535 bytes.
TAG_SIZE = 16  # ChaCha20-Poly1305 tag.
MAX_CHUNK = MAX_NOISE_MESSAGE - TAG_SIZE - 1  # room for the flag byte: 65518 bytes of message per frame.
# Largest Noise frame; swarm.tunnel.framing allows a little more on the wire and refuses larger length prefixes.
MAX_FRAME = MAX_NOISE_MESSAGE

# A peer that never sends a "last" frame could make us buffer without end. 256 MiB is far above the largest message
# swarm sends (a prefill chunk of hidden states: 512 tokens x 8192 hidden x 4 bytes = 16 MiB) and small enough to
# survive on a fellow with little RAM. It is the ceiling for ring hops; a session that carries only small messages
# (the leader's control links, a stranger before enrolment) sets a far lower ``max_message_size`` of its own.
MAX_MESSAGE_SIZE = 256 * 1024 * 1024

_FLAG_LAST = 0x00
_FLAG_MORE = 0x01

# What noiseprotocol and pyca/cryptography raise on a malformed or forged handshake message: InvalidTag, ValueError
# (a truncated key, a low-order point giving an all-zero shared secret) and the library's own errors, which derive
# from bare Exception. There is no narrower common base, so the handshake calls catch Exception and name it.
_HANDSHAKE_ERRORS = (Exception,)


class _State(enum.Enum):
    NEW = "new"
    SENT_HELLO = "sent hello"
    OPEN = "open"
    DEAD = "dead"


class NoiseSession:
    """One end of a Noise IK session; make it with :meth:`initiator` or :meth:`responder`."""

    def __init__(self, conn: NoiseConnection, is_initiator: bool, allow: Callable[[bytes], bool] | None):
        self._conn = conn
        self._is_initiator = is_initiator
        self._allow = allow
        self._state = _State.NEW
        self._remote_static: bytes | None = None
        self._handshake_payload = b""
        self._parts: list[memoryview] = []  # chunks of the message being received
        self._parts_size = 0
        # The largest message this end accepts; a longer one kills the session before more of it is buffered.
        self.max_message_size = MAX_MESSAGE_SIZE

    # --- construction ------------------------------------------------------------------------------------------

    @classmethod
    def initiator(cls, local_private: bytes, remote_public: bytes) -> NoiseSession:
        """The connecting side; ``remote_public`` is the responder's key the leader vouched for (pinned)."""
        if len(remote_public) != KEY_SIZE:
            raise HandshakeFailed(f"the peer's public key has {len(remote_public)} bytes, a key has {KEY_SIZE}")
        conn = cls._make_conn(local_private)
        conn.set_keypair_from_public_bytes(Keypair.REMOTE_STATIC, bytes(remote_public))
        conn.set_as_initiator()
        conn.start_handshake()
        session = cls(conn, True, None)
        session._remote_static = bytes(remote_public)
        return session

    @classmethod
    def responder(cls, local_private: bytes, allow: Callable[[bytes], bool] | None) -> NoiseSession:
        """The accepting side; ``allow(key)`` says whether the leader vouched for an initiator's static key.

        ``allow=None`` accepts any key: only for the leader's control port, where the key is then looked up.
        """
        conn = cls._make_conn(local_private)
        conn.set_as_responder()
        conn.start_handshake()
        return cls(conn, False, allow)

    @staticmethod
    def _make_conn(local_private: bytes) -> NoiseConnection:
        if len(local_private) != KEY_SIZE:
            raise HandshakeFailed(f"the local private key has {len(local_private)} bytes, a key has {KEY_SIZE}")
        conn = NoiseConnection.from_name(PROTOCOL_NAME)
        conn.set_prologue(PROLOGUE)
        conn.set_keypair_from_private_bytes(Keypair.STATIC, bytes(local_private))
        return conn

    # --- state -------------------------------------------------------------------------------------------------

    @property
    def handshake_done(self) -> bool:
        return self._state is _State.OPEN

    @property
    def remote_static(self) -> bytes:
        """The peer's static public key: pinned on the initiator, learnt from message 1 on the responder."""
        if self._remote_static is None:
            raise RuntimeError("the responder learns the peer's key only from handshake message 1")
        return self._remote_static

    @property
    def handshake_payload(self) -> bytes:
        """What the initiator put in message 1 (encrypted to the responder's static key); b"" on the initiator."""
        return self._handshake_payload

    def _expect(self, *states: _State) -> None:
        if self._state is _State.DEAD:
            # A failed session stays failed: its nonces no longer match the peer's.
            raise FrameCorrupted("this encrypted link already failed; open a new one")
        if self._state not in states:
            raise RuntimeError(f"NoiseSession is {self._state.value}, call not allowed now")

    # --- handshake ---------------------------------------------------------------------------------------------

    def start(self, payload: bytes = b"") -> bytes:
        """Handshake message 1 (initiator only). ``payload`` reaches the responder encrypted, e.g. a channel id."""
        if not self._is_initiator:
            raise RuntimeError("only the initiator starts a handshake")
        self._expect(_State.NEW)
        # 32 (e) + 48 (encrypted s) + 16 (payload tag) bytes of handshake around the payload.
        if len(payload) > MAX_NOISE_MESSAGE - 96:
            raise ProtocolError(f"a handshake payload holds at most {MAX_NOISE_MESSAGE - 96} bytes")
        message = bytes(self._conn.write_message(bytes(payload)))
        self._state = _State.SENT_HELLO
        return message

    def receive_handshake(self, data: bytes) -> bytes:
        """Read a handshake message; the responder returns message 2 to send back, the initiator returns b""."""
        if self._is_initiator:
            self._expect(_State.SENT_HELLO)
            self._read_handshake(data, "the peer's reply")
            self._state = _State.OPEN
            return b""

        self._expect(_State.NEW)
        self._handshake_payload = self._read_handshake(data, "the peer's hello")
        remote = bytes(self._conn.noise_protocol.handshake_state.rs.public_bytes)
        self._remote_static = remote
        if self._allow is not None and not self._allow(remote):
            self._state = _State.DEAD
            raise PeerRejected(
                f"refused a peer with key {fingerprint(remote)}: the leader did not vouch for it; "
                "if it is a new fellow, approve it on the leader first"
            )
        try:
            reply = bytes(self._conn.write_message(b""))
        except _HANDSHAKE_ERRORS as exc:
            self._state = _State.DEAD
            raise HandshakeFailed(f"could not answer the peer's hello: {exc}") from exc
        self._state = _State.OPEN
        return reply

    def _read_handshake(self, data: bytes, what: str) -> bytes:
        if len(data) > MAX_NOISE_MESSAGE:
            self._state = _State.DEAD
            raise HandshakeFailed(f"{what} is {len(data)} bytes, more than a Noise message can hold")
        try:
            return bytes(self._conn.read_message(bytes(data)))
        except _HANDSHAKE_ERRORS as exc:
            self._state = _State.DEAD
            # A wrong pinned key, a different protocol version (prologue) or a damaged message all look the same
            # to us: decryption of the handshake fails.
            raise HandshakeFailed(
                f"{what} failed the Noise handshake ({type(exc).__name__}): the peer has a different key than the "
                "one the leader gave us, runs another swarm version, or the message was damaged"
            ) from exc

    # --- transport ---------------------------------------------------------------------------------------------

    def encrypt(self, message: bytes) -> list[bytes]:
        """The frames that carry ``message``; send all of them, in order, before the frames of any other message."""
        self._expect(_State.OPEN)
        if len(message) > MAX_MESSAGE_SIZE:
            raise ProtocolError(
                f"a message of {len(message)} bytes is larger than the {MAX_MESSAGE_SIZE} bytes a peer accepts"
            )
        view = memoryview(message).cast("B")
        frames = []
        start = 0
        while True:
            chunk = view[start : start + MAX_CHUNK]
            start += len(chunk)
            flag = _FLAG_LAST if start >= len(view) else _FLAG_MORE
            frames.append(self._conn.encrypt(bytes((flag,)) + chunk))
            if flag == _FLAG_LAST:
                return frames

    def decrypt(self, frame: bytes) -> bytes | None:
        """Read one frame; the whole message once its last frame arrives, None before that."""
        self._expect(_State.OPEN)
        if len(frame) > MAX_FRAME:
            self._state = _State.DEAD
            raise ProtocolError(f"a frame of {len(frame)} bytes is larger than a Noise message can be")
        try:
            plain = self._conn.decrypt(bytes(frame))
        except Exception as exc:  # noiseprotocol wraps InvalidTag in NoiseInvalidMessage, a bare Exception
            self._state = _State.DEAD
            raise FrameCorrupted(
                "a frame failed authentication: it was changed on the way, or a frame was lost or repeated"
            ) from exc
        if not plain or plain[0] not in (_FLAG_LAST, _FLAG_MORE):
            self._state = _State.DEAD
            raise ProtocolError("a frame carries no valid flag byte; the peer does not speak swarm/1 framing")

        body = memoryview(plain)[1:]
        if self._parts_size + len(body) > self.max_message_size:
            self._state = _State.DEAD
            self._parts.clear()
            self._parts_size = 0
            raise ProtocolError(f"the peer sent a message larger than the {self.max_message_size} bytes this link "
                                "accepts")
        if plain[0] == _FLAG_MORE:
            self._parts.append(body)
            self._parts_size += len(body)
            return None
        if not self._parts:
            return bytes(body)
        self._parts.append(body)
        message = b"".join(self._parts)
        self._parts.clear()
        self._parts_size = 0
        return message
