"""The Noise tunnel: keys, the sans-IO session (no sockets), and NoiseChannel over memory streams, TCP and a relay."""

from __future__ import annotations

import os
import stat

import pytest
import trio
import trio.testing

from swarm.errors import FrameCorrupted, HandshakeFailed, LinkClosed, PeerRejected, ProtocolError, TunnelError
from swarm.tunnel import keys
from swarm.tunnel.channel import FrameTransport, NoiseChannel, StreamFrameTransport
from swarm.tunnel.framing import MAX_WIRE_FRAME, FrameDecoder, encode_frame
from swarm.tunnel.noise import MAX_CHUNK, NoiseSession

# Sizes around the frame boundary (65518 bytes of message per frame) and one that takes many frames.
SIZES = [0, 1, MAX_CHUNK, MAX_CHUNK + 1, 64 * 1024, 64 * 1024 + 1, 5 * 1024 * 1024]


def pattern(n: int, seed: int = 0) -> bytes:
    """Bytes that differ at every position mod 251, so a dropped or moved chunk cannot go unnoticed."""
    return bytes((i * 7 + seed) % 251 for i in range(min(n, 251))) * (n // 251) + bytes(
        (i * 7 + seed) % 251 for i in range(n % 251)
    )


@pytest.fixture
def leader():
    private = keys.generate_private_key()
    return private, keys.public_key(private)


@pytest.fixture
def fellow():
    private = keys.generate_private_key()
    return private, keys.public_key(private)


def open_pair(initiator_key, responder_key, allow=None, payload=b""):
    """A sans-IO initiator/responder pair after a complete handshake."""
    ini = NoiseSession.initiator(initiator_key[0], responder_key[1])
    res = NoiseSession.responder(responder_key[0], allow)
    assert ini.receive_handshake(res.receive_handshake(ini.start(payload))) == b""
    return ini, res


# --- keys ------------------------------------------------------------------------------------------------------------


