"""A mixture of experts under the serving features, over real `swarm join` processes: a tiny random Qwen3-MoE with
drafting ahead on (SWARM_SERVE_SPECULATIVE=3: the verifying passes route each guessed row through its own experts)
answers 2 drafting chats and then 4 concurrent chats (batched decode) as transformers' generate does, then the fellow
of a stage is killed mid-reply and the standby takes the stage over with the reply still generate's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from conftest import shared_once
from exactness import check_reply, reference
from fleet import fellow_fleet, logs
from harness import running_swarm, wait_until

pytestmark = pytest.mark.e2e

CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=320, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, num_hidden_layers=4, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32)
# prompts that repeat themselves, so that the last stage's prompt lookup has guesses to send through the ring
CHATS = [[5, 17, 42, 99, 7, 5, 17, 42, 99, 7, 5, 17], [11, 12, 13, 11, 12, 13, 11, 12],
         [30, 31, 32, 33, 30, 31, 32, 33, 30], [1, 250, 31, 5, 1, 250, 31]]
CHAT_TOKENS = 24
LONG = [40, 41, 42, 43, 44, 40, 41, 42]  # the reply cut mid-way
LONG_TOKENS = 200


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, Path]:
    """(the transformers folder, the imported model dir) of the tiny Qwen3-MoE."""
    import transformers

    from swarm.store.importer import import_model

    def build(root: Path) -> None:
        torch.manual_seed(4321)
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**CONFIG))
        model.save_pretrained(root / "src")
        import_model(str(root / "src"), root / "models", "tiny-moe")

    root = shared_once(tmp_path_factory, "moe-serving", build)
    return root / "src", root / "models" / "tiny-moe"


async def _reply(swarm, name: str, prompt: list[int], tokens: int):
    """The greedy reply's tokens and its request (its stages' reported times)."""
    from swarm import messages
    from swarm.leader.serving.request import Reader, Request

    request = Request(model=name, prompt=prompt, max_tokens=tokens, sampling=messages.Sampling(), eos=[])
    await swarm.leader.serving.intake.submit(request)
    reader = Reader(request)
    while True:
        kind, value = await reader.next(120)
        assert kind != "error", value
        if kind == "done":
            return list(request.tokens), request


async def test_moe_drafts_batches_and_fails_over_as_generate(tmp_path, moe):
    import transformers

    source, model_dir = moe
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    expected = [reference(model, p, CHAT_TOKENS) for p in CHATS]
    long_want, long_margins = reference(model, LONG, LONG_TOKENS)
    name = model_dir.name
    with trio.fail_after(280):
        async with running_swarm(tmp_path, [model_dir], fellows=0,
                                 leader_env={"SWARM_SERVE_SPECULATIVE": "3"}) as swarm:
            async with fellow_fleet(swarm, tmp_path, 3, standby={2}) as fellows:
                try:
                    view = await swarm.load(name, 2)
                    placed = [s["fellow"] for s in view["stages"]]
                    assert sorted(placed) == ["fellow-0", "fellow-1"]
                    assert swarm.leader.serving.models[name].speculative == 3
                    async def chats(indices: list[int]) -> list:
                        got: dict[int, tuple] = {}

                        async def chat(i: int) -> None:
                            got[i] = await _reply(swarm, name, CHATS[i], CHAT_TOKENS)

                        async with trio.open_nursery() as nursery:
                            for i in indices:
                                nursery.start_soon(chat, i)
                        verdicts = [check_reply(got[i][0], *expected[i]) for i in indices]
                        assert verdicts == ["identical"] * len(indices), verdicts
                        return [got[i][1] for i in indices]

                    # as many chats as stages: each drafts (a stage guesses only while it has no more chats than
                    # the ring has stages, swarm.stage.drafting.draft_for), its verifying passes several rows each
                    requests = await chats([0, 1])
                    await wait_until(lambda: all(1 in r.stage_times for r in requests), 30)
                    drafted = sum(r.stage_times[1].spec_drafted for r in requests)
                    accepted = sum(r.stage_times[1].spec_accepted for r in requests)
                    assert drafted > 0 and accepted > 0, (drafted, accepted)
                    print(f"2 chats: {drafted} tokens guessed, {accepted} kept")
                    await chats([0, 1, 2, 3])  # more chats than stages: batched decode, rows grouped by expert

                    # the fellow of stage 1 killed mid-reply: the standby takes the stage, the reply goes on exact
                    victim = next(f for f in fellows if f.name == placed[1])
                    result: dict = {}

                    async def long_reply() -> None:
                        result["tokens"], _ = await _reply(swarm, name, LONG, LONG_TOKENS)

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(long_reply)
                        request = await wait_until(lambda: next(iter(swarm.leader.serving.requests.values()), None),
                                                   60)
                        await wait_until(lambda: len(request.tokens) >= 30, 120)
                        cut_at = len(request.tokens)
                        await trio.to_thread.run_sync(victim.kill)
                    assert cut_at < LONG_TOKENS
                    assert check_reply(result["tokens"], long_want, long_margins) == "identical", cut_at
                    view = (await swarm.http.get(f"/api/v1/models/{name}")).json()
                    assert view["status"] == "ready" and view["stages"][1]["fellow"] == "fellow-2", view
                except BaseException:
                    print(logs(fellows))
                    raise
