"""A 32,000-token prompt over 2 stages (issue 36): a tiny random Llama whose rope allows it (context 32,768, float32,
hidden 32, two layers: one a stage) answers exactly as transformers' generate; the stages stay within the memory
their plan gave them; no message on the wire is bigger than its limits (the prompt goes round in chunks, each a
message of its own); and a short chat keeps streaming while the long prompt prefills -- the ring takes at most one
prompt chunk per pass, so a decode token waits for one chunk a stage, never for the whole prompt. The leader holds
the long prompt once (the request's own list goes to stage 0 and the prefix cache's index alike), and refuses a
10 MB body for it before reading it."""

from __future__ import annotations

import json
import random
import statistics
import time

import pytest
import torch
import trio

from exactness import check_reply, reference
from harness import running_swarm, wait_until
from swarm import messages, wire
from swarm.leader.fleet.fellows import CONTROL_MAX_BYTES
from swarm.leader.serving.request import Request
from swarm.stage.prefix_cache import store_of
from swarm.tunnel.noise import MAX_MESSAGE_SIZE

pytestmark = pytest.mark.e2e

CONTEXT = 32_768
PROMPT_TOKENS = 32_000
REPLY = 8
CHUNK = 256  # SWARM_SERVE_PREFILL_CHUNK's default
HIDDEN = 32
PROMPT = [random.Random(36).randrange(3, 320) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def long_model(module_tmp):
    import transformers

    from swarm.store.importer import import_model

    root = module_tmp("long")
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_hidden_layers=2, vocab_size=320, max_position_embeddings=CONTEXT, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(36)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "src")
    import_model(str(root / "src"), root / "models", "long-llama")
    return root / "models" / "long-llama"


@pytest.fixture(scope="module")
def expected(long_model):
    from reference_model import load_reference_model

    return reference(load_reference_model(long_model), PROMPT, REPLY)  # ~15 s, 0.5 GB: sdpa never builds the mask


def cache_bytes(stage_model) -> int:
    """Bytes of every running request's KV cache on a stage, and of its prefix cache."""
    total = store_of(stage_model).bytes
    for rid in stage_model.requests():
        for layer in stage_model.request_cache(rid).layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    return total


