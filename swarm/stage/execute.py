"""Computing a batch of ring work on a stage: the forward pass, sampling on the last stage, and the hidden states
made ready for the wire -- everything torch does for one step of the ring protocol, run by the driver in a worker
thread so that neither compute nor the copy off the GPU ever blocks the event loop.
"""

from __future__ import annotations

import dataclasses

import torch

from swarm import messages, wire
from swarm.stage import prefix_cache, verify
from swarm.stage.grammar import constraint
from swarm.stage.protocol_records import Output, Work
from swarm.stage.ragged import forward_batch, forward_one
from swarm.stage.sampling import (
    IMPOSSIBLE,
    SamplingParams,
    penalise,
    sample,
    sample_with_logprobs,
    token_generator,
)
from swarm.stage.slice import StageModel


def run_batch(stage: StageModel, batch: list[Work], threads: int | None = None) -> Output:
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # in this worker thread: OpenMP keeps the count per calling thread
    output = _run(stage, batch)
    prefix_cache.after(stage, batch)  # the prompts' blocks the leader wants kept, and those it evicts
    if stage.drafter is not None and stage.spec.is_last:  # a draft model beside the last stage guesses ahead
        output = stage.drafter.guesses(stage, batch, output)
    return output


def _run(stage: StageModel, batch: list[Work]) -> Output:
    verify.align(stage, batch)  # drafting ahead: rejected guesses leave the caches first
    if stage.spec.is_last and any(verify.verifying(work) for work in batch):
        return verify.run(stage, batch, lambda rest: _run(stage, rest))
    if stage.spec.is_last and any(_wants_prompt_logprobs(work) for work in batch):
        return _with_prompt_logprobs(stage, batch)
    if len(batch) > 1:
        return _run_together(stage, batch)
    hidden_out: list[torch.Tensor] = []
    tokens: list[int | None] = []
    for work in batch:
        if work.start:
            # a first chunk starts a fresh cache (a replayed request starts over), or one of the prompt's cached blocks
            prefix_cache.begin(stage, work)
        if work.ids is not None:
            out = stage.forward(work.rid, work.pos, input_ids=torch.tensor([work.ids], dtype=torch.long),
                                want_logits=work.last, alone=not work.prefill)
        else:
            rows = work.rows
            assert rows is not None  # a work item carries its token ids or its rows of the hidden state
            hidden = rows.source.tensor()[:, rows.row : rows.row + rows.n]
            out = stage.forward(work.rid, work.pos, hidden=hidden, want_logits=work.last, alone=not work.prefill)
        fan_out(stage, work)
        if stage.spec.is_last:
            tokens.append(_pick(stage, work, out))
        else:
            assert out is not None  # a stage before the last always passes its hidden state on
            hidden_out.append(out)
    if stage.spec.is_last:
        return _sampled(tokens)
    states = hidden_out[0] if len(hidden_out) == 1 else torch.cat(hidden_out, dim=1)
    return Output(hidden=wire.tensor_to_wire(states))


def sampling_params(sampling: messages.Sampling) -> SamplingParams:
    return SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          min_p=sampling.min_p, seed=sampling.seed)


def fan_out(stage: StageModel, work: Work) -> None:
    """A group's last prompt chunk is computed: the prompt's KV cache goes to each sibling (copies, and the carrier's
    own to the last one), so the siblings decode on their own from here without prefilling again."""
    if work.fans_out:
        stage.fan_out(work.rid, [member.rid for member in work.request.members])


def _pick(stage: StageModel, work: Work, logits: torch.Tensor | None):
    """What the last stage draws after ``work``: nothing (a prompt chunk before the last), the request's next token
    with its logprobs, or -- a group's last prompt chunk -- each sibling's first, from the same logits."""
    if not work.fans_out and not work.last:
        return None
    assert logits is not None  # the last chunk asked for its logits (want_logits=work.last)
    if work.fans_out:
        return [_sample(stage, member, logits) for member in work.request.members]
    return _sample(stage, work.request, logits)


