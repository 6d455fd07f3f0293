"""The last stage's logprobs and penalties, through the real ring protocol and stage models in one process
(swarm.stage.local), checked against transformers' own model, logits processors and log_softmax."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from reference_model import load_reference_model
from swarm import messages
from swarm.stage import LocalRing, StageModel, stage_specs
from swarm.stage.sampling import SamplingParams
from swarm.store.manifest import load_manifest

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
STEPS = 12


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    return model_dir, load_reference_model(model_dir)


def ring_of(model_dir, stages=2) -> LocalRing:
    specs = stage_specs(load_manifest(model_dir).num_layers, stages)
    return LocalRing([StageModel.load_dir(model_dir, s) for s in specs], prefill_chunk=4)


def last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_greedy_logprobs_are_transformers_log_softmax(llama):
    model_dir, model = llama
    ring = ring_of(model_dir)
    reply = ring.submit("a", PROMPT, STEPS, messages.Sampling(logprobs=5))
    ring.run()
    assert len(reply.tokens) == len(reply.logprobs) == STEPS
    ids = list(PROMPT)
    for token, got in zip(reply.tokens, reply.logprobs):
        want = torch.log_softmax(last_logits(model, ids), dim=-1)
        assert token == int(want.argmax())
        assert got.logprob == pytest.approx(float(want[token]), abs=1e-4)
        values, top = torch.topk(want, 5)
        assert got.top_ids == top.tolist()
        assert got.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)
        ids.append(token)


def test_sampled_logprobs_are_of_the_filtered_distribution_and_change_no_draw(llama):
    model_dir, model = llama
    sampling = messages.Sampling(temperature=0.8, top_k=10, top_p=0.9, seed=7)
    ring = ring_of(model_dir)
    plain = ring.submit("plain", PROMPT, STEPS, sampling)
    with_lp = ring.submit("lp", PROMPT, STEPS, messages.Sampling(**{**sampling.__dict__, "logprobs": 3}))
    ring.run()
    assert with_lp.tokens == plain.tokens and not plain.logprobs  # asking for logprobs does not change the reply
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    ids = list(PROMPT)
    for token, got in zip(with_lp.tokens, with_lp.logprobs):
        scores = params.warpers()(torch.empty((1, 0), dtype=torch.long), last_logits(model, ids).reshape(1, -1))
        want = torch.log_softmax(scores, dim=-1)[0]
        assert got.logprob == pytest.approx(float(want[token]), abs=1e-4) and got.logprob > -9999
        assert got.top_logprobs == pytest.approx(torch.topk(want, 3).values.tolist(), abs=1e-4)
        ids.append(token)


@pytest.mark.parametrize("penalty", [1.5, 0.3])  # below 1 favours what was said: this random model then repeats
def test_repetition_penalty_is_transformers_generate(llama, penalty):
    model_dir, model = llama
    ring = ring_of(model_dir)
    reply = ring.submit("a", PROMPT, STEPS, messages.Sampling(repetition_penalty=penalty))
    plain = ring.submit("b", PROMPT, STEPS)
    ring.run()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False,
                             repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    assert reply.tokens == out[0, len(PROMPT):].tolist()
    if penalty < 1:
        assert plain.tokens != reply.tokens  # the penalty changed something worth checking


def penalised_greedy(model, prompt, steps, presence, frequency, repetition=1.0) -> list[int]:
    """OpenAI's presence and frequency penalties over the reply, written out from their definition."""
    ids, reply = list(prompt), []
    for _ in range(steps):
        logits = last_logits(model, ids).reshape(1, -1)
        if repetition != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), logits)
        logits = logits[0]
        for token in set(reply):
            logits[token] -= presence + frequency * reply.count(token)
        token = int(logits.argmax())
        ids.append(token)
        reply.append(token)
    return reply


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.0), (0.5, 0.7), (-2.0, 0.0), (0.0, -1.5)])
def test_presence_and_frequency_penalties_are_openais(llama, presence, frequency):
    model_dir, model = llama
    ring = ring_of(model_dir)
    reply = ring.submit("a", PROMPT, STEPS, messages.Sampling(presence_penalty=presence, frequency_penalty=frequency))
    plain = ring.submit("b", PROMPT, STEPS)
    ring.run()
    assert reply.tokens == penalised_greedy(model, PROMPT, STEPS, presence, frequency)
    if presence < 0 or frequency < 0:  # negative values favour repeating: this random model then does
        assert plain.tokens != reply.tokens


