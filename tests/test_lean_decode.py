"""The lean decode step (swarm.stage.lean_decode): taken by the Llama-shaped families once warm-up has checked it,
bit for bit the library's step at every quantization, and the replies still transformers' generate's."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY_MODELS
from reference_model import load_reference_model
from swarm.stage import LocalRing, StageModel, lean_decode, stage_specs
from swarm.store.manifest import load_manifest
from test_stage_slicing import NEW_TOKENS, PREFILL_CHUNK, PROMPTS, reference_reply

# Llama (the built-in model's family), Qwen3 (per-head query and key norms) and the DeepSeek-R1 distills' bodies:
# Llama 3 (rope scaling) and Qwen2 (biases on q/k/v), without sliding windows. The others have a window on every layer,
# fused projections of their own or Gemma's norms: they keep the library's step.
LEAN = {"llama", "qwen3", "r1-llama", "r1-qwen"}
# Which of 2 stages take it, where that is not "both" or "neither": the tiny Qwen2's first 3 layers (stage 0) attend
# to everything; its sliding window starts on layer 4 (stage 1).
LEAN_STAGES = {"qwen2": [True, False]}


def warmed_stages(model_dir, stages: int, quantization: str = "none") -> list[StageModel]:
    out = [StageModel.load_dir(model_dir, s, quantization=quantization)
           for s in stage_specs(load_manifest(model_dir).num_layers, stages)]
    for stage in out:
        stage.warm_up()
    return out


def count_lean_steps(stages: list[StageModel]) -> list[int]:
    counts = [0] * len(stages)
    for i, stage in enumerate(stages):
        if stage.lean is not None:
            forward = stage.lean.forward

            def counted(*args, i=i, forward=forward):
                counts[i] += 1
                return forward(*args)

            stage.lean.forward = counted
    return counts


@pytest.mark.parametrize("kind", list(TINY_MODELS))
def test_the_llama_shaped_families_take_the_lean_step(tiny_model_dirs, kind):
    stages = warmed_stages(tiny_model_dirs[kind], 2)
    assert [stage.lean is not None for stage in stages] == LEAN_STAGES.get(kind, [kind in LEAN] * 2)


@pytest.mark.parametrize("kind", sorted(LEAN))
def test_replies_through_the_lean_step_match_generate(tiny_model_dirs, kind):
    model_dir = tiny_model_dirs[kind]
    model = load_reference_model(model_dir)
    model.generation_config.eos_token_id = None
    stages = warmed_stages(model_dir, 2)
    counts = count_lean_steps(stages)
    chain = LocalRing(stages, prefill_chunk=PREFILL_CHUNK)
    for prompt in PROMPTS:
        want = reference_reply(model, prompt)
        assert len(set(want)) > 3, "the random model is degenerate; the comparison would prove little"
        assert chain.generate(prompt, NEW_TOKENS) == want
    # every pass went through the lean step on both stages: each reply's decode steps (its first token comes from the
    # prompt) and each prompt's chunks (7, 13 and 21 tokens in chunks of 5: the first from an empty cache, the others
    # masked against what is cached, the last of 21 one row)
    chunks = sum(math.ceil(len(p) / PREFILL_CHUNK) for p in PROMPTS)
    assert chunks == 10
    assert counts == [len(PROMPTS) * (NEW_TOKENS - 1) + chunks] * 2


@pytest.mark.parametrize("quantization", ["none", "int8", "int4-fast"])
def test_the_lean_step_is_the_library_step_to_the_bit(tiny_model_dirs, quantization):
    """The same stage with and without the lean step: every decode step's logits and hidden states are equal, and so
    are those of a pass of several rows after them (drafting ahead's verifying pass: every row's logits)."""
    model_dir = tiny_model_dirs["llama"]
    lean, library = warmed_stages(model_dir, 2, quantization), warmed_stages(model_dir, 2, quantization)
    for stage in library:
        stage.lean = None
    assert all(stage.lean is not None for stage in lean)
    outputs = []
    for stages in (lean, library):
        for stage in stages:
            stage.new_request("r")
        prompt = PROMPTS[1]
        hidden = stages[0].forward("r", 0, input_ids=torch.tensor([prompt]))
        logits = stages[1].forward("r", 0, hidden=hidden)
        steps = []
        for position in range(len(prompt), len(prompt) + 12):
            token = int(logits.argmax())
            hidden = stages[0].forward("r", position, input_ids=torch.tensor([[token]]))
            logits = stages[1].forward("r", position, hidden=hidden)
            steps.append((hidden, logits))
        guesses = torch.tensor([[int(logits.argmax()), 5, 17, 5, 9]])  # the pick and 4 guesses, one pass
        position += 1
        hidden = stages[0].forward("r", position, input_ids=guesses)
        steps.append((hidden, stages[1].forward("r", position, hidden=hidden, all_logits=True)))
        outputs.append(steps)
    for (lean_hidden, lean_logits), (hidden, logits) in zip(*outputs):
        assert torch.equal(lean_hidden, hidden)
        assert torch.equal(lean_logits, logits)


def test_a_lean_step_that_differs_is_not_taken(tiny_model_dirs, monkeypatch):
    """Warm-up's check has teeth: a lean step off by one rounding step in one place leaves the stage on the
    library's."""
    forward = lean_decode.LeanDecode.forward

    def off(self, states, position_ids, caches, *more):
        out = forward(self, states, position_ids, caches, *more)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(lean_decode.LeanDecode, "forward", off)
    stages = warmed_stages(tiny_model_dirs["llama"], 1)
    assert stages[0].lean is None


@pytest.mark.parametrize("quantization", ["none", "int4-fast"])
def test_chats_batched_through_the_lean_step_get_the_replies_they_get_alone(tiny_model_dirs, quantization):
    """Several requests decoding together: each row attends to its own cache, and each reply is the one the
    library's layers give it alone."""
    model_dir = tiny_model_dirs["llama"]
    library = [StageModel.load_dir(model_dir, s, quantization=quantization)
               for s in stage_specs(load_manifest(model_dir).num_layers, 2)]
    alone = [LocalRing(library, prefill_chunk=PREFILL_CHUNK).generate(p, NEW_TOKENS) for p in PROMPTS]
    stages = warmed_stages(model_dir, 2, quantization)
    rows = []
    for stage in stages:
        forward = stage.lean.forward

        def seen(states, position_ids, caches, *more, forward=forward):
            rows.append(len(caches))
            return forward(states, position_ids, caches, *more)

        stage.lean.forward = seen
    chain = LocalRing(stages, prefill_chunk=PREFILL_CHUNK)
    replies = [chain.submit(f"r{i}", prompt, NEW_TOKENS) for i, prompt in enumerate(PROMPTS)]
    chain.run()
    assert [r.tokens for r in replies] == alone
    assert max(rows) >= 2  # requests decoded together (the ring keeps the rest in flight on the other stage)