def _sample(stage: StageModel, request, logits: torch.Tensor) -> tuple[int, messages.TokenLogprob | None]:
    """The request's next token (and its logprobs, when it asked for them), from the logits of its last row."""
    sampling = request.sampling
    params = sampling_params(sampling)
    generator = None
    if not params.greedy:  # on the CPU: the logits are moved there to sample
        generator = token_generator(params.seed, request.start.drawn + request.generated)
    logits = logits.cpu()
    if sampling.bias_ids:  # logit_bias, before everything else (OpenAI's order)
        logits = logits.float().clone()
        logits[torch.tensor(sampling.bias_ids, dtype=torch.long)] += torch.tensor(sampling.bias_values)
    context = request.start.context
    if context is not None and sampling.penalised:
        # the reply so far: the tokens a resent request had before this attempt (the prompt ends with them), then
        # this attempt's
        reply = context[len(context) - request.start.drawn :] + request.reply
        logits = penalise(logits, presence=sampling.presence_penalty, frequency=sampling.frequency_penalty,
                          repetition=sampling.repetition_penalty, context=context + request.reply, reply=reply)
    grammar = constraint(stage, request)
    if grammar is not None:
        logits = grammar.apply(logits)  # only the tokens that can continue the grammar
    if sampling.logprobs is None:
        token, entry = sample(logits, params, generator), None
    else:
        token, logprob, top_ids, top_logprobs = sample_with_logprobs(logits, params, generator, sampling.logprobs)
        token, entry = token, messages.TokenLogprob(logprob, top_ids, top_logprobs)
    if grammar is not None:
        grammar.consume(token)
    return token, entry


def _wants_prompt_logprobs(work: Work) -> bool:
    return work.prefill and work.request.sampling.prompt_logprobs is not None


def _with_prompt_logprobs(stage: StageModel, batch: list[Work]) -> Output:
    """A last stage's batch where some prompt chunks want their prompt's logprobs: those are computed alone, with
    the logits of every row; the rest of the batch as usual."""
    rest = [work for work in batch if not _wants_prompt_logprobs(work)]
    done = _run(stage, rest) if rest else Output(tokens=[])
    assert done.tokens is not None  # a last stage's output
    results = dict(zip(map(id, rest), zip(done.tokens, done.logprobs or [None] * len(rest),
                                          done.fanned or [None] * len(rest))))
    picked, prompt_logprobs = [], []
    for work in batch:
        if id(work) in results:
            token, logprob, group = results[id(work)]
            picked.append(group if group is not None else (token, logprob) if token is not None else None)
            entries = None
        else:
            if work.start:
                prefix_cache.begin(stage, work)
            logits = forward_one(stage, work, all_logits=True)
            fan_out(stage, work)
            logits = logits.cpu()
            entries = prompt_entries(work, logits)
            picked.append(_pick(stage, work, logits[-1]))
        prompt_logprobs.append(entries)
    return dataclasses.replace(_sampled(picked), prompt_logprobs=prompt_logprobs)


def prompt_entries(work: Work, logits: torch.Tensor) -> list[messages.TokenLogprob]:
    """The logprobs of the prompt tokens that the rows of ``work`` predict (row r: the token at pos + r + 1), in the
    model's own distribution (no temperature, no filters), with the request's number of alternatives."""
    request = work.request
    context, top = request.start.context, request.sampling.prompt_logprobs
    n = max(0, min(work.n, request.start.prompt_len - 1 - work.pos))
    if n == 0 or context is None:
        return []
    lp = torch.log_softmax(logits[:n].float(), dim=-1)
    targets = torch.tensor(context[work.pos + 1 : work.pos + 1 + n], dtype=torch.long)
    chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
    assert top is not None  # only a request that asked for prompt logprobs comes here
    if top > 0:
        top_values, top_ids = torch.topk(lp, top, dim=-1)
        values, ids = top_values.tolist(), top_ids.tolist()
    else:
        values, ids = [[]] * n, [[]] * n
    return [messages.TokenLogprob(max(c, IMPOSSIBLE), i, [max(v, IMPOSSIBLE) for v in vs])
            for c, i, vs in zip(chosen, ids, values)]


def _sampled(results: list) -> Output:
    """The last stage's Output from what :func:`_pick` gave for each piece of work."""
    single = [r if isinstance(r, tuple) else None for r in results]
    tokens = [r[0] if r is not None else None for r in single]
    logprobs = [r[1] if r is not None else None for r in single]
    fanned = [r if isinstance(r, list) else None for r in results]
    return Output(tokens=tokens, logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
                  fanned=fanned if any(f is not None for f in fanned) else None)


def _run_together(stage: StageModel, batch: list[Work]) -> Output:
    """Several requests in one pass (swarm.stage.ragged): each weight is read once for all of them."""
    items = []
    for work in batch:
        if work.start:
            prefix_cache.begin(stage, work)
        if work.ids is not None:
            x = torch.tensor([work.ids], dtype=torch.long)
        else:
            rows = work.rows
            assert rows is not None  # a work item carries its token ids or its rows of the hidden state
            x = rows.source.tensor()[:, rows.row : rows.row + rows.n]
        items.append((work.rid, work.pos, x, work.last))
    out = forward_batch(stage, items, [not work.prefill for work in batch])
    for work in batch:
        fan_out(stage, work)
    if not stage.spec.is_last:
        return Output(hidden=wire.tensor_to_wire(out))
    return _sampled([_pick(stage, work, logits) for work, logits in zip(batch, out)])
