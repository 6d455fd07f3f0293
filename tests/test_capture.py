"""What crosses the wire between fellows is ciphertext: a capture of loopback while replies go over the relay and
over the hole-punched tunnel holds no ring message in the clear."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import trio

from harness import running_swarm, wait_until
from swarm import wire

# Ring messages are CBOR maps whose type key comes first: these bytes start every hidden-state and token message.
HIDDEN = b"\x61t\x66hidden"
TOKEN = b"\x61t\x65token"


def _udp_packets(capture) -> int:
    out = subprocess.run(["tcpdump", "-r", str(capture), "-nn", "udp"], capture_output=True, text=True).stdout
    return out.count("\n")


def test_the_markers_are_what_a_plaintext_ring_message_would_show():
    assert HIDDEN in wire.encode({"t": "hidden", "rid": "r1", "pos": 0, "last": True})
    assert TOKEN in wire.encode({"t": "token", "rid": "r1", "pos": 9, "token": 5, "done": False})


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("tcpdump") is None, reason="needs tcpdump (apt-get install tcpdump)")
async def test_relay_and_tunnel_carry_no_plaintext(tmp_path, smollm_model_dir):
    name = smollm_model_dir.name
    capture = tmp_path / "lo.pcap"
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir],
                                 leader_env={"SWARM_PIPELINE_TRANSPORT": "auto"}) as swarm:
            # Everything on loopback except the fellows' direct TCP ports (they are blocked below anyway).
            dump = subprocess.Popen(["tcpdump", "-i", "lo", "--immediate-mode", "-U", "-s", "0", "-w", str(capture)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                # tcpdump says "listening on lo, ..." once it captures: nothing sent after that line is missed.
                line = await trio.to_thread.run_sync(dump.stderr.readline)
                assert "listening on" in line, line
                with trio.socket.socket() as s:
                    await s.bind(("127.0.0.1", 0))
                    dead = s.getsockname()[1]
                for conn in swarm.leader.hub.online.values():
                    conn.serve_port = dead  # no direct TCP: the hops start on the relay
                await swarm.load(name, 2)
                hop = swarm.fellows[0].stages[name].driver.out_hop
                relay_reply = await swarm.chat(name, [{"role": "user", "content": "Name three colours."}],
                                               max_tokens=16)
                assert hop.path == "relay"
                await swarm.http.put("/api/v1/settings/direct-links", json={"enabled": True})
                await wait_until(lambda: hop.path == "tunnel", 30, message=lambda: f"the hop is on {hop.path}")
                tunnel_reply = await swarm.chat(name, [{"role": "user", "content": "Name three colours."}],
                                                max_tokens=16)
                assert tunnel_reply["choices"][0]["token_ids"] == relay_reply["choices"][0]["token_ids"]
                # Packet-buffered (-U) and immediate: both replies' packets reach the file as tcpdump sees them.
                await wait_until(lambda: capture.stat().st_size > 200_000 and _udp_packets(capture) > 20, 10,
                                 message=lambda: f"{capture.stat().st_size} bytes, {_udp_packets(capture)} UDP")
            finally:
                dump.terminate()
                dump.wait(timeout=10)
                dump.stderr.close()
    data = capture.read_bytes()
    assert _udp_packets(capture) > 20, "the tunnel's UDP packets should be in the capture"
    assert len(data) > 200_000  # 2 replies of hidden states went through: there was something to read
    assert HIDDEN not in data and TOKEN not in data