def test_identity_file_is_private_and_stable(tmp_path):
    path = tmp_path / "deep" / "dir" / "identity.key"
    private, public = keys.load_or_create_identity(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(private) == 32 and public == keys.public_key(private)
    assert keys.load_or_create_identity(path) == (private, public)
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temporary file left behind


def test_identity_file_of_wrong_size_is_refused(tmp_path):
    path = tmp_path / "identity.key"
    path.write_bytes(b"x" * 31)
    with pytest.raises(TunnelError, match="31 bytes"):
        keys.load_or_create_identity(path)


def test_key_text_round_trip_and_fingerprint(leader, fellow):
    text = keys.encode_key(leader[1])
    assert "=" not in text and "+" not in text and "/" not in text
    assert keys.decode_key(text) == leader[1]
    fp = keys.fingerprint(leader[1])
    assert fp == keys.fingerprint(leader[1]) != keys.fingerprint(fellow[1])
    assert len(fp) == 26 and fp.isalnum() and fp == fp.lower()


@pytest.mark.parametrize("text", ["", "abc", "not base64 at all!", keys.encode_key(b"\x01" * 31), "é" * 43])
def test_malformed_key_text_is_refused(text):
    with pytest.raises(ProtocolError, match="key"):
        keys.decode_key(text)


# --- sans-IO handshake -----------------------------------------------------------------------------------------------


def test_handshake_without_sockets(leader, fellow):
    ini, res = open_pair(fellow, leader, payload=b"channel-7")
    assert ini.handshake_done and res.handshake_done
    assert res.remote_static == fellow[1] and ini.remote_static == leader[1]
    assert res.handshake_payload == b"channel-7"
    assert res.decrypt(ini.encrypt(b"hello")[0]) == b"hello"
    assert ini.decrypt(res.encrypt(b"back")[0]) == b"back"


def test_responder_refuses_a_key_the_leader_did_not_vouch_for(leader, fellow):
    stranger = keys.generate_private_key()
    vouched = {fellow[1]}
    res = NoiseSession.responder(leader[0], vouched.__contains__)
    msg1 = NoiseSession.initiator(stranger, leader[1]).start()
    with pytest.raises(PeerRejected, match=keys.fingerprint(keys.public_key(stranger))) as info:
        res.receive_handshake(msg1)
    assert "vouch" in str(info.value)
    assert not res.handshake_done

    ini, res = open_pair(fellow, leader, allow=vouched.__contains__)
    assert res.remote_static == fellow[1]


def test_initiator_that_pinned_another_key_fails(leader, fellow):
    impostor = keys.generate_private_key()
    ini = NoiseSession.initiator(fellow[0], leader[1])  # pinned the real leader
    res = NoiseSession.responder(impostor, None)  # but reached someone else
    with pytest.raises(HandshakeFailed):
        res.receive_handshake(ini.start())


def test_garbage_handshake_messages_fail(leader, fellow):
    with pytest.raises(HandshakeFailed):
        NoiseSession.responder(leader[0], None).receive_handshake(os.urandom(96))
    with pytest.raises(HandshakeFailed):
        NoiseSession.responder(leader[0], None).receive_handshake(b"")
    ini = NoiseSession.initiator(fellow[0], leader[1])
    msg2 = NoiseSession.responder(leader[0], None).receive_handshake(ini.start())
    with pytest.raises(HandshakeFailed):
        ini.receive_handshake(msg2[:-1])


def test_transport_before_handshake_is_a_caller_bug(leader, fellow):
    ini = NoiseSession.initiator(fellow[0], leader[1])
    with pytest.raises(RuntimeError):
        ini.encrypt(b"too early")


# --- sans-IO framing -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_messages_of_any_size_round_trip(leader, fellow, size):
    ini, res = open_pair(fellow, leader)
    message = pattern(size)
    frames = ini.encrypt(message)
    assert len(frames) == max(1, -(-size // MAX_CHUNK))
    assert all(len(f) <= 65535 for f in frames)
    results = [res.decrypt(f) for f in frames]
    assert results[:-1] == [None] * (len(frames) - 1)
    assert results[-1] == message
    assert res.decrypt(ini.encrypt(b"next")[0]) == b"next"  # state is clean after a multi-frame message


def test_flipped_bit_kills_the_session(leader, fellow):
    ini, res = open_pair(fellow, leader)
    frames = ini.encrypt(pattern(200_000))
    bad = bytearray(frames[1])
    bad[100] ^= 0x04
    assert res.decrypt(frames[0]) is None
    with pytest.raises(FrameCorrupted):
        res.decrypt(bytes(bad))
    # Dead for good: even the genuine frame is refused now, and so is sending.
    with pytest.raises(FrameCorrupted):
        res.decrypt(frames[1])
    with pytest.raises(FrameCorrupted):
        res.encrypt(b"x")


def test_reordered_or_repeated_frames_are_corruption(leader, fellow):
    ini, res = open_pair(fellow, leader)
    _, second = ini.encrypt(b"one")[0], ini.encrypt(b"two")[0]
    with pytest.raises(FrameCorrupted):
        res.decrypt(second)
    ini, res = open_pair(fellow, leader)
    frame = ini.encrypt(b"one")[0]
    assert res.decrypt(frame) == b"one"
    with pytest.raises(FrameCorrupted):
        res.decrypt(frame)


def test_assembled_message_size_is_capped(leader, fellow):
    ini, res = open_pair(fellow, leader)
    frames = ini.encrypt(pattern(3 * MAX_CHUNK))
    res.max_message_size = 2 * MAX_CHUNK  # each session has its own cap (the control link's is small)
    assert res.decrypt(frames[0]) is None
    assert res.decrypt(frames[1]) is None
    with pytest.raises(ProtocolError, match="larger than"):
        res.decrypt(frames[2])


# --- length-prefixed frames (sans-IO) --------------------------------------------------------------------------------


FRAMES = [b"", b"x", pattern(1000), pattern(MAX_WIRE_FRAME, seed=3)]


def test_frames_survive_every_split_point():
    wire = b"".join(encode_frame(f) for f in FRAMES[:3])
    for cut in range(len(wire) + 1):
        decoder = FrameDecoder()
        decoder.feed(wire[:cut])
        got = list(decoder)
        decoder.feed(wire[cut:])
        got += list(decoder)
        assert got == FRAMES[:3], cut
        assert decoder.buffered == 0


def test_one_byte_at_a_time_and_many_frames_per_feed():
    wire = b"".join(encode_frame(f) for f in FRAMES)
    decoder = FrameDecoder()
    decoder.feed(wire)
    assert list(decoder) == FRAMES  # several frames from one feed, in order
    assert decoder.next_frame() is None

    decoder = FrameDecoder()
    got = []
    for i in range(len(wire)):
        decoder.feed(wire[i : i + 1])
        if (frame := decoder.next_frame()) is not None:
            got.append(frame)
    assert got == FRAMES


def test_partial_frame_is_held_until_complete():
    decoder = FrameDecoder()
    decoder.feed(encode_frame(b"hello")[:-1])
    assert decoder.next_frame() is None and decoder.buffered == 8  # EOF now would be "in the middle of a frame"
    decoder.feed(b"o")
    assert decoder.next_frame() == b"hello" and decoder.buffered == 0


def test_oversize_length_prefix_is_refused_before_its_body():
    decoder = FrameDecoder()
    decoder.feed((MAX_WIRE_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError, match="not a swarm peer"):
        decoder.next_frame()
    with pytest.raises(ProtocolError):  # the stream cannot be resynchronised: it stays refused
        decoder.next_frame()
    decoder = FrameDecoder()
    decoder.feed(MAX_WIRE_FRAME.to_bytes(4, "big"))
    assert decoder.next_frame() is None  # the largest allowed frame is waited for


@pytest.mark.parametrize("garbage", [b"GET ", b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x02\x00"])
def test_garbage_is_refused_at_once(garbage):
    decoder = FrameDecoder()
    decoder.feed(garbage)
    with pytest.raises(ProtocolError, match="not a swarm peer"):
        list(decoder)


def test_encode_frame_limits():
    assert encode_frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert len(encode_frame(bytes(MAX_WIRE_FRAME))) == MAX_WIRE_FRAME + 4
    with pytest.raises(ProtocolError, match="larger than"):
        encode_frame(bytes(MAX_WIRE_FRAME + 1))


# --- NoiseChannel over memory streams --------------------------------------------------------------------------------


def memory_transports() -> tuple[StreamFrameTransport, StreamFrameTransport]:
    a, b = trio.testing.memory_stream_pair()
    return StreamFrameTransport(a), StreamFrameTransport(b)


async def open_channels(a: FrameTransport, b: FrameTransport, fellow, leader, allow=None, payload=b""):
    """(initiator channel, responder channel) over two connected transports."""
    result = {}
    async with trio.open_nursery() as nursery:

        async def accept():
            result["res"] = await NoiseChannel.accept(b, leader[0], allow)

        nursery.start_soon(accept)
        result["ini"] = await NoiseChannel.connect(a, fellow[0], leader[1], payload)
    return result["ini"], result["res"]


async def test_channel_over_memory_streams(leader, fellow):
    with trio.fail_after(10):
        a, b = memory_transports()
        assert isinstance(a, FrameTransport)
        ini, res = await open_channels(a, b, fellow, leader, payload=b"ring-1/stage-0")
        assert res.handshake_payload == b"ring-1/stage-0" and res.remote_static == fellow[1]
        for size in SIZES:
            await ini.send(pattern(size, seed=size))
            assert await res.receive() == pattern(size, seed=size)
        await res.send(b"pong")
        assert await ini.receive() == b"pong"


async def test_concurrent_senders_never_interleave(leader, fellow):
    with trio.fail_after(20):
        ini, res = await open_channels(*memory_transports(), fellow, leader)
        senders, per_sender = 4, 6
        received = []

        async def sender(k):
            for i in range(per_sender):
                # Multi-frame messages, so interleaving would show as a mixed-up message.
                await ini.send(bytes([k, i]) + pattern(150_000, seed=k * 16 + i))
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            for k in range(senders):
                nursery.start_soon(sender, k)
            for _ in range(senders * per_sender):
                received.append(await res.receive())

        for msg in received:
            assert msg[2:] == pattern(150_000, seed=msg[0] * 16 + msg[1])
        for k in range(senders):
            assert [m[1] for m in received if m[0] == k] == list(range(per_sender))


async def test_eof_is_link_closed(leader, fellow):
    with trio.fail_after(10):
        ini, res = await open_channels(*memory_transports(), fellow, leader)
        await ini.send(b"last words")
        await ini.aclose()
        assert await res.receive() == b"last words"
        with pytest.raises(LinkClosed):
            await res.receive()


async def test_rejected_peer_sees_the_handshake_fail(leader, fellow):
    with trio.fail_after(10):
        a, b = memory_transports()
        async with trio.open_nursery() as nursery:

            async def connect():
                with pytest.raises(HandshakeFailed, match="closed the link"):
                    await NoiseChannel.connect(a, fellow[0], leader[1])

            nursery.start_soon(connect)
            with pytest.raises(PeerRejected):
                await NoiseChannel.accept(b, leader[0], lambda key: False)


async def test_silent_peer_times_out(leader, fellow, autojump_clock):
    with trio.fail_after(60):
        a, _b = memory_transports()  # nobody answers on _b
        start = trio.current_time()
        with pytest.raises(HandshakeFailed, match="within 10 s"):
            await NoiseChannel.connect(a, fellow[0], leader[1])
        assert trio.current_time() - start == pytest.approx(10)


async def test_the_channel_closes_its_transport_even_for_a_malformed_key(leader, fellow):
    # NoiseChannel owns the transport from the call on, so a caller (swarm.mesh.paths) needs no cleanup of its own.
    with trio.fail_after(10):
        a, b = memory_transports()
        with pytest.raises(HandshakeFailed, match="public key"):
            await NoiseChannel.connect(a, fellow[0], leader[1][:31])
        with pytest.raises(LinkClosed):
            await b.receive_frame()
        a, b = memory_transports()
        with pytest.raises(HandshakeFailed, match="private key"):
            await NoiseChannel.accept(b, leader[0][:31], None)
        with pytest.raises(LinkClosed):
            await a.receive_frame()


async def test_garbage_length_prefix_is_refused():
    with trio.fail_after(10):
        a, b = trio.testing.memory_stream_pair()
        await a.send_all(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(ProtocolError, match="not a swarm peer"):
            await StreamFrameTransport(b).receive_frame()


async def test_interrupted_send_makes_the_link_unusable(leader, fellow):
    with trio.fail_after(10):
        # lockstep: send_all blocks until the other side reads, so the send below is stuck half way.
        x, y = trio.testing.lockstep_stream_pair()
        ini, res = await open_channels(StreamFrameTransport(x), StreamFrameTransport(y), fellow, leader)
        with trio.move_on_after(0.1):
            await ini.send(pattern(1_000_000))
        with pytest.raises(TunnelError, match="interrupted"):
            await ini.send(b"after")


# --- a relay in the middle -------------------------------------------------------------------------------------------


async def relay(src: FrameTransport, dst: FrameTransport, corrupt_frame: int | None = None):
    """Forward frames like the leader's relay hub; optionally flip one bit of frame number ``corrupt_frame``."""
    n = 0
    while True:
        try:
            frame = await src.receive_frame()
        except LinkClosed:
            await dst.aclose()
            return
        if n == corrupt_frame:
            frame = bytearray(frame)
            frame[len(frame) // 2] ^= 0x01
            frame = bytes(frame)
        n += 1
        await dst.send_frame(frame)


@pytest.mark.parametrize("corrupt", [False, True])
async def test_relay_forwards_ciphertext_and_tampering_is_caught(leader, fellow, corrupt):
    with trio.fail_after(10):
        fellow_side, relay_left = memory_transports()
        relay_right, leader_side = memory_transports()
        async with trio.open_nursery() as nursery:
            # Frames 0 and 1 of fellow->leader are the hello and the first data frame.
            nursery.start_soon(relay, relay_left, relay_right, 2 if corrupt else None)
            nursery.start_soon(relay, relay_right, relay_left)
            ini, res = await open_channels(fellow_side, leader_side, fellow, leader)
            await ini.send(b"first")
            assert await res.receive() == b"first"
            await ini.send(pattern(300_000))
            if corrupt:
                with pytest.raises(FrameCorrupted):
                    await res.receive()
                with pytest.raises(FrameCorrupted):
                    await res.receive()
            else:
                assert await res.receive() == pattern(300_000)
            nursery.cancel_scope.cancel()


# --- real loopback TCP -----------------------------------------------------------------------------------------------


async def tcp_transports(nursery) -> tuple[StreamFrameTransport, StreamFrameTransport]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    send, receive = trio.open_memory_channel(1)

    async def accept_one():
        await send.send(await listeners[0].accept())
        await listeners[0].aclose()

    nursery.start_soon(accept_one)
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await receive.receive()
    return StreamFrameTransport(client), StreamFrameTransport(server)


async def test_channel_over_loopback_tcp(leader, fellow):
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, b = await tcp_transports(nursery)
            ini, res = await open_channels(a, b, fellow, leader, allow={fellow[1]}.__contains__)
            big = pattern(5 * 1024 * 1024)

            async def send_many(k):
                for _ in range(3):
                    await ini.send(bytes([k]) + big)

            for k in range(3):
                nursery.start_soon(send_many, k)
            for _ in range(9):
                msg = await res.receive()
                assert msg[1:] == big
            await res.send(b"done")
            assert await ini.receive() == b"done"
            await res.aclose()
            with pytest.raises(LinkClosed):
                await ini.receive()