async def test_a_32k_prompt_is_exact_within_its_plan_in_chunks_and_a_short_chat_streams_meanwhile(
        tmp_path, long_model, expected, monkeypatch):
    want, margins = expected
    name = long_model.name
    sizes: dict[str, int] = {}
    encode = wire.encode

    rows: list[list[int]] = []  # each Hidden's parts' rows

    def measured(message):  # every message the leader and the fellows (in this process) send
        data = encode(message)
        kind = getattr(message, "TYPE", None) or message.get("t", "?")
        sizes[kind] = max(sizes.get(kind, 0), len(data))
        if isinstance(message, messages.Hidden):
            rows.append([part.n for part in message.parts])
        return data

    monkeypatch.setattr(wire, "encode", measured)
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [long_model], fellows=2) as swarm:
            await swarm.load(name, 2)
            serving = swarm.leader.serving
            # the fellows said in their hello that they carry out prefix cache plans: the ring gets them
            assert all(conn.prefix_cache for conn in swarm.leader.hub.online.values())
            assert serving.prefix.ring_takes_plans(serving.models[name], swarm.leader.hub.online)
            plans = {s.plan.fellow_id: s.plan for s in serving.models[name].stages}
            stages = [swarm.stage(name, i).driver.stage_model for i in range(2)]
            peak = [0, 0]

            async def watch_memory():
                while True:
                    for i, stage in enumerate(stages):
                        peak[i] = max(peak[i], stage.parameter_bytes() + cache_bytes(stage))
                    await trio.sleep(0.05)

            # a 10 MB body for this model is refused from its Content-Length, before a byte of it is read
            began = time.monotonic()
            huge = await swarm.http.post("/v1/completions", content=b"x" * 10_000_000, timeout=60, headers={
                "content-type": "application/json"})
            assert huge.status_code == 413 and time.monotonic() - began < 10, huge.text
            assert "larger than" in huge.json()["error"]["message"], huge.text

            short = Request(model=name, prompt=[5, 6, 7], max_tokens=2000, sampling=messages.Sampling(), eos=[])
            long = Request(model=name, prompt=PROMPT, max_tokens=REPLY, sampling=messages.Sampling(), eos=[])
            arrivals: list[tuple[float, int]] = []

            async def follow_short():
                while not short.ended:
                    if short.tokens and (not arrivals or arrivals[-1][1] != len(short.tokens)):
                        arrivals.append((trio.current_time(), len(short.tokens)))
                    await short.changed.wait()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_memory)
                await serving.intake.submit(short)
                nursery.start_soon(follow_short)
                await wait_until(lambda: len(short.tokens) >= 3, 60)
                await serving.intake.submit(long)
                # the leader holds the long prompt once: stage 0's message and the prefix cache's index share it
                assert long.generate_message().prompt is long.prompt
                assert all(reply.prompt is long.prompt or reply.prompt is short.prompt
                           for reply in serving.prefix.indexes[name].replies.values())
                await wait_until(lambda: long.first_token_at is not None, 240)
                prefill_began, prefill_ended = long.started_at, long.first_token_at
                await wait_until(lambda: long.ended, 60)
                serving.cancel(short)
                nursery.cancel_scope.cancel()

            assert long.error is None, long.error
            outcome = check_reply(long.tokens, want, margins)
            assert outcome == "identical" or outcome.startswith("left"), outcome
            # the stages held no more than their plans: weights, one full-length conversation's KV, the margin
            for i in range(2):
                plan = next(p for p in plans.values() if p.index == i)
                assert peak[i] <= plan.need_bytes, (i, peak[i], plan.need_bytes)
            # the wire: the prompt went round in chunks (a Hidden is one chunk's rows), nothing near a limit
            # (the first chunk's Hidden also carries the request's start: its prefix cache plan names the prompt's
            # 1,000 blocks, ~20 KB; the Generate to stage 0 is the 32,000 ids, ~84 KB)
            widest = max(rows, key=sum)
            assert sum(widest) <= CHUNK + 1 and max(max(r) for r in rows) <= CHUNK, widest  # a chunk, a decode row
            assert max(sizes.values()) < MAX_MESSAGE_SIZE and sizes["tokens"] < CONTROL_MAX_BYTES, sizes
            # the short chat streamed all along: between two of its tokens at most about one chunk a stage
            chunks = -(-PROMPT_TOKENS // CHUNK)
            chunk_s = (prefill_ended - prefill_began) / chunks  # a chunk's turn through the ring, on average
            during = [b - a for (a, _), (b, _) in zip(arrivals, arrivals[1:])
                      if prefill_began <= a and b <= prefill_ended]
            print(f"32k prompt: prefill {prefill_ended - prefill_began:.1f} s in {chunks} chunks ({chunk_s * 1000:.0f} "
                  f"ms a chunk); the short chat's gaps meanwhile: {len(during)}, median "
                  f"{statistics.median(during) * 1000:.0f} ms, max {max(during) * 1000:.0f} ms; stage peaks "
                  f"{[round(p / 1e6, 1) for p in peak]} MB of plans "
                  f"{[round(p.need_bytes / 1e6, 1) for p in plans.values()]} MB; largest messages {json.dumps(sizes)} "
                  f"(the widest Hidden: rows {widest}); "
                  f"reply {outcome}")
            assert len(during) >= chunks // 4, "the short chat waited for the long prompt's chunks"
            # a decode token waits for one chunk on each stage (the two stages work on neighbouring chunks at once),
            # then runs its own passes: about two chunks' time between tokens. Measured on a shared 2-core VM (load
            # ~14): median 503-767 ms against 229-264 ms a chunk (2.2-2.9x); single gaps up to 2.4 s where the
            # machine's other work took the cores -- never the whole prefill (29-33 s), as a scheduler that does not
            # interleave would give.
            assert statistics.median(during) <= 4 * chunk_s, (statistics.median(during), chunk_s)
            assert max(during) <= 0.2 * (prefill_ended - prefill_began), (max(during), prefill_ended - prefill_began)
