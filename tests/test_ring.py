"""The ring end to end on loopback: a greedy reply over 2 stages is token for token transformers' generate."""

from __future__ import annotations

import pytest
import torch
import trio

from harness import running_swarm, wait_until

pytestmark = pytest.mark.e2e

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def reference(smollm_model_dir):
    """transformers' own float32 load of the packaged GGUF file: the imported model keeps the file's blocks and the
    stages widen them to float32 at `none`, so the ring must answer what the file's model answers."""
    from transformers import AutoModelForCausalLM

    from swarm.leader.chat.chat_format import encode_chat
    from swarm.store.importer import builtin_gguf_path
    from swarm.store.manifest import load_manifest

    assert load_manifest(smollm_model_dir).storage == "gguf"
    path = builtin_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    out = {}
    for prompt in PROMPTS:
        ids = encode_chat(smollm_model_dir, [{"role": "user", "content": prompt}], None)
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        out[prompt] = gen[0, len(ids):].tolist()
    return out


async def _replies(tmp_path, model_dir, transport):
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [model_dir], leader_env={"SWARM_PIPELINE_TRANSPORT": transport}) as swarm:
            view = await swarm.load(model_dir.name, 2)
            assert [s["layers"] for s in view["stages"]] == [[0, 15], [15, 30]]
            replies = {}
            for prompt in PROMPTS:
                data = await swarm.chat(model_dir.name, [{"role": "user", "content": prompt}], max_tokens=24)
                replies[prompt] = data
            paths = {f.name: [s.driver.out_hop.path for s in f.stages.values()] for f in swarm.fellows}
            # A heartbeat after the replies brings the hops' figures to the leader (each one replaces the entries).
            before = dict(swarm.leader.serving.hop_stats)
            stats = swarm.leader.serving.hop_stats
            await wait_until(lambda: len(stats) == 2 and all(stats[k] is not before.get(k) for k in stats), 10,
                             message=lambda: f"hop stats: {stats}")
            perf = (await swarm.http.get(f"/api/v1/models/{model_dir.name}/performance")).json()
            hour = (await swarm.http.get(f"/api/v1/models/{model_dir.name}/performance?range=1h")).json()
            bad = await swarm.http.get(f"/api/v1/models/{model_dir.name}/performance?range=2h")
            assert bad.status_code == 400 and "use one of 15m, 1h, 6h, 24h, 7d" in bad.json()["error"]["message"]
            check_performance(perf, hour, replies)
            return replies, paths, perf


def check_performance(perf: dict, hour: dict, replies: dict) -> None:
    """The performance view after the replies (issue 12): speed, series, pipeline, hops, split, last 15 minutes."""
    tokens = sum(d["usage"]["completion_tokens"] for d in replies.values())
    assert perf["range"] == "15m" and perf["step_s"] == 30 and len(perf["series"]) == 30
    assert sum(p["replies"] for p in perf["series"]) == len(replies)
    assert sum(p["tokens"] for p in perf["series"]) == tokens == perf["speed"]["tokens"]
    assert perf["speed"]["tokens_per_s"] > 0 and perf["speed"]["median_ttft_ms"] > 0
    assert [(s["fellow"], s["layers"]) for s in perf["stages"]] == [("fellow-0", [0, 15]), ("fellow-1", [15, 30])]
    for stage in perf["stages"]:  # these fellows compute on the CPU: their card shows its cores, load and RAM
        assert stage["online"] and stage["model_bytes"] > 0 and stage["gpus"] == []
        cpu = stage["cpu"]
        assert cpu["cores"] >= 1 and 0 < cpu["ram_used_bytes"] <= cpu["ram_total_bytes"]
        assert 0 <= cpu["load_percent"] <= 100
    assert [h["direction"] for h in perf["hops"]] == ["forward", "back"]
    split = perf["time_per_token"]
    # the fellows measured it (swarm.timing's split, kept with each record): stage 0, the link, stage 1
    assert split["source"] == "fellows" and split["replies"] == len(replies) and split["ms_per_token"] > 0
    assert [p["label"] for p in split["parts"]] == ["stage 0", "link", "stage 1"]
    assert [p["fellow"] for p in split["parts"]] == ["fellow-0", None, "fellow-1"]
    assert split["prompt_ms"] > 0 and 576 * 4 <= split["bytes_per_token"]["forward"] < 576 * 4 + 400
    assert all(h["link_ms"] is not None and h["link_ms"] >= 0 for h in perf["hops"])
    assert abs(sum(p["share"] for p in split["parts"]) - 1) < 0.01
    assert perf["bottleneck"].endswith(".") and "takes most of each token" in perf["bottleneck"]
    table = perf["last_15m"]
    assert (table["replies"], table["failed"], table["tokens"]) == (len(replies), 0, tokens)
    assert table["tokens_per_s"]["p50"] > 0 and table["ttft_ms"]["p95"] >= table["ttft_ms"]["p50"] > 0
    assert table["mean_ms_between_tokens"] > 0
    # an hour rolls up from the database (with what is not written yet): the same replies in 2-minute steps
    assert hour["step_s"] == 120 and sum(p["replies"] for p in hour["series"]) == len(replies)
    assert hour["speed"]["tokens"] == tokens