def test_a_resent_request_keeps_counting_the_reply_it_had(llama):
    """After a failover the leader sends the prompt plus the tokens already streamed (drawn): the penalties must
    still count those as the reply's."""
    model_dir, model = llama
    sampling = messages.Sampling(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.2)
    want = penalised_greedy(model, PROMPT, STEPS, 0.8, 0.6, 1.2)
    ring = ring_of(model_dir, stages=3)
    ring.replies["again"] = reply = type(ring.submit("x", PROMPT, 1))()
    ring.run()
    ring.inboxes[0].append(messages.Generate(ring.model, "again", PROMPT + want[:5], STEPS - 5, [], sampling, drawn=5))
    ring.run()
    assert want[:5] + reply.tokens == want


@pytest.mark.parametrize("stages", [1, 2])
def test_prompt_logprobs_are_the_models_over_every_chunk(llama, stages):
    """Every prompt token after the first gets the model's log-probability of it (chunks of 4: the rows of every
    chunk count), with its alternatives; the reply itself is unchanged."""
    model_dir, model = llama
    ring = ring_of(model_dir, stages)
    reply = ring.submit("a", PROMPT, 3, messages.Sampling(prompt_logprobs=2, logprobs=0))
    plain = ring.submit("b", PROMPT, 3)
    ring.run()
    assert reply.tokens == plain.tokens and len(reply.logprobs) == 3
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    assert len(reply.prompt_logprobs) == len(PROMPT) - 1
    for position, got in enumerate(reply.prompt_logprobs, start=1):
        assert got.logprob == pytest.approx(float(want[position - 1, PROMPT[position]]), abs=1e-4)
        values, ids = torch.topk(want[position - 1], 2)
        assert got.top_ids == ids.tolist() and got.top_logprobs == pytest.approx(values.tolist(), abs=1e-4)
    assert ring.holding() == [[] for _ in range(stages)]


def test_logit_bias_is_added_before_everything_else(llama):
    model_dir, model = llama
    ring = ring_of(model_dir)
    plain = ring.submit("plain", PROMPT, 4)
    ring.run()
    first = plain.tokens[0]
    banned = ring.submit("banned", PROMPT, 4, messages.Sampling(bias_ids=[first], bias_values=[-100.0], logprobs=0))
    forced = ring.submit("forced", PROMPT, 4, messages.Sampling(bias_ids=[7], bias_values=[100.0]))
    ring.run()
    logits = last_logits(model, PROMPT)
    logits[first] -= 100
    assert banned.tokens[0] == int(logits.argmax()) != first
    assert banned.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits, -1)[banned.tokens[0]]),
                                                       abs=1e-4)
    assert forced.tokens == [7, 7, 7, 7]


@pytest.mark.parametrize("stages", [1, 2])
def test_sampled_choices_prefill_once_and_draw_what_separate_requests_draw(llama, stages):
    """A group of four sampled choices: every stage computes the prompt once (not four times), copies its KV cache to
    each choice, and each choice's reply (and logprobs) is what a request of its own with the same seed gets."""
    model_dir, _ = llama
    prompt = PROMPT * 3  # 24 tokens: six chunks of 4
    sampling = messages.Sampling(temperature=1.0, top_k=50, logprobs=2, frequency_penalty=0.5)
    seeds = [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    ring = ring_of(model_dir, stages)
    group = ring.submit_group("g", seeds, prompt, STEPS, sampling)
    ring.run()
    assert [p.prefill_tokens for p in ring.protocols] == [len(prompt)] * stages
    assert all(s.requests() == [] for s in ring.stages)
    apart = ring_of(model_dir, stages)
    alone = {rid: apart.submit(rid, prompt, STEPS, messages.Sampling(**{**sampling.__dict__, "seed": seed}))
             for rid, seed in seeds}
    apart.run()
    assert [p.prefill_tokens for p in apart.protocols] == [4 * len(prompt)] * stages
    for rid, _ in seeds:
        assert group[rid].tokens == alone[rid].tokens and len(group[rid].tokens) == STEPS
        assert [e.logprob for e in group[rid].logprobs] == pytest.approx([e.logprob for e in alone[rid].logprobs],
                                                                         abs=1e-4)
    assert len({tuple(r.tokens) for r in group.values()}) > 1  # the choices draw on their own
