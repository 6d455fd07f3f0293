"""Direct links on loopback: a hop that starts on the relay moves to a hole-punched QUIC tunnel, also in the middle
of a reply, without losing or repeating a token."""

from __future__ import annotations

import json

import pytest
import torch
import trio

from harness import running_swarm, wait_until

pytestmark = pytest.mark.e2e

LONG = "Write a long story about a lighthouse keeper."
LONG_TOKENS = 96


@pytest.fixture(scope="module")
def long_reference(smollm_model_dir):
    from reference_model import load_reference_model
    from swarm.leader.chat.chat_format import encode_chat

    model = load_reference_model(smollm_model_dir, dtype=torch.float32)
    ids = encode_chat(smollm_model_dir, [{"role": "user", "content": LONG}], None)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=LONG_TOKENS, do_sample=False)
    want = out[0, len(ids):].tolist()
    return want[: want.index(2) + 1] if 2 in want else want


async def _block_direct(swarm):
    """Make the hops start on the relay: the leader announces serving ports nobody listens on."""
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    for conn in swarm.leader.hub.online.values():
        conn.serve_port = dead


async def _perf(swarm, name):
    return (await swarm.http.get(f"/api/v1/models/{name}/performance")).json()


async def _wait_transports(swarm, name, want: list[str], timeout: float = 30) -> dict:
    """Poll the leader's performance view until the hops report ``want``; that view."""
    seen = {}

    async def reported():
        seen["perf"] = await _perf(swarm, name)
        return [h["transport"] for h in seen["perf"]["hops"]] == want

    await wait_until(reported, timeout, interval=0.2, message=lambda: f"hops: {seen.get('perf', {}).get('hops')}")
    return seen["perf"]


async def test_relay_hop_moves_to_the_tunnel_mid_reply_and_the_reply_stays_exact(
    tmp_path, smollm_model_dir, long_reference
):
    name = smollm_model_dir.name
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir]) as swarm:
            assert (await swarm.http.get("/api/v1/settings/direct-links")).json() == {"enabled": False}
            await _block_direct(swarm)
            await swarm.load(name, 2)
            hop = swarm.fellows[0].stages[name].driver.out_hop
            body = {"model": name, "messages": [{"role": "user", "content": LONG}], "temperature": 0,
                    "max_tokens": LONG_TOKENS, "stream": True}
            tokens_text, paths_seen = [], set()
            async with swarm.http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.aiter_lines()
                async for line in lines:
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    paths_seen.add(hop.path)
                    if data["choices"] and data["choices"][0]["delta"].get("content"):
                        tokens_text.append(data["choices"][0]["delta"]["content"])
                    if len(tokens_text) == 10:
                        assert hop.path == "relay"
                        r = await swarm.http.put("/api/v1/settings/direct-links", json={"enabled": True})
                        assert r.json() == {"enabled": True}
                    usage = data.get("usage")
            assert "tunnel" in paths_seen and "relay" in paths_seen, paths_seen
            assert usage["completion_tokens"] == len(long_reference)
            from swarm.leader.chat.chat_format import load_tokenizer

            expected_text = load_tokenizer(str(smollm_model_dir)).decode(long_reference, skip_special_tokens=True)
            assert "".join(tokens_text) == expected_text

            # Both hops end on the tunnel; a greedy reply over it is exact token for token.
            await _wait_transports(swarm, name, ["tunnel", "tunnel"])
            data = await swarm.chat(name, [{"role": "user", "content": LONG}], max_tokens=LONG_TOKENS)
            assert data["choices"][0]["token_ids"] == long_reference

            # The tunnel goes away: the hop falls back to the relay at once, replies stay exact, and the leader
            # punches a new tunnel in the background.
            tunnel = hop._channel
            await tunnel.aclose()
            data = await swarm.chat(name, [{"role": "user", "content": LONG}], max_tokens=24)
            assert data["choices"][0]["token_ids"] == long_reference[:24]
            assert hop._channel is not tunnel
            await wait_until(lambda: hop.path == "tunnel", 30, message=lambda: f"the hop is on {hop.path}")


async def test_a_ring_of_three_fellows_tunnels_every_hop_including_last_to_first(
    tmp_path, smollm_model_dir, long_reference
):
    name = smollm_model_dir.name
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir], fellows=3) as swarm:
            await _block_direct(swarm)
            await swarm.http.put("/api/v1/settings/direct-links", json={"enabled": True})
            view = await swarm.load(name, 3)
            assert [s["layers"] for s in view["stages"]] == [[0, 10], [10, 20], [20, 30]]
            perf = await _wait_transports(swarm, name, ["tunnel"] * 3)
            assert [(h["from_stage"], h["to_stage"], h["transport"]) for h in perf["hops"]] == [
                (0, 1, "tunnel"), (1, 2, "tunnel"), (2, 0, "tunnel")]
            data = await swarm.chat(name, [{"role": "user", "content": LONG}], max_tokens=32)
            assert data["choices"][0]["token_ids"] == long_reference[:32]
