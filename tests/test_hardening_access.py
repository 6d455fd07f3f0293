"""Attacks on a running leader (issue 32: a review against a leader with two fellows): a stranger's websocket frame,
reloads that end other users' replies, forged hot-cover claims, MCP arguments used as paths, malformed input that
used to be a 500, and sign-in and token limits. Each test attacks the way the finding describes."""

from __future__ import annotations

import base64
import os
import socket

import pytest
import trio

from harness import running_swarm

pytestmark = pytest.mark.e2e


# --- Medium 1: a websocket frame that announces a terabyte -------------------------------------------------------------


async def _upgrade(url: str, path: str) -> trio.SocketStream:
    """A raw TCP connection to the leader, upgraded to a websocket on ``path`` (a stranger's: no credential)."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    await stream.send_all((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
    answer = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in answer:
            answer += await stream.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return stream


async def test_a_stranger_announcing_a_huge_websocket_frame_is_cut_off_at_the_limit(tmp_path):
    """One frame header announcing 2^40 bytes, then zeros: the leader answered 1009 but went on buffering what came
    (1 GB before the 10 s hello deadline). Now the connection ends at the limit."""
    async with running_swarm(tmp_path, [], fellows=0) as swarm:
        stream = await _upgrade(swarm.url, "/fellow/link")
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # what we sent ~ what the leader took
        # FIN + binary, masked, 64-bit length 2^40, mask key 0 (the zeros stay zeros)
        await stream.send_all(bytes([0x82, 0x80 | 127]) + (1 << 40).to_bytes(8, "big") + b"\0" * 4)
        chunk, sent, cut = b"\0" * 65536, 0, False
        start = trio.current_time()
        with trio.move_on_after(5):
            try:
                while sent < 256 << 20:
                    await stream.send_all(chunk)
                    sent += len(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                cut = True
        took = trio.current_time() - start
        assert cut, f"the leader took {sent >> 20} MiB of one frame in {took:.1f} s and kept the connection"
        assert took < 2.0, f"the connection ended only after {took:.1f} s"
        assert sent < 4 << 20, f"the leader accepted {sent >> 20} MiB before ending the connection"
        assert (await swarm.http.get("/healthz")).status_code == 200
