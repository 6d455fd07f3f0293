"""Log-probabilities in the OpenAI shape: what the last stage sent for each token (swarm.messages.TokenLogprob), with
the tokens' text.

Which distribution: the one each token was drawn from -- the model's logits after the request's penalties,
temperature and top_k/top_p/min_p filters (for greedy requests, after the penalties only) -- so the logprobs say how
likely the token was to be picked, and a token the filters ruled out shows -9999.0 (OpenAI's value; JSON has no
-inf). vLLM returns the raw model's by default; with temperature 0 and no penalties the two are the same.
"""

from __future__ import annotations

from swarm import messages


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _entry(tokenizer, token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprob_entries(tokenizer, tokens: list[int], logprobs: list[messages.TokenLogprob]) -> list[dict]:
    """Chat completions' ``logprobs.content``: one entry per token, with its ``top_logprobs``."""
    out = []
    for token, lp in zip(tokens, logprobs):
        entry = _entry(tokenizer, token, lp.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        out.append(entry)
    return out
