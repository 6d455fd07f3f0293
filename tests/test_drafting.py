"""Drafting ahead (prompt lookup) through the real ring protocol and stage models in one process (swarm.stage.local):
greedy replies are transformers' generate token for token (near-tie rule: a verifying pass sums floats over several
rows), drafting stops while the model has more chats than stages, sampled replies keep the model's distribution
(the acceptance rule checked exactly as a function, and its draws counted), and the counters add up."""

from __future__ import annotations

import collections

import pytest
import torch

from exactness import check_reply, reference
from reference_model import load_reference_model
from swarm import messages
from swarm.stage import LocalRing, StageModel, stage_specs
from swarm.stage.drafting import propose
from swarm.stage.sampling import SamplingParams, accept_drafted, token_generator
from swarm.store.manifest import load_manifest

STEPS = 40


@pytest.fixture(scope="module")
def qwen3(tiny_model_dirs):
    """The tiny Qwen3: its greedy reply from PROMPT runs into repeats (67 67 67 67 ..., 187 187 187 187): guesses
    are kept there, and rejected elsewhere."""
    model_dir = tiny_model_dirs["qwen3"]
    return model_dir, load_reference_model(model_dir)


PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def ring_of(model_dir, stages: int) -> LocalRing:
    specs = stage_specs(load_manifest(model_dir).num_layers, stages)
    return LocalRing([StageModel.load_dir(model_dir, s) for s in specs], prefill_chunk=8)


def check_counters(spec, tokens: int) -> None:
    assert spec.spec_tokens == tokens
    assert 0 <= spec.spec_accepted <= spec.spec_drafted
    assert spec.spec_passes == spec.spec_tokens - spec.spec_accepted  # each pass: its kept guesses and one more


# --- the lookup ------------------------------------------------------------------------------------------------------


