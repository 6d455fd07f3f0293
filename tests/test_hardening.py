"""Attacks on a running leader (issue 10): a stranger on the fellow link, leaked or reused join tokens, removed
fellows, and fellows that speak for models they do not serve. Each test attacks the way the finding describes."""

from __future__ import annotations

import threading

import trio
import trio_websocket

from harness import running_swarm
from swarm import wire
from swarm.errors import LinkClosed, SwarmError
from swarm.fellow import hardware
from swarm.leader import fellows as fellows_module
from swarm.mesh.websocket import WebSocketFrameTransport, ws_url
from swarm.tunnel.channel import NoiseChannel
from swarm.tunnel.join_token import parse_join_token
from swarm.tunnel.keys import generate_private_key


async def _open_link(nursery, swarm, private: bytes | None = None) -> NoiseChannel:
    """A Noise session on the leader's fellow link, as anyone on the network can open one."""
    ws = await trio_websocket.connect_websocket_url(nursery, ws_url(swarm.url, "/fellow/link"),
                                                     max_message_size=1 << 20)
    return await NoiseChannel.connect(WebSocketFrameTransport(ws), private or generate_private_key(),
                                      swarm.leader.public)


async def _closed_by_leader(channel: NoiseChannel, within: float) -> bool:
    """True when the leader ends the link (or answers a refusal) within ``within`` seconds."""
    with trio.move_on_after(within):
        try:
            while True:
                message = wire.decode(await channel.receive())
                if message["t"] == "refused":
                    return True
        except (LinkClosed, SwarmError, trio_websocket.ConnectionClosed):
            return True
    return False


def _hello(join_secret: str | None, name: str = "mallory") -> dict:
    hello = {"t": "hello", "name": name, "version": "x", "hardware": hardware.probe().to_wire(), "stages": []}
    if join_secret:
        hello["join_token"] = join_secret
    return hello


async def _enrol(nursery, swarm, join_token: str, name: str = "mallory", private: bytes | None = None):
    channel = await _open_link(nursery, swarm, private)
    await channel.send(wire.encode(_hello(parse_join_token(join_token)[1], name)))
    reply = wire.decode(await channel.receive())
    return channel, reply


# --- High 1: memory and time a stranger can take before enrolment -----------------------------------------------------


async def test_a_stranger_cannot_make_the_leader_buffer_a_huge_message_before_hello(tmp_path):
    """A random key completes the handshake and starts a 256 MiB message: the leader refuses it after 64 KiB
    instead of buffering it (it kept up to 256 MiB and peaked at 2.6 GB)."""
    async with running_swarm(tmp_path, [], fellows=0) as swarm, trio.open_nursery() as nursery:
        channel = await _open_link(nursery, swarm)
        frames = channel.session.encrypt(b"\0" * (4 << 20))[:-1]  # 4 MiB of "more follows", never the last frame
        sent = 0
        try:
            for frame in frames:
                await channel.transport.send_frame(frame)
                sent += len(frame)
        except (LinkClosed, SwarmError, trio_websocket.ConnectionClosed):
            pass
        assert await _closed_by_leader(channel, 3), "the leader kept buffering a stranger's message"
        assert (await swarm.http.get("/healthz")).status_code == 200
        nursery.cancel_scope.cancel()


async def test_a_connection_that_never_says_hello_is_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(fellows_module, "HELLO_S", 0.5)
    async with running_swarm(tmp_path, [], fellows=0) as swarm, trio.open_nursery() as nursery:
        channel = await _open_link(nursery, swarm)
        assert await _closed_by_leader(channel, 3), "a link without hello stayed open"
        nursery.cancel_scope.cancel()


async def test_an_enrolled_fellow_cannot_send_a_huge_control_message(tmp_path):
    async with running_swarm(tmp_path, [], fellows=0) as swarm, trio.open_nursery() as nursery:
        channel, reply = await _enrol(nursery, swarm, swarm.leader.first_start.join_token)
        assert reply["t"] == "welcome", reply
        frames = channel.session.encrypt(b"\0" * (16 << 20))[:-1]
        try:
            for frame in frames:
                await channel.transport.send_frame(frame)
        except (LinkClosed, SwarmError, trio_websocket.ConnectionClosed):
            pass
        assert await _closed_by_leader(channel, 3), "the control link took a 16 MiB message"
        nursery.cancel_scope.cancel()


async def test_big_control_messages_are_decoded_off_the_event_loop(tmp_path, monkeypatch):
    threads = []
    unpack = wire.unpack

    def spy(data):
        if len(data) > fellows_module.DECODE_OFF_LOOP_BYTES:
            threads.append(threading.current_thread() is threading.main_thread())
        return unpack(data)

    monkeypatch.setattr(fellows_module.wire, "unpack", spy)
    async with running_swarm(tmp_path, [], fellows=0) as swarm, trio.open_nursery() as nursery:
        channel, reply = await _enrol(nursery, swarm, swarm.leader.first_start.join_token)
        assert reply["t"] == "welcome", reply
        # Many small items: the shape that is slow to decode (a 2 MiB list of ints took ~0.1 s on the loop).
        await channel.send(wire.encode({"t": "noise", "items": list(range(300_000))}))
        await channel.send(wire.encode({"t": "alive"}))
        with trio.fail_after(5):
            while not threads:
                await trio.sleep(0.01)
        assert threads == [False], "a big control message was decoded on the event loop"
        nursery.cancel_scope.cancel()