@pytest.mark.parametrize("transport", ["auto", "relay"])
async def test_two_stage_ring_matches_generate(tmp_path, smollm_model_dir, reference, transport):
    replies, paths, perf = await _replies(tmp_path, smollm_model_dir, transport)
    expected_path = "direct" if transport == "auto" else "relay"
    assert paths == {"fellow-0": [expected_path], "fellow-1": [expected_path]}
    hops = perf["hops"]
    assert [(h["from"], h["to"], h["transport"]) for h in hops] == [
        ("fellow-0", "fellow-1", expected_path), ("fellow-1", "fellow-0", expected_path)]
    assert all(h["rtt_ms"] is not None and h["rtt_ms"] < 1000 for h in hops)
    # forward: one float32 hidden state of 576 values per token; back: just the token
    assert 576 * 4 < hops[0]["bytes_per_token"] < 576 * 4 + 400
    assert hops[1]["bytes_per_token"] < 300
    for prompt, data in replies.items():
        choice = data["choices"][0]
        want = reference[prompt]
        eos = 2
        if eos in want:
            want = want[: want.index(eos) + 1]
        assert choice["token_ids"] == want, prompt
        assert choice["finish_reason"] == ("stop" if want[-1] == eos else "length")
        assert data["usage"]["completion_tokens"] == len(want)
        assert data["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert "Paris" in replies[PROMPTS[0]]["choices"][0]["message"]["content"]


def _expected(reference, prompt):
    want = reference[prompt]
    return want[: want.index(2) + 1] if 2 in want else want


async def test_unreachable_direct_address_falls_back_to_relay_and_strangers_are_refused(
    tmp_path, smollm_model_dir, reference
):
    from swarm.errors import HandshakeFailed, PeerRejected
    from swarm.tunnel.channel import NoiseChannel, StreamFrameTransport
    from swarm.tunnel.keys import generate_private_key

    name = smollm_model_dir.name
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir]) as swarm:
            # The leader announces fellow-1's serving port as a port nobody listens on.
            with trio.socket.socket() as s:
                await s.bind(("127.0.0.1", 0))
                dead_port = s.getsockname()[1]
            real_port = swarm.fellows[1].serve_port
            for conn in swarm.leader.hub.online.values():
                if conn.name == "fellow-1":
                    conn.serve_port = dead_port
            await swarm.load(name, 2)
            data = await swarm.chat(name, [{"role": "user", "content": PROMPTS[0]}], max_tokens=24)
            assert data["choices"][0]["token_ids"] == _expected(reference, PROMPTS[0])
            assert swarm.fellows[0].stages[name].driver.out_hop.path == "relay"

            # A peer whose key the leader did not vouch for gets nothing from a fellow's serving port.
            hop_id = swarm.fellows[1].stages[name].hop_in.hop_id
            stream = await trio.open_tcp_stream("127.0.0.1", real_port)
            with pytest.raises((HandshakeFailed, PeerRejected)):
                await NoiseChannel.connect(StreamFrameTransport(stream), generate_private_key(),
                                           swarm.fellows[1].public, payload=hop_id.encode())

            # ...nor from the relay: a stranger's credential cannot join a hop's channel.
            from httpx import AsyncClient
            async with AsyncClient(base_url=swarm.url) as http:
                r = await http.get(f"/api/v1/models/{name}/files/config.json",
                                   headers={"authorization": "Bearer swn_not-a-credential"})
                assert r.status_code == 401


async def test_direct_link_failing_before_the_first_token_is_retried_over_the_relay_and_stop_frees_stages(
    tmp_path, smollm_model_dir, reference
):
    from swarm.errors import LinkClosed

    name = smollm_model_dir.name
    with trio.fail_after(300):
        async with running_swarm(tmp_path, [smollm_model_dir]) as swarm:
            await swarm.load(name, 2)
            first = await swarm.chat(name, [{"role": "user", "content": PROMPTS[1]}], max_tokens=24)
            assert first["choices"][0]["token_ids"] == _expected(reference, PROMPTS[1])
            hop = swarm.stage(name, 0).driver.out_hop  # stage 0 -> 1: it carries the prompt's hidden states
            assert hop.path == "direct"

            # The direct link breaks under the next request's first message.
            channel = hop._channel
            real_send = channel.send

            async def broken_send(frame):
                if frame[0] not in (0, 1):  # a keepalive ping, not a ring message
                    return await real_send(frame)
                channel.send = real_send
                raise LinkClosed("simulated: the direct link dropped")

            channel.send = broken_send
            data = await swarm.chat(name, [{"role": "user", "content": PROMPTS[0]}], max_tokens=24)
            assert data["choices"][0]["token_ids"] == _expected(reference, PROMPTS[0])
            assert hop.path == "relay"

            # Stop: an explicit cancel ends generation on every fellow.
            body = {"model": name, "messages": [{"role": "user", "content": "Write a very long story."}],
                    "max_tokens": 2000, "temperature": 0, "stream": True}
            async with swarm.http.stream("POST", "/v1/chat/completions", json=body) as response:
                rid = response.headers["x-swarm-request-id"]
                chunks = 0
                lines = response.aiter_lines()  # held: a dropped iterator would close the stream (and so cancel)
                async for line in lines:
                    if line.startswith("data: "):
                        chunks += 1
                    if chunks >= 5:
                        break
                live = swarm.leader.serving.find(rid)
                assert live is not None, "the reply ended before Stop"
                r = await swarm.http.post(f"/api/v1/requests/{rid}/cancel")
                assert r.json() == {"cancelled": True}
            for _ in range(100):
                busy = [f.name for f in swarm.fellows if f.stages[name].driver.stage_model.requests()]
                if not busy and not swarm.leader.serving.requests:
                    break
                await trio.sleep(0.05)
            assert busy == [] and swarm.leader.serving.requests == {}