def test_propose_takes_the_longest_latest_match():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    seq = [1, 2, 3, 9, 2, 3, 4, 5, 6, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurs at 0: what followed it there
    assert propose(seq, 3) == [9, 2, 3]
    # a 2-gram only: (2, 3) last occurred at 4, followed by 4 5 6 (not 9 from position 1)
    assert propose([7, 2, 3, 9, 2, 3, 4, 5, 6, 8, 2, 3], 2) == [4, 5]
    assert propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert propose([1, 2, 3, 4, 2], 3) == []  # one token is not a match
    # the occurrence that shares the most with the end wins over a later, shorter one: (7, 8, 1, 2, 3) at 0
    # (followed by 50), not (1, 2, 3) at 7 (followed by 60) -- which line of a copy the reply is on
    assert propose([7, 8, 1, 2, 3, 50, 9, 1, 2, 3, 60, 7, 8, 1, 2, 3], 2) == [50, 9]
    assert propose([5, 6, 5, 6], 4) == [5, 6]  # up to the end of what is known
    assert propose(seq, 0) == []


# --- the acceptance rule -----------------------------------------------------------------------------------------


def test_acceptance_rule_keeps_the_distribution():
    """Each token comes out with the model's own probability whatever is guessed: over 20,000 seeded draws per
    guess the frequencies are p within 4 standard deviations, and a guess of probability 1 or 0 is always kept or
    never."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = 20_000
    for guess in (0, 2, 4):
        counts = collections.Counter(accept_drafted(probs, guess, token_generator(99, i)) for i in range(draws))
        for token, p in enumerate(probs.tolist()):
            sd = (p * (1 - p) / draws) ** 0.5
            assert abs(counts[token] / draws - p) <= 4 * sd + 1e-9, (guess, token, counts)
    certain = torch.tensor([0.0, 1.0, 0.0])
    assert {accept_drafted(certain, 1, token_generator(1, i)) for i in range(50)} == {1}
    assert 0 not in {accept_drafted(certain, 0, token_generator(1, i)) for i in range(50)}


# --- greedy replies ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_reply_with_drafting_is_generate(qwen3, tiny_model_dirs, stages):
    model_dir, model = qwen3
    want, margins = reference(model, PROMPT, STEPS)
    ring = ring_of(model_dir, stages)
    reply = ring.submit("a", PROMPT, STEPS, draft=3)
    ring.run()
    check_reply(reply.tokens, want, margins)
    spec = ring.times["a"][stages - 1]
    check_counters(spec, STEPS)
    assert spec.spec_accepted >= 1 and spec.spec_drafted > spec.spec_accepted, spec  # some kept, some not
    assert ring.holding() == [[]] * stages and not any(stage.requests() for stage in ring.stages)
    # a reply that rarely repeats (the tiny Llama's): the same as generate, whatever was guessed
    llama_dir = tiny_model_dirs["llama"]
    llama = load_reference_model(llama_dir)
    want, margins = reference(llama, PROMPT, STEPS)
    ring = ring_of(llama_dir, stages)
    reply = ring.submit("b", PROMPT, STEPS, draft=3)
    ring.run()
    check_reply(reply.tokens, want, margins)
    check_counters(ring.times["b"][stages - 1], STEPS)


def test_eos_and_max_tokens_cut_a_drafted_pass(qwen3):
    """A pass that would give several tokens stops at the end-of-sequence token or at max_tokens: nothing past it
    streams, and the reply is generate's."""
    model_dir, model = qwen3
    prompt = PROMPT
    want, margins = reference(model, prompt, STEPS)
    ring = ring_of(model_dir, 2)
    for max_tokens in (7, 13):
        reply = ring.submit(f"len{max_tokens}", prompt, max_tokens, draft=4)
        ring.run()
        check_reply(reply.tokens, want[:max_tokens], margins)
        assert reply.finish_reason == "length"
    eos = want[10]  # a token the reply reaches mid-loop, likely inside a drafted pass
    reply = ring.submit("eos", prompt, STEPS, eos=[eos], draft=4)
    ring.run()
    cut = want.index(eos) + 1
    check_reply(reply.tokens, want[:cut], margins)
    assert reply.finish_reason == "stop" and reply.tokens[-1] == eos
    assert ring.holding() == [[], []]


def test_greedy_logprobs_with_drafting_are_the_models(qwen3):
    model_dir, model = qwen3
    prompt = PROMPT
    ring = ring_of(model_dir, 2)
    reply = ring.submit("lp", prompt, 16, messages.Sampling(logprobs=3), draft=3)
    ring.run()
    assert len(reply.logprobs) == len(reply.tokens) == 16
    assert ring.times["lp"][1].spec_accepted > 0
    ids = list(prompt)
    for token, got in zip(reply.tokens, reply.logprobs):
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        assert token == int(want.argmax())
        assert got.logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert got.top_ids == torch.topk(want, 3).indices.tolist()
        ids.append(token)


def test_no_drafting_while_more_chats_than_stages(qwen3):
    """Three chats on two stages: no pass carries guesses, and every reply is still generate's."""
    model_dir, model = qwen3
    prompt = PROMPT
    want, margins = reference(model, prompt, 24)
    ring = ring_of(model_dir, 2)
    replies = [ring.submit(f"c{i}", prompt, 24, draft=3) for i in range(3)]
    ring.run()
    for reply in replies:
        check_reply(reply.tokens, want, margins)
    drafted = [ring.times[f"c{i}"][1].spec_drafted for i in range(3)]
    # the first chat starts alone for a pass or two (the others' prompts still on the way); once three run, none drafts
    assert sum(drafted) <= 2 * 3, drafted
    alone = ring.submit("alone", prompt, 24, draft=3)
    ring.run()
    check_reply(alone.tokens, want, margins)
    assert ring.times["alone"][1].spec_accepted >= 1


def test_sampled_reply_with_drafting_follows_the_acceptance_rule(qwen3):
    """Seeded sampled replies with drafting are exactly what the acceptance rule (checked above to keep the
    distribution) gives over transformers' own probabilities: each pass's guesses (the lookup's), each row's draw
    from the token's own seeded generator, the first guess that is not kept replaced by the rule's redraw."""
    model_dir, model = qwen3
    prompt = PROMPT * 2
    # a logit_bias towards four tokens makes the reply a shuffle of them: the lookup finds something to guess at
    # almost every pass, and the guesses are kept or not by chance
    bias = {5: 6.0, 17: 6.0, 42: 6.0, 99: 6.0}
    params = SamplingParams(temperature=0.8, top_k=20)
    ring = ring_of(model_dir, 2)
    drafted = accepted = 0
    for seed in range(6):
        sampling = messages.Sampling(temperature=0.8, top_k=20, seed=seed, bias_ids=list(bias),
                                     bias_values=list(bias.values()))
        reply = ring.submit(f"s{seed}", prompt, 16, sampling, draft=3)
        ring.run()
        drafted += ring.times[f"s{seed}"][1].spec_drafted
        accepted += ring.times[f"s{seed}"][1].spec_accepted
        check_counters(ring.times[f"s{seed}"][1], 16)
        want: list[int] = []
        guesses: list[int] = []  # the prompt's last chunk: no guesses
        while len(want) < 16:  # one pass: its guesses checked in turn, then (all kept) one more token
            for i in range(len(guesses) + 1):
                with torch.no_grad():
                    scores = model(torch.tensor([prompt + want])).logits[0, -1].float().reshape(1, -1)
                scores[0, list(bias)] += torch.tensor(list(bias.values()))
                probs = torch.softmax(params.warpers()(torch.empty((1, 0), dtype=torch.long), scores), dim=-1)[0]
                generator = token_generator(seed, len(want))
                if i < len(guesses):
                    want.append(accept_drafted(probs, guesses[i], generator))
                    if want[-1] != guesses[i]:
                        break
                else:
                    want.append(int(torch.multinomial(probs, 1, generator=generator)[0]))
            guesses = propose(prompt + want, min(3, 16 - len(want) - 1))
        assert reply.tokens == want, seed
    assert 0 < accepted < drafted, (accepted, drafted)


# --- the leader's side -------------------------------------------------------------------------------------------


def test_leader_drafts_only_on_rings_that_support_it():
    from types import SimpleNamespace as NS

    from swarm.leader.serving.drafting import sliding, tokens_ahead, with_drafting

    stages = [NS(plan=NS(fellow_id=1)), NS(plan=NS(fellow_id=2))]
    online = {1: NS(drafting=True), 2: NS(drafting=True)}
    llama = {"model_type": "llama"}
    serving = NS(speculative=3, config=llama, stages=stages)
    generate = messages.Generate("m", "r1", [1, 2, 3], 8, [2], messages.Sampling())
    assert with_drafting(generate, serving, online).draft == 3
    assert with_drafting(messages.Cancel("m", "r1"), serving, online) == messages.Cancel("m", "r1")
    assert tokens_ahead(NS(speculative=0, config=llama, stages=stages), online) == 0  # loaded with it off
    assert tokens_ahead(serving, {1: NS(drafting=True), 2: NS(drafting=False)}) == 0  # an older fellow
    assert tokens_ahead(serving, {1: NS(drafting=True)}) == 0  # a stage's fellow offline
    # sliding-window layers could not give rejected guesses back once their window is full
    assert sliding({"layer_types": ["full_attention", "sliding_attention"]})
    assert sliding({"sliding_window": 4096})  # Mistral's older configs: every layer
    assert not sliding({"sliding_window": 4096, "use_sliding_window": False})  # Qwen2's: off
    assert not sliding({"layer_types": ["full_attention"] * 4, "sliding_window": 4096})
    assert tokens_ahead(NS(speculative=3, config={"sliding_window": 16}, stages=stages), online) == 0
