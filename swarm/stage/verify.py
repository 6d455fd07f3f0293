"""The last stage's side of drafting ahead, in torch: the pass that runs a sampled token and the tokens guessed after
it (swarm.stage.drafting) computes every row's logits, and keeps the guesses its model agrees with.

Greedy: a guess is kept while it is the row before's argmax; the first row that disagrees gives its own argmax (or,
all kept, the last row gives one more). So the reply is the one without drafting, token for token -- up to the
order floats are summed in over several rows (a near-tie may tip) -- except at int4-fast on CPU, where each row of the
pass computes exactly its decode step's bits (swarm.stage.compiled_decode). Sampled: each guess is kept by speculative
sampling's acceptance rule (swarm.stage.sampling.accept_drafted), which keeps the model's distribution.

Every stage (this one too) holds the rejected rows in its KV cache after the pass; :func:`align` forgets them when
the request's next pass starts at an earlier position than the cache's end.
"""

from __future__ import annotations

import torch

from swarm import messages
from swarm.stage.protocol_records import Output, Work
from swarm.stage.ragged import forward_one
from swarm.stage.sampling import IMPOSSIBLE, SamplingParams, accept_drafted, no_input_ids, token_generator

# Rows of the head computed in one call. On CPU torch's float32 matrix product costs about what one row costs for up to
# 3 rows and twice that from 4 (bench/HISTORY.md). swarm's int4 kernel unpacks each weight once for up to 8 rows
# (a tile): the built-in model's head costs 1.5x one row's for 5 rows, and 1.3x for 3.
HEAD_ROWS = 3
KERNEL_HEAD_ROWS = 8


def align(stage, batch: list[Work]) -> None:
    """Before a pass: a drafting request's cache ends past the pass's first position when guesses were rejected --
    crop it there (the stage's rollback)."""
    for work in batch:
        if work.request.start.draft > 0 and not work.prefill and stage.has_request(work.rid) \
                and stage.cached_length(work.rid) > work.pos:
            stage.rollback(work.rid, work.pos)


def verifying(work: Work) -> bool:
    """A decode pass that carries guesses: its rows past the first are drafted tokens (the last stage remembers
    them in request.draft)."""
    return work.last and not work.prefill and work.n > 1 and len(work.request.draft) == work.n - 1


def run(stage, batch: list[Work], run_rest) -> Output:
    """The last stage's batch where some passes verify guesses: those are computed alone (every row's logits), the
    rest by ``run_rest`` (execute.run_batch) in one pass, and the outputs merged in the batch's order."""
    rest = [work for work in batch if not verifying(work)]
    done = run_rest(rest) if rest else Output(tokens=[])
    index = {id(work): i for i, work in enumerate(rest)}
    assert done.tokens is not None  # a last stage's output
    tokens: list[int | None] = []
    logprobs: list[messages.TokenLogprob | None] = []
    fanned: list[list[tuple[int, messages.TokenLogprob | None]] | None] = []
    prompt_lp: list[list[messages.TokenLogprob] | None] = []
    verified: list[list[tuple[int, messages.TokenLogprob | None]] | None] = []
    for work in batch:
        i = index.get(id(work))
        if i is None:
            tokens.append(None)
            logprobs.append(None)
            fanned.append(None)
            prompt_lp.append(None)
            verified.append(verify(stage, work))
            continue
        tokens.append(done.tokens[i])
        logprobs.append(done.logprobs[i] if done.logprobs else None)
        fanned.append(done.fanned[i] if done.fanned else None)
        prompt_lp.append(done.prompt_logprobs[i] if done.prompt_logprobs else None)
        verified.append(None)
    return Output(tokens=tokens, logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
                  fanned=fanned if any(f is not None for f in fanned) else None,
                  prompt_logprobs=prompt_lp if any(p is not None for p in prompt_lp) else None, verified=verified)


def verify(stage, work: Work) -> list[tuple[int, messages.TokenLogprob | None]]:
    """Compute ``work`` (a sampled token and the guesses after it) and keep what the model agrees with: the guesses
    kept, then the model's own next token."""
    states = forward_one(stage, work, final_states=True, alone=True)
    request = work.request
    draft = request.draft
    sampling = request.sampling
    params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            min_p=sampling.min_p, seed=sampling.seed)
    bias = (torch.tensor(sampling.bias_ids, dtype=torch.long), torch.tensor(sampling.bias_values)) \
        if sampling.bias_ids else None
    kept: list[tuple[int, messages.TokenLogprob | None]] = []
    rows, at_once = None, head_rows(stage)
    for i in range(work.n):
        # the head a few rows at a time, as far as the guesses are kept: a rejected guess's later rows never pay
        if i % at_once == 0:
            with torch.inference_mode():
                rows = stage.logits(states[:, i : i + at_once, :])[0].float().cpu()
        assert rows is not None  # computed at i == 0
        logits = rows[i % at_once]
        if bias is not None:  # logit_bias, before everything else (OpenAI's order)
            logits = logits.clone()
            logits[bias[0]] += bias[1]
        guess = draft[i] if i < len(draft) else None
        generator = None if params.greedy else token_generator(params.seed, request.start.drawn + request.generated + i)
        token, entry = choose(logits, params, generator, guess, sampling.logprobs)
        kept.append((token, entry))
        if guess is None or token != guess:
            break
    return kept


def head_rows(stage) -> int:
    """How many rows of a verifying pass the last stage's head computes in one call: a tile of swarm's int4 kernel
    where the head runs on it, else what costs about one row on torch's."""
    return KERNEL_HEAD_ROWS if getattr(stage.lm_head, "kernel", None) is not None else HEAD_ROWS


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, guess: int | None,
           top: int | None) -> tuple[int, messages.TokenLogprob | None]:
    """One row's token: greedy's argmax, a plain draw (no guess), or the acceptance rule's (a guess) -- with its
    logprobs when asked for, in the distribution it was drawn from (as swarm.stage.sampling.sample_with_logprobs)."""
    scores = logits.reshape(1, -1)
    if not params.greedy:
        scores = params.warpers()(no_input_ids(scores.device), scores)
    if params.greedy:
        token = int(torch.argmax(scores))
    else:
        probs = torch.softmax(scores, dim=-1)
        if guess is None:
            token = int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])
        else:
            token = accept_drafted(probs[0], guess, generator)
    if top is None:
        return token, None
    lp = torch.log_softmax(scores, dim=-1)[0]
    values, ids = torch.topk(lp, top) if top > 0 else (lp[:0], lp[:0].long())
    return token, messages.TokenLogprob(_finite(lp[token]), [int(i) for i in ids], [_finite(v) for v in values])


def _finite(value: torch.Tensor) -> float:
    number = float(value)
    return number if number > IMPOSSIBLE else IMPOSSIBLE
